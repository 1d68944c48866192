"""ddpnb's training worker: image classification with DistributedDataParallel.

Part 1 is DDP, top to bottom: ``main()`` lists the steps, each a short function after it.
Part 2 holds what a DDP tutorial leaves out: the same dataset on every node, augmentation,
averaging gradients through shared memory, checkpoint guards and each rank's records.

It needs torch, torchvision and what ddpnb writes beside it: ``config.json``,
``ddpnb_constants.py`` and ``ddpnb_reporting.py`` (progress for ddpnb's panel; a no-op
elsewhere). Outputs (``metrics.jsonl``, ``ranks/``, ``checkpoints/``) go to the run directory.

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

Every node needs the same dataset at ``data_dir``: at start-up the ranks compare
dataset fingerprints and stop if they differ. The rendezvous store is not
authenticated: run multi-node jobs on trusted networks only.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import errno
import hashlib
import inspect
import itertools
import json
import math
import os
import random
import shutil
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torchvision
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.elastic.multiprocessing.errors import record
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader, DistributedSampler, Subset
from torchvision import transforms

try:  # the stdlib files ddpnb places beside this script
    import ddpnb_constants as constants
    import ddpnb_reporting as report
except ImportError:  # imported by the package as ddpnb.worker
    from ddpnb import constants
    from ddpnb import reporting as report

# =============================================================================
# Part 1: DDP, top to bottom
# =============================================================================


@record  # a failing rank's own traceback reaches torchrun's error report
def main(argv: list[str] | None = None) -> None:
    """Train this process's share of the run; each line is one step of DDP."""
    cfg, run_dir, data_dir = read_config(argv)  # Part 2: config.json, paths
    me = who_am_i()
    device = set_up_process(cfg, me)
    fingerprint = check_same_dataset(data_dir, me)  # Part 2: stop if nodes hold other data
    report.joined(me.world_size)  # every rank got here: the rendezvous is complete
    data = make_data(cfg, me, data_dir, device)

    torch.manual_seed(cfg["seed"])  # identical init everywhere (DDP also broadcasts rank 0's)
    model, weights_note = build_model(cfg, data.num_classes)  # Part 2: torchvision, new head
    torch.manual_seed(cfg["seed"] + me.global_rank)  # augmentation: each rank its own draws
    model = wrap_model(model.to(device), cfg, me, device)
    raw_model = model.module if isinstance(model, DDP) else model  # checkpoints load without DDP
    optimizer, scheduler = make_optimizer(model, cfg, data.steps_per_epoch)  # Part 2: SGD
    ckpt_path = run_dir / "checkpoints" / "last.pt"  # resume (Part 2): go on after it, if any
    start_epoch = resume(ckpt_path, cfg, fingerprint, raw_model, optimizer, scheduler, me)
    # Part 2: ranks/, metrics.jsonl and effective_config.json; timings by hooks, not in the loop
    records = Records(cfg, me, run_dir, data, start_epoch, model, optimizer, weights_note)

    for epoch in range(start_epoch, cfg["epochs"] + 1):
        data.train_sampler.set_epoch(epoch)  # a new shuffle every epoch, the same on every rank
        started = time.perf_counter()
        train_sums = train_one_epoch(model, data, optimizer, scheduler, epoch, cfg)
        train_seconds = time.perf_counter() - started
        val_sums = validate(model, data)
        metrics = reduce_epoch_metrics(train_sums, val_sums, me)
        records.epoch(epoch, metrics, train_sums, val_sums, train_seconds, scheduler)
        save_checkpoint(ckpt_path, epoch, cfg, me, raw_model, optimizer, scheduler, fingerprint)
        if me.distributed:
            dist.barrier()  # nobody starts the next epoch before the checkpoint is on disk

    report.done(cfg["epochs"], data.steps_per_epoch)
    if me.distributed:
        dist.destroy_process_group()


def who_am_i() -> Rank:
    """This process's place in the run, from torchrun's environment (or one process)."""
    env = os.environ
    return Rank(
        distributed="RANK" in env,  # started by torchrun; otherwise one plain process
        global_rank=int(env.get("RANK", 0)),  # 0 .. world_size - 1 across all nodes
        local_rank=int(env.get("LOCAL_RANK", 0)),  # 0 .. on this node: picks the GPU
        world_size=int(env.get("WORLD_SIZE", 1)),  # processes in the whole run
        local_world_size=int(env.get("LOCAL_WORLD_SIZE", 1)),  # processes on this node
        node_rank=int(env.get("GROUP_RANK", 0)),  # this node: --node_rank, or c10d's choice
        restart_count=int(env.get("TORCHELASTIC_RESTART_COUNT", 0)),  # this agent's restarts
    )


