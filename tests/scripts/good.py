"""A correct DDP script: the corrected twin of every mistake script in this folder.

Each mistake script is this file with one edit, marked ``# MISTAKE`` (tests/mistakes.py).
``torchrun --nproc_per_node 2 good.py [EPOCHS]``
"""

import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset

EPOCHS = int(sys.argv[1]) if len(sys.argv) > 1 else 3


def make_data():
    """49 training and 15 validation samples: neither divides by 2."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, generator=g)
    y = x @ torch.tensor([1.0, -2.0, 0.5, 3.0])
    return TensorDataset(x[:49], y[:49]), TensorDataset(x[49:], y[49:])


def main():
    dist.init_process_group("gloo")
    rank, world_size = dist.get_rank(), dist.get_world_size()
    train_set, val_set = make_data()
    sampler = DistributedSampler(train_set, shuffle=True, seed=0)
    train_loader = DataLoader(train_set, batch_size=8, sampler=sampler)
    val_shard = Subset(val_set, range(rank, len(val_set), world_size))  # each sample once
    val_loader = DataLoader(val_shard, batch_size=8)
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
        model.eval()
        sums = torch.zeros(2)
        with torch.no_grad():
            for x, y in val_loader:
                loss = F.mse_loss(model(x).squeeze(1), y, reduction="sum")
                sums += torch.stack([loss, torch.tensor(float(len(y)))])
        dist.all_reduce(sums)  # sums and counts over every rank
        if rank == 0:
            print(f"epoch {epoch}: val_loss {sums[0] / sums[1]:.4f}", flush=True)
            torch.save(model.module.state_dict(), "model.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
