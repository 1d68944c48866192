"""Hangs after its first epoch: rank 0 alone calls dist.barrier() (the others train on)."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(100):
    for _step in range(5):
        optimizer.zero_grad()
        model(torch.randn(8, 4)).sum().backward()
        optimizer.step()
    if rank == 0:
        dist.barrier()  # MISTAKE: on rank 0 only
    print(f"epoch {epoch} done", flush=True)
