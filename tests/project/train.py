"""A project's training script (tests/project/): a package beside it, a config given as an
argument, data read by a relative path, its model written to a folder of its own.

From the project's folder: torchrun --nproc_per_node 2 train.py config/small.json
"""

import json
import os
import sys

import torch
import torch.distributed as dist
from mypkg.model import make_model, read_rows
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler

with open(sys.argv[1]) as f:
    config = json.load(f)
dist.init_process_group("gloo")
rank = dist.get_rank()
data = read_rows("data/tiny/train.txt")  # relative to the working directory
sampler = DistributedSampler(data)
loader = DataLoader(data, batch_size=config["batch_size"], sampler=sampler)
torch.manual_seed(0)
model = DDP(make_model(data.tensors[0].shape[1]))
optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
for epoch in range(1, config["epochs"] + 1):
    sampler.set_epoch(epoch)
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    print(f"rank {rank} epoch {epoch} loss {loss.item():.3f}", flush=True)
if rank == 0:
    os.makedirs("out", exist_ok=True)
    torch.save(model.module.state_dict(), "out/model.pt")
dist.barrier()  # every rank done before the group goes
dist.destroy_process_group()
