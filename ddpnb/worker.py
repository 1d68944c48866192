"""ddpnb's training worker: image classification with DistributedDataParallel.

How to read this file: Part 1 is DDP, top to bottom; Part 2 is the machinery that makes
it robust and measurable. Part 1 starts right below the imports with ``main()``, a list
of named steps (who am I, the process group, the same dataset everywhere, the data with
its ``DistributedSampler``, the model wrapped in DDP, the epoch loop, the checkpoint),
each one a short function after it. Part 2, below its banner, holds what those steps call
and a DDP tutorial leaves out: averaging gradients through shared memory, timing, the
progress and metrics files, fault injection, the agent watchdog, checkpoint guards.

This file needs only torch, torchvision and the Python standard library, so it can
be copied to any cluster node together with its ``config.json``. ddpnb writes both
into the run directory; the outputs (``metrics.jsonl``, ``ranks/``,
``checkpoints/``, ``progress.json``) go next to the config.

One node, two processes::

    torchrun --nnodes 1 --nproc_per_node 2 train_ddp.py --config config.json

Two nodes, one process each. Node 0 is the master: it hosts the rendezvous at
``--master_addr:--master_port``, which every node must be able to reach::

    # on node 0 (say its address is 10.0.0.1)
    torchrun --nnodes 2 --node_rank 0 --nproc_per_node 1 \\
        --master_addr 10.0.0.1 --master_port 29500 train_ddp.py --config config.json
    # on node 1
    torchrun --nnodes 2 --node_rank 1 --nproc_per_node 1 \\
        --master_addr 10.0.0.1 --master_port 29500 train_ddp.py --config config.json

Without torchrun it trains as one process: ``python train_ddp.py --config config.json``.

Ranks that share a host (and its /dev/shm) average gradients through shared memory
rather than the backend's all-reduce (``comm_hook`` ``auto``, the default); across hosts
gloo or NCCL carry them as usual.

Every node needs the same dataset at ``data_dir``: at start-up the ranks compare
dataset fingerprints and stop if they differ. The rendezvous store is not
authenticated: run multi-node jobs on trusted networks only.

Environment read besides torchrun's: ``DDPNB_PROCS_ON_HOST`` (processes sharing
this host's cores, simulated nodes included; set by ddpnb's launcher) and
``DDPNB_FAULT`` (a teaching/testing aid, e.g. ``rank=1,epoch=3,step=5`` SIGKILLs
global rank 1 at that step of the first attempt; ``mode=raise`` raises instead).
"""

from __future__ import annotations

import argparse
import ctypes
import dataclasses
import datetime
import errno
import hashlib
import inspect
import json
import math
import os
import random
import shutil
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import transforms

# =============================================================================
# Part 1: DDP, top to bottom
# =============================================================================


@record  # a failing rank's own traceback reaches torchrun's error report
def main(argv: list[str] | None = None) -> None:
    """Train this process's share of the run; each line is one step of DDP."""
    cfg, run_dir, data_dir = read_config(argv)
    me = who_am_i()
    monitor = Monitor(cfg, me, run_dir)  # Part 2: progress file, timings, fault injection
    device, backend = set_up_process(cfg, me)
    warn_about_pitfalls(cfg, me)
    fingerprint = check_same_dataset(data_dir, me)
    monitor.joined()  # every rank got here: the rendezvous is complete
    data = make_data(cfg, me, data_dir, device)

    torch.manual_seed(cfg["seed"])  # identical init everywhere (DDP also broadcasts rank 0's)
    model, weights_note = build_model(cfg, data.num_classes)
    model = wrap_model(model.to(device, memory_format=data.memory_format), cfg, me, device)
    raw_model = model.module if isinstance(model, DDP) else model  # checkpoints load without DDP
    optimizer, scheduler = make_optimizer(model, cfg, data.steps_per_epoch)
    gradients = monitor.watch(model, optimizer, cfg, backend)  # Part 2: comm hook and timing
    ckpt_path = run_dir / "checkpoints" / "last.pt"
    start_epoch = resume(ckpt_path, cfg, fingerprint, raw_model, optimizer, scheduler, me)
    monitor.start_run(start_epoch, data, device, backend, gradients, weights_note)

    amp = cfg["amp"] and device.type == "cuda"  # bf16 autocast on CUDA; CPU trains in fp32
    for epoch in range(start_epoch, cfg["epochs"] + 1):
        if cfg["set_epoch"]:  # pitfall set_epoch=False: epoch 0's order forever
            data.train_sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        train_sums = train_one_epoch(model, data, optimizer, scheduler, epoch, amp, monitor)
        val_sums = validate(model, data, amp)
        metrics = reduce_epoch_metrics(train_sums, val_sums, me)
        monitor.write_metrics(epoch, metrics, train_sums, val_sums, raw_model, scheduler, data)
        save_checkpoint(ckpt_path, epoch, cfg, me, raw_model, optimizer, scheduler, fingerprint)
        if me.distributed:
            dist.barrier()  # nobody starts the next epoch before the checkpoint is on disk

    monitor.done(data.steps_per_epoch)
    if me.distributed:
        dist.destroy_process_group()


def read_config(argv: list[str] | None) -> tuple[dict, Path, Path]:
    """The run's settings (config.json holds every TrainConfig field), run_dir and data_dir."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", required=True, help="config.json written by ddpnb")
    parser.add_argument("--run-dir", help="where outputs go (default: the config's folder)")
    args = parser.parse_args(argv)
    cfg = json.loads(Path(args.config).read_text())
    run_dir = Path(args.run_dir or Path(args.config).resolve().parent)
    data_dir = Path(cfg["data_dir"])
    if not data_dir.is_absolute() and not data_dir.exists():
        data_dir = run_dir / data_dir  # a relative data_dir may be relative to the run
    return cfg, run_dir, data_dir


@dataclasses.dataclass(frozen=True)
class Rank:
    """Who this process is in the run, in torchrun's terms."""

    distributed: bool  # started by torchrun; False: one plain process
    global_rank: int  # 0 .. world_size - 1 across all nodes (RANK)
    local_rank: int  # 0 .. local_world_size - 1 on this node: picks the GPU (LOCAL_RANK)
    world_size: int  # processes in the whole run (WORLD_SIZE)
    local_world_size: int  # processes on this node (LOCAL_WORLD_SIZE)
    node_rank: int  # this node's number; node 0 hosts the rendezvous (GROUP_RANK)
    restart_count: int  # torchrun restarts so far (TORCHELASTIC_RESTART_COUNT)

    @property
    def master_process(self) -> bool:
        return self.global_rank == 0  # does the run's file I/O

    def log(self, msg: str) -> None:
        # ddpnb's launcher has torchrun prefix every line with the rank already.
        prefix = "" if os.environ.get("DDPNB_LAUNCHED") else f"[rank {self.global_rank}] "
        print(prefix + msg, flush=True)


def who_am_i() -> Rank:
    """This process's place in the run, from torchrun's environment (or one process)."""
    env = os.environ
    return Rank(
        distributed="RANK" in env,
        global_rank=int(env.get("RANK", 0)),
        local_rank=int(env.get("LOCAL_RANK", 0)),
        world_size=int(env.get("WORLD_SIZE", 1)),
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),
        node_rank=int(env.get("GROUP_RANK", 0)),
        restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),
    )