def set_up_process(cfg: dict, me: Rank) -> torch.device:
    """Pick this rank's device and threads, then join the process group."""
    device = pick_device(cfg, me)  # Part 2: GPU number LOCAL_RANK (checked), else the CPU
    if device.type == "cuda":
        torch.cuda.set_device(device)  # before init: nccl and the object collectives use it
    else:  # this process's share of the host's cores; torch's default, every core in every
        torch.set_num_threads(cfg["threads"] or cpu_share(me))  # process: 8x slower here
    backend = "nccl" if device.type == "cuda" else "gloo"
    if me.distributed:
        join_process_group(backend, cfg["timeout_seconds"], me, device)
    me.log(
        f"node {me.node_rank} local_rank {me.local_rank} of world_size {me.world_size} on "
        f"{socket.gethostname()}, {device}, backend {backend if me.distributed else 'none'}, "
        f"threads {torch.get_num_threads()}, attempt {me.restart_count}"
    )
    return device


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
    # Handed a store, init_process_group needs rank= and world_size= too (torch asks for all
    # three): both are torchrun's, read from its environment, never chosen by the script.
    dist.init_process_group(
        backend,
        store=store,
        rank=me.global_rank,
        world_size=me.world_size,
        timeout=timeout,
        **bound,
    )


def make_data(cfg: dict, me: Rank, data_dir: Path, device: torch.device) -> Data:
    """This rank's shard of train (a DistributedSampler) and of val (exact), as DataLoaders."""
    train_set, val_set, augment = image_folders(cfg, me, data_dir)  # Part 2: transforms
    # Faster path, taken when the decoded images fit in memory and need no photo crops:
    # decode each image once and transform a whole batch in one call, instead of each
    # image as it loads. One process on 2 CPU cores: 1.18x the images/s (bench/run.py, 4).
    train_set, val_set = decoded_in_memory(train_set, val_set, cfg, augment[0])  # Part 2
    # Every rank draws the same seeded shuffle and keeps its own 1/world_size of it (padded
    # with repeats, so every rank takes the same number of steps).
    train_sampler = DistributedSampler(
        train_set, num_replicas=me.world_size, rank=me.global_rank, shuffle=True, seed=cfg["seed"]
    )
    # Validation without padding: rank r takes every world_size-th image, so each image
    # counts exactly once and the result does not depend on the world size.
    val_set = Subset(val_set, range(me.global_rank, len(val_set), me.world_size))
    workers = cfg["num_workers"]  # 0: batches made in this process (small hosts)
    loader = dict(batch_size=cfg["batch_size"], num_workers=workers, persistent_workers=workers > 0)
    loader["pin_memory"] = device.type == "cuda"  # page-locked: copies to the GPU overlap
    train_loader = DataLoader(train_set, sampler=train_sampler, **loader)
    val_loader = DataLoader(val_set, shuffle=False, **loader)
    steps = min(len(train_loader), cfg["max_steps_per_epoch"] or len(train_loader))
    classes = len(train_set.classes)
    return Data(train_sampler, train_loader, val_loader, steps, classes, *augment)


def wrap_model(model: nn.Module, cfg: dict, me: Rank, device: torch.device) -> nn.Module:
    """The model in DistributedDataParallel: backward then averages gradients over ranks."""
    # One process has nobody to average gradients with: DDP would only add its bucket
    # copies and an all-reduce with itself (about 10% of a 1-process epoch, measured).
    if me.world_size == 1:
        return model
    ddp = DDP(
        model,
        device_ids=[me.local_rank] if device.type == "cuda" else None,
        bucket_cap_mb=cfg["bucket_cap_mb"],
        gradient_as_bucket_view=True,
        # Rank 0's BatchNorm statistics are sent once per epoch (validate), not before
        # every forward: training never reads them.
        **no_forward_buffer_sync(),
    )
    # How each gradient bucket is averaged (comm_hook). On one host with gloo: through
    # shared memory instead of gloo's TCP loopback, the same sums, about 1.15x the images/s
    # on 2 CPU cores (bench/run.py, 0). Elsewhere the backend's all-reduce, as plain DDP.
    ddp.register_comm_hook(COMM, gradient_hook(cfg, me, device))  # Part 2: chosen, timed
    return ddp


