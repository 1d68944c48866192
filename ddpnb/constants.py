"""What the package and the worker share, stdlib only: one copy of each.

The worker imports it as ``ddpnb_constants.py`` on nodes without ddpnb; torch-free, so it is light.
"""

from __future__ import annotations

import hashlib
import os
import random
import socket
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


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now, for a rendezvous that binds it seconds later.

    Taken below the ephemeral range (net.ipv4.ip_local_port_range; torchrun's 29500 is too):
    the kernel gives ports of that range to every outgoing connection of the machine, one of
    which could take the port before torchrun binds it ("Address already in use"); a port
    below it is only taken by a listener that names it. Random, so callers at once differ."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            first_ephemeral = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        first_ephemeral = 32768
    candidates = range(20000, first_ephemeral) if first_ephemeral > 21000 else range(0)
    for port in random.sample(candidates, min(len(candidates), 100)) + [0]:
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError(f"no free TCP port on {host!r}")
