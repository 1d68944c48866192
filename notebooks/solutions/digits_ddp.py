"""Solution: this classifier of 8x8 digits as a DDP script (DDP, set_epoch, one writer)."""

import torch
import torch.distributed as dist
from sklearn.datasets import load_digits
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main(epochs=3):
    dist.init_process_group("gloo")  # rank and world size come from torchrun
    rank = dist.get_rank()
    torch.manual_seed(0)
    x, y = load_digits(return_X_y=True)  # 1797 images of 8x8 pixels, bundled
    train_set = TensorDataset(torch.tensor(x / 16, dtype=torch.float32), torch.tensor(y))
    sampler = DistributedSampler(train_set)  # each rank its own shard
    loader = DataLoader(train_set, batch_size=32, sampler=sampler)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 10))
    model = DDP(model)  # gradients averaged over the ranks in backward()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(1, epochs + 1):
        sampler.set_epoch(epoch)  # a new shuffle each epoch, the same on every rank
        for xb, yb in loader:
            loss = nn.functional.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        print(f"rank {rank} epoch {epoch} loss {loss.item():.3f}")
        if rank == 0:  # one writer (model.module is the model inside DDP)
            torch.save(model.module.state_dict(), "checkpoint.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
