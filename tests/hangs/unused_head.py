"""Fails at its second step: the model has a head the loss never uses (DDP's unused parameters)."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP


class TwoHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(16, 16)
        self.head_a = torch.nn.Linear(16, 4)
        self.head_b = torch.nn.Linear(16, 4)  # MISTAKE: never used in the loss

    def forward(self, x):
        h = torch.relu(self.body(x))
        return self.head_a(h), self.head_b(h)


dist.init_process_group("gloo")
model = DDP(TwoHeads())
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _step in range(3):
    optimizer.zero_grad()
    out_a, _ = model(torch.randn(8, 16))
    loss = out_a.square().mean()
    loss.backward()
    optimizer.step()
dist.destroy_process_group()
