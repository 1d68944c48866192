"""Your own torchrun script under ddpnb: simulated nodes, the CLI, failures, interrupts.

The scripts in tests/own/ are plain torchrun scripts (gloo, synthetic data); SSH hosts
and Slurm run them in test_ssh.py and test_slurm.py.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ddpnb
from ddpnb.errors import ConfigError, RunDirError, WorkerFailed

OWN = Path(__file__).with_name("own")
TRICKY = "a b 'c' \"d\" $HOME;"  # spaces, quotes and shell characters reach the script as is

pytestmark = pytest.mark.slow


def run_pids(run_dir: Path) -> list[int]:
    """Processes (any user) whose environment says they belong to run_dir's run."""
    tag = f"DDPNB_RUN_DIR={run_dir}".encode()
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if tag in env:
                out.append(int(entry))
    return out


def _alive(pids, within=10.0):
    deadline = time.time() + within
    while True:
        alive = [p for p in pids if Path(f"/proc/{p}").exists() and _not_zombie(p)]
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.1)


def _not_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture(scope="module")
def linear_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("own") / "linear run"
    script = ddpnb.Script(OWN / "linear.py", args=["3", TRICKY], files=[OWN / "datautils.py"])
    job = ddpnb.launch(script, run, nnodes=2, progress="text")
    return job


def test_a_script_with_its_files_runs_on_two_simulated_nodes(linear_run):
    job, run = linear_run, linear_run.run_dir
    assert sorted(p.name for p in run.iterdir() if p.suffix == ".py") == [
        "datautils.py",
        "ddpnb_reporting.py",
        "linear.py",
    ]
    log = (run / "logs" / "node-1.log").read_text()
    assert f"rank 1 of 2 args ['3', {TRICKY!r}]" in log  # the arguments, unchanged
    assert (run / "model.pt").is_file()  # written by rank 0 in its working directory
    assert job.node_status() == {0: "done", 1: "done"}
    metrics = job.metrics
    assert [r["epoch"] for r in metrics.epochs] == [1, 2, 3]
    assert all(r["world_size"] == 2 for r in metrics.epochs)
    assert metrics.final["train_acc"] > 0.7
    assert job.epochs == 3 and not job.pids()


def test_what_reports_draws_like_the_worker(linear_run):
    fig = ddpnb.plot_curves(linear_run.run_dir)
    assert fig.axes[0].lines  # the train loss the script reported


def test_the_panel_follows_a_script(linear_run):
    from ddpnb.progress import WidgetProgress

    panel = WidgetProgress(linear_run)
    panel.close(linear_run)
    assert panel.epoch_bar.value == panel.epoch_bar.max == 3
    assert all(">done<" in row.value for row in panel.node_rows)
    assert "rank 1 of 2" in panel.node_rows[1].value or "ddpnb" not in panel.node_rows[1].value
    assert panel.plot.value[:4] == b"\x89PNG"


def test_a_script_that_does_not_report(tmp_path):
    job = ddpnb.launch(
        ddpnb.Script(OWN / "plain.py", args=[TRICKY]), tmp_path / "plain", progress="none"
    )
    assert (job.run_dir / "out.txt").read_text() == TRICKY
    assert job.node_status() == {0: "done", 1: "done"} and job.metrics.epochs == []
    assert "plain rank 1 sees" in job.last_line(1)


@pytest.mark.parametrize("record", [False, True], ids=["plain", "with @record"])
def test_a_raising_script_gives_its_traceback(tmp_path, record):
    script = ddpnb.Script(OWN / "fails.py", args=["record"] if record else [])
    start = time.time()
    with pytest.raises(WorkerFailed) as info:
        ddpnb.launch(script, tmp_path / "run", nnodes=2, progress="none")
    err = info.value
    assert (err.node_rank, err.global_rank, err.exit_code) == (1, 1, 1)
    assert "ValueError: bad batch at step 2" in str(err)
    assert 'fails.py", line 12, in train_step' in err.traceback  # the script's own frame
    assert time.time() - start < 60
    assert not _alive(run_pids(tmp_path / "run"), within=5)