def train_one_epoch(model, data, optimizer, scheduler, epoch: int, cfg: dict) -> torch.Tensor:
    """One pass over this rank's shard of train; returns its sums (loss*n, correct, n)."""
    model.train()
    device = next(model.parameters()).device
    amp = cfg["amp"] and device.type == "cuda"  # bf16 autocast on CUDA; CPU trains in fp32
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    batches = itertools.islice(data.train_loader, data.steps_per_epoch)
    for step, (x, y) in enumerate(batches, 1):
        x, y = x.to(device, non_blocking=True), y.to(device, non_blocking=True)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            logits = model(x)
            loss = F.cross_entropy(logits, y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()  # DDP averages gradient buckets over all ranks while backward runs
        optimizer.step()
        scheduler.step()
        sums += batch_sums(loss.detach(), logits, y)  # Part 2: (loss*n, correct, n)
        report.step(step, data.steps_per_epoch, epoch=epoch, epochs=cfg["epochs"], loss=loss)
    return sums


def validate(model: nn.Module, data: Data) -> torch.Tensor:
    """Sums (loss*n, correct, n) over this rank's exact shard of val."""
    net = model.module if isinstance(model, DDP) else model
    if isinstance(model, DDP):
        for buffer in net.buffers():  # BatchNorm statistics: every rank validates rank 0's
            dist.broadcast(buffer, src=0)
    # The unwrapped model: no DDP collectives inside, so ranks whose shards differ by
    # one batch cannot hang each other.
    net.eval()
    device = next(net.parameters()).device
    sums = torch.zeros(3, dtype=torch.float64, device=device)
    with (
        torch.no_grad(),
        torch.autocast(device.type, torch.bfloat16, enabled=device.type == "cuda"),
    ):
        for x, y in data.val_loader:
            x, y = x.to(device), y.to(device)
            logits = net(x)
            sums += batch_sums(F.cross_entropy(logits.float(), y), logits, y)
    return sums


def reduce_epoch_metrics(train_sums: torch.Tensor, val_sums: torch.Tensor, me: Rank) -> dict:
    """The epoch's metrics over all ranks: sums and counts are reduced, then divided."""
    totals = torch.cat([train_sums, val_sums])  # loss*n, correct, n of train, then of val
    if me.distributed:
        dist.all_reduce(totals)  # sums and counts over every rank, never means of means
    train_loss, train_correct, train_n, val_loss, val_correct, val_n = totals.tolist()
    return {
        "train_loss": train_loss / train_n,
        "train_acc": train_correct / train_n,
        "val_loss": val_loss / max(val_n, 1),
        "val_acc": val_correct / max(val_n, 1),
        "train_samples": round(train_n),
        "val_samples": round(val_n),
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
            "config": cfg,
            "fingerprint": fingerprint,
            "rng": rngs,  # one entry per global rank
        }
        write_checkpoint(ckpt, path, epoch)  # Part 2: atomic; a full disk keeps the last one


# =============================================================================
# Part 2: the machinery (what Part 1 calls to be robust and measurable)
# =============================================================================
# ddpnb's hang watch names a rank's line in Part 1: a call into this part is where it is.


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
    report.use_run_dir(run_dir)  # progress.json and metrics.jsonl, also when run by hand
    return cfg, run_dir, data_dir


@dataclasses.dataclass(frozen=True)
class Rank:
    """Who this process is in the run, in torchrun's terms (``who_am_i`` reads them)."""

    distributed: bool
    global_rank: int
    local_rank: int
    world_size: int
    local_world_size: int
    node_rank: int
    restart_count: int

    @property
    def master_process(self) -> bool:
        return self.global_rank == 0  # does the run's file I/O

    def log(self, msg: str) -> None:
        # ddpnb's launcher has torchrun prefix every line with the rank already.
        prefix = "" if os.environ.get("DDPNB_LAUNCHED") else f"[rank {self.global_rank}] "
        print(prefix + msg, flush=True)


@dataclasses.dataclass
class Data:
    """This rank's data, as make_data returns it."""

    train_sampler: DistributedSampler  # set_epoch(epoch) reshuffles this rank's shard
    train_loader: DataLoader
    val_loader: DataLoader
    steps_per_epoch: int
    num_classes: int
    augment: str  # what augment="auto" became,
    augment_reason: str  # and why


# -- the process: device, threads, the rendezvous store, the same dataset everywhere -----
def pick_device(cfg: dict, me: Rank) -> torch.device:
    """This rank's GPU (``LOCAL_RANK``) unless backend is gloo or CUDA is absent; else the CPU."""
    if torch.cuda.is_available() and cfg["backend"] != "gloo":
        visible = torch.cuda.device_count()
        if me.local_rank >= visible:
            raise RuntimeError(
                f"local_rank {me.local_rank} needs GPU {me.local_rank}, but "
                f"{socket.gethostname()} shows torch {visible} GPU(s) (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}). "
                f"Use nproc_per_node <= {visible}."
            )
        torch.backends.cudnn.benchmark = True  # fixed shapes: cuDNN picks its kernels once
        return torch.device("cuda", me.local_rank)
    if cfg["backend"] == "nccl":
        raise RuntimeError(
            f"backend='nccl' needs CUDA GPUs, and {socket.gethostname()} has none visible to "
            "torch. Use backend='auto' (nccl on GPUs, gloo elsewhere) or 'gloo'."
        )
    return torch.device("cpu")


def cpu_share(me: Rank) -> int:
    """Threads: the host's cores over its processes (ddpnb's launcher counts simulated nodes)."""
    procs = int(os.environ.get("DDPNB_PROCS_ON_HOST", me.local_world_size))
    return constants.threads_for_host(procs)


def attempt_store(restart_count: int, timeout: datetime.timedelta) -> dist.Store:
    """The store torchrun shares with the workers, seen through a prefix per attempt."""
    # torchrun's static rendezvous keeps one store for every attempt: after a restart the
    # new workers would read the dead workers' addresses from it and hang. A prefix per
    # attempt gives clean keys if every node agrees on TORCHELASTIC_RESTART_COUNT (its
    # agent's restarts). Static rendezvous: a failure fails every node's workers, each
    # agent counts it once, the prefixes agree. c10d (Slurm): an agent also restarts healthy
    # workers, uncounted, when a failed node rejoins; differing prefixes then time out.
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout
    )
    return dist.PrefixStore(f"ddpnb/attempt_{restart_count}", store)


