"""What the package and the worker must agree on, stdlib only.

The worker (``train_ddp.py``) is a standalone copy and cannot import the package, so
it holds its own copy of these names; ``tests/test_constants.py`` checks that the two
copies match. Keeping them here lets ``import ddpnb`` (and ``ddpnb check``) run without
importing torch.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
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


def threads_for_host(procs_on_host: int, cores: int | None = None) -> int:
    # Each process gets its share of the host's cores: N simulated nodes x P processes
    # with default threads each would oversubscribe the cores (8x slower measured).
    # ``cores``: another host's count (the SSH launcher asks each host for its own). Here:
    # the CPUs this process may use (a Slurm allocation, taskset), not all of the machine's.
    if cores is None:
        affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere every core
        cores = len(affinity(0)) if affinity else os.cpu_count() or 1
    return max(1, cores // max(1, procs_on_host))
