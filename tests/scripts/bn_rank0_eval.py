"""Correct: rank 0 alone evaluates, through model.module (the plain model: no DDP collectives).

A model with BatchNorm: evaluating through the DDP wrapper instead broadcasts its buffers
on rank 0 only (tests/mistakes.py: ddp_eval_rank0).
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EPOCHS = int(sys.argv[1]) if len(sys.argv) > 1 else 3


def make_data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0])
    return TensorDataset(x[:48], y[:48]), TensorDataset(x[48:], y[48:])


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    train_set, val_set = make_data()
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    train_loader = DataLoader(train_set, batch_size=8, sampler=sampler)
    val_loader = DataLoader(val_set, batch_size=8)  # used by rank 0 only
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))
    model = DDP(net)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    for epoch in range(EPOCHS):
        sampler.set_epoch(epoch)
        model.train()
        for x, y in train_loader:
            optimizer.zero_grad()
            F.mse_loss(model(x).squeeze(1), y).backward()
            optimizer.step()
        if rank == 0:
            model.eval()
            total = 0.0
            with torch.no_grad():
                for x, y in val_loader:
                    total += float(F.mse_loss(model.module(x).squeeze(1), y, reduction="sum"))
            print(f"epoch {epoch}: val_loss {total / len(val_loader.dataset):.4f}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