def set_up_process(cfg: dict, me: Rank) -> tuple[torch.device, str]:
    """Pick this rank's device, then join the process group; returns (device, backend)."""
    if torch.cuda.is_available() and cfg["backend"] != "gloo":
        device = cuda_device(me)  # Part 2: one GPU per process on each node, checked
        torch.cuda.set_device(device)  # before init: nccl and the object collectives use it
        torch.backends.cudnn.benchmark = True  # fixed shapes: cuDNN picks its kernels once
    elif cfg["backend"] == "nccl":
        raise RuntimeError(
            f"backend='nccl' needs CUDA GPUs, and {socket.gethostname()} has none visible to "
            "torch. Use backend='auto' (nccl on GPUs, gloo elsewhere) or 'gloo'."
        )
    else:
        device = torch.device("cpu")
        set_thread_budget(cfg, me)  # Part 2: this process's share of the host's cores
    backend = cfg["backend"]
    if backend == "auto":
        backend = "nccl" if device.type == "cuda" else "gloo"
    if me.distributed:
        join_process_group(backend, cfg["timeout_seconds"], me, device)
    me.log(
        f"node {me.node_rank} local_rank {me.local_rank} of world_size {me.world_size} on "
        f"{socket.gethostname()}, {device}, backend {backend if me.distributed else 'none'}, "
        f"threads {torch.get_num_threads()}, attempt {me.restart_count}"
    )
    return device, backend


def join_process_group(backend: str, timeout_seconds: int, me: Rank, device: torch.device) -> None:
    """Join the run's default process group (``dist.init_process_group``)."""
    # A collective that waits longer than this fails the run instead of hanging it.
    timeout = datetime.timedelta(seconds=timeout_seconds)
    # nccl binds the group to this rank's GPU (barrier() need not guess it).
    bound = {"device_id": device} if backend == "nccl" else {}
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        dist.init_process_group(backend, timeout=timeout, **bound)  # MASTER_ADDR etc. from torchrun
        return
    store = attempt_store(me.restart_count, timeout)  # Part 2: clean keys for each attempt
    dist.init_process_group(
        backend,
        store=store,
        rank=me.global_rank,
        world_size=me.world_size,
        timeout=timeout,
        **bound,
    )


def check_same_dataset(data_dir: Path, me: Rank) -> str:
    """This node's dataset fingerprint, once every rank has shown it holds the same data."""
    fingerprint = dataset_fingerprint(data_dir)
    if me.distributed:
        seen = [None] * me.world_size
        dist.all_gather_object(seen, (me.node_rank, socket.gethostname(), fingerprint))
        differing = sorted({(n, h) for n, h, fp in seen if fp != seen[0][2]})
        if differing:
            names = ", ".join(f"node {n} ({h})" for n, h in differing)
            raise RuntimeError(
                f"The dataset at {data_dir} differs between nodes: {names} hold data whose "
                f"fingerprint differs from node 0's ({seen[0][2][:12]}). Copy the identical "
                "dataset to every node (rsync -a, or a shared filesystem) and run again."
            )
    return fingerprint


@dataclasses.dataclass
class Data:
    """This rank's data, as make_data returns it."""

    train_sampler: DistributedSampler  # this rank's shard of train; set_epoch reshuffles it
    train_batches: Callable[[int], Iterator]  # train_batches(epoch): (x, y) on the device
    val_batches: Callable[[], Iterator]  # this rank's exact validation shard, in batches
    steps_per_epoch: int
    num_classes: int
    device: torch.device
    memory_format: torch.memory_format
    augment: str  # what was made of augment="auto", and why
    augment_reason: str
    pipeline: str  # "memory" (decoded once) or "loader" (a DataLoader)
    decode_seconds: float  # the memory pipeline's one-off decode of every image


def make_data(cfg: dict, me: Rank, data_dir: Path, device: torch.device) -> Data:
    """This rank's shard of train (a DistributedSampler) and of val (exact), as batches."""
    train_set, val_set, augment, augment_reason = image_folders(cfg, me, data_dir)  # Part 2
    # Every rank draws the same seeded shuffle and keeps its own 1/world_size of it (padded
    # with repeats, so every rank takes the same number of steps).
    # Pitfall distributed_sampler=False: one shard holding the whole split, on every rank.
    sharded = cfg["distributed_sampler"]
    train_sampler = DistributedSampler(
        train_set,
        num_replicas=me.world_size if sharded else 1,
        rank=me.global_rank if sharded else 0,
        shuffle=True,
        seed=cfg["seed"],
    )
    # Validation shards without padding: rank r takes every world_size-th image, so each
    # image is counted exactly once and the result does not depend on world size.
    val_indices = list(range(me.global_rank, len(val_set), me.world_size))
    if not cfg["exact_validation"]:  # pitfall: shards padded with repeated images
        val_indices = list(
            DistributedSampler(
                val_set, num_replicas=me.world_size, rank=me.global_rank, shuffle=False
            )
        )
    pipeline = choose_pipeline(cfg, train_set, val_set)  # Part 2: "memory" if it fits in RAM
    if pipeline == "memory":  # Part 2: decoded once, batches sliced from tensors
        train_batches, val_batches, decode_seconds = memory_batches(
            cfg, me, train_set, val_set, train_sampler, val_indices, augment, device
        )
    else:  # the classic pipeline: a DataLoader that draws this rank's indices from the sampler
        loader_args = dict(
            batch_size=cfg["batch_size"],
            num_workers=cfg["num_workers"],
            pin_memory=device.type == "cuda",
        )
        train_loader = DataLoader(train_set, sampler=train_sampler, **loader_args)
        val_loader = DataLoader(Subset(val_set, val_indices), shuffle=False, **loader_args)
        train_batches = lambda epoch: on_device(train_loader, device, non_blocking=True)
        val_batches = lambda: on_device(val_loader, device, non_blocking=False)
        decode_seconds = 0.0
    steps_per_epoch = math.ceil(len(train_sampler) / cfg["batch_size"])
    if cfg["max_steps_per_epoch"]:
        steps_per_epoch = min(steps_per_epoch, cfg["max_steps_per_epoch"])
    memory_format = torch.channels_last if cfg["channels_last"] else torch.contiguous_format
    return Data(
        train_sampler=train_sampler,
        train_batches=train_batches,
        val_batches=val_batches,
        steps_per_epoch=steps_per_epoch,
        num_classes=len(train_set.classes),
        device=device,
        memory_format=memory_format,
        augment=augment,
        augment_reason=augment_reason,
        pipeline=pipeline,
        decode_seconds=decode_seconds,
    )


def wrap_model(model: nn.Module, cfg: dict, me: Rank, device: torch.device) -> nn.Module:
    """The model in DistributedDataParallel: backward then averages gradients over ranks."""
    # One process has nobody to average gradients with: DDP would only add its bucket
    # copies and an all-reduce with itself (about 10% of a 1-process epoch, measured).
    if me.world_size == 1:
        return model
    return DDP(
        model,
        device_ids=[me.local_rank] if device.type == "cuda" else None,
        bucket_cap_mb=cfg["bucket_cap_mb"],
        gradient_as_bucket_view=True,
        # Rank 0's BatchNorm statistics are sent once per epoch (sync_buffers), not
        # before every forward: training never reads them, and a per-step broadcast
        # is one more point where every rank waits for the slowest.
        **no_forward_buffer_sync(),
    )


