"""Solution: a barrier on every rank between rank 0's save and the reads: no rank reads
before the file is written (only the saving is rank 0's)."""

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset


def main(epochs=3):
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    x = torch.randn(1024, 16)
    train_set = TensorDataset(x, (x.sum(1) > 0).long())  # is the sum positive?
    sampler = DistributedSampler(train_set)
    loader = DataLoader(train_set, batch_size=32, sampler=sampler)
    model = DDP(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(1, epochs + 1):
        sampler.set_epoch(epoch)
        for xb, yb in loader:
            loss = nn.functional.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        if rank == 0:
            torch.save(model.module.state_dict(), "checkpoint.pt")  # one writer
        dist.barrier()  # every rank waits here until rank 0 has written the file
        saved = torch.load("checkpoint.pt")  # every rank reads what rank 0 wrote
        same = all(torch.equal(saved[k], v) for k, v in model.module.state_dict().items())
        assert same, f"rank {rank} read a checkpoint of another epoch"
        print(f"rank {rank}, epoch {epoch}: the checkpoint holds this epoch's weights")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
