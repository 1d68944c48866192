"""Step (d) of bench/gpu_check.py: a hang on NCCL, for the flight recorder to name.

Run by gpu_check through ``ddpnb.launch`` (the hang watch on), one process per GPU::

    torchrun --nproc_per_node=2 bench/nccl_hang.py barrier|uneven nccl TIMEOUT
    torchrun --nproc_per_node=1 bench/nccl_hang.py single nccl TIMEOUT

``barrier``: rank 0 alone calls ``dist.barrier()`` after step 3 (pitfall 6 of notebook 06).
``uneven``: rank 0 trains one step more than rank 1, then both all-reduce a metric.
``single``: one rank reads its own flight recorder through the watch's function: a completed
all_reduce, then one held back behind a GPU sleep, and how long a read takes with the ring
full. Each rank notes what it does, with the time, in ``events-<rank>.jsonl``; ``single``
writes ``single.json``. With ``gloo`` (``--allow-cpu``) the same runs on the CPU.
"""

import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

RING = 2000  # collectives that fill the flight recorder before a read is timed
LONE_BARRIER_AFTER = 3  # the step after which rank 0 alone calls dist.barrier()
STEPS = 20


def main() -> None:
    mode, backend, timeout = sys.argv[1], sys.argv[2], int(sys.argv[3])
    local = int(os.environ["LOCAL_RANK"])
    cuda = backend == "nccl"
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
    rank = dist.get_rank()
    events = open(f"events-{rank}.jsonl", "a", buffering=1)  # noqa: SIM115 (to the end)

    def note(what: str, **more) -> None:
        events.write(json.dumps({"time": time.time(), "rank": rank, "what": what, **more}) + "\n")

    if mode == "single":
        note("single", **single(device, cuda))
        dist.destroy_process_group()
        return
    model = DDP(torch.nn.Linear(256, 256).to(device), device_ids=[local] if cuda else None)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(32, 256, device=device)
    steps = STEPS + (1 if mode == "uneven" and rank == 0 else 0)
    for step in range(steps):
        if step == STEPS:
            note("extra step")  # uneven: rank 0 only
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()  # DDP's gradient all-reduce, enqueued
        opt.step()
        note("step", step=step, loss=loss.item())  # .item() waits for the GPU
        if mode == "barrier" and rank == 0 and step == LONE_BARRIER_AFTER:
            note("lone barrier")
            dist.barrier()  # MISTAKE: on rank 0 only
            note("lone barrier returned")
        time.sleep(0.05)
    note("loop done")
    metric = torch.ones(1, device=device)
    dist.all_reduce(metric)
    note("metric all_reduce returned", value=metric.item())
    dist.destroy_process_group()
    note("ended")


def single(device: torch.device, cuda: bool) -> dict:
    """The watch's read of this rank's recorder: completed, pending, and its cost."""
    read = sys.modules["ddpnb_watch"].nccl_collectives  # loaded by ddpnb's sitecustomize
    small = torch.ones(1, device=device)
    for _ in range(RING):
        dist.all_reduce(small)
    if cuda:
        torch.cuda.synchronize()
    seconds = []
    for _ in range(20):
        t0 = time.perf_counter()
        completed = read(dist)
        seconds.append(time.perf_counter() - t0)
    last = None
    if cuda:  # the newest entry of the whole ring, as torch dumps it
        from torch._C._distributed_c10d import _dump_nccl_trace_json

        entries = json.loads(_dump_nccl_trace_json(includeCollectives=True)).get("entries", [])
        last = {k: entries[-1][k] for k in ("profiling_name", "state")} if entries else None
        torch.cuda._sleep(2_000_000_000)  # about a second of GPU work ahead of the next
    held = torch.ones(1000, device=device)
    dist.all_reduce(held)  # enqueued behind the sleep
    pending = read(dist)
    if cuda:
        torch.cuda.synchronize()
    return {
        "completed": completed,
        "newest": last,
        "pending": pending,
        "after": read(dist),
        "read_ms": 1e3 * statistics.median(seconds),
        "ring": RING,
    }


if __name__ == "__main__":
    main()