def make_optimizer(model: nn.Module, cfg: dict, steps_per_epoch: int):
    """SGD with momentum, and its learning-rate schedule (stepped after every step)."""
    optimizer = make_sgd(model.parameters(), cfg)  # Part 2: the fused kernel where torch has it
    total_steps = cfg["epochs"] * steps_per_epoch
    if cfg["lr_schedule"] == "cosine":
        schedule = lambda step: 0.5 * (1 + math.cos(math.pi * min(step, total_steps) / total_steps))
    else:
        schedule = lambda step: 1.0
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def resume(path, cfg, fingerprint, model, optimizer, scheduler, me) -> int:
    """Load the last checkpoint, if any (also after a torchrun restart): the first epoch to run."""
    if not path.exists():
        return 1
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    check_checkpoint_fits(ckpt, path, cfg, fingerprint)  # Part 2: same config, same dataset
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    # Each rank continues its own random streams (the loader pipeline's transforms
    # draw from them); with another world size the per-epoch seeds still hold.
    if isinstance(ckpt["rng"], list) and len(ckpt["rng"]) == me.world_size:
        set_rng_state(ckpt["rng"][me.global_rank], next(model.parameters()).is_cuda)
    me.log(f"resumed from {path} after epoch {ckpt['epoch']}")
    return ckpt["epoch"] + 1


