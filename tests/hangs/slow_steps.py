"""Correct, only slow: every rank computes each step's backward for several seconds, nothing waits.

A deep stack of wide layers on a large batch, sized at start for this machine (the work, not
the machine's speed, is what the test sets): the stack stays inside ``loss.backward()``."""

import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

SECONDS = float(sys.argv[1]) if len(sys.argv) > 1 else 6.0  # one backward, about
STEPS = 2


class Deep(torch.nn.Module):
    def __init__(self, depth: int) -> None:
        super().__init__()
        self.depth, self.layer = depth, torch.nn.Linear(512, 512)

    def forward(self, x):
        for _ in range(self.depth):
            x = torch.tanh(self.layer(x))
        return x


def backward_seconds(depth: int) -> float:
    x, model = torch.randn(256, 512), Deep(depth)
    model(x).sum()  # warm up
    start = time.perf_counter()
    model(x).sum().backward()
    return time.perf_counter() - start


dist.init_process_group("gloo")
depth = torch.tensor([max(1, round(SECONDS * 10 / backward_seconds(10)))])
dist.broadcast(depth, 0)  # rank 0 sizes it: every rank does the same work
depth = int(depth)  # layers for a backward of about SECONDS
model = DDP(Deep(depth))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
for step in range(STEPS):
    optimizer.zero_grad()
    loss = model(torch.randn(256, 512)).sum()
    loss.backward()  # every rank computes here for SECONDS s
    optimizer.step()
    print(f"step {step} done", flush=True)
dist.barrier()
dist.destroy_process_group()
