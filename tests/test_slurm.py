"""Slurm from the notebook, against a real Slurm: a throwaway cluster of two nodes on this host.

munged, slurmctld and two slurmd (tests/slurm_cluster.py) run for the session; every
run here is a real ``sbatch`` job whose ``srun`` starts one torchrun per Slurm node.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import nbformat
import pytest
from conftest import tiny_config, wait_for_hang
from slurm_cluster import PARTITION, SlurmCluster

import ddpnb
from ddpnb.demo import NOTEBOOKS, ipc_kernel_manager
from ddpnb.errors import ConfigError, DatasetError, LaunchError, NetworkError, WorkerFailed
from ddpnb.progress import WidgetProgress
from ddpnb.slurm import (
    MARKER_NAME,
    RunDirNotShared,
    SlurmError,
    SlurmJobEnded,
    SlurmRequestError,
    attach,
    submit_slurm,
)

pytestmark = pytest.mark.slow
ONE_THREAD = dict(threads=1)  # two Slurm nodes share this host's cores


@pytest.fixture(scope="session")
def slurm():
    if not all(map(_which, ("munged", "slurmctld", "slurmd", "sbatch"))):
        pytest.fail("slurm-wlm and munge are needed (.ci/run installs them)")
    cluster = SlurmCluster().start()
    mp = pytest.MonkeyPatch()
    mp.setenv("SLURM_CONF", cluster.env["SLURM_CONF"])  # Slurm's commands find the cluster
    try:
        yield cluster
    finally:
        mp.undo()
        cluster.stop()


def _which(name: str) -> bool:
    return shutil.which(name) is not None


def _squeue(job_id: str) -> str:
    r = subprocess.run(["squeue", "-h", "-j", job_id], capture_output=True, text=True)
    return r.stdout.strip()


def _job_pids(job_id: str) -> list[int]:
    """Every process of this machine that runs in the job (its environment says so)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"SLURM_JOB_ID={job_id}".encode() in environ:
            pids.append(int(entry.name))
    return pids


def _still_alive(pids: list[int], seconds: float) -> list[str]:
    """The command lines of those ``pids`` still alive after ``seconds``."""
    deadline = time.time() + seconds
    while True:
        alive = []
        for pid in pids:
            try:
                stat = Path(f"/proc/{pid}/stat").read_text()
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if stat.rsplit(")", 1)[1].split()[0] != "Z":
                alive.append(f"{pid}: {cmd[:120]}")
        if not alive or time.time() > deadline:
            return alive
        time.sleep(0.2)


def _wait_until(predicate, timeout: float, what: str) -> None:
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.3)


def _scontrol(*args: str) -> None:
    subprocess.run(["scontrol", *args], check=True, capture_output=True)


# -- preflight: nothing is submitted ----------------------------------------------------------


def test_preflight_errors_name_the_problem(slurm, tiny_data, tmp_path, monkeypatch):
    cfg = tiny_config(tiny_data)
    with pytest.raises(SlurmRequestError, match="no partition 'gpu'.*debug"):
        submit_slurm(cfg, tmp_path / "a", nnodes=1, partition="gpu")
    with pytest.raises(SlurmRequestError, match="nnodes=3.*2 node"):
        submit_slurm(cfg, tmp_path / "b", nnodes=3)
    with pytest.raises(SlurmRequestError, match="gpus_per_node=1.*at most 0 GPU"):
        submit_slurm(cfg, tmp_path / "c", nnodes=1, gpus_per_node=1)
    with pytest.raises(DatasetError):
        submit_slurm(tiny_config(tmp_path / "nowhere"), tmp_path / "d", nnodes=1)
    assert isinstance(SlurmRequestError("x"), ConfigError)
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(SlurmError, match="sbatch was not found.*Slurm"):
        submit_slurm(cfg, tmp_path / "e", nnodes=1)
    assert not any((tmp_path / n).exists() for n in "abcde")  # nothing written, nothing queued
    assert slurm.run(["squeue", "-h"]).stdout.strip() == ""


def test_a_node_that_cannot_see_the_run_dir_stops_the_job_at_once(slurm, tiny_data, tmp_path):
    run = tmp_path / "r"
    job = submit_slurm(tiny_config(tiny_data), run, nnodes=2, sbatch_args=["--hold"], wait=False)
    (run / MARKER_NAME).write_text("another submission\n")  # what a node off the shared FS sees
    _scontrol("release", job.scheduler.job_id)
    t = time.time()
    with pytest.raises(RunDirNotShared, match="shared by this host and every node"):
        job.wait()
    assert time.time() - t < 20  # before any torch import
    assert "cannot see" in job.scheduler.batch_log().read_text()