def train_one_epoch(model, data, optimizer, scheduler, epoch, amp, monitor) -> torch.Tensor:
    """One pass over this rank's shard of train; returns its sums (loss*n, correct, n)."""
    model.train()
    sums = torch.zeros(3, dtype=torch.float64, device=data.device)  # loss*n, correct, n
    batches = monitor.start_epoch(epoch, data)  # data.train_batches(epoch), timed (Part 2)
    for step, (x, y) in enumerate(batches):
        x = x.contiguous(memory_format=data.memory_format)
        with torch.autocast(data.device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP all-reduces gradient buckets while backward runs
        optimizer.step()
        scheduler.step()
        sums += batch_sums(loss.detach(), logits, y)
        monitor.after_step(step, loss)  # Part 2: timings, progress file, fault injection
    return sums


def validate(model, data, amp) -> torch.Tensor:
    """Sums (loss*n, correct, n) over this rank's exact shard of val."""
    net = model.module if isinstance(model, DDP) else model
    if isinstance(model, DDP):
        sync_buffers(net)  # every rank validates the model rank 0 checkpoints
    # Validation on the unwrapped model: no DDP collectives inside, so ranks whose
    # shards differ by one batch cannot hang each other.
    model.eval()
    sums = torch.zeros(3, dtype=torch.float64, device=data.device)
    with torch.no_grad(), torch.autocast(data.device.type, dtype=torch.bfloat16, enabled=amp):
        for x, y in data.val_batches():
            logits = net(x.contiguous(memory_format=data.memory_format))
            sums += batch_sums(F.cross_entropy(logits.float(), y), logits, y)
    return sums


def batch_sums(loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(loss*n, correct, n) of one batch, in float64: sums, not means, add up over ranks."""
    n = y.shape[0]
    return torch.stack(
        [
            loss.double() * n,
            (logits.argmax(1) == y).sum().double(),
            torch.full((), float(n), dtype=torch.float64, device=y.device),  # no host copy
        ]
    )


def sync_buffers(model: nn.Module) -> None:
    """Give every rank rank 0's buffers (BatchNorm running statistics)."""
    for b in model.buffers():
        dist.broadcast(b, src=0)


def reduce_epoch_metrics(train_sums: torch.Tensor, val_sums: torch.Tensor, me: Rank) -> dict:
    """The epoch's metrics over all ranks: sums and counts are reduced, then divided."""
    # This rank's own means (loss, acc for train then val) ride along in the same
    # all_reduce: their average is the mean of means that reduce_sums=False reports.
    rank_means = torch.cat([s[:2] / s[2].clamp(min=1) for s in (train_sums, val_sums)])
    totals = torch.cat([train_sums, val_sums, rank_means])
    if me.distributed:
        dist.all_reduce(totals)  # sums and counts, never means of means
    train_loss, train_correct, train_n, val_loss, val_correct, val_n = totals[:6].tolist()
    return {
        "train_loss": train_loss / train_n,
        "train_acc": train_correct / train_n,
        "val_loss": val_loss / max(val_n, 1),
        "val_acc": val_correct / max(val_n, 1),
        "train_samples": int(train_n),
        "val_samples": int(val_n),
        "mean_of_means": (totals[6:] / me.world_size).tolist(),
        "rank_means": rank_means.tolist(),
    }


def save_checkpoint(path, epoch, cfg, me, model, optimizer, scheduler, fingerprint) -> None:
    """Rank 0 saves what resuming needs: model, optimizer, schedule, epoch, every rank's RNG."""
    if epoch % cfg["checkpoint_every"] != 0 and epoch != cfg["epochs"]:
        return
    use_cuda = next(model.parameters()).is_cuda
    rngs = [rng_state(use_cuda)]
    if me.distributed:  # a collective: every rank takes part, rank 0 keeps the list
        rngs = [None] * me.world_size
        dist.all_gather_object(rngs, rng_state(use_cuda))
    if me.master_process:  # one copy is enough: every rank holds the same weights
        ckpt = {
            "model": model.state_dict(),
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "epoch": epoch,
            "sampler_epoch": epoch,
            "config": cfg,
            "fingerprint": fingerprint,
            "rng": rngs,  # one entry per global rank
        }
        write_checkpoint(ckpt, path, epoch)  # Part 2: atomic; a full disk keeps the last one


# =============================================================================
# Part 2: the machinery (what Part 1 calls to be robust and measurable)
# =============================================================================

try:  # progress.json and metrics.jsonl: the reporting file ddpnb places beside every script
    import ddpnb_reporting as report
except ImportError:  # imported as ddpnb.worker (the package reads a few helpers)
    from ddpnb import reporting as report

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
MEMORY_PIPELINE_BYTES = 2 << 30  # decode into RAM when the uint8 tensors fit in this
# The pitfall switches (config field -> what goes wrong when it is False): each reproduces
# a classic DDP mistake on purpose, for notebook 06. All are True in a correct run.
PITFALL_SWITCHES = {
    "distributed_sampler": "no DistributedSampler: every rank trains on the whole split",
    "set_epoch": "sampler.set_epoch is never called: every epoch repeats the same order",
    "exact_validation": "validation over padded DistributedSampler shards: some images count twice",
    "reduce_sums": "metrics are the mean of per-rank means, not reduced sums and counts",
    "thread_budget": "each process takes torch's default thread count: cores oversubscribed",
}
# Fields that may change on resume without invalidating the checkpoint: how long to
# train and wait, and how gradients travel (the averaged values are the same).
RESUMABLE_KEYS = ("epochs", "timeout_seconds", "comm_hook", "bucket_cap_mb")


# -- around every step: timings, progress.json, fault injection, the agent watchdog ------


class Monitor:
    """Everything Part 1 does besides training, in one place.

    It writes ``progress.json`` (phases ``joined``, ``train``, ``done``), the per-epoch
    rows of ``metrics.jsonl`` (rank 0) and ``ranks/rank-N.jsonl`` (every rank) and
    ``effective_config.json``; it times data, compute and exposed communication; it
    injects ``DDPNB_FAULT``; and it stops this worker if its torchrun agent is gone.
    """

    def __init__(self, cfg: dict, me: Rank, run_dir: Path) -> None:
        self.cfg, self.me, self.run_dir = cfg, me, run_dir
        self.fault = (
            parse_fault(os.environ["DDPNB_FAULT"]) if os.environ.get("DDPNB_FAULT") else None
        )
        self.agent_pid = os.getppid()  # torchrun's agent; if it dies, this node is lost: stop too
        report.use_run_dir(run_dir)  # progress.json and metrics.jsonl: the reporting file
        self.metrics_path = run_dir / "metrics.jsonl"
        self.rank_path = run_dir / "ranks" / f"rank-{me.global_rank}.jsonl"
        self.comm = {"blocked": 0.0, "returned": None}  # the comm hook's timing of each step
        self.backward_end = self.batch_ready = 0.0
        self.epoch = self.steps = 0
        self.order_hash = ""
        self.data_wait = self.compute = self.comm_wait = 0.0
        self.epoch_start = self.train_seconds = 0.0

    def joined(self) -> None:
        report.joined(self.me.world_size)

    def watch(self, model: nn.Module, optimizer, cfg: dict, backend: str) -> str:
        """Register the comm hook that averages and times gradients; returns how they travel."""
        # optimizer.step() starts the moment backward returns: backward's end, for the timing.
        optimizer.register_step_pre_hook(self._backward_returned)
        if not isinstance(model, DDP):
            return "none (one process)"
        shared = None
        if cfg["comm_hook"] in ("auto", "shm") and backend == "gloo":
            shared = SharedMemoryAllReduce.create()
            if shared is None and cfg["comm_hook"] == "shm":
                raise RuntimeError(
                    "comm_hook='shm' needs every rank on one host with a shared /dev/shm, "
                    "and these ranks are not. Use comm_hook='auto' (shared memory where it "
                    "can, the backend's all-reduce elsewhere) or 'none'."
                )
        compression = cfg["comm_hook"] if cfg["comm_hook"] in ("bf16", "fp16") else "none"
        model.register_comm_hook(self.comm, timed_comm_hook(compression, shared))
        gradients = "shared memory" if shared else f"{backend} all-reduce ({compression})"
        if self.me.master_process:
            self.me.log(f"gradients are averaged through {gradients}")
        return gradients

    def _backward_returned(self, optimizer, args, kwargs) -> None:
        self.backward_end = time.perf_counter()

    def start_run(self, start_epoch, data, device, backend, gradients, weights_note) -> None:
        """Drop rows of the epochs to redo; rank 0 logs the run and writes effective_config."""
        if self.me.master_process:
            keep_epochs_upto(self.metrics_path, start_epoch - 1)
        self.rank_path.parent.mkdir(parents=True, exist_ok=True)
        keep_epochs_upto(self.rank_path, start_epoch - 1)
        if self.me.master_process:
            self.me.log(
                f"{self.cfg['model']} ({weights_note}), {data.num_classes} classes, augment "
                f"{data.augment}, pipeline {data.pipeline}, {data.steps_per_epoch} steps/epoch, "
                f"global batch {self.cfg['batch_size'] * self.me.world_size}"
            )
            write_effective_config(
                self.run_dir, self.cfg, self.me, data, device, backend, gradients, weights_note
            )

    def start_epoch(self, epoch: int, data: Data) -> Iterator:
        """``data.train_batches(epoch)``, timed; the epoch's clock starts now."""
        self.epoch, self.steps = epoch, data.steps_per_epoch
        self.order_hash = index_order_hash(data.train_sampler)
        self.data_wait = self.compute = self.comm_wait = 0.0
        self.comm["blocked"], self.comm["returned"] = 0.0, None
        self.epoch_start = time.perf_counter()
        return self._timed(data.train_batches(epoch), data.device)

    def _timed(self, batches: Iterator, device: torch.device) -> Iterator:
        # Exactly steps_per_epoch batches; the wait for each is data time.
        for _ in range(self.steps):
            t0 = time.perf_counter()
            batch = next(batches)
            self.batch_ready = time.perf_counter()
            self.data_wait += self.batch_ready - t0
            yield batch
        if device.type == "cuda":
            torch.cuda.synchronize()
        self.train_seconds = time.perf_counter() - self.epoch_start  # the epoch's batches are done

    def after_step(self, step: int, loss: torch.Tensor) -> None:
        """Timings, DDPNB_FAULT, the agent watchdog and progress.json, after each step."""
        self.compute += time.perf_counter() - self.batch_ready
        if self.comm["returned"] is not None:  # time in the hook, then waiting for it alone
            self.comm_wait += self.comm["blocked"] + self.backward_end - self.comm["returned"]
        self.comm["blocked"], self.comm["returned"] = 0.0, None
        self._inject_fault(step)
        if self.me.distributed and os.getppid() != self.agent_pid:
            raise RuntimeError(
                f"The torchrun agent (pid {self.agent_pid}) of node {self.me.node_rank} is gone: "
                "this node is lost, so its worker stops too. Relaunch with resume=True."
            )
        report.step(step + 1, self.steps, epoch=self.epoch, epochs=self.cfg["epochs"], loss=loss)

    def _inject_fault(self, step: int) -> None:
        fault, me, epoch = self.fault, self.me, self.epoch
        if (
            fault
            and me.global_rank == fault["rank"]
            and epoch == fault["epoch"]
            and step == fault["step"]
            and me.restart_count == fault["restart"]
        ):
            me.log(f"DDPNB_FAULT: {fault['mode']} at epoch {epoch} step {step}")
            if fault["mode"] == "raise":
                raise RuntimeError(f"DDPNB_FAULT injected failure at epoch {epoch} step {step}")
            os.kill(os.getpid(), signal.SIGKILL)

    def write_metrics(self, epoch, metrics, train_sums, val_sums, model, scheduler, data) -> None:
        """This rank's row in ranks/; rank 0 also writes the run's row in metrics.jsonl."""
        param_checksum = parameter_checksum(model)  # after sync_buffers: equal on every rank
        local_train_samples = int(train_sums[2].item())
        epoch_seconds = time.perf_counter() - self.epoch_start
        me, train_seconds = self.me, self.train_seconds
        append_jsonl(
            self.rank_path,
            {
                "epoch": epoch,
                "global_rank": me.global_rank,
                "local_rank": me.local_rank,
                "node_rank": me.node_rank,
                "train_samples": local_train_samples,
                "val_samples": int(val_sums[2].item()),
                "images_per_second": local_train_samples / train_seconds,
                "data_wait_seconds": self.data_wait,
                "compute_seconds": self.compute - self.comm_wait,
                "comm_seconds": self.comm_wait,
                "restart_count": me.restart_count,
                "train_seconds": train_seconds,
                "threads": torch.get_num_threads(),
                "val_loss": metrics["rank_means"][2],
                "val_acc": metrics["rank_means"][3],
                "order_hash": self.order_hash,
                "param_checksum": param_checksum,
            },
        )
        if me.master_process:
            row = {
                "epoch": epoch,
                "world_size": me.world_size,
                "train_loss": metrics["train_loss"],
                "train_acc": metrics["train_acc"],
                "val_loss": metrics["val_loss"],
                "val_acc": metrics["val_acc"],
                "train_samples": metrics["train_samples"],
                "val_samples": metrics["val_samples"],
                "epoch_seconds": epoch_seconds,
                "images_per_second": metrics["train_samples"] / train_seconds,
                "restart_count": me.restart_count,
                "decode_seconds": data.decode_seconds,
                "lr": scheduler.get_last_lr()[0],
                "val_loss_exact": metrics["val_loss"],
                "val_acc_exact": metrics["val_acc"],
            }
            if not self.cfg["reduce_sums"]:  # pitfall: report the mean of per-rank means
                keys = ["train_loss", "train_acc", "val_loss", "val_acc"]
                row.update(zip(keys, metrics["mean_of_means"]))
            report.epoch(**row)
            me.log(
                f"epoch {epoch}/{self.cfg['epochs']} train_loss {row['train_loss']:.4f} "
                f"val_acc {row['val_acc']:.4f} {row['images_per_second']:.0f} img/s"
            )

    def done(self, steps_per_epoch: int) -> None:
        report.done(self.cfg["epochs"], steps_per_epoch)


def parse_fault(spec: str) -> dict:
    """Parse DDPNB_FAULT ('rank=1,epoch=3,step=5[,mode=kill|raise][,restart=0]')."""
    fault = {"rank": 0, "epoch": 1, "step": 0, "mode": "kill", "restart": 0}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, _, value = item.partition("=")
        if key not in fault:
            raise ValueError(f"DDPNB_FAULT: unknown key {key!r} in {spec!r}")
        fault[key] = value if key == "mode" else int(value)
    return fault


def write_effective_config(run_dir, cfg, me, data, device, backend, gradients, weights_note):
    """What "auto" and the defaults became on this run, next to config.json."""
    effective = {
        **cfg,
        "augment": data.augment,
        "augment_requested": cfg["augment"],
        "augment_reason": data.augment_reason,
        "backend": backend if me.distributed else "none",
        "device": str(device),
        "world_size": me.world_size,
        "local_world_size": me.local_world_size,
        "threads": torch.get_num_threads(),  # per process (rank 0's)
        "pipeline": data.pipeline,
        "gradients": gradients,
        "num_classes": data.num_classes,
        "steps_per_epoch": data.steps_per_epoch,
        "global_batch_size": cfg["batch_size"] * me.world_size,
        "weights_note": weights_note,
        "restart_count": me.restart_count,
    }
    atomic_write_bytes(
        run_dir / "effective_config.json", (json.dumps(effective, indent=2) + "\n").encode()
    )


def atomic_write_bytes(path: Path, data: bytes, durable: bool = True) -> None:
    """Write via a temp file, fsync and rename, so readers never see half a file.

    ``durable=False`` skips the fsync: the rename alone keeps readers safe, and the live
    progress file, rewritten 4 times a second, need not survive a power cut (an fsync
    there stalls rank 0, and with it every rank, at the next all-reduce).
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        if durable:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)


def append_jsonl(path: Path, record_: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record_) + "\n")
        f.flush()
        os.fsync(f.fileno())


def keep_epochs_upto(path: Path, last_epoch: int) -> None:
    """Drop lines of epochs after last_epoch: they are redone after a restart."""
    if not path.exists():
        return
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    kept = [ln for ln in lines if json.loads(ln)["epoch"] <= last_epoch]
    if len(kept) != len(lines):
        atomic_write_bytes(path, "".join(ln + "\n" for ln in kept).encode())


def index_order_hash(indices) -> str:
    """16 hex digits of sha256 over an index order: equal orders, equal hashes."""
    return hashlib.sha256(",".join(map(str, indices)).encode()).hexdigest()[:16]


def parameter_checksum(model: nn.Module) -> str:
    """16 hex digits of sha256 over parameters and buffers (identical copies match)."""
    digest = hashlib.sha256()
    for p in [*model.parameters(), *model.buffers()]:
        x = p.detach().cpu().contiguous()
        # A plain memory copy: bytes(storage) would walk the elements one by one.
        digest.update(ctypes.string_at(x.data_ptr(), x.numel() * x.element_size()))
    return digest.hexdigest()[:16]


# -- the process: threads, pitfall warnings, the rendezvous store ---------------------


def set_thread_budget(cfg: dict, me: Rank) -> None:
    """Intra-op threads: config.threads, else this process's share of the host's cores."""
    procs_on_host = int(os.environ.get("DDPNB_PROCS_ON_HOST", me.local_world_size))
    if cfg["threads"] or cfg["thread_budget"]:  # pitfall thread_budget=False: torch's default
        torch.set_num_threads(cfg["threads"] or threads_for_host(procs_on_host))


def threads_for_host(procs_on_host: int, cores: int | None = None) -> int:
    # Each process gets its share of the host's cores: N simulated nodes x P processes
    # with default threads each would oversubscribe the cores (8x slower measured).
    # ``cores``: another host's count (the SSH launcher asks each host for its own). Here:
    # the CPUs this process may use (a Slurm allocation, taskset), not all of the machine's.
    if cores is None:
        affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere every core
        cores = len(affinity(0)) if affinity else os.cpu_count() or 1
    return max(1, cores // max(1, procs_on_host))


def warn_about_pitfalls(cfg: dict, me: Rank) -> None:
    """Once in every node's log: each pitfall switch that is off (notebook 06)."""
    if me.local_rank == 0:
        for name, harm in PITFALL_SWITCHES.items():
            if not cfg[name]:
                me.log(f"WARNING: pitfall switch {name} is OFF ({harm}); wrong on purpose.")


def attempt_store(restart_count: int, timeout: datetime.timedelta) -> dist.Store:
    """torchrun's rendezvous store, seen through a key prefix of this attempt's own."""
    # torchrun's static rendezvous keeps one store for every attempt: after a restart the
    # new workers would read the dead workers' addresses from it and hang. A prefix per
    # attempt gives each attempt clean keys.
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"ddpnb/attempt_{restart_count}", store)


# -- the same dataset on every node ----------------------------------------------------


def dataset_files(root: str | os.PathLike) -> list[tuple[str, Path]]:
    """Sorted (relative path, path) of every file under root/train and root/val."""
    root = Path(root)
    files = []
    for split in ("train", "val"):
        for dirpath, dirnames, filenames in os.walk(root / split):
            dirnames.sort()
            for name in sorted(filenames):
                path = Path(dirpath) / name
                files.append((path.relative_to(root).as_posix(), path))
    files.sort()
    return files


def dataset_fingerprint(root: str | os.PathLike) -> str:
    """sha256 over the sorted relative paths and contents of train/ and val/.

    Files are streamed in 1 MiB blocks, so memory stays flat for any dataset size.
    """
    digest = hashlib.sha256()
    for rel, path in dataset_files(root):
        digest.update(rel.encode() + b"\0")
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()


# -- gradients: averaged through shared memory where ranks share a host, and timed -----


class SharedMemoryAllReduce:
    """Averages DDP gradient buckets through shared memory when all ranks share a host.

    gloo pushes every bucket through the kernel's TCP loopback, and on a small host that
    copying competes with compute (about 40 ms per step for resnet18 here). Ranks on one
    host can read each other's memory instead, as NCCL does within a node: every rank
    copies the slices the others own into a shared file in /dev/shm, sums its own slice
    from everybody's copies, and copies the summed slices back. The sum is the same as
    gloo's (bit for bit at two ranks). Two one-element gloo all-reduces per bucket keep
    the ranks in step, so a dead or hung rank still fails the run within the timeout.

    Use :meth:`create`, which returns ``None`` when the ranks do not share /dev/shm.
    """

    SHM_DIR = Path("/dev/shm")

    def __init__(self, base: Path) -> None:
        self.base = base  # every rank derives the same file names from it
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.flag = torch.zeros(1)
        self.nbytes = 0
        self.generation = 0
        self.storage: torch.UntypedStorage | None = None
        self.disabled = False  # /dev/shm too small: plain all-reduce from then on

    @classmethod
    def create(cls) -> SharedMemoryAllReduce | None:
        """Collective: a shared-memory reducer if every rank can open rank 0's file."""
        name = [None]
        if dist.get_rank() == 0:
            try:
                marker = cls.SHM_DIR / f"ddpnb-{os.getpid()}-{os.urandom(6).hex()}"
                marker.write_text(marker.name)
                name[0] = marker.name
            except OSError:
                pass  # no /dev/shm here
        dist.broadcast_object_list(name, src=0)
        marker = cls.SHM_DIR / (name[0] or "ddpnb-none")
        try:
            ok = name[0] is not None and marker.read_text() == name[0]
        except OSError:
            ok = False  # another host, or another container's /dev/shm
        reducer = cls(marker)
        everyone = reducer.agree(ok)
        if dist.get_rank() == 0 and name[0]:
            marker.unlink(missing_ok=True)
        return reducer if everyone else None

    def agree(self, ok: bool) -> bool:
        """True only if ``ok`` holds on every rank; doubles as a barrier."""
        self.flag.fill_(0.0 if ok else 1.0)
        dist.all_reduce(self.flag)
        return self.flag.item() == 0.0

    def reserve(self, nbytes: int) -> bool:
        """Collective: map a shared buffer of at least ``nbytes`` (False if no room)."""
        if nbytes <= self.nbytes:
            return True
        self.generation += 1
        path = self.base.with_name(f"{self.base.name}-{self.generation}")
        ok = True
        if self.rank == 0:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                try:
                    # Reserve the pages now: writing past a full tmpfs through a mapping
                    # is a SIGBUS, not an exception.
                    os.posix_fallocate(fd, 0, nbytes)
                finally:
                    os.close(fd)
            except OSError:
                path.unlink(missing_ok=True)
                ok = False
        if not self.agree(ok):
            return False
        self.storage = torch.UntypedStorage.from_file(str(path), shared=True, nbytes=nbytes)
        self.agree(True)  # everyone has mapped it: the name is no longer needed
        if self.rank == 0:
            path.unlink()
        self.nbytes = nbytes
        return True

    def allreduce(self, buf: torch.Tensor) -> torch.Tensor:
        """Average ``buf`` (a flat CPU tensor) over all ranks, in place."""
        n, w, r = buf.numel(), self.world, self.rank
        if self.disabled or not self.reserve((w + 1) * n * buf.element_size()):
            self.disabled = True
            dist.all_reduce(buf.div_(w))
            return buf
        shared = torch.empty(0, dtype=buf.dtype).set_(self.storage)[: (w + 1) * n]
        inbox = shared[: w * n].view(w, n)  # inbox[s]: rank s's copy of the others' slices
        summed = shared[w * n :]  # slice o holds the average that rank o computed
        edges = [n * i // w for i in range(w + 1)]
        own = slice(edges[r], edges[r + 1])
        for o in range(w):  # divided on the way: a/w + b/w, the terms gloo adds
            if o != r:
                torch.div(buf[edges[o] : edges[o + 1]], w, out=inbox[r, edges[o] : edges[o + 1]])
        self.agree(True)  # every copy is in place
        mine = buf[own]
        others = [o for o in range(w) if o != r]
        # One pass for the first term: inbox + mine / w (exact scaling for w = 2, 4, ...).
        torch.add(inbox[others[0], own], mine, alpha=1.0 / w, out=mine)
        for o in others[1:]:
            mine.add_(inbox[o, own])
        summed[own].copy_(mine)
        # After this barrier nobody reads the inbox any more, and the next bucket's
        # inbox writes cannot overtake a reader of ``summed`` (they wait at the first).
        self.agree(True)
        for o in range(w):
            if o != r:
                buf[edges[o] : edges[o + 1]].copy_(summed[edges[o] : edges[o + 1]])
        return buf


def timed_comm_hook(compression: str, shared: SharedMemoryAllReduce | None = None):
    """A DDP comm hook that all-reduces each gradient bucket and notes the time it takes.

    ``compression`` is ``none``/``bf16``/``fp16`` for gloo's or NCCL's all-reduce; with
    ``shared`` the buckets are averaged through shared memory instead. The state is a
    dict: ``blocked`` sums the seconds spent inside the hook (the shared-memory path works
    there, in backward's thread) and ``returned`` is when the last bucket was handed
    over. Backward's time after that was spent waiting for asynchronous all-reduces, so
    the exposed communication of a step is ``blocked`` plus that wait.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    inner = {
        "none": default_hooks.allreduce_hook,
        "bf16": default_hooks.bf16_compress_hook,
        "fp16": default_hooks.fp16_compress_hook,
    }[compression]

    def hook(state: dict, bucket):
        start = time.perf_counter()
        if shared is None:
            fut = inner(None, bucket)
        else:
            fut = torch.futures.Future()
            fut.set_result(shared.allreduce(bucket.buffer()))
        state["returned"] = time.perf_counter()
        state["blocked"] += state["returned"] - start
        return fut

    return hook


def no_forward_buffer_sync() -> dict:
    """DDP's keyword for "do not broadcast buffers before every forward".

    torch 2.13 renamed ``broadcast_buffers`` to ``forward_sync_buffers`` (the old name
    warns on every rank). The new flag still syncs buffers once at construction, which
    changes nothing here: every rank builds the same model from the same seed.
    """
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


# -- data: ImageFolders, augmentation, the in-memory pipeline --------------------------


def image_folders(cfg: dict, me: Rank, data_dir: Path):
    """The train and val ImageFolders with their transforms, and the augmentation chosen."""
    augment, augment_reason = resolve_augment(cfg, data_dir)
    if me.master_process:
        me.log(f"augment {augment_reason}")
    train_tf, val_tf = loader_transforms(augment, cfg["image_size"])
    train_set = torchvision.datasets.ImageFolder(
        data_dir / "train", transform=train_tf, loader=load_image
    )
    val_set = torchvision.datasets.ImageFolder(
        data_dir / "val", transform=val_tf, loader=load_image
    )
    if train_set.classes != val_set.classes:
        raise ValueError(f"train/ and val/ of {data_dir} hold different classes.")
    return train_set, val_set, augment, augment_reason


def choose_pipeline(cfg: dict, train_set, val_set) -> str:
    """config.pipeline; "auto" is "memory" when every decoded image fits in RAM."""
    if cfg["pipeline"] != "auto":
        return cfg["pipeline"]
    need = (len(train_set) + len(val_set)) * 3 * cfg["image_size"] ** 2
    return "memory" if need <= MEMORY_PIPELINE_BYTES else "loader"


def memory_batches(cfg, me, train_set, val_set, train_sampler, val_indices, augment, device):
    """(train_batches, val_batches, decode_seconds) of the in-memory pipeline.

    Decoded once; batches are slices, augmented on tensors: no per-sample collation
    and no DataLoader processes competing with compute on a small host.
    """
    size, batch_size = cfg["image_size"], cfg["batch_size"]
    mean = torch.tensor(IMAGENET_MEAN, device=device).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD, device=device).view(1, 3, 1, 1)
    decode_start = time.perf_counter()
    train_images, train_labels = decode_all(train_set.samples, size)
    val_images, val_labels = decode_all([val_set.samples[i] for i in val_indices], size)
    if device.type == "cuda":  # at most MEMORY_PIPELINE_BYTES: kept on the GPU, batches
        # are sliced there (a host-side gather would copy from unpinned memory, in sync).
        train_images, train_labels, val_images, val_labels = (
            t.to(device) for t in (train_images, train_labels, val_images, val_labels)
        )
    decode_seconds = time.perf_counter() - decode_start

    def train_batches(epoch: int):
        # Augmentation randomness depends only on (seed, rank, epoch): a resumed epoch
        # sees exactly what the uninterrupted one saw.
        seed = cfg["seed"] * 1_000_003 + me.global_rank * 1009 + epoch
        gen = torch.Generator().manual_seed(seed)
        order = torch.tensor(list(train_sampler), dtype=torch.long, device=train_images.device)
        for start in range(0, len(order), batch_size):
            idx = order[start : start + batch_size]
            x = train_images[idx].to(device, non_blocking=True).float().div_(255)
            x = augment_batch(x, augment, gen)
            yield (x - mean) / std, train_labels[idx].to(device, non_blocking=True)

    def val_batches():
        for start in range(0, len(val_labels), batch_size):
            x = val_images[start : start + batch_size].to(device).float().div_(255)
            yield (x - mean) / std, val_labels[start : start + batch_size].to(device)

    return train_batches, val_batches, decode_seconds


def on_device(loader: DataLoader, device: torch.device, non_blocking: bool) -> Iterator:
    """A DataLoader's (x, y) batches, moved to the device."""
    for x, y in loader:
        yield x.to(device, non_blocking=non_blocking), y.to(device, non_blocking=non_blocking)


# Photo-style augmentation (crops down to 8% of the area, mirror images) suits colour
# photographs; on small grayscale images such as digits it costs accuracy. ``auto``
# therefore picks "photo" only for images that look like photos.
PHOTO_MIN_SIDE = 128  # px: the short side of a photo-like image
AUGMENT_SAMPLES = 8  # train images looked at by augment="auto"


def sample_images(split_dir: Path, count: int) -> list[Path]:
    """Up to ``count`` image files of a split, spread over its classes."""
    classes = sorted(d for d in split_dir.iterdir() if d.is_dir()) if split_dir.is_dir() else []
    per_class = [
        sorted(p for p in d.iterdir() if p.suffix.lower() in IMAGE_EXTENSIONS) for d in classes
    ]
    chosen: list[Path] = []
    depth = 0
    while len(chosen) < count and any(len(files) > depth for files in per_class):
        chosen += [files[depth] for files in per_class if len(files) > depth]
        depth += 1
    return chosen[:count]


def resolve_augment(cfg: dict, data_dir: Path) -> tuple[str, str]:
    """The augmentation to train with, and a one-line reason for the choice.

    ``auto`` is "digits" for ddpnb's prepared digits, "photo" for colour images whose
    short side is at least PHOTO_MIN_SIDE, and "none" for everything else.
    """
    if cfg["augment"] != "auto":
        return cfg["augment"], f"{cfg['augment']}: set in the config"
    try:
        source = json.loads((data_dir / "manifest.json").read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        source = None
    if source == "digits":
        return "digits", "auto -> digits: ddpnb's prepared digits (manifest source 'digits')"
    colour, sides, sizes = 0, [], set()
    for path in sample_images(data_dir / "train", AUGMENT_SAMPLES):
        try:
            img = load_image(str(path))  # RGB; a grayscale file has three equal channels
        except ValueError:
            continue
        sides.append(min(img.size))
        sizes.add(f"{img.size[0]}x{img.size[1]}")
        img.thumbnail((64, 64))
        x = transforms.functional.pil_to_tensor(img).float()
        if (x.amax(0) - x.amin(0)).mean().item() > 2.0:  # channels differ: colour
            colour += 1
    if not sides:
        return "none", "auto -> none: no sample image could be read; set augment='photo' to opt in"
    is_colour = colour * 2 > len(sides)
    side = sorted(sides)[len(sides) // 2]
    size = sizes.pop() if len(sizes) == 1 else f"{min(sides)}-{max(sides)} px (short side)"
    kind = f"{'colour' if is_colour else 'grayscale'} {size} images"
    if is_colour and side >= PHOTO_MIN_SIDE:
        return "photo", f"auto -> photo: {kind}, photo-like; set augment='none' to opt out"
    return "none", f"auto -> none: {kind}, not photo-like; set augment='photo' to opt in"


def loader_transforms(augment: str, size: int) -> tuple[transforms.Compose, transforms.Compose]:
    """The classic per-sample torchvision pipelines (train, val)."""
    tail = [transforms.ToTensor(), transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    val = transforms.Compose([transforms.Resize(size), transforms.CenterCrop(size), *tail])
    if augment == "photo":
        train = [transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip()]
    elif augment == "digits":
        # No flips: a mirrored digit is another shape.
        train = [
            transforms.Resize(size),
            transforms.CenterCrop(size),
            transforms.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.9, 1.1)),
        ]
    else:
        train = [transforms.Resize(size), transforms.CenterCrop(size)]
    return transforms.Compose([*train, *tail]), val


def load_image(path: str):
    """An image as RGB; a file that cannot be decoded is named in the error."""
    try:
        return torchvision.datasets.folder.default_loader(path)
    except Exception as e:
        raise ValueError(
            f"Corrupt or unreadable image {path} ({e}). Remove or replace the file "
            "(`ddpnb check DATA_DIR` lists every problem), then run again."
        ) from e


def decode_all(samples: list[tuple[str, int]], size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Decode an ImageFolder's samples once into uint8 [N, 3, size, size] and labels."""
    base = transforms.Compose(
        [transforms.Resize(size), transforms.CenterCrop(size), transforms.PILToTensor()]
    )
    images = torch.empty((len(samples), 3, size, size), dtype=torch.uint8)
    for i, (path, _) in enumerate(samples):
        images[i] = base(load_image(path))
    labels = torch.tensor([label for _, label in samples], dtype=torch.long)
    return images, labels


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``; to a GPU through pinned memory, so the copy does not wait."""
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def cuda_device(me: Rank) -> torch.device:
    """This rank's GPU (``LOCAL_RANK``), or a clear error when the node has too few."""
    visible = torch.cuda.device_count()
    if me.local_rank >= visible:
        raise RuntimeError(
            f"local_rank {me.local_rank} needs GPU {me.local_rank}, but {socket.gethostname()} "
            f"shows torch {visible} GPU(s) (CUDA_VISIBLE_DEVICES="
            f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}). Use nproc_per_node <= {visible}."
        )
    return torch.device("cuda", me.local_rank)


def augment_batch(x: torch.Tensor, augment: str, gen: torch.Generator) -> torch.Tensor:
    """Random per-sample affine crops on a float batch, as one grid_sample call."""
    n = x.shape[0]
    if augment == "none" or n == 0:
        return x
    u = to_device(torch.rand((n, 4), generator=gen), x.device)  # drawn on the CPU: resumable
    if augment == "digits":  # mild: +-10 degrees, 0.9-1.1 scale, +-10% shift
        angle = (u[:, 0] * 2 - 1) * math.radians(10)
        scale = 1 / (0.9 + 0.2 * u[:, 1])
        sx = sy = scale
        tx, ty = (u[:, 2] * 2 - 1) * 0.2, (u[:, 3] * 2 - 1) * 0.2
        flip = torch.ones(n, device=x.device)
    else:  # RandomResizedCrop(scale=(0.08, 1), ratio=(3/4, 4/3)) + horizontal flip
        area = 0.08 + 0.92 * u[:, 0]
        ratio = torch.exp(math.log(3 / 4) + (math.log(4 / 3) - math.log(3 / 4)) * u[:, 1])
        sx = torch.sqrt(area * ratio).clamp(max=1.0)
        sy = torch.sqrt(area / ratio).clamp(max=1.0)
        tx, ty = (u[:, 2] * 2 - 1) * (1 - sx), (u[:, 3] * 2 - 1) * (1 - sy)
        angle = torch.zeros(n, device=x.device)
        flip = to_device(torch.where(torch.rand(n, generator=gen) < 0.5, -1.0, 1.0), x.device)
    cos, sin = torch.cos(angle), torch.sin(angle)
    theta = torch.stack(
        [
            torch.stack([sx * cos * flip, -sy * sin, tx], dim=1),
            torch.stack([sx * sin * flip, sy * cos, ty], dim=1),
        ],
        dim=1,
    ).to(x.dtype)
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="border", align_corners=False)


# -- the model ------------------------------------------------------------------------


def replace_head(model: nn.Module, num_classes: int) -> nn.Module:
    """Give a torchvision classifier a fresh final layer with num_classes outputs."""
    if isinstance(getattr(model, "fc", None), nn.Linear):  # ResNet, RegNet, GoogLeNet...
        model.fc = nn.Linear(model.fc.in_features, num_classes)
        return model
    for owner_name in ("classifier", "heads", "head"):
        owner = getattr(model, owner_name, None)
        if isinstance(owner, nn.Linear):
            setattr(model, owner_name, nn.Linear(owner.in_features, num_classes))
            return model
        if isinstance(owner, nn.Sequential):
            # The last Linear (VGG, EfficientNet, ViT) or 1x1 Conv (SqueezeNet) is the head.
            for i in reversed(range(len(owner))):
                layer = owner[i]
                if isinstance(layer, nn.Linear):
                    owner[i] = nn.Linear(layer.in_features, num_classes)
                    return model
                if isinstance(layer, nn.Conv2d):
                    owner[i] = nn.Conv2d(layer.in_channels, num_classes, layer.kernel_size)
                    return model
    raise ValueError(f"Cannot find the classification head of {type(model).__name__}.")


def read_state_dict(path: str) -> dict:
    """A state dict (name -> tensor) from a file, or from a ddpnb checkpoint's model."""
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"weights file {path} cannot be loaded as a state dict: {e}") from e
    if isinstance(state, dict) and isinstance(state.get("model"), dict):
        state = state["model"]  # a ddpnb checkpoint
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"weights file {path} does not hold a state dict (name -> tensor).")
    return state