def check_same_dataset(data_dir: Path, me: Rank) -> str:
    """This node's dataset fingerprint, once every rank has shown it holds the same data."""
    fingerprint = constants.dataset_fingerprint(data_dir)
    if me.distributed:
        seen = [None] * me.world_size
        dist.all_gather_object(seen, (me.node_rank, socket.gethostname(), fingerprint))
        if differing := sorted({(n, h) for n, h, fp in seen if fp != seen[0][2]}):
            names = ", ".join(f"node {n} ({h})" for n, h in differing)
            raise RuntimeError(
                f"The dataset at {data_dir} differs between nodes: {names} hold data whose "
                f"fingerprint differs from node 0's ({seen[0][2][:12]}). Copy the identical "
                "dataset to every node (rsync -a, or a shared filesystem) and run again."
            )
    return fingerprint


# -- this rank's records: ranks/rank-N.jsonl, metrics.jsonl, effective_config.json --------
def batch_sums(loss: torch.Tensor, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """(loss*n, correct, n) of one batch, in float64: sums, not means, add up over ranks."""
    n = y.shape[0]
    correct = (logits.argmax(1) == y).sum().double()
    return torch.stack([loss.double() * n, correct, torch.full_like(correct, n)])  # no host copy


class Records:
    """This rank's row in ``ranks/`` every epoch, rank 0's ``metrics.jsonl`` row and
    ``effective_config.json``. Timings come from hooks, not the loop: a forward pre-hook marks
    a batch ready, the optimizer's step hooks the end of backward and of the step, the comm hook
    (``COMM``) the exposed gradient time (communication). The rest of an epoch is data wait."""

    def __init__(self, cfg, me, run_dir, data, start_epoch, model, optimizer, weights_note):
        self.cfg, self.me, self.run_dir, self.data = cfg, me, run_dir, data
        self.model = model.module if isinstance(model, DDP) else model
        self.rank_path = run_dir / "ranks" / f"rank-{me.global_rank}.jsonl"
        self.rank_path.parent.mkdir(parents=True, exist_ok=True)
        keep_epochs_upto(self.rank_path, start_epoch - 1)  # epochs to redo after a restart
        if me.master_process:
            keep_epochs_upto(run_dir / "metrics.jsonl", start_epoch - 1)
            self.write_effective_config(weights_note)
        self.busy = self.comm = 0.0  # seconds from batch ready to step end; on gradients
        self.forward_start = self.backward_end = None
        self.epoch_start = time.perf_counter()
        model.register_forward_pre_hook(self._batch_ready)
        optimizer.register_step_pre_hook(self._backward_returned)
        optimizer.register_step_post_hook(self._stepped)

    def _batch_ready(self, module, args) -> None:
        if module.training and self.forward_start is None:
            self.forward_start = time.perf_counter()

    def _backward_returned(self, optimizer, args, kwargs) -> None:
        self.backward_end = time.perf_counter()

    def _stepped(self, optimizer, args, kwargs) -> None:
        if self.forward_start is not None:
            self.busy += time.perf_counter() - self.forward_start
        if COMM["returned"] is not None:  # time in the hook, then waiting for it alone
            self.comm += COMM["blocked"] + self.backward_end - COMM["returned"]
        COMM["blocked"], COMM["returned"], self.forward_start = 0.0, None, None

    def write_effective_config(self, weights_note: str) -> None:
        """What "auto" and the defaults became on this run, next to config.json."""
        cfg, me, data = self.cfg, self.me, self.data
        device = next(self.model.parameters()).device
        backend = ("nccl" if device.type == "cuda" else "gloo") if me.distributed else "none"
        decoded = isinstance(data.train_loader.dataset, DecodedImages)  # make_data's faster path
        images = "decoded in memory" if decoded else "decoded per load"
        effective = {
            **cfg,
            "augment": data.augment,
            "augment_requested": cfg["augment"],
            "augment_reason": data.augment_reason,
            "images": images,
            "backend": backend,
            "device": str(device),
            "world_size": me.world_size,
            "local_world_size": me.local_world_size,
            "threads": torch.get_num_threads(),  # per process (rank 0's)
            "gradients": COMM["route"],
            "num_classes": data.num_classes,
            "steps_per_epoch": data.steps_per_epoch,
            "global_batch_size": cfg["batch_size"] * me.world_size,
            "weights_note": weights_note,
            "restart_count": me.restart_count,
        }
        text = json.dumps(effective, indent=2) + "\n"
        atomic_write(self.run_dir / "effective_config.json", lambda f: f.write(text.encode()))
        me.log(
            f"{cfg['model']} ({weights_note}), {data.num_classes} classes, augment "
            f"{data.augment}, images {images}, {data.steps_per_epoch} steps/epoch, global batch "
            f"{cfg['batch_size'] * me.world_size}"
        )

    def epoch(self, epoch, metrics, train_sums, val_sums, train_seconds, scheduler) -> None:
        """This rank's row in ranks/; rank 0 also reports the run's row to metrics.jsonl."""
        me, sampler = self.me, self.data.train_loader.sampler
        local_train, local_val = round(train_sums[2].item()), round(val_sums[2].item())
        rank_loss, rank_acc = (val_sums[:2] / val_sums[2].clamp(min=1)).tolist()
        # The order this rank drew (a DistributedSampler's; None for any other sampler).
        order = ",".join(map(str, sampler)) if hasattr(sampler, "set_epoch") else None
        row = {
            "epoch": epoch,
            "global_rank": me.global_rank,
            "local_rank": me.local_rank,
            "node_rank": me.node_rank,
            "train_samples": local_train,
            "val_samples": local_val,
            "images_per_second": local_train / train_seconds,
            "data_wait_seconds": max(0.0, train_seconds - self.busy),
            "compute_seconds": self.busy - self.comm,
            "comm_seconds": self.comm,
            "restart_count": me.restart_count,
            "train_seconds": train_seconds,
            "threads": torch.get_num_threads(),
            "val_loss": rank_loss,  # this rank's own shard: the mean of means' ingredients
            "val_acc": rank_acc,
            "order_hash": None if order is None else short_hash(order.encode()),
            "param_checksum": parameter_checksum(self.model),  # equal on every rank
            # The stream augmentation draws from: per rank.
            "rng_checksum": short_hash(torch.get_rng_state().numpy().tobytes()),
        }
        with open(self.rank_path, "a") as f:
            f.write(json.dumps(row) + "\n")
            f.flush()
            os.fsync(f.fileno())
        self.busy = self.comm = 0.0
        now = time.perf_counter()
        epoch_seconds, self.epoch_start = now - self.epoch_start, now
        if me.master_process:
            speed = metrics["train_samples"] / train_seconds  # the run's images/s
            report.epoch(
                epoch,
                **metrics,
                epoch_seconds=epoch_seconds,
                images_per_second=speed,
                restart_count=me.restart_count,
                lr=scheduler.get_last_lr()[0],
            )
            me.log(
                f"epoch {epoch}/{self.cfg['epochs']} train_loss {metrics['train_loss']:.4f} "
                f"val_acc {metrics['val_acc']:.4f} {speed:.0f} img/s"
            )


# -- gradients: averaged through shared memory where ranks share a host, and timed -----
COMM = {"blocked": 0.0, "returned": None, "route": "none (one process)"}  # the comm hook's


def gradient_hook(cfg: dict, me: Rank, device: torch.device):
    """The comm hook wrap_model registers, as config.comm_hook asks, timed into ``COMM``:
    ``auto`` is shared memory where every rank shares /dev/shm (CPU), else the all-reduce."""
    shm = None
    if cfg["comm_hook"] in ("auto", "shm") and device.type == "cpu":
        shm = SharedMemoryAllReduce.create()
        if shm is None and cfg["comm_hook"] == "shm":
            raise RuntimeError(
                "comm_hook='shm' needs every rank on one host with a shared /dev/shm, "
                "and these ranks are not. Use comm_hook='auto' (shared memory where it "
                "can, the backend's all-reduce elsewhere) or 'none'."
            )
    compression = cfg["comm_hook"] if cfg["comm_hook"] in ("bf16", "fp16") else "none"
    COMM["route"] = "shared memory" if shm else f"{dist.get_backend()} all-reduce ({compression})"
    if me.master_process:
        me.log(f"gradients are averaged through {COMM['route']}")
    return timed_comm_hook(compression, shm)


class SharedMemoryAllReduce:
    """Averages DDP gradient buckets through shared memory when all ranks share a host.

    gloo pushes every bucket through the kernel's TCP loopback, which on a small host competes with
    compute (about 40 ms per step for resnet18 here). As NCCL does within a node, every rank copies
    the slices the others own into a file in /dev/shm, sums its own slice from everybody's copies,
    and copies the summed slices back: gloo's sum (bit for bit at two ranks). Two one-element gloo
    all-reduces per bucket keep the ranks in step, so a dead or hung rank still fails the run within
    the timeout. Make it with ``create``."""

    SHM_DIR = Path("/dev/shm")

    def __init__(self, base: Path) -> None:
        self.base = base  # every rank derives the same file names from it
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.flag = torch.zeros(1)
        self.nbytes = 0  # the mapped buffer's size; it only grows
        self.storage: torch.UntypedStorage | None = None
        self.disabled = False  # /dev/shm too small: plain all-reduce from then on

    @classmethod
    def create(cls) -> SharedMemoryAllReduce | None:
        """Collective: a shared-memory reducer if every rank can open rank 0's file."""
        name = [None]
        if dist.get_rank() == 0:
            with contextlib.suppress(OSError):  # no /dev/shm here
                marker = cls.SHM_DIR / f"ddpnb-{os.getpid()}-{os.urandom(6).hex()}"
                marker.write_text(marker.name)
                name[0] = marker.name
        dist.broadcast_object_list(name, src=0)
        marker = cls.SHM_DIR / (name[0] or "ddpnb-none")
        ok = False
        with contextlib.suppress(OSError):  # another host, or another container's /dev/shm
            ok = name[0] is not None and marker.read_text() == name[0]
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
        path = self.base.with_name(f"{self.base.name}-{nbytes}")
        ok = True
        if self.rank == 0:
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                with os.fdopen(fd, "wb"):  # closes fd
                    # Reserve the pages now: writing past a full tmpfs through a mapping
                    # is a SIGBUS, not an exception.
                    os.posix_fallocate(fd, 0, nbytes)
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
        part = [slice(edges[o], edges[o + 1]) for o in range(w)]  # rank o owns part[o]
        own, others = part[r], [o for o in range(w) if o != r]
        for o in others:  # divided on the way: a/w + b/w, the terms gloo adds
            torch.div(buf[part[o]], w, out=inbox[r, part[o]])
        self.agree(True)  # every copy is in place
        mine = buf[own]
        # One pass for the first term: inbox + mine / w (exact scaling for w = 2, 4, ...).
        torch.add(inbox[others[0], own], mine, alpha=1.0 / w, out=mine)
        for o in others[1:]:
            mine.add_(inbox[o, own])
        summed[own].copy_(mine)
        # After this barrier nobody reads the inbox any more, and the next bucket's
        # inbox writes cannot overtake a reader of ``summed`` (they wait at the first).
        self.agree(True)
        for o in others:
            buf[part[o]].copy_(summed[part[o]])
        return buf


def timed_comm_hook(compression: str, shared: SharedMemoryAllReduce | None = None):
    """A DDP comm hook that all-reduces each gradient bucket (``compression``: none, bf16, fp16;
    or through ``shared`` memory), timed into its state: ``blocked``, the seconds inside the hook;
    ``returned``, when the last bucket left (backward's wait after it is exposed communication)."""
    name = "allreduce_hook" if compression == "none" else f"{compression}_compress_hook"
    inner = getattr(default_hooks, name)

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
    """DDP's "no buffer broadcast before each forward": ``forward_sync_buffers`` from torch 2.13
    (it syncs once, at construction: harmless), else ``broadcast_buffers`` (warns on 2.13)."""
    if "forward_sync_buffers" in inspect.signature(DDP.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


# -- data: ImageFolders and augmentation -----------------------------------------------
def image_folders(cfg: dict, me: Rank, data_dir: Path):
    """The train and val ImageFolders with their transforms, and the augmentation chosen."""
    augment, augment_reason = resolve_augment(cfg, data_dir)
    if me.master_process:
        me.log(f"augment {augment_reason}")
    train_set, val_set = (
        torchvision.datasets.ImageFolder(data_dir / split, transform=tf, loader=load_image)
        for split, tf in zip(("train", "val"), loader_transforms(augment, cfg["image_size"]))
    )
    if train_set.classes != val_set.classes:
        raise ValueError(f"train/ and val/ of {data_dir} hold different classes.")
    return train_set, val_set, (augment, augment_reason)


# Photo-style augmentation (crops down to 8% of the area, mirror images) suits colour photographs;
# on small grayscale images such as digits it costs accuracy: ``auto`` picks it for photos only.
PHOTO_MIN_SIDE = 128  # px: the short side of a photo-like image
AUGMENT_SAMPLES = 8  # train images looked at by augment="auto"


def resolve_augment(cfg: dict, data_dir: Path) -> tuple[str, str]:
    """The augmentation to train with, and a one-line reason: ``auto`` is "digits" for
    ddpnb's digits, "photo" for colour images of short side >= PHOTO_MIN_SIDE, else "none"."""
    if cfg["augment"] != "auto":
        return cfg["augment"], f"{cfg['augment']}: set in the config"
    source = None
    with contextlib.suppress(OSError, ValueError, AttributeError):
        source = json.loads((data_dir / "manifest.json").read_text()).get("source")
    if source == "digits":
        return "digits", "auto -> digits: ddpnb's prepared digits (manifest source 'digits')"
    # A few train images, taken in turn from each class.
    files = (data_dir / "train").glob("*/*")
    images = sorted(p for p in files if p.suffix.lower() in constants.IMAGE_EXTENSIONS)
    by_class = [list(group) for _, group in itertools.groupby(images, lambda p: p.parent)]
    in_turn = itertools.chain.from_iterable(itertools.zip_longest(*by_class))
    colour, sides, sizes = 0, [], set()
    for path in [p for p in in_turn if p is not None][:AUGMENT_SAMPLES]:
        try:
            img = load_image(str(path))  # RGB; a grayscale file has three equal channels
        except ValueError:
            continue
        sides.append(min(img.size))
        sizes.add(f"{img.size[0]}x{img.size[1]}")
        img.thumbnail((64, 64))
        x = transforms.functional.pil_to_tensor(img).float()
        colour += (x.amax(0) - x.amin(0)).mean().item() > 2.0  # channels differ: colour
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
    fit = [transforms.Resize(size), transforms.CenterCrop(size)]
    tail = [
        transforms.ToTensor(),
        transforms.Normalize(constants.IMAGENET_MEAN, constants.IMAGENET_STD),
    ]
    train = fit
    if augment == "photo":
        train = [transforms.RandomResizedCrop(size), transforms.RandomHorizontalFlip()]
    elif augment == "digits":  # no flips: a mirrored digit is another shape
        train = [*fit, transforms.RandomAffine(degrees=10, translate=(0.1, 0.1), scale=(0.9, 1.1))]
    return transforms.Compose([*train, *tail]), transforms.Compose([*fit, *tail])


DECODED_BYTES = 1 << 30  # the faster path's decoded images per process (and DataLoader worker)


def decoded_in_memory(train_set, val_set, cfg: dict, augment: str):
    """Both splits as DecodedImages when they fit in DECODED_BYTES and need no photo
    crops (those are cut from the full-size image); otherwise the ImageFolders as given."""
    size = cfg["image_size"]
    need = (len(train_set) + len(val_set)) * 3 * size * size * max(1, cfg["num_workers"])
    if augment == "photo" or need > DECODED_BYTES:
        return train_set, val_set
    return DecodedImages(train_set, size, augment), DecodedImages(val_set, size, "none")


class DecodedImages(torch.utils.data.Dataset):
    """An ImageFolder's images kept decoded (uint8) and transformed a batch at a time:
    ``loader_transforms`` for augment "none" and "digits", with resize and centre-crop once, at
    the first decode, then the random affine and normalisation as one call per batch (the
    DataLoader asks for a batch's indices together, ``__getitems__``)."""

    def __init__(self, folder: torchvision.datasets.ImageFolder, size: int, augment: str):
        self.samples, self.classes, self.augment = folder.samples, folder.classes, augment
        self.fit = transforms.Compose(
            [transforms.Resize(size), transforms.CenterCrop(size), transforms.PILToTensor()]
        )
        self.images = torch.empty((len(self.samples), 3, size, size), dtype=torch.uint8)
        self.decoded = [False] * len(self.samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int):
        return self.__getitems__([i])[0]

    def __getitems__(self, indices: list[int]) -> list:
        for i in indices:
            if not self.decoded[i]:
                self.images[i] = self.fit(load_image(self.samples[i][0]))
                self.decoded[i] = True
        x = self.images[indices].float().div_(255)
        if self.augment == "digits":
            x = random_affine(x, degrees=10, translate=0.1, scale=(0.9, 1.1))
        x = transforms.functional.normalize(x, constants.IMAGENET_MEAN, constants.IMAGENET_STD)
        return list(zip(x, (self.samples[i][1] for i in indices)))


def random_affine(x: torch.Tensor, degrees: float, translate: float, scale: tuple) -> torch.Tensor:
    """transforms.RandomAffine on each image of a batch (its own angle, shift and scale),
    as one grid_sample call: nearest pixel, zeros outside, as torchvision does."""
    n = x.shape[0]
    angle = (torch.rand(n) * 2 - 1) * math.radians(degrees)
    zoom = scale[0] + (scale[1] - scale[0]) * torch.rand(n)
    shift = (torch.rand(n, 2, 1) * 2 - 1) * (2 * translate)  # in [-1, 1] image coordinates
    cos, sin = torch.cos(angle) / zoom, torch.sin(angle) / zoom
    inverse = torch.stack([torch.stack([cos, sin], 1), torch.stack([-sin, cos], 1)], 1)
    theta = torch.cat([inverse, -inverse @ shift], 2)  # output pixel -> where it came from
    grid = F.affine_grid(theta, list(x.shape), align_corners=False)
    return F.grid_sample(x, grid, mode="nearest", padding_mode="zeros", align_corners=False)


def load_image(path: str):
    """An image as RGB; a file that cannot be decoded is named in the error."""
    try:
        return torchvision.datasets.folder.default_loader(path)
    except Exception as e:
        raise ValueError(
            f"Corrupt or unreadable image {path} ({e}). Remove or replace the file "
            "(`ddpnb check DATA_DIR` lists every problem), then run again."
        ) from e


# -- the model ------------------------------------------------------------------------
def replace_head(model: nn.Module, num_classes: int) -> nn.Module:
    """Give a torchvision classifier a fresh final layer with num_classes outputs."""
    for owner_name in ("fc", "classifier", "heads", "head"):  # fc: ResNet, RegNet, GoogLeNet...
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


def build_model(cfg: dict, num_classes: int) -> tuple[nn.Module, str]:
    """The torchvision model with a new head, and where its weights came from."""
    weights = cfg["weights"]
    local = weights not in (None, "DEFAULT")
    if local and not Path(weights).is_file():
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
    note = "torchvision DEFAULT weights" if weights == "DEFAULT" else "random init"
    replace_head(model, num_classes)
    if local:  # a state-dict file: head tensors whose shapes no longer fit are skipped
        state, own = read_state_dict(weights), model.state_dict()
        skipped = [k for k, v in state.items() if k in own and own[k].shape != v.shape]
        state = {k: v for k, v in state.items() if k not in skipped}
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if k not in skipped]
        if missing or unexpected:
            raise ValueError(
                f"weights={weights!r} does not fit model: missing {missing[:5]}, "
                f"unexpected {unexpected[:5]}"
            )
        note = f"weights from {weights}" + (f" (head re-initialised: {skipped})" if skipped else "")
    if cfg["channels_last"]:  # NHWC: faster convolutions on recent GPUs (slower on CPU here)
        model = model.to(memory_format=torch.channels_last)
    return model, note


def make_optimizer(model: nn.Module, cfg: dict, steps_per_epoch: int):
    """SGD with momentum, and its learning-rate schedule (stepped after every step)."""
    optimizer = make_sgd(model.parameters(), cfg)
    total = cfg["epochs"] * steps_per_epoch
    cosine = lambda step: 0.5 * (1 + math.cos(math.pi * min(step, total) / total))
    schedule = cosine if cfg["lr_schedule"] == "cosine" else lambda step: 1.0
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)