# -- a run: pending, running, requeued and resumed, done ------------------------------------


def test_submit_pending_running_requeued_done(slurm, tiny_data, tmp_path, layout_run):
    """About 40 s: a job held, released, requeued by Slurm mid-run and finished; each state
    is Slurm's own, reached by its commands (scontrol hold/release/requeue), not simulated."""
    run = tmp_path / "r"
    cfg = tiny_config(tiny_data, epochs=3, **ONE_THREAD)
    job = submit_slurm(cfg, run, nnodes=2, sbatch_args=["--hold"], wait=False, progress="none")
    assert json.loads((run / "slurm_job.json").read_text())["job_id"] == job.scheduler.job_id
    assert job.node_status() == {0: "pending (JobHeldUser)", 1: "pending (JobHeldUser)"}
    panel = WidgetProgress(job)  # the JupyterLab panel reads the same protocol
    assert all(">pending (JobHeldUser)<" in row.value for row in panel.node_rows)

    seen = []
    _scontrol("release", job.scheduler.job_id)
    checkpoint = run / "checkpoints" / "last.pt"  # written just after epoch 1's metrics
    _wait_until(lambda: seen.append(job.node_status()[0]) or checkpoint.exists(), 120, "epoch 1")
    _scontrol("requeue", job.scheduler.job_id)  # as after a node failure or a preemption
    _wait_until(lambda: job.scheduler.state == "PENDING", 30, "requeued")
    seen.append(job.node_status()[0])
    _scontrol("update", f"JobId={job.scheduler.job_id}", "StartTime=now")  # skip the requeue delay
    job.wait()
    panel.close(job)
    # Released, a job may pend a moment longer (Slurm's reason then changes, or is None).
    phases = [s.split(" ")[0] for s in seen]
    assert seen[0] == "pending (JobHeldUser)"
    assert [p for i, p in enumerate(phases) if i == 0 or p != phases[i - 1]][:3] == [
        "pending",
        "starting",
        "running",
    ]
    assert seen[-1].startswith("pending")  # after the requeue
    assert job.node_status() == {0: "done", 1: "done"}
    assert all(">done<" in row.value for row in panel.node_rows)

    log = job.log_tail(0, 400) + job.log_tail(1, 400)
    assert "resumed from" in log and "after epoch 1" in log
    rows = job.metrics.epochs
    assert [r["epoch"] for r in rows] == [1, 2, 3]  # the redone epoch is recorded once
    local = layout_run("1x2").metrics.epochs
    for r, ref in zip(rows, local):
        assert (r["world_size"], r["val_samples"]) == (ref["world_size"], ref["val_samples"])
        assert r["val_samples"] == 37  # every validation image counted once
    assert sorted(job.metrics.ranks) == [0, 1]
    assert {rec[-1]["node_rank"] for rec in job.metrics.ranks.values()} == {0, 1}
    assert _squeue(job.scheduler.job_id) == ""


def test_a_torchrun_restart_under_c10d_meets_again(slurm, tiny_data, tmp_path):
    """Rank 1 is killed in epoch 2; under c10d only its agent counts a restart, yet the
    nodes meet in the next round (each round's own store) and the run resumes."""
    cfg = tiny_config(tiny_data, epochs=3, **ONE_THREAD)
    job = submit_slurm(
        cfg,
        tmp_path / "r",
        nnodes=2,
        max_restarts=1,
        progress="none",
        env={"DDPNB_FAULT": "rank=1,epoch=2,step=2"},
    )
    assert [r["epoch"] for r in job.metrics.epochs] == [1, 2, 3]
    assert max(r["restart_count"] for recs in job.metrics.ranks.values() for r in recs) == 1
    logs = job.log_tail(0, 400) + job.log_tail(1, 400)  # c10d numbers the nodes itself
    assert "DDPNB_FAULT: kill at epoch 2 step 2" in logs and "resumed from" in logs
    for epoch in (1, 2, 3):  # one model on both nodes after every epoch
        sums = {
            r["param_checksum"]
            for recs in job.metrics.ranks.values()
            for r in recs
            if r["epoch"] == epoch
        }
        assert len(sums) == 1, (epoch, sums)
    assert "TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1" in (job.run_dir / "train.sbatch").read_text()
    # The Job knows what the job was submitted with, and so does one attached later.
    again = attach(job.run_dir, progress="none")
    assert [(j.rdzv_timeout, j.max_restarts) for j in (job, again)] == [(300, 1), (300, 1)]


