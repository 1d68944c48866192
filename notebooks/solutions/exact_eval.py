"""Solution: an exact evaluation, every validation sample counted once on any number of ranks."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset, TensorDataset, random_split


def main(epochs=3):
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    x = torch.randn(1125, 16)
    data = TensorDataset(x, (x.sum(1) > 0).long())  # is the sum positive?
    train_set, val_set = random_split(data, [1000, 125])  # 125: odd, on purpose
    sampler = DistributedSampler(train_set)
    loader = DataLoader(train_set, batch_size=32, sampler=sampler)
    # rank r validates samples r, r + world, r + 2 * world, ...: each once, no padding
    val_loader = DataLoader(Subset(val_set, range(rank, len(val_set), world)), batch_size=64)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(1, epochs + 1):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = nn.functional.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        correct = seen = 0
        with torch.no_grad():
            for xb, yb in val_loader:
                correct += (model.module(xb).argmax(1) == yb).sum().item()
                seen += len(yb)
        totals = torch.tensor([correct, seen])
        dist.all_reduce(totals)  # sums and counts over the ranks, divided once
        if rank == 0:
            print(f"epoch {epoch}: {totals[0]} of {totals[1]} validation samples right")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