def make_sgd(params, cfg: dict) -> torch.optim.Optimizer:
    # The fused kernel updates every tensor in one pass: measured 33 -> 10 ms per step for
    # resnet18 on one CPU core, the same update up to float rounding. Older builds lack it.
    kwargs = dict(lr=cfg["lr"], momentum=cfg["momentum"], weight_decay=cfg["weight_decay"])
    try:
        return torch.optim.SGD(params, fused=True, **kwargs)
    except (RuntimeError, TypeError, ValueError):
        return torch.optim.SGD(params, **kwargs)


# -- checkpoints and random number generator states -----------------------------------
def resume(path, cfg, fingerprint, model, optimizer, scheduler, me) -> int:
    """Load the last checkpoint, if any (also after a torchrun restart): the first epoch to run.

    Only node 0's disk surely holds it (hosts without a shared folder each have their own run
    directory): rank 0 reads it and sends it to every rank."""
    ckpt = None
    if me.master_process and path.exists():
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    if me.distributed:  # a collective: every rank takes part, whether there is one or not
        box = [ckpt]
        dist.broadcast_object_list(box, src=0)
        ckpt = box[0]
    if ckpt is None:
        return 1
    # Refuse a checkpoint written with another config, or trained on another dataset. A field
    # the checkpoint predates (an older ddpnb) is not compared: the launcher compared it with
    # that field's default.
    kept = ckpt["config"]
    changed = sorted(
        k for k in cfg if k not in constants.RESUMABLE_KEYS and k in kept and kept[k] != cfg[k]
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
    model.load_state_dict(ckpt["model"])
    optimizer.load_state_dict(ckpt["optimizer"])
    scheduler.load_state_dict(ckpt["scheduler"])
    # Each rank continues its own random streams (the loader's transforms draw from
    # them); with another world size the per-epoch seeds still hold.
    if isinstance(ckpt["rng"], list) and len(ckpt["rng"]) == me.world_size:
        set_rng_state(ckpt["rng"][me.global_rank], next(model.parameters()).is_cuda)
    sent = "" if me.master_process else " (node 0's, sent by rank 0)"
    me.log(f"resumed from {path}{sent} after epoch {ckpt['epoch']}")
    return ckpt["epoch"] + 1


def write_checkpoint(ckpt: dict, path: Path, epoch: int) -> None:
    """torch.save via a temp file, fsync and rename; a failed write keeps the previous one."""
    path.parent.mkdir(exist_ok=True)
    try:
        atomic_write(path, lambda f: torch.save(ckpt, f))
    except (OSError, RuntimeError) as e:  # torch.save wraps write errors
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


# -- files written whole, hashes ---------------------------------------------------------
def atomic_write(path: Path, write) -> None:
    """``write(file)`` into a temp file, fsync and rename: readers never see half a file,
    and a failed write leaves the previous one."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def keep_epochs_upto(path: Path, last_epoch: int) -> None:
    """Drop lines of epochs after last_epoch: they are redone after a restart."""
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()] if path.exists() else []
    kept = [ln for ln in lines if json.loads(ln)["epoch"] <= last_epoch]
    if len(kept) != len(lines):
        text = "".join(ln + "\n" for ln in kept)
        atomic_write(path, lambda f: f.write(text.encode()))


def short_hash(data: bytes) -> str:
    """16 hex digits of sha256: equal data (an index order, an RNG state), equal hashes."""
    return hashlib.sha256(data).hexdigest()[:16]


def parameter_checksum(model: nn.Module) -> str:
    """16 hex digits of sha256 over parameters and buffers (identical copies match)."""
    digest = hashlib.sha256()
    for p in [*model.parameters(), *model.buffers()]:
        digest.update(p.detach().cpu().reshape(-1).view(torch.uint8).numpy())  # its raw bytes
    return digest.hexdigest()[:16]


if __name__ == "__main__":
    main(sys.argv[1:])
