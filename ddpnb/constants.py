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
    # measured). ``cores``: another host's; None: this one's (usable_cpus).
    return max(1, (cores or usable_cpus()) // max(1, procs_on_host))


def usable_cpus() -> int:
    """The CPUs this process may use: its affinity (Slurm, taskset) or its CPU quota, the smaller.

    A container's CPU limit (JupyterHub's cpu_limit, Docker --cpus, Kubernetes limits.cpu) is a
    CFS quota that neither os.cpu_count() nor the affinity shows: a 2-CPU limit on a 64-core host
    would otherwise get 64 threads per process, throttled most of each period.
    """
    affinity = getattr(os, "sched_getaffinity", None)  # Linux; elsewhere every core
    cpus = len(affinity(0)) if affinity else os.cpu_count() or 1
    quota = cpu_quota()
    return max(1, min(cpus, int(quota))) if quota else cpus


def cpu_quota() -> float | None:
    """CPUs' worth of time this process's cgroups allow per period (the smallest limit on the
    path to the root, cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``); None if unlimited."""
    try:
        with open("/proc/self/cgroup") as f:
            groups = [line.rstrip("\n").split(":", 2) for line in f if line.count(":") >= 2]
        with open("/proc/self/mountinfo") as f:
            mounts = [line.split() for line in f]
    except OSError:
        return None  # not Linux
    limits = []
    for fields in mounts:
        sep = fields.index("-") if "-" in fields else -1
        if sep < 0 or len(fields) < sep + 4:
            continue
        root, point, fstype, options = fields[3], fields[4], fields[sep + 1], fields[sep + 3]
        v2 = fstype == "cgroup2"
        if not v2 and not (fstype == "cgroup" and "cpu" in options.split(",")):
            continue
        for _, controllers, path in groups:
            if v2 != (controllers == "") or (not v2 and "cpu" not in controllers.split(",")):
                continue
            rel = os.path.relpath(path, root) if path.startswith(root) else "."
            folder = os.path.normpath(os.path.join(point, rel))
            while folder.startswith(point):  # this cgroup and each parent up to the mount
                limits.append(_cgroup_limit(folder, v2))
                if folder == point:
                    break
                folder = os.path.dirname(folder)
    limits = [x for x in limits if x]
    return min(limits) if limits else None


def _cgroup_limit(folder: str, v2: bool) -> float | None:
    """One cgroup's CPU limit in CPUs, None if it has none (or it cannot be read)."""
    try:
        if v2:
            with open(os.path.join(folder, "cpu.max")) as f:
                quota, period = (f.read().split() + ["100000"])[:2]
        else:
            with open(os.path.join(folder, "cpu.cfs_quota_us")) as f:
                quota = f.read().strip()
            with open(os.path.join(folder, "cpu.cfs_period_us")) as f:
                period = f.read().strip()
        if quota in ("max", "-1") or int(period) <= 0:
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        return None


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
