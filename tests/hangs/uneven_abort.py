"""Aborts (gloo): a shard split by hand gives rank 1 two more batches; rank 0 goes on to its
epoch-loss all_reduce while rank 1 is still in backward: collectives of different sizes."""

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

dist.init_process_group("gloo")
rank = dist.get_rank()
model = DDP(torch.nn.Linear(16, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
batches = 4 + 2 * rank  # MISTAKE: rank 1 has two more batches (shards split by hand)
total = torch.zeros(1)
for _step in range(batches):
    optimizer.zero_grad()
    loss = model(torch.randn(8, 16)).square().mean()
    loss.backward()
    optimizer.step()
    total += loss.detach()
dist.all_reduce(total)  # the epoch's loss, summed over ranks
print(f"loss {total.item():.3f}", flush=True)
dist.destroy_process_group()
