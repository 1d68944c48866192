"""What the package and the worker share, stdlib only: one copy of each.

The worker imports it as ``ddpnb_constants.py`` on nodes without ddpnb; torch-free, so it is light.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
# Fields that may change on resume without invalidating the checkpoint (same averaged values).
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
    """sha256 over the sorted relative paths and contents of train/ and val/."""
    digest = hashlib.sha256()
    for rel, path in dataset_files(root):
        digest.update(rel.encode() + b"\0")
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
        digest.update(b"\0")
    return digest.hexdigest()


def threads_for_host(procs_on_host: int, cores: int | None = None) -> int:
    # Each process gets its share of the cores: default threads oversubscribe them (8x slower,
    # measured). ``cores``: another host's; None: the CPUs this process may use (Slurm, taskset).
    if cores is None:
        affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere every core
        cores = len(affinity(0)) if affinity else os.cpu_count() or 1
    return max(1, cores // max(1, procs_on_host))
