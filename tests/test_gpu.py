"""The GPU path: step (a) of bench/gpu_check.py on CUDA (``pytest -m gpu``), and what
holds everywhere: the kernel never initialises CUDA, backend knobs reach the workers,
and the check itself runs (on the CPU, with gloo) before a GPU is ever lent."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ddpnb

ROOT = Path(__file__).resolve().parents[1]
GPU_CHECK = ROOT / "bench" / "gpu_check.py"
HAS_CUDA = torch.cuda.is_available()  # reads the driver; CUDA stays uninitialised

needs_cuda = pytest.mark.skipif(
    not HAS_CUDA,
    reason="no CUDA device: step (a) of bench/gpu_check.py needs one (run `pytest -m gpu` "
    "where a GPU is lent)",
)


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", GPU_CHECK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- on a GPU: step (a)'s assertions --------------------------------------------------


@pytest.mark.gpu
@pytest.mark.slow
@needs_cuda
@pytest.mark.parametrize("name", ["jpeg-folder", "digits"])
def test_nccl_launch_trains_checkpoints_and_resumes(name, tmp_path):
    gpu_check = load_gpu_check()
    configs = {
        n: (c, v) for n, c, v in gpu_check.correctness_configs(tmp_path, cuda=True, quick=False)
    }
    cfg, n_val = configs[name]
    nproc = torch.cuda.device_count()
    # Raises CheckFailed naming the run and the assertion: val_samples exact, finite
    # losses, nccl on cuda, a checkpoint, a resume that continues from it.
    summary = gpu_check.launch_and_resume(cfg, tmp_path / "run", nproc, n_val, cuda=True)
    assert f"nccl {nproc}x" in summary and "resumed 1->2" in summary


# -- everywhere ------------------------------------------------------------------------


@pytest.mark.skipif(HAS_CUDA, reason="this machine has CUDA: the no-CUDA answer cannot show")
def test_gpu_check_without_cuda_says_so_and_exits_77():
    out = subprocess.run(
        [sys.executable, str(GPU_CHECK), "--record"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 77, out.stdout + out.stderr
    assert "no CUDA device: nothing to check; run this where a GPU is lent" in out.stdout
    assert "recorded" not in out.stdout


@pytest.mark.slow
def test_gpu_check_step_a_runs_on_cpu(tmp_path):
    """About 60 s: the same launch/resume checks on gloo at tiny sizes (the JPEG folder's
    config; with a GPU both run): the script works before a GPU is lent."""
    out = subprocess.run(
        [sys.executable, str(GPU_CHECK), "--allow-cpu", "--only", "a", "--work", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    ok = [ln for ln in out.stdout.splitlines() if ln.startswith("gpu-check: a ") and ": ok: " in ln]
    assert len(ok) == 1 and ok[0].startswith("gpu-check: a jpeg-folder: ok: "), out.stdout
    assert all("gloo 2x" in ln and "resumed 1->2" in ln for ln in ok), out.stdout


@pytest.mark.slow
def test_step_a_checks_can_fail(layout_run):
    """The assertions gpu_check makes on a run: they hold on a good run and name a bad count."""
    gpu_check = load_gpu_check()
    job = layout_run("1x2")  # tiny_data: 37 val images, 2 epochs, gloo
    gpu_check.check_epochs(job.run_dir, 2, 2, 37, cuda=False)
    with pytest.raises(gpu_check.CheckFailed, match="val_samples 37, expected 36"):
        gpu_check.check_epochs(job.run_dir, 2, 2, 36, cuda=False)
    with pytest.raises(gpu_check.CheckFailed, match="backend 'gloo', expected nccl"):
        gpu_check.check_epochs(job.run_dir, 2, 2, 37, cuda=True)
    with pytest.raises(gpu_check.CheckFailed, match="epochs recorded"):
        gpu_check.check_epochs(job.run_dir, 3, 2, 37, cuda=False)


def test_record_appends_a_dated_section(tmp_path):
    """--record's writer, which otherwise runs only at the end of a GPU run."""
    gpu_check = load_gpu_check()
    path = tmp_path / "results.md"
    path.write_text("# Benchmark results\n")
    gpu_check.record(["b worker / bare loop: 0.970"], "1 x GPU", quick=True, path=path)
    text = path.read_text()
    assert text.startswith("# Benchmark results\n\n## GPU check (--quick, ")
    assert "Machine: 1 x GPU." in text and "\n- b worker / bare loop: 0.970\n" in text


