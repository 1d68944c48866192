"""Correct, only slow: rank 0 writes a "large checkpoint" while the others wait at a barrier."""

import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

SECONDS = float(sys.argv[1]) if len(sys.argv) > 1 else 6.0
dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _step in range(3):
    optimizer.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
if rank == 0:
    time.sleep(SECONDS)  # writing a large checkpoint to a slow disk
dist.barrier()
print("done", flush=True)
