"""Fault tolerance: the restart drill, lost nodes, a full disk, loopback-only rendezvous."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_config, tmpfs

import ddpnb
from ddpnb.constants import free_port
from ddpnb.scheduler import alive

pytestmark = pytest.mark.slow
# threads fixed: both runs compute in the same order; digits augmentation draws per rank
DRILL = dict(epochs=3, threads=1, augment="digits")


def _epochs(run_dir: Path) -> list[int]:
    return [e["epoch"] for e in ddpnb.load_metrics(run_dir).epochs]


def _wait_for_epoch(run_dir: Path, epoch: int, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while len(_epochs(run_dir)) < epoch:
        assert time.time() < deadline, f"epoch {epoch} not reached in {timeout} s"
        time.sleep(0.2)


# -- the drill: a rank is killed, torchrun restarts it, the run resumes -------------------


def test_restart_resumes_and_matches_the_uninterrupted_run(tiny_data, tmp_path):
    """About 35 s: the same training twice, once uninterrupted and once with a rank killed
    and restarted by torchrun, to compare their numbers."""
    cfg = tiny_config(tiny_data, **DRILL)
    clean = ddpnb.launch(cfg, tmp_path / "clean", nnodes=2, progress="none")
    faulty = ddpnb.launch(
        cfg,
        tmp_path / "fault",
        nnodes=2,
        max_restarts=1,
        progress="none",
        env={"DDPNB_FAULT": "rank=1,epoch=2,step=3"},
    )
    rows = faulty.metrics.epochs
    assert [e["epoch"] for e in rows] == [1, 2, 3]  # epoch 2 was redone and written once
    assert [e["restart_count"] for e in rows] == [0, 1, 1]
    for records in faulty.metrics.ranks.values():
        assert [r["epoch"] for r in records] == [1, 2, 3]
    log = faulty.log_tail(1, 400)
    assert "DDPNB_FAULT: kill at epoch 2 step 3" in log
    assert "resumed from" in log and "after epoch 1" in log
    # Same seed, same data order, same augmentations, restored RNG: the same numbers.
    for a, b in zip(clean.metrics.epochs, rows):
        assert b["val_acc"] == pytest.approx(a["val_acc"], abs=0.01)  # the 1 point
        assert b["train_loss"] == pytest.approx(a["train_loss"], rel=1e-5)
    assert rows[-1]["val_acc"] == clean.metrics.final["val_acc"]
    # Each rank's augmentation stream: its own, and after the restart where it would be.
    for rank, records in faulty.metrics.ranks.items():
        assert [r["rng_checksum"] for r in records] == [
            r["rng_checksum"] for r in clean.metrics.ranks[rank]
        ]
    assert clean.metrics.ranks[0][0]["rng_checksum"] != clean.metrics.ranks[1][0]["rng_checksum"]

    fig = ddpnb.plot_curves([tmp_path / "clean", tmp_path / "fault"], labels=["clean", "fault"])
    markers = [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_label() == "fault: restart"]
    assert len(markers) == 2 and all(list(m.get_xdata()) == [2] for m in markers)


# -- a node is lost: the survivor stops with a clear error, and the run resumes -------------


def _start_remote_node(cfg, run_dir: Path, port: int, node_rank: int) -> subprocess.Popen:
    """Start a node the way its own host would: the torchrun line of node_commands."""
    (cmd,) = ddpnb.node_commands(
        cfg, run_dir, hosts=["127.0.0.1"] * 2, master_port=port, node_rank=node_rank
    )
    argv = [sys.executable, "-m", "torch.distributed.run", *cmd.split()[1:]]
    log = open(run_dir / f"remote-node-{node_rank}.log", "wb")  # noqa: SIM115
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def test_a_lost_node_stops_the_survivor_and_the_run_resumes(tiny_data, tmp_path):
    """About 50 s under two workers: the survivor waits out its collective timeout (10 s)
    before the lost node is named, then a resume trains."""
    run = tmp_path / "r"
    cfg = tiny_config(tiny_data, epochs=40, timeout_seconds=10, threads=1)
    port = free_port()
    job = ddpnb.launch(
        cfg, run, nnodes=2, local_nodes=[0], master_port=port, wait=False, progress="none"
    )
    node1 = _start_remote_node(job.config, run, port, 1)
    try:
        _wait_for_epoch(run, 1)
        assert_loopback_only(job.pids(), port, workers=1)  # node 0 here, at master_addr 127.0.0.1
        os.killpg(node1.pid, signal.SIGKILL)  # node 1's torchrun agent (its workers live on)
        killed_at = time.time()
        with pytest.raises(ddpnb.errors.NodeLost) as e:
            job.wait(timeout=120)
        assert time.time() - killed_at < cfg.timeout_seconds + 30
    finally:
        os.killpg(node1.pid, signal.SIGKILL) if node1.poll() is None else None
        job.stop()
    message = str(e.value)
    assert "nodes [1] run elsewhere" in message and e.value.node_rank == 1
    assert "resume=True" in message
    # node 1's orphaned worker noticed that its agent was gone and stopped by itself
    deadline = time.time() + 30
    while _processes_of(run) and time.time() < deadline:
        time.sleep(0.5)
    assert _processes_of(run) == []

    done = _epochs(run)
    assert done and done == list(range(1, len(done) + 1))
    resumed = ddpnb.launch(
        cfg.replace(epochs=len(done) + 1), run, nnodes=2, resume=True, progress="none"
    )
    assert _epochs(run) == list(range(1, len(done) + 2))  # each epoch exactly once
    assert f"after epoch {len(done)}" in resumed.log_tail(0, 400)


def test_a_killed_local_agent_is_named(tiny_data, tmp_path):
    """Also: with master_addr="localhost" (loopback too) the store and every worker's gloo
    listener bind loopback only, never every interface."""
    cfg = tiny_config(tiny_data, epochs=40, timeout_seconds=10, threads=1)
    job = ddpnb.launch(
        cfg, tmp_path / "r", nnodes=2, master_addr="localhost", wait=False, progress="none"
    )
    _wait_for_epoch(tmp_path / "r", 1)
    pids = job.pids()
    assert_loopback_only(pids, job.master_port, workers=2)
    os.killpg(job.scheduler.procs[1].pid, signal.SIGKILL)
    killed_at = time.time()
    with pytest.raises(ddpnb.errors.NodeLost, match=r"Node 1 was lost: .*killed \(SIGKILL\)") as e:
        job.wait(timeout=120)
    assert time.time() - killed_at < cfg.timeout_seconds + 30
    assert e.value.node_rank == 1 and "resume=True" in str(e.value)
    deadline = time.time() + 10
    while any(alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.2)
    assert not [p for p in pids if alive(p)]


def _processes_of(run_dir: Path) -> list[int]:
    """PIDs whose command line names run_dir (agents and workers of that run)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(run_dir) in cmdline and alive(int(pid)):
            out.append(int(pid))
    return out


