"""Fails at once: the model is wrapped in DDP before the process group exists."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

model = DDP(torch.nn.Linear(16, 4))  # MISTAKE: before dist.init_process_group
dist.init_process_group("gloo")
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _step in range(3):
    optimizer.zero_grad()
    model(torch.randn(8, 16)).square().mean().backward()
    optimizer.step()
dist.destroy_process_group()
