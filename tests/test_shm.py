"""The shared-memory gradient average: same numbers as gloo's, and safe fallbacks.

Real gloo process groups in spawned processes (no torchrun needed to test one class).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from conftest import tmpfs

from ddpnb.worker import SharedMemoryAllReduce

# Sizes that do not split evenly over 3 ranks, then one that needs a bigger buffer.
SIZES = [7, 1000, 12_345, 100_003]


def _ranks(rank: int, world: int, init: str, shm_dirs: list[str], out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    SharedMemoryAllReduce.SHM_DIR = Path(shm_dirs[rank])
    reducer = SharedMemoryAllReduce.create()
    results = {"shared": reducer is not None, "match": [], "disabled": None}
    for n in SIZES:
        grad = torch.randn(n, generator=torch.Generator().manual_seed(rank * 100 + n))
        expected = grad.clone().div_(world)
        dist.all_reduce(expected)
        if reducer is not None:
            got = reducer.allreduce(grad)
            results["match"].append(torch.allclose(got, expected, rtol=1e-6, atol=1e-7))
    if reducer is not None:
        results["disabled"] = reducer.disabled
    torch.save(results, f"{out}.{rank}")
    dist.destroy_process_group()


def run_ranks(tmp_path: Path, shm_dirs: list[str]) -> list[dict]:
    world = len(shm_dirs)
    out = str(tmp_path / "result")
    mp.spawn(_ranks, args=(world, f"file://{tmp_path / 'store'}", shm_dirs, out), nprocs=world)
    return [torch.load(f"{out}.{r}") for r in range(world)]


def test_three_ranks_average_like_gloo(tmp_path):
    """Up to about 40 s under two workers: three spawned ranks, each importing torch and
    forming a gloo group, on 2 cores."""
    # /dev/shm is the machine's: only what this run made counts (a run another test
    # SIGKILLed in its first second may have left its 24-byte marker there).
    before = set(os.listdir("/dev/shm"))
    results = run_ranks(tmp_path, ["/dev/shm"] * 3)
    assert all(r["shared"] for r in results)
    assert all(r["match"] == [True] * len(SIZES) for r in results)
    assert not any(r["disabled"] for r in results)
    left = [p for p in set(os.listdir("/dev/shm")) - before if p.startswith("ddpnb-")]
    assert not left, f"files left over: {left}"


def test_ranks_that_do_not_share_dev_shm_use_the_backend(tmp_path):
    # Separate folders stand in for separate hosts: rank 1 cannot see rank 0's file.
    dirs = [tmp_path / "host0", tmp_path / "host1"]
    for d in dirs:
        d.mkdir()
    results = run_ranks(tmp_path, [str(d) for d in dirs])
    assert [r["shared"] for r in results] == [False, False]
    assert [list(d.iterdir()) for d in dirs] == [[], []]


@pytest.mark.root
def test_full_dev_shm_falls_back_to_the_backend(tmp_path):
    """Up to about 45 s under two workers: three spawned ranks (as above) on a tmpfs too
    small for the largest bucket."""
    small = tmp_path / "small-shm"
    small.mkdir()
    # Room for the small buckets but not for the largest: it must not SIGBUS.
    with tmpfs(small, "size=256k"):
        results = run_ranks(tmp_path, [str(small)] * 3)
    assert all(r["shared"] for r in results)
    assert all(r["match"] == [True] * len(SIZES) for r in results)
    assert all(r["disabled"] for r in results)
