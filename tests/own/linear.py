"""A user's DDP script: a linear classifier, its data from datautils.py beside it.

python linear.py EPOCHS TAG  (under torchrun). Reports through ddpnb_reporting when
ddpnb placed it beside this file; writes model.pt on rank 0.
"""

import sys

import torch
import torch.distributed as dist
from datautils import make_data
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

try:
    import ddpnb_reporting as report
except ImportError:  # run by plain torchrun
    report = None

epochs, tag = int(sys.argv[1]), sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
threads = torch.get_num_threads()  # what the launcher gave this rank
print(f"rank {rank} of {dist.get_world_size()} args {sys.argv[1:]!r} threads {threads}", flush=True)
data = make_data()
sampler = DistributedSampler(data)
loader = DataLoader(data, batch_size=16, sampler=sampler)
torch.manual_seed(0)
model = DDP(torch.nn.Linear(8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(1, epochs + 1):
    sampler.set_epoch(epoch)
    sums = torch.zeros(3)  # loss sum, correct, count: reduced as sums, never means
    for step, (x, y) in enumerate(loader, 1):
        out = model(x)
        loss = torch.nn.functional.cross_entropy(out, y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        sums += torch.tensor([loss.item() * len(y), (out.argmax(1) == y).sum().item(), len(y)])
        if report:
            report.step(step, len(loader), epoch=epoch, epochs=epochs, loss=loss.item())
    dist.all_reduce(sums)
    if report:
        report.epoch(
            epoch, train_loss=(sums[0] / sums[2]).item(), train_acc=(sums[1] / sums[2]).item()
        )
if rank == 0:
    torch.save(model.module.state_dict(), "model.pt")  # in the working directory: the run's
dist.barrier()  # every rank done before the group goes
dist.destroy_process_group()
