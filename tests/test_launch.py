"""The launcher: validation before launch, failures surfaced, nothing left running."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch
from conftest import tiny_config

import ddpnb
from ddpnb.errors import ConfigError, DatasetError, PortInUseError, RendezvousTimeout, RunDirError
from ddpnb.preflight import check_port_free
from ddpnb.scheduler import alive


def _no_process_left(pids):
    deadline = time.time() + 2
    while time.time() < deadline and any(alive(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if alive(p)]


# -- validation: nothing starts, nothing is written ---------------------------------------


@pytest.mark.parametrize(
    "kwargs, error, words",
    [
        ({"nnodes": 0}, ConfigError, "nnodes"),
        ({"nnodes": 1.5}, ConfigError, "nnodes"),
        ({"nproc_per_node": 0}, ConfigError, "nproc_per_node"),
        ({"local_nodes": [2], "nnodes": 2}, ConfigError, "node_rank < nnodes"),
        ({"max_restarts": -1}, ConfigError, "max_restarts"),
    ],
)
def test_bad_launch_arguments(tiny_data, tmp_path, kwargs, error, words):
    with pytest.raises(error, match=words):
        ddpnb.launch(tiny_config(tiny_data), tmp_path / "run", **kwargs)
    assert not (tmp_path / "run").exists()


def test_bad_config_values(tiny_data, tmp_path):
    with pytest.raises(ConfigError, match="Unknown model 'resnet19'"):
        ddpnb.launch(tiny_config(tiny_data, model="resnet19"), tmp_path / "r")
    with pytest.raises(ConfigError, match="batch_size=64 .* larger than each rank's shard"):
        ddpnb.launch(tiny_config(tiny_data, batch_size=64), tmp_path / "r", nnodes=2)
    with pytest.raises(ConfigError, match="does not exist"):
        ddpnb.launch(tiny_config(tiny_data, weights=str(tmp_path / "nope.pt")), tmp_path / "r")
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(ConfigError, match="cannot be loaded"):
        ddpnb.launch(tiny_config(tiny_data, weights=str(tmp_path / "junk.pt")), tmp_path / "r")
    torch.save([1, 2, 3], tmp_path / "list.pt")
    with pytest.raises(ConfigError, match="does not hold a state dict"):
        ddpnb.launch(tiny_config(tiny_data, weights=str(tmp_path / "list.pt")), tmp_path / "r")
    assert not (tmp_path / "r").exists()


def test_default_weights_offline_fail_fast(tiny_data, tmp_path):
    t = time.time()
    with pytest.raises(ConfigError, match="no network is available.*weights=None"):
        ddpnb.launch(tiny_config(tiny_data, weights="DEFAULT"), tmp_path / "r", nnodes=1)
    assert time.time() - t < 15


def test_worker_also_gives_the_offline_message(tiny_data, tmp_path):
    from ddpnb.worker import build_model

    with pytest.raises(RuntimeError, match="No network is available: pass weights=None"):
        build_model(tiny_config(tiny_data, weights="DEFAULT").to_dict(), 10)


def test_bad_dataset_is_refused_before_launch(data_copy, tmp_path):
    (data_copy / "train" / "3" / "bad.png").write_bytes(b"\x89PNG nope")
    with pytest.raises(DatasetError, match="bad.png"):
        ddpnb.launch(tiny_config(data_copy), tmp_path / "r")
    with pytest.raises(DatasetError, match="does not exist"):
        ddpnb.launch(tiny_config(tmp_path / "missing"), tmp_path / "r")


def test_busy_port_is_refused(tiny_data, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(PortInUseError, match=f"master_port {port}.*master_port=None"):
            ddpnb.launch(tiny_config(tiny_data), tmp_path / "r", master_port=port)
    check_port_free("127.0.0.1", port)  # free again


# -- run directory rules -----------------------------------------------------------------------


@pytest.mark.slow
def test_finished_run_is_never_overwritten_silently(layout_run, tiny_data):
    """Up to about 60 s under two workers: the first test to ask for the session's 1x1 run pays for it."""
    job = layout_run("1x1")
    before = (job.run_dir / "metrics.jsonl").read_bytes()
    with pytest.raises(RunDirError, match="resume=True.*overwrite=True"):
        ddpnb.launch(tiny_config(tiny_data), job.run_dir, nnodes=1)
    with pytest.raises(RunDirError, match="different config.*lr"):
        ddpnb.launch(tiny_config(tiny_data, lr=0.1), job.run_dir, nnodes=1, resume=True)
    assert (job.run_dir / "metrics.jsonl").read_bytes() == before