# -- failures --------------------------------------------------------------------------------


def test_a_raising_worker_is_a_worker_failed_with_its_traceback(
    slurm, tiny_data, tmp_path, monkeypatch
):
    """About 40 s: a two-node batch job whose rank 1 raises; Slurm ends the job, the error is read."""
    # The job's environment is the submitter's (sbatch --export=ALL, Slurm's default).
    monkeypatch.setenv("DDPNB_FAULT", "rank=1,epoch=1,step=1,mode=raise")
    run = tmp_path / "r"
    with pytest.raises(WorkerFailed) as info:
        submit_slurm(tiny_config(tiny_data, **ONE_THREAD), run, nnodes=2, progress="none")
    err = info.value
    assert err.global_rank == 1 and err.exit_code == 1
    assert "DDPNB_FAULT injected failure at epoch 1 step 1" in err.traceback
    # c10d hands out the ranks: the node is the one whose log shows rank 1.
    node_of_rank1 = next(
        n for n in (0, 1) if "[rank1]" in (run / "logs" / f"node-{n}.log").read_text()
    )
    assert err.node_rank == node_of_rank1
    assert f"Worker global rank 1 on node {node_of_rank1}" in str(err)


def test_interrupt_cancels_the_job_and_nothing_is_left(slurm, tiny_data, tmp_path):
    """About 40 s: a two-node job must train before Ctrl-C; scancel, then no process is left."""
    cfg = tiny_config(tiny_data, epochs=50, **ONE_THREAD)
    job = submit_slurm(cfg, tmp_path / "r", nnodes=2, wait=False, progress="none")
    _wait_until(lambda: job.metrics.epochs, 120, "epoch 1")
    pids = _job_pids(job.scheduler.job_id)
    assert len(pids) >= 4  # per node: slurmstepd's tasks, torchrun, a worker
    # Ctrl-C in the cell. Python's own handler, also where SIGINT came in ignored (a
    # background shell starts its commands so).
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT)).start()
    try:
        with pytest.raises(KeyboardInterrupt):
            job.wait()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert job.scheduler.state == "CANCELLED" and _squeue(job.scheduler.job_id) == ""
    # proctrack/linuxproc follows process trees, so a worker whose torchrun exited first
    # may still be finishing its SIGTERM when Slurm reports the end (cgroups would not
    # allow that); a few seconds later nothing may be left.
    left = _still_alive(pids, 10)
    assert left == [], left
    assert job.node_status() == {0: "stopped", 1: "stopped"}


def test_the_time_limit_is_slurms_typed_error(slurm, tiny_data, tmp_path):
    """About 45 s: a job must be training when Slurm's time limit (1 minute, its smallest) ends it."""
    cfg = tiny_config(tiny_data, epochs=1000, **ONE_THREAD)
    job = submit_slurm(cfg, tmp_path / "r", nnodes=1, time="1", wait=False, progress="none")
    _wait_until(lambda: job.metrics.epochs, 120, "epoch 1")  # training, as at a real limit
    shown = slurm.run(["scontrol", "show", "job", job.scheduler.job_id]).stdout
    assert "TimeLimit=00:01:00" in shown  # time="1": sbatch --time, in minutes
    # Slurm counts limits in whole minutes and checks them every 30 s (60 to 90 s from the
    # start): the job's end time brought forward to now ends it at the next check instead.
    brought = slurm.run(
        ["scontrol", "update", f"JobId={job.scheduler.job_id}", "EndTime=now"], check=False
    )
    if brought.returncode:  # a slow machine: the limit itself came first, the job is ending
        shown = slurm.run(["scontrol", "show", "job", job.scheduler.job_id]).stdout
        assert "Reason=TimeLimit" in shown or "JobState=TIMEOUT" in shown, (brought.stderr, shown)
    with pytest.raises(SlurmJobEnded) as info:
        job.wait()
    err = info.value
    assert (err.state, err.reason) == ("TIMEOUT", "TimeLimit")
    assert "time limit" in str(err) and "resume=True" in str(err)


# -- attach: the job outlives what submitted it ----------------------------------------------