KERNEL = """
import json, sys
import ddpnb
cfg = ddpnb.TrainConfig(data_dir=sys.argv[1], image_size=16, epochs=1, batch_size=8,
                        max_steps_per_epoch=2, timeout_seconds=30)
job = ddpnb.launch(cfg, sys.argv[2], nnodes=1, nproc_per_node=1, progress="none")
epochs = len(ddpnb.load_metrics(sys.argv[2]).epochs)
torch_imported = "torch" in sys.modules
import torch
print(json.dumps({"epochs": epochs, "torch_imported": torch_imported,
                  "cuda_initialized": torch.cuda.is_initialized()}))
"""


@pytest.mark.slow
def test_kernel_never_initialises_cuda(tiny_data, tmp_path):
    """A fresh process plays the notebook kernel: import ddpnb, launch, read the metrics."""
    out = subprocess.run(
        [sys.executable, "-c", KERNEL, str(tiny_data), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    state = json.loads(out.stdout.strip().splitlines()[-1])
    assert state["epochs"] == 1
    assert state["cuda_initialized"] is False, state
    assert "initialised CUDA" not in out.stderr  # the launcher's warning


# Imported by every Python process whose PYTHONPATH starts with its folder: a worker
# (torchrun sets RANK) notes the backend knobs it sees, then the sitecustomize it
# shadows (if any) still runs.
PROBE = """
import importlib, json, os, sys
if "RANK" in os.environ and "DDPNB_ENV_PROBE" in os.environ:
    keys = ("NCCL_DEBUG", "NCCL_SOCKET_IFNAME", "GLOO_SOCKET_IFNAME")
    name = f"rank-{os.environ['RANK']}-{os.getpid()}.json"
    with open(os.path.join(os.environ["DDPNB_ENV_PROBE"], name), "w") as f:
        json.dump({k: os.environ.get(k) for k in keys}, f)
here = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
del sys.modules["sitecustomize"]
try:
    importlib.import_module("sitecustomize")
except ImportError:
    pass
"""


@pytest.mark.slow
def test_backend_env_knobs_reach_the_workers(tiny_data, tmp_path, monkeypatch):
    """NCCL_*/GLOO_* set in the kernel's environment, or passed as env=, reach every rank."""
    probe = tmp_path / "probe"
    probe.mkdir()
    (probe / "sitecustomize.py").write_text(PROBE)
    seen = tmp_path / "seen"
    seen.mkdir()
    monkeypatch.setenv("NCCL_SOCKET_IFNAME", "lo")
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    path = os.pathsep.join(filter(None, [str(probe), os.environ.get("PYTHONPATH")]))
    cfg = ddpnb.TrainConfig(
        data_dir=str(tiny_data),
        image_size=16,
        epochs=1,
        batch_size=8,
        max_steps_per_epoch=1,
        timeout_seconds=30,
        backend="gloo",  # two ranks on any machine, one GPU or none
    )
    job = ddpnb.launch(
        cfg,
        tmp_path / "run",
        nnodes=1,
        nproc_per_node=2,
        progress="none",
        # gloo binds to the named interface: on loopback, "lo" is the right one.
        env={"GLOO_SOCKET_IFNAME": "lo", "PYTHONPATH": path, "DDPNB_ENV_PROBE": str(seen)},
    )
    assert len(job.metrics.epochs) == 1
    records = {}
    for f in seen.glob("rank-*.json"):
        records.setdefault(int(f.name.split("-")[1]), []).append(json.loads(f.read_text()))
    assert sorted(records) == [0, 1], sorted(seen.iterdir())
    want = {"NCCL_DEBUG": "INFO", "NCCL_SOCKET_IFNAME": "lo", "GLOO_SOCKET_IFNAME": "lo"}
    for rank, recs in records.items():
        assert all(r == want for r in recs), (rank, recs)


def test_step_d_names_what_the_flight_recorder_saw():
    """Step (d)'s lines, which otherwise print only on 2 GPUs, from a hand-made run."""
    from ddpnb.hang import nccl_waits

    gpu_check = load_gpu_check()
    pending = lambda seq, op, size, t: {  # noqa: E731
        "pending": [{"pg": "0", "seq": seq, "p2p": False, "op": op, "size": size, "for": t}],
        "groups": {"0": [seq, seq - 1]},
    }
    summaries = {
        0: pending(9, "nccl:all_reduce_barrier", 1, 11.0),
        1: pending(9, "nccl:all_reduce", 65792, 10.9),
    }
    start = 1000.0
    events = [
        *(
            {"time": start - 1 + i / 10, "rank": r, "what": "step"}
            for i in range(4)
            for r in (0, 1)
        ),
        {"time": start, "rank": 0, "what": "lone barrier"},
        {"time": start + 0.2, "rank": 1, "what": "step"},
    ]
    run = {
        "recorder": (start + 11.5, nccl_waits(summaries, 10), summaries),
        "stack": None,
        "ended": None,
        "ended_at": None,
        "last": None,
        "t0": start - 20,
        "stop_at": start + 25,
        "events": events,
    }
    named, stack, did, nccl = gpu_check.hang_lines("barrier", run)
    assert named.startswith("d lone barrier: named by the flight recorder 11.5 s after the mistake")
    assert "ranks [0, 1] wait in different collectives" in named
    assert "rank 0: nccl:all_reduce_barrier #9 (1 element), not completed for 11 s" in named
    assert stack.endswith("the Python-stack path (ddpnb's verdict today) did not name it")
    assert "rank 0's lone barrier never returned; rank 0 4 steps" in did
    assert "rank 1 5 steps, last noted 'step'" in did
    assert nccl == (
        "d lone barrier: what NCCL did with it: paired: rank 0's nccl:all_reduce_barrier #9 "
        "(1 element) met rank 1's nccl:all_reduce #9 (65792 elements), and neither completed"
    )
    run = {**run, "recorder": None, "last": nccl_waits({0: None, 1: None}, 10)}
    run["ended"], run["ended_at"] = "WorkerFailed: rank 1 ...", start + 30
    named = gpu_check.hang_lines("barrier", run)[0]
    assert "NOT named by the flight recorder before the run ended, 30 s after" in named


def test_step_d_checks_the_one_gpu_read():
    gpu_check = load_gpu_check()
    held = {"pg": "0", "seq": 2002, "p2p": False, "op": "nccl:all_reduce", "size": 1000}
    read = {
        "completed": {"groups": {"0": [2001, 2001]}, "pending": [], "more": 0},
        "newest": {"profiling_name": "nccl:all_reduce", "state": "completed"},
        "pending": {
            "groups": {"0": [2002, 2001]},
            "pending": [{**held, "state": "scheduled", "for": 0.004}],
        },
        "after": {"groups": {"0": [2002, 2002]}, "pending": []},
        "read_ms": 0.31,
        "ring": 2000,
    }
    line = gpu_check.single_summary(read)
    assert line.startswith("d flight recorder read, world size 1: ok: a completed all_reduce")
    assert "(nccl:all_reduce #2002, 1000 elements, scheduled, 4 ms)" in line
    assert line.endswith("a read with 2000 collectives in the ring takes 0.31 ms (median of 20)")
    with pytest.raises(gpu_check.CheckFailed, match="read as pending"):
        gpu_check.single_summary({**read, "completed": read["pending"]})
    with pytest.raises(gpu_check.CheckFailed, match="did not read as pending"):
        gpu_check.single_summary({**read, "pending": read["after"]})
