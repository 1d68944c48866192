"""Hangs at its end: rank 0's shard holds one batch more, the others wait at the last barrier."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _epoch in range(2):
    batches = 5 if rank == 0 else 4  # MISTAKE: shards of different sizes
    for _step in range(batches):
        optimizer.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
dist.barrier()  # every rank, before leaving
