"""Correct too: rank 0 alone evaluates the whole validation set (nothing to reduce).

The check must stay silent: no sample is counted twice.
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

EPOCHS = int(sys.argv[1]) if len(sys.argv) > 1 else 3


def make_data():
    """49 training and 15 validation samples: neither divides by 2."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0])
    return TensorDataset(x[:49], y[:49]), TensorDataset(x[49:], y[49:])


def main():
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    train_set, val_set = make_data()
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    train_loader = DataLoader(train_set, batch_size=8, sampler=sampler)
    val_loader = DataLoader(val_set, batch_size=8)  # used by rank 0 only
    torch.manual_seed(0)
    model = DDP(torch.nn.Linear(4, 1))
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
            sums = torch.zeros(2)
            with torch.no_grad():
                for x, y in val_loader:
                    loss = F.mse_loss(model.module(x).squeeze(1), y, reduction="sum")
                    sums += torch.stack([loss, torch.tensor(float(len(y)))])
            print(f"epoch {epoch}: val_loss {sums[0] / sums[1]:.4f}", flush=True)
            torch.save(model.module.state_dict(), "model.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