def test_a_script_that_reports_gets_the_fault_drill(tmp_path):
    # DDPNB_FAULT rides on ddpnb_reporting.step: any script that reports can be drilled.
    script = ddpnb.Script(OWN / "linear.py", args=["2", "drill"], files=[OWN / "datautils.py"])
    env = {"DDPNB_FAULT": "rank=1,epoch=2,step=1"}
    with pytest.raises(WorkerFailed) as info:
        ddpnb.launch(script, tmp_path / "drill", nnodes=2, env=env, progress="none")
    err = info.value  # the killed rank, not rank 0's "connection reset" after it
    assert (err.node_rank, err.global_rank, err.exit_code) == (1, 1, -9)
    assert "killed by SIGKILL" in str(err)
    log = (tmp_path / "drill" / "logs" / "node-1.log").read_text()
    assert "DDPNB_FAULT: kill at epoch 2 step 1" in log
    assert not _alive(run_pids(tmp_path / "drill"), within=5)
    with pytest.raises(ConfigError, match="'epok=2' is not understood"):  # before any start
        ddpnb.launch(script, tmp_path / "typo", env={"DDPNB_FAULT": "rank=1,epok=2"})
    assert not (tmp_path / "typo").exists()


def test_bad_input_is_refused_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="no_such.py: no such file"):
        ddpnb.launch(ddpnb.Script(tmp_path / "no_such.py"), tmp_path / "r1")
    with pytest.raises(ConfigError, match="args must be strings"):
        ddpnb.Script(OWN / "plain.py", args=[3])
    with pytest.raises(ConfigError, match="args must be a list"):
        ddpnb.Script(OWN / "plain.py", args="--epochs 3")
    clash = tmp_path / "ddpnb_reporting.py"
    clash.write_text("")
    with pytest.raises(ConfigError, match="ddpnb_reporting.py.*Rename or move one"):
        ddpnb.launch(ddpnb.Script(OWN / "plain.py", files=[clash]), tmp_path / "r2")
    assert not (tmp_path / "r1").exists() and not (tmp_path / "r2").exists()
    mine = tmp_path / "r3"  # a folder holding the user's own plain.py, another one
    mine.mkdir()
    (mine / "plain.py").write_text("print('mine')\n")
    with pytest.raises(RunDirError, match="other files named plain.py"):
        ddpnb.launch(ddpnb.Script(OWN / "plain.py"), mine)
    assert (mine / "plain.py").read_text() == "print('mine')\n"  # never overwritten


def _cli(*args, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddpnb", *args], capture_output=True, text=True, **kwargs
    )


def test_cli_run_options_then_script_then_its_args(tmp_path):
    """About 30 s: the CLI (its own interpreter) and a two-node launch of a user's script."""
    run = tmp_path / "cli"
    r = _cli(
        "run", "--nnodes", "2", "--run-dir", str(run), "--file", str(OWN / "datautils.py"),
        str(OWN / "linear.py"), "2", "--not-ours", timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    assert "epoch 2/2  train_loss" in r.stdout
    assert "args ['2', '--not-ours']" in (run / "logs" / "node-0.log").read_text()
    again = _cli("run", "--run-dir", str(run), str(OWN / "linear.py"), "2", "x", timeout=60)
    assert again.returncode == 2 and "already holds a run" in again.stderr
    failed = _cli("run", "--run-dir", str(tmp_path / "f"), str(OWN / "fails.py"), timeout=120)
    assert failed.returncode == 2 and "bad batch at step 2" in failed.stderr


def test_cli_interrupt_leaves_nothing(tmp_path):
    run = tmp_path / "forever"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpnb", "run", "--run-dir", str(run), str(OWN / "forever.py")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 60
        while not all(
            "started" in (run / "logs" / f"node-{n}.log").read_text()
            if (run / "logs" / f"node-{n}.log").exists()
            else False
            for n in (0, 1)
        ):
            assert time.time() < deadline and proc.poll() is None, proc.stderr.read()
            time.sleep(0.2)
        pids = run_pids(run)
        assert len(pids) >= 4  # two agents, two workers
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130 and "every process of the run was stopped" in err
    assert not _alive(pids, within=5)