def test_cli_submit_then_attach_from_a_second_kernel(slurm, tiny_data, tmp_path):
    """About 45 s: a detached submission from the CLI, then a fresh Jupyter kernel that attaches
    and follows the job to its end."""
    from jupyter_client import KernelManager

    run = tmp_path / "r"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddpnb",
            "submit",
            "--run-dir",
            str(run),
            "--nnodes",
            "2",
            "--data",
            str(tiny_data),
            "--image-size",
            "16",
            "--epochs",
            "2",
            "--batch-size",
            "8",
            "--threads",
            "1",
            "--partition",
            PARTITION,
            "--detach",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    job_id = json.loads((run / "slurm_job.json").read_text())["job_id"]
    assert f"submitted Slurm job {job_id}" in r.stdout and "ddpnb attach" in r.stdout

    km = KernelManager(kernel_name="python3")
    km.start_kernel(cwd=str(tmp_path))
    kc = km.client()
    kc.start_channels()
    out: list[str] = []
    try:
        kc.wait_for_ready(timeout=60)
        code = textwrap.dedent(
            f"""
            import ddpnb.slurm
            job = ddpnb.slurm.attach({str(run)!r}, progress="text")
            print("FINAL", job.scheduler.job_id, job.scheduler.state, len(job.metrics.epochs))
            """
        )
        reply = kc.execute_interactive(
            code, timeout=180, output_hook=lambda m: out.append(m["content"].get("text", ""))
        )
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
    text = "".join(out)
    assert reply["content"]["status"] == "ok", (reply["content"], text)
    assert f"FINAL {job_id} COMPLETED 2" in text and "epoch 2/2" in text
    # Attaching to an ended job reports it at once.
    r = subprocess.run(
        [sys.executable, "-m", "ddpnb", "attach", str(run)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0 and "run finished" in r.stdout, r.stderr


def test_attach_to_a_job_slurm_has_forgotten(slurm, tmp_path, layout_run):
    with pytest.raises(LaunchError, match="no submitted Slurm job"):
        attach(tmp_path)
    # A finished run whose job left slurmctld long ago (MinJobAge), without accounting.
    run = Path(shutil.copytree(layout_run("1x2").run_dir, tmp_path / "r"))
    (run / "slurm_job.json").write_text('{"job_id": "999999", "nnodes": 1, "nproc_per_node": 2}')
    job = attach(run, progress="none")
    assert job.scheduler.state == "UNKNOWN" and job.node_status() == {0: "done"}
    assert len(job.metrics.epochs) == 2
    (run / "progress.json").unlink()  # no sign of an ending: Slurm's silence is an error
    with pytest.raises(SlurmJobEnded, match="state UNKNOWN"):
        attach(run, progress="none")


# -- notebook 08 -----------------------------------------------------------------------------


def test_notebook_08_submits_to_slurm(slurm, digits_data, tmp_path):
    """About 50 s: notebook 08 top to bottom against the throwaway Slurm, its job queued, run and followed."""
    import papermill

    out = tmp_path / "08_slurm.ipynb"
    papermill.execute_notebook(
        str(NOTEBOOKS / "08_slurm.ipynb"),
        str(out),
        parameters={
            "data_dir": str(digits_data),
            "run_dir": str(tmp_path / "slurm-run"),
            "nnodes": 2,
            "epochs": 1,
            "max_steps_per_epoch": 3,
            "progress": "text",
        },
        kernel_name="python3",
        execution_timeout=300,
        cwd=str(tmp_path),
        progress_bar=False,
        kernel_manager_class=ipc_kernel_manager(),
    )
    nb = nbformat.read(out, as_version=4)
    printed = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    assert "Slurm found: submitting" in printed
    assert re.search(r"job \d+ COMPLETED - submitted", printed)  # what Slurm said at the end
    run = ddpnb.load_metrics(tmp_path / "slurm-run")
    assert len(run.epochs) == 1 and run.final["world_size"] == 2
    shown = [o for c in nb.cells for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(shown) == 1  # the run's curves
    text = out.read_text()
    assert "srun" in text and "sbatch --parsable" in text


def test_notebook_08_without_slurm_prints_the_script(digits_data, tmp_path):
    import papermill

    out = tmp_path / "08_slurm.ipynb"
    papermill.execute_notebook(
        str(NOTEBOOKS / "08_slurm.ipynb"),
        str(out),
        parameters={
            "data_dir": str(digits_data),
            "run_dir": str(tmp_path / "slurm-run"),
            "use_slurm": False,
        },
        kernel_name="python3",
        execution_timeout=120,
        cwd=str(tmp_path),
        progress_bar=False,
        kernel_manager_class=ipc_kernel_manager(),
    )
    text = out.read_text()
    assert "#SBATCH --nodes=2" in text and "exec torchrun" in text and "sbatch " in text
    assert "no Slurm here: printing" in text
    assert not (tmp_path / "slurm-run" / "slurm_job.json").exists()  # nothing submitted


# -- your own script ---------------------------------------------------------------------------

OWN = Path(__file__).with_name("own")


def test_your_own_script_runs_as_a_batch_job(slurm, tmp_path):
    # The command line: ddpnb run --slurm, options first, the script, then its arguments.
    cli = subprocess.run(
        [sys.executable, "-m", "ddpnb", "run", "--slurm", "--nnodes", "2", "--rdzv-timeout", "120",
         "--run-dir", str(tmp_path / "own run"), "--file", str(OWN / "datautils.py"),
         str(OWN / "linear.py"), "2", "a b 'c'"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    assert "epoch 2/2  train_loss" in cli.stdout  # followed with the text panel
    job = attach(tmp_path / "own run", progress="none")  # a Job for what ran
    run = job.run_dir
    assert job.node_status() == {0: "done", 1: "done"}
    assert [r["epoch"] for r in job.metrics.epochs] == [1, 2]  # reported by the script
    assert (run / "model.pt").is_file()  # what rank 0 wrote in its working directory
    assert "args ['2', \"a b 'c'\"]" in (run / "logs" / "node-0.log").read_text()
    # Each node's threads: its own CPUs shared by its one worker (the job brought none).
    # (c10d numbers the ranks in the order the nodes join: rank 1 may run on node 0.)
    cpus = os.environ.get("OMP_NUM_THREADS") or str(len(os.sched_getaffinity(0)))
    logs = "".join(p.read_text() for p in (run / "logs").glob("node-*.log"))
    assert sorted(re.findall(r"rank (\d) of 2 args .* threads (\d+)", logs)) == [
        ("0", cpus),
        ("1", cpus),
    ], logs
    assert "join_timeout=120," in (run / "train.sbatch").read_text()  # --rdzv-timeout reached it
    # The job's first step proved the network and chose each node's interface.
    assert "reaches node 0 and all 1 peer(s)" in job.scheduler.batch_log().read_text()
    assert sorted(p.name for p in (run / "logs").glob("net-env-*.sh")) == [
        "net-env-0.sh",
        "net-env-1.sh",
    ]


def test_your_own_script_failing_on_slurm_gives_its_traceback(slurm, tmp_path):
    from ddpnb import Script

    with pytest.raises(WorkerFailed) as info:
        submit_slurm(Script(OWN / "fails.py"), tmp_path / "fails", nnodes=2, progress="none")
    err = info.value
    assert err.global_rank == 1 and err.exit_code == 1
    assert 'fails.py", line 12, in train_step' in err.traceback


def test_a_hang_in_a_batch_job_shows_every_ranks_stack(slurm, tmp_path):
    """The stacks of the allocation's nodes, read from the shared run directory."""
    from ddpnb import Script

    script = Script(Path(__file__).with_name("hangs") / "barrier_rank0.py")
    job = submit_slurm(
        script,
        tmp_path / "hang",
        nnodes=2,
        wait=False,
        progress="none",
        env={"DDPNB_WATCH_INTERVAL": "0.5"},
        hang_timeout=6,
        on_hang="wait",
    )
    try:
        wait_for_hang(job, 120)
        assert job.waiting is not None and job.waiting.kind == "hang", job.waiting
        cli = subprocess.run(
            [sys.executable, "-m", "ddpnb", "stacks", str(job.run_dir)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert cli.returncode == 0, cli.stderr
        assert "rank 0 waits in barrier at barrier_rank0.py:" in cli.stdout
        assert "rank 1 waits in DDP's gradient all-reduce inside backward" in cli.stdout
        assert {r.node for r in job.stacks().ranks} == {0, 1}
    finally:
        job.stop()
    assert job.scheduler.state == "CANCELLED" and _squeue(job.scheduler.job_id) == ""


def test_a_network_check_failure_stops_the_job_before_training(slurm, tmp_path):
    """The job's first step relays every node's check through srun and names what failed."""
    from ddpnb import Script

    with pytest.raises(NetworkError) as info:
        submit_slurm(Script(OWN / "linear.py"), tmp_path / "net", nnodes=2, progress="none",
                     env={"GLOO_SOCKET_IFNAME": "nosuch0"})  # fmt: skip
    message = str(info.value)
    assert "network check of its first step failed" in message, message
    for n in (0, 1):
        assert f"node {n} (" in message and "has no interface nosuch0" in message, message
    assert not list((tmp_path / "net" / "logs").glob("node-*.log"))  # no torchrun started
