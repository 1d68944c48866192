"""A user's torchrun script, as small as DDP gets: it writes when its first optimizer step is done.

``python first_step.py OUT`` under torchrun: rank 0 writes ``time.time()`` to OUT right
after the first ``optimizer.step()``. Used by bench/script_launch.py.
"""

import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
model = DDP(torch.nn.Linear(8, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.randn(16, 8)).sum().backward()
optimizer.step()
if dist.get_rank() == 0:
    with open(sys.argv[1], "w") as f:
        f.write(repr(time.time()))
dist.barrier()  # every rank done before the group goes (gloo aborts a rank that leaves early)
dist.destroy_process_group()
