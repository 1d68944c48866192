"""Fails at its first backward: a layer used twice under reentrant activation checkpointing."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.checkpoint import checkpoint


class Shared(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, 4)

    def forward(self, x):
        # MISTAKE: reentrant checkpointing, the same layer in two segments: each segment's
        # backward runs on its own, and DDP sees layer's parameters become ready twice
        h = checkpoint(self.layer, x, use_reentrant=True)
        h = checkpoint(self.layer, torch.relu(h), use_reentrant=True)
        return self.head(h)


dist.init_process_group("gloo")
model = DDP(Shared(), find_unused_parameters=True)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _step in range(3):
    optimizer.zero_grad()
    x = torch.randn(8, 16, requires_grad=True)
    loss = model(x).square().mean()
    loss.backward()
    optimizer.step()
dist.destroy_process_group()