def load_local_weights(model: nn.Module, path: str) -> list[str]:
    """Load a state-dict file, skipping head tensors whose shapes no longer fit."""
    state = read_state_dict(path)
    own = model.state_dict()
    skipped = [k for k, v in state.items() if k in own and own[k].shape != v.shape]
    state = {k: v for k, v in state.items() if k not in skipped}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in skipped]
    if missing or unexpected:
        raise ValueError(
            f"weights={path!r} does not fit model: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    return skipped


def build_model(cfg: dict, num_classes: int) -> tuple[nn.Module, str]:
    weights = cfg["weights"]
    note = "random init"
    if weights is not None and weights != "DEFAULT" and not Path(weights).is_file():
        raise FileNotFoundError(f"weights file {weights!r} does not exist.")
    try:
        model = torchvision.models.get_model(
            cfg["model"], weights="DEFAULT" if weights == "DEFAULT" else None, **cfg["model_kwargs"]
        )
    except OSError as e:  # URLError is an OSError: no network for the download
        raise RuntimeError(
            f"Could not download the pretrained weights of {cfg['model']} ({e}). No network is "
            "available: pass weights=None to train from scratch, or the path of a local "
            "state-dict file."
        ) from e
    if weights == "DEFAULT":
        note = "torchvision DEFAULT weights"
    replace_head(model, num_classes)
    if weights not in (None, "DEFAULT"):
        skipped = load_local_weights(model, weights)
        note = f"weights from {weights}" + (f" (head re-initialised: {skipped})" if skipped else "")
    return model, note


def make_sgd(params, cfg: dict) -> torch.optim.Optimizer:
    # The fused kernel updates every tensor in one pass: measured 33 -> 10 ms per step for
    # resnet18 on one CPU core, the same update up to float rounding. Older builds lack it.
    kwargs = dict(lr=cfg["lr"], momentum=cfg["momentum"], weight_decay=cfg["weight_decay"])
    try:
        return torch.optim.SGD(params, fused=True, **kwargs)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.SGD(params, **kwargs)


# -- checkpoints and random number generator states -----------------------------------


def checkpoint_config(cfg: dict) -> dict:
    return {k: v for k, v in cfg.items() if k not in RESUMABLE_KEYS}


def check_checkpoint_fits(ckpt: dict, path: Path, cfg: dict, fingerprint: str) -> None:
    """Refuse a checkpoint written with another config, or trained on another dataset."""
    # A field the checkpoint predates (written by an older ddpnb) is not compared
    # here; the launcher has compared it with that field's default.
    changed = sorted(
        k for k in checkpoint_config(cfg) if k in ckpt["config"] and ckpt["config"][k] != cfg[k]
    )
    if changed:
        raise RuntimeError(
            f"{path} was written with a different config (changed: {changed}). "
            "Resume with the original config, or start a new run (another run_dir, "
            "or overwrite=True)."
        )
    if ckpt["fingerprint"] != fingerprint:
        raise RuntimeError(
            f"{path} was trained on another dataset (fingerprint "
            f"{ckpt['fingerprint'][:12]}, now {fingerprint[:12]}). Resume on the original "
            "data, or start a new run."
        )


def write_checkpoint(ckpt: dict, path: Path, epoch: int) -> None:
    """torch.save via a temp file, fsync and rename; a failed write keeps the previous one."""
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(ckpt, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # the previous checkpoint survives a failed write
    except (OSError, RuntimeError) as e:  # torch.save wraps write errors
        tmp.unlink(missing_ok=True)
        kept = "is kept intact" if path.exists() else "does not exist yet"
        free = shutil.disk_usage(path.parent).free
        raise OSError(
            getattr(e, "errno", None) or errno.EIO,
            f"Could not write the checkpoint of epoch {epoch} to {path} "
            f"({e}; {free / 2**20:.1f} MiB free there). The previous checkpoint "
            f"{kept}. Free space on that filesystem (or choose another run_dir), "
            "then relaunch with resume=True",
        ) from e


def rng_state(use_cuda: bool) -> dict:
    """This process's random number generator states (tensors and ints: safe to load)."""
    return {
        "torch": torch.get_rng_state(),
        "python": list(random.getstate()[1]),
        "cuda": [torch.cuda.get_rng_state()] if use_cuda else [],  # this rank's GPU only
    }


def set_rng_state(state: dict, use_cuda: bool) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate((3, tuple(state["python"]), None))
    if use_cuda and state["cuda"]:
        # This rank's GPU's state (checkpoints before that held every visible GPU's).
        states = state["cuda"]
        torch.cuda.set_rng_state(states[torch.cuda.current_device() if len(states) > 1 else 0])


if __name__ == "__main__":
    main(sys.argv[1:])
