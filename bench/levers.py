"""The performance levers of issue 6, each measured alone against the plain DDP loop.

2 processes x 1 thread on this host, resnet18 at 32 px, per-process batch 32, in-memory
batches. Each variant changes one thing; the ratio is its images/s over the plain loop's,
measured back to back in every repeat (median [min-max] printed). Every variant after
"fused SGD" is on top of it. ``noop`` skips the
all-reduce entirely (the ranks drift apart): it is the ceiling that communication leaves.

    python bench/levers.py [--repeats 3] [--steps 30]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {
    "plain": [],
    "fused SGD": ["--fused"],
    "fused + bf16 compression hook": ["--fused", "--hook", "bf16"],
    "fused + bucket_cap_mb 5": ["--fused", "--bucket", "5"],
    "fused + bucket_cap_mb 100": ["--fused", "--bucket", "100"],
    "fused + gradient_as_bucket_view + static_graph": ["--fused", "--view", "--static"],
    "fused + channels_last": ["--fused", "--channels-last"],
    "fused + pinned to one core per rank": ["--fused", "--pin"],
    "fused + shared-memory average (ddpnb's default on one host)": ["--fused", "--hook", "shm"],
    "fused + no all-reduce at all (noop hook)": ["--fused", "--hook", "noop"],
}


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torchvision
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    if args.pin:
        os.sched_setaffinity(0, {int(os.environ["LOCAL_RANK"]) % (os.cpu_count() or 1)})
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    fmt = torch.channels_last if args.channels_last else torch.contiguous_format
    x = torch.rand(args.batch, 3, 32, 32).contiguous(memory_format=fmt)
    y = torch.randint(0, 10, (args.batch,))
    model = torchvision.models.resnet18(num_classes=10).to(memory_format=fmt)
    model = DDP(
        model,
        bucket_cap_mb=args.bucket,
        gradient_as_bucket_view=args.view,
        static_graph=args.static,
    )
    if args.hook == "bf16":
        model.register_comm_hook(None, default_hooks.bf16_compress_hook)
    elif args.hook == "shm":
        sys.path.insert(0, str(ROOT))
        from ddpnb.worker import SharedMemoryAllReduce, timed_comm_hook

        state = {"blocked": 0.0, "returned": None}
        model.register_comm_hook(state, timed_comm_hook("none", SharedMemoryAllReduce.create()))
    elif args.hook == "noop":

        def noop(state, bucket):
            fut = torch.futures.Future()
            fut.set_result(bucket.buffer())
            return fut

        model.register_comm_hook(None, noop)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, fused=args.fused or None)
    loss_fn = torch.nn.CrossEntropyLoss()
    for step in range(5 + args.steps):
        if step == 5:
            dist.barrier()
            t0 = time.perf_counter()
        loss = loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    dist.barrier()
    seconds = time.perf_counter() - t0
    if dist.get_rank() == 0:
        ips = args.steps * args.batch * dist.get_world_size() / seconds
        print(json.dumps({"images_per_second": ips}), flush=True)
    dist.destroy_process_group()


def measure(flags: list[str], steps: int) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    cmd += [__file__, "--worker", "--steps", str(steps), *flags]
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])["images_per_second"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--hook", default="none")
    p.add_argument("--bucket", type=float, default=25)
    p.add_argument("--fused", action="store_true")
    p.add_argument("--view", action="store_true")
    p.add_argument("--static", action="store_true")
    p.add_argument("--channels-last", action="store_true")
    p.add_argument("--pin", action="store_true")
    args = p.parse_args()
    if args.worker:
        return worker(args)
    ratios: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for i in range(args.repeats):
        plain = measure(VARIANTS["plain"], args.steps)
        for name, flags in VARIANTS.items():
            ips = plain if name == "plain" else measure(flags, args.steps)
            ratios[name].append(ips / plain)
            print(f"repeat {i + 1}: {name}: {ips:.0f} images/s ({ips / plain:.3f}x)", flush=True)
    print("\n| lever (2 processes, per-process batch 32) | images/s vs plain DDP loop |")
    print("|---|---|")
    for name, values in ratios.items():
        m = statistics.median(values)
        print(f"| {name} | {m:.3f} [{min(values):.3f}-{max(values):.3f}] |")


if __name__ == "__main__":
    main()
