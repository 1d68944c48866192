"""A script in a subfolder (tools/) of the project, a module beside it, data read from the
working directory. It forgets the DistributedSampler: every rank trains on all the data.

From the project's folder: torchrun --nproc_per_node 2 tools/unsharded.py
"""

import torch
import torch.distributed as dist
from common import read_rows
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader

dist.init_process_group("gloo")
data = read_rows("data/tiny/train.txt")  # relative to the working directory
loader = DataLoader(data, batch_size=16, shuffle=True)
model = DDP(torch.nn.Linear(4, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for _epoch in range(2):
    for x, y in loader:
        loss = torch.nn.functional.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
dist.barrier()
dist.destroy_process_group()
