"""The minimal hand-written DDP loop that ddpnb's worker is measured against.

What a tutorial would have you write: DistributedSampler, DDP(resnet18), SGD, batches
sliced from in-memory tensors, no logging. Run it under torchrun::

    torchrun --nproc_per_node 2 bench/reference_ddp.py --steps 40 --batch-size 32

Without torchrun it is the single-process ceiling (no DDP, every core). With
``--independent`` under torchrun the processes skip DDP and never exchange gradients:
the bound that any gradient averaging leaves (the models drift apart).
Prints one JSON line: images/s over the timed steps, and the wall time of the first step.
"""

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torchvision
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DistributedSampler


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=32, help="per process")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--n", type=int, default=1437, help="training images")
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--independent", action="store_true", help="no DDP: no gradient exchange")
    args = p.parse_args()
    started = float(os.environ.get("BENCH_T0", time.time()))
    distributed = "RANK" in os.environ
    if args.threads:
        torch.set_num_threads(args.threads)
    if distributed:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if distributed else 0
    world = dist.get_world_size() if distributed else 1

    torch.manual_seed(0)
    images = torch.rand(args.n, 3, args.image_size, args.image_size)
    labels = torch.randint(0, 10, (args.n,))
    model = torchvision.models.resnet18(num_classes=10)
    if distributed and not args.independent:
        model = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = torch.nn.CrossEntropyLoss()
    sampler = DistributedSampler(range(args.n), num_replicas=world, rank=rank, seed=0)

    def batches():
        epoch = 0
        while True:
            sampler.set_epoch(epoch)
            order = torch.tensor(list(sampler))
            for i in range(0, len(order) - args.batch_size + 1, args.batch_size):
                idx = order[i : i + args.batch_size]
                yield images[idx], labels[idx]
            epoch += 1

    it = batches()
    first_step = None
    t0 = None
    for step in range(args.warmup + args.steps):
        if step == args.warmup:
            if distributed:
                dist.barrier()
            t0 = time.perf_counter()
        x, y = next(it)
        loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if first_step is None:
            first_step = time.time() - started
    if distributed:
        dist.barrier()
    seconds = time.perf_counter() - t0
    if rank == 0:
        out = {
            "images_per_second": args.steps * args.batch_size * world / seconds,
            "first_step_seconds": first_step,
            "world_size": world,
            "threads": torch.get_num_threads(),
        }
        print(json.dumps(out), flush=True)
    if distributed:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