def test_unwritable_run_dir(tiny_data, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if os.access(ro, os.W_OK):  # root ignores modes: use a path under a file instead
            target = tmp_path / "file"
            target.write_text("")
            target = target / "run"
        else:
            target = ro / "run"
        with pytest.raises(RunDirError, match="not writable"):
            ddpnb.launch(tiny_config(tiny_data), target, nnodes=1)
    finally:
        ro.chmod(0o700)


# -- failures surface fast, with the traceback ------------------------------------------------------


@pytest.mark.slow
def test_a_raising_worker_gives_its_traceback(tiny_data, tmp_path):
    env_before = dict(os.environ)
    t = time.time()
    with pytest.raises(ddpnb.WorkerFailed) as e:
        ddpnb.launch(
            tiny_config(tiny_data),
            tmp_path / "r",
            nnodes=2,
            progress="none",
            env={"DDPNB_FAULT": "rank=1,epoch=1,step=1,mode=raise"},
        )
    err = e.value
    assert (err.node_rank, err.global_rank, err.exit_code) == (1, 1, 1)
    assert "Traceback" in err.traceback and "DDPNB_FAULT injected failure" in err.traceback
    assert "train_ddp.py" in err.traceback
    assert "global rank 1 on node 1" in str(err)
    assert time.time() - t < 40
    assert dict(os.environ) == env_before  # the kernel's environment is never touched


@pytest.mark.slow
def test_a_node_that_never_joins_times_out(tiny_data, tmp_path):
    t = time.time()
    with pytest.raises(RendezvousTimeout, match="not all 2 nodes joined|timed out|Rendezvous"):
        ddpnb.launch(
            tiny_config(tiny_data),
            tmp_path / "r",
            nnodes=2,
            local_nodes=[0],
            rdzv_timeout=8,
            progress="none",
        )
    assert time.time() - t < 8 + 35


@pytest.mark.slow
def test_interrupt_stops_every_process(tiny_data, tmp_path):
    job = ddpnb.launch(
        tiny_config(tiny_data, epochs=50), tmp_path / "r", nnodes=2, wait=False, progress="none"
    )
    deadline = time.time() + 60
    while not (tmp_path / "r" / "progress.json").exists() and time.time() < deadline:
        time.sleep(0.2)
    pids = job.pids()
    assert len(pids) >= 4  # two agents, two workers
    timer = threading.Timer(
        0.5, lambda: signal.pthread_kill(threading.main_thread().ident, signal.SIGINT)
    )
    timer.start()
    t = time.time()
    with pytest.raises(KeyboardInterrupt):
        job.wait()
    assert time.time() - t < 10.5
    assert _no_process_left(pids) == []
    check_port_free("127.0.0.1", job.master_port)


def _cli_train(data, run_dir, *args):
    argv = [sys.executable, "-m", "ddpnb", "train", "--data", str(data), "--run-dir", str(run_dir)]
    return subprocess.run([*argv, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_cli_train_two_nodes(tiny_data, tmp_path):
    """About 30 s: the CLI (its own interpreter) and a two-node launch."""
    r = _cli_train(
        tiny_data,
        tmp_path / "r",
        "--epochs",
        "1",
        "--batch-size",
        "8",
        "--image-size",
        "16",
        "--nnodes",
        "2",
        "--nproc-per-node",
        "1",
    )
    assert r.returncode == 0, r.stderr
    assert "epoch 1/1" in r.stdout and "hosts the rendezvous" in r.stdout
    assert ddpnb.load_metrics(tmp_path / "r").final["world_size"] == 2
    logs = (tmp_path / "r" / "logs" / "node-1.log").read_text()
    assert "--node_rank=1" in logs and "[rank1]" in logs
    r = _cli_train(tiny_data, tmp_path / "r", "--epochs", "1")
    assert r.returncode == 2 and "--resume" in r.stderr


@pytest.mark.slow
def test_resume_continues_from_the_checkpoint_an_older_ddpnb_wrote_too(
    layout_run, tiny_data, tmp_path
):
    """About 35 s under two workers: one launch, the resume of a copy of the session's 1x1 run
    (2 epochs) whose files are rewritten as an older ddpnb wrote them."""
    # An older ddpnb wrote config.json and the checkpoint without channels_last, and with
    # fields retired since (the pitfall switches, the in-memory pipeline).
    run = tmp_path / "r"
    shutil.copytree(layout_run("1x1").run_dir, run)
    first = (run / "metrics.jsonl").read_text().splitlines()
    retired = {"thread_budget": True, "set_epoch": True, "pipeline": "auto"}
    saved = {**json.loads((run / "config.json").read_text()), **retired}
    del saved["channels_last"]
    (run / "config.json").write_text(json.dumps(saved))
    ckpt = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    ckpt["config"] = {**ckpt["config"], **retired}
    del ckpt["config"]["channels_last"]
    torch.save(ckpt, run / "checkpoints" / "last.pt")
    with pytest.raises(RunDirError, match="channels_last"):  # not its default
        ddpnb.launch(
            tiny_config(tiny_data, epochs=3, channels_last=True),
            run,
            nnodes=1,
            progress="none",
            resume=True,
        )
    job = ddpnb.launch(
        tiny_config(tiny_data, epochs=3), run, nnodes=1, progress="none", resume=True
    )
    assert [e["epoch"] for e in job.metrics.epochs] == [1, 2, 3]  # each epoch exactly once
    assert (run / "metrics.jsonl").read_text().splitlines()[:2] == first[:2]  # kept as they were
    assert "resumed from" in job.log_tail(0, 200) and "after epoch 2" in job.log_tail(0, 200)
