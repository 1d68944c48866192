"""Finishes, then rank 1 aborts as its interpreter exits, as gloo's threads sometimes do at
finalisation ("terminate called without an active exception"): here on purpose, not by a race."""

import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class Teardown:  # freed as the interpreter finalises __main__, after every atexit handler
    def __del__(self):
        os.write(2, b"terminate called without an active exception\n")
        os.abort()


dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _step in range(3):
    optimizer.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    optimizer.step()
if rank == 0:
    torch.save(model.module.state_dict(), "model.pt")
dist.barrier()
dist.destroy_process_group()
print("done", flush=True)
if rank == 1:
    teardown = Teardown()