# -- a full disk while writing a checkpoint -------------------------------------------------------


@pytest.mark.root
def test_full_disk_keeps_the_previous_checkpoint(tiny_data, tmp_path):
    """About 35 s: a finished run, then a resumed one on a tmpfs too small for its next
    checkpoint; the first checkpoint must survive the second's failed write."""
    run = tmp_path / "r"
    cfg = tiny_config(tiny_data, epochs=1)
    ddpnb.launch(cfg, run, nnodes=1, progress="none")
    ckpt = run / "checkpoints" / "last.pt"
    saved = ckpt.read_bytes()
    # A filesystem with room for the one checkpoint and 1 MiB more: the next one cannot fit.
    size = len(saved) + (1 << 20)
    with tmpfs(ckpt.parent, f"size={size}"):
        ckpt.write_bytes(saved)
        with pytest.raises(ddpnb.WorkerFailed) as e:
            ddpnb.launch(cfg.replace(epochs=2), run, nnodes=1, resume=True, progress="none")
        message = str(e.value)
        assert "Could not write the checkpoint of epoch 2" in message
        assert (
            "No space left on device" in message and "previous checkpoint is kept intact" in message
        )
        assert torch.load(ckpt, weights_only=True)["epoch"] == 1  # loadable, untouched
        assert [p.name for p in ckpt.parent.iterdir()] == ["last.pt"]  # no half-written file
    ckpt.parent.mkdir(exist_ok=True)
    ckpt.write_bytes(saved)  # the disk is "freed": the same run resumes from epoch 1
    ddpnb.launch(cfg.replace(epochs=2), run, nnodes=1, resume=True, progress="none")
    assert _epochs(run) == [1, 2]


# -- bad data found only while the worker loads it -------------------------------------------------


def test_worker_names_a_corrupt_image_found_while_loading(data_copy, tmp_path):
    """About 40 s: a real torchrun at world size 2 must reach the broken image while loading."""
    ddpnb.write_worker(tiny_config(data_copy), tmp_path / "run")  # no launch-time check here
    bad = data_copy / "val" / "4" / "broken.png"
    bad.write_bytes(b"\x89PNG garbage")
    r = subprocess.run(
        [sys.executable, str(tmp_path / "run" / "train_ddp.py"), "--config", "config.json"],
        cwd=tmp_path / "run",
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode != 0
    assert f"Corrupt or unreadable image {bad}" in r.stderr and "ddpnb check" in r.stderr


# -- safety: simulated nodes keep the unauthenticated store on loopback ----------------------------


def _listening(pids: list[int]) -> list[str]:
    """Addresses on which these processes listen for TCP (from /proc)."""
    import ipaddress

    inodes = set()
    for pid in pids:
        for fd in Path(f"/proc/{pid}/fd").glob("*"):
            try:
                target = os.readlink(fd)
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    out = []
    for name in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{name}").read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A" or inode not in inodes:  # 0A: LISTEN
                continue
            host, port = local.split(":")
            raw = b"".join(bytes.fromhex(host[i : i + 8])[::-1] for i in range(0, len(host), 8))
            out.append(f"{ipaddress.ip_address(raw)}:{int(port, 16)}")
    return out


def assert_loopback_only(pids: list[int], master_port: int, workers: int) -> None:
    """Simulated nodes keep the unauthenticated store and gloo's listeners on 127.0.0.1."""
    addresses = _listening(pids)
    assert f"127.0.0.1:{master_port}" in addresses  # the rendezvous store
    assert len(addresses) >= 1 + workers  # and each worker's gloo listener
    assert all(a.startswith("127.0.0.1:") for a in addresses), addresses
