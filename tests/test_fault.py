"""Fault tolerance: the restart drill, lost nodes, a full disk, loopback-only rendezvous."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import tiny_config

import ddpnb
from ddpnb.launch import _alive, free_port

pytestmark = pytest.mark.slow
DRILL = dict(epochs=3, threads=1)  # threads fixed: both runs compute in the same order


def _epochs(run_dir: Path) -> list[int]:
    return [e["epoch"] for e in ddpnb.load_metrics(run_dir).epochs]


def _wait_for_epoch(run_dir: Path, epoch: int, timeout: float = 90) -> None:
    deadline = time.time() + timeout
    while len(_epochs(run_dir)) < epoch:
        assert time.time() < deadline, f"epoch {epoch} not reached in {timeout} s"
        time.sleep(0.2)


# -- the drill: a rank is killed, torchrun restarts it, the run resumes -------------------


@pytest.mark.parametrize("pipeline", ["memory", "loader"])
def test_restart_resumes_and_matches_the_uninterrupted_run(tiny_data, tmp_path, pipeline):
    cfg = tiny_config(tiny_data, pipeline=pipeline, **DRILL)
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

    fig = ddpnb.plot_curves([tmp_path / "clean", tmp_path / "fault"], labels=["clean", "fault"])
    markers = [ln for ax in fig.axes for ln in ax.get_lines() if ln.get_label() == "fault resumed"]
    assert len(markers) == 2 and all(list(m.get_xdata()) == [2] for m in markers)
