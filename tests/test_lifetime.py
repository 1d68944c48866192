"""A run never outlives what started it: a killed kernel or a crashed parent leaves nothing.

Real processes: a real Jupyter kernel (jupyter_client) or a plain Python parent launches
two simulated nodes with ``wait=False``; the parent is then killed with SIGKILL, so none
of its cleanup code runs. Every agent and worker, found by PID, must be gone within 10 s,
and the run directory must resume to completion afterwards.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import TINY

import ddpnb
from ddpnb.scheduler import alive

LIFETIME_LIMIT = 10.0


def _launch_code(data: Path, run: Path) -> str:
    """Python that launches a 2-node run, waits for epoch 1, and prints every PID."""
    return textwrap.dedent(
        f"""
        import json, time
        import ddpnb
        cfg = ddpnb.TrainConfig(data_dir={str(data)!r}, **{dict(TINY, epochs=30)!r})
        job = ddpnb.launch(cfg, {str(run)!r}, nnodes=2, wait=False, progress="none")
        deadline = time.time() + 120
        while not job.metrics.epochs and time.time() < deadline:
            time.sleep(0.2)
        print("PIDS", json.dumps(job.pids()), flush=True)
        """
    )


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.time() + seconds
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def _resume_completes(data: Path, run: Path) -> None:
    done = [e["epoch"] for e in ddpnb.load_metrics(run).epochs]
    assert done == list(range(1, len(done) + 1)) and done
    cfg = ddpnb.TrainConfig(data_dir=str(data), **dict(TINY, epochs=len(done) + 1))
    ddpnb.launch(cfg, run, nnodes=2, resume=True, progress="none")
    assert [e["epoch"] for e in ddpnb.load_metrics(run).epochs] == list(range(1, len(done) + 2))


@pytest.mark.slow
@pytest.mark.parametrize("end", ["sigkill", "restart"])
def test_an_ended_kernel_leaves_nothing_and_the_run_resumes(tiny_data, tmp_path, end):
    """About 50 s under two workers: a kernel starts a run and is ended, then (after the
    SIGKILL, where nothing of the kernel ran) a resume trains; the resume after a polite
    restart is the same launch, once is enough for the suite."""
    from jupyter_client import KernelManager

    run = tmp_path / "r"
    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(tmp_path))
    kc = km.client()
    kc.start_channels()
    out: list[str] = []
    try:
        kc.wait_for_ready(timeout=60)
        reply = kc.execute_interactive(
            _launch_code(tiny_data, run),
            timeout=180,
            output_hook=lambda m: out.append(m["content"].get("text", "")),
        )
        assert reply["content"]["status"] == "ok", reply["content"]
        pids = json.loads("".join(out).split("PIDS", 1)[1])
        assert len(pids) >= 4  # two agents, two workers
        if end == "sigkill":
            os.kill(km.provisioner.pid, signal.SIGKILL)  # the OOM killer: no cleanup runs
        else:
            km.restart_kernel(now=False)  # JupyterLab's "Restart Kernel": a polite shutdown
        left = _gone_within(pids, LIFETIME_LIMIT)
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    assert left == [], f"still alive {LIFETIME_LIMIT} s after the kernel ended ({end}): {left}"
    if end == "sigkill":  # nothing of the kernel ran: the lifeline stopped the nodes
        assert "the launcher is gone" in (run / "logs" / "node-0.log").read_text()
        _resume_completes(tiny_data, run)


@pytest.mark.slow
def test_a_crashed_parent_leaves_nothing(tiny_data, tmp_path):
    """About 30 s: a parent that starts two nodes and aborts; the lifeline must end them."""
    run = tmp_path / "r"
    code = _launch_code(tiny_data, run) + "import os; os.abort()\n"
    parent = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=dict(os.environ)
    )
    try:
        line = next(ln for ln in parent.stdout if ln.startswith("PIDS"))
        pids = json.loads(line.split("PIDS", 1)[1])
        assert parent.wait(timeout=30) == -signal.SIGABRT
        left = _gone_within(pids, LIFETIME_LIMIT)
    finally:
        parent.kill() if parent.poll() is None else None
    assert len(pids) >= 4 and left == [], left
