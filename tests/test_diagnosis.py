"""Diagnosis from fixture files: no process is started."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

import ddpnb
from ddpnb.diagnosis import check_stalled, diagnose_failure
from ddpnb.errors import NodeLost, RendezvousTimeout, RunFailed, RunStalled, WorkerFailed
from ddpnb.script import Script
from ddpnb.topology import Topology

FAST = {"DDPNB_WATCH_INTERVAL": "0.5"}

TOPO = Topology(nnodes=2, nproc_per_node=1, master_addr="127.0.0.1", master_port=29500)


def _error_file(run, node, message, traceback="Traceback ...\nValueError: boom"):
    path = run / "logs" / f"node-{node}" / "none_x" / "attempt_0" / "0" / "error.json"
    path.parent.mkdir(parents=True)
    info = {"message": message, "extraInfo": {"py_callstack": traceback, "timestamp": "1"}}
    path.write_text(json.dumps({"message": info}))


def _progress(run, t, phase="train"):
    (run / "progress.json").write_text(json.dumps({"time": t, "phase": phase}))


def test_a_raising_worker_is_named_with_its_traceback(tmp_path):
    _progress(tmp_path, time.time())
    _error_file(tmp_path, 1, "ValueError: boom")
    _error_file(tmp_path, 0, "Connection closed by peer")  # a secondary failure
    err = diagnose_failure(tmp_path, TOPO, [0, 1], {0: 1, 1: 1}, started_at=0)
    assert type(err) is WorkerFailed and isinstance(err, RunFailed)
    assert (err.node_rank, err.global_rank) == (1, 1)
    assert "ValueError: boom" in err.traceback


def test_a_killed_agent_is_a_lost_node(tmp_path):
    _progress(tmp_path, time.time())
    _error_file(tmp_path, 0, "Connection reset by peer")
    err = diagnose_failure(tmp_path, TOPO, [0, 1], {0: 1, 1: -9}, started_at=0)
    assert isinstance(err, NodeLost) and err.node_rank == 1 and "SIGKILL" in str(err)


def test_silence_before_joining_is_a_rendezvous_timeout_and_after_it_a_stall(tmp_path):
    started = 1000.0
    err = check_stalled(tmp_path, TOPO, [0], started, 30, now=started + 91)
    assert isinstance(err, RendezvousTimeout) and "Nodes [1] are not started" in str(err)
    assert check_stalled(tmp_path, TOPO, [0], started, 30, now=started + 10) is None
    _progress(tmp_path, started + 5)
    err = check_stalled(tmp_path, TOPO, [0, 1], started, 30, now=started + 5 + 61)
    assert type(err) is RunStalled and "no progress for 61 s" in str(err)
    _progress(tmp_path, started + 5, phase="done")
    assert check_stalled(tmp_path, TOPO, [0, 1], started, 30, now=started + 500) is None


def test_torchrun_rendezvous_timeout_in_the_log(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "node-0.log").write_text(
        "Timed out after 61 seconds waiting for clients. 1/2 clients joined.\n"
    )
    err = diagnose_failure(tmp_path, TOPO, [0], {0: 1}, started_at=time.time())
    assert isinstance(err, RendezvousTimeout) and "(1 of 2 nodes joined)" in str(err)


def test_the_failing_line_of_the_script_leads(tmp_path):
    """The innermost frame in the run directory, not torch's nor torchrun's."""
    from ddpnb.diagnosis import script_line

    run = tmp_path / "run"
    tb = (
        "Traceback (most recent call last):\n"
        f'  File "{run}/train.py", line 24, in <module>\n    main()\n'
        f'  File "{run}/train.py", line 12, in train_step\n    raise ValueError(x)\n'
        '  File "/venv/lib/python3.11/site-packages/torch/x.py", line 5, in f\n    g()\n'
        "ValueError: bad batch\n"
    )
    assert script_line(tb, run) == " at train.py:12 in train_step"
    assert script_line("no frames here", run) == ""


# -- aborts and the errors users meet, named by their own words (real torchrun runs) ----------

HANGS = Path(__file__).with_name("hangs")


def run_script(name: str, run_dir: Path):
    return ddpnb.launch(Script(HANGS / name), run_dir, nnodes=2, env=FAST, progress="none")


def line_of(name: str, snippet: str) -> int:
    lines = (HANGS / name).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if snippet in line)


@pytest.mark.slow
def test_a_collective_mismatch_is_named_by_gloos_words_with_each_ranks_line(tmp_path):
    """Uneven inputs: gloo aborts rank 0 (SIGABRT); its own line leads, then each rank's line."""
    with pytest.raises(WorkerFailed) as caught:
        run_script("uneven_abort.py", tmp_path / "run")
    err, text = caught.value, str(caught.value)
    head = text.splitlines()[0]
    assert err.cause == "collective_mismatch" and err.global_rank == 0 and err.exit_code == -6
    assert head.startswith("Worker global rank 0 on node 0 was killed by SIGABRT (exit code -6): ")
    assert "Is there a distributed collective mismatch in your code?" in head
    reduce_at = line_of("uneven_abort.py", "dist.all_reduce(total)")
    backward_at = line_of("uneven_abort.py", "loss.backward()")
    assert f"rank 0 in all_reduce at uneven_abort.py:{reduce_at}" in head
    assert (
        f"rank 1 in DDP's gradient all-reduce inside backward at uneven_abort.py:{backward_at}"
        in head
    )
    assert "uneven inputs" in head and "torch.distributed.algorithms.Join" in head
    assert "ChildFailedError" not in text  # torchrun's banner is not what the user reads


@pytest.mark.slow
def test_unused_parameters_are_headed_by_torchs_first_sentence(tmp_path):
    with pytest.raises(WorkerFailed) as caught:
        run_script("unused_head.py", tmp_path / "run")
    head = str(caught.value).splitlines()[0]
    assert caught.value.cause == "unused_parameters"
    assert "RuntimeError: Expected to have finished reduction in the prior iteration" in head
    assert "Parameter indices which did not receive grad for rank" in head and ": 4 5." in head
    assert "find_unused_parameters=True" in head and "TORCH_DISTRIBUTED_DEBUG" not in head


@pytest.mark.slow
def test_a_run_whose_ranks_all_ended_then_one_aborts_at_exit_is_finished(tmp_path):
    """Rank 1 aborts as its interpreter finalises, after destroy_process_group: on purpose."""
    with pytest.warns(RuntimeWarning, match="The run finished") as said:
        job = run_script("abort_at_exit.py", tmp_path / "run")
    assert job.error is None and (tmp_path / "run" / "model.pt").is_file()
    note = str(said[0].message)
    assert "worker global rank 1 on node 1 was killed by SIGABRT" in note
    assert "terminate called without an active exception" in note and job.warnings == [note]


def test_the_workers_own_traceback_not_one_python_went_on_past(tmp_path):
    """A thread's or an atexit callback's traceback after the fatal one is not the error."""
    from ddpnb.diagnosis import stderr_traceback

    log = tmp_path / "stderr.log"
    log.write_text(
        "[rank0]: Traceback (most recent call last):\n"
        '[rank0]:   File "/run/train.py", line 7, in <module>\n'
        "[rank0]:     model = DDP(model)\n"
        "[rank0]: ValueError: Default process group has not been initialized, please make sure"
        " to call init_process_group.\n"
        "Exception ignored in atexit callback: <bound method _Watch.end>\n"
        "Traceback (most recent call last):\n"
        '  File "/run/.ddpnb/ddpnb_watch.py", line 210, in write\n'
        "FileNotFoundError: [Errno 2] No such file or directory\n"
        "Exception in thread loader:\n"
        "Traceback (most recent call last):\n"
        '  File "/run/train.py", line 3, in load\n'
        "OSError: gone\n"
    )
    found = stderr_traceback(log)
    assert found["message"].startswith("ValueError: Default process group has not been init")
    assert 'train.py", line 7' in found["traceback"] and "FileNotFound" not in found["traceback"]
    ignored = log.read_text().index("Exception ignored")
    log.write_text(log.read_text()[ignored:])  # only tracebacks Python went on past: the last
    assert stderr_traceback(log)["message"] == "OSError: gone"


def test_an_abort_at_exit_waits_for_the_other_ranks_records_at_exit(tmp_path):
    """Rank 1 died of SIGABRT after its script ended: finished once rank 0's record says it
    ended too; until then "not yet" (None), not a failure; a rank that failed is not."""
    from ddpnb.diagnosis import died_after_end

    watch = tmp_path / ".ddpnb" / "watch"
    watch.mkdir(parents=True)
    (tmp_path / "logs").mkdir()
    summary = "  rank      : 1 (local_rank: 0)\n  exitcode  : -6 (pid: 9)\n"
    (tmp_path / "logs" / "node-1.log").write_text(summary)

    def record(rank, state, clean):
        about = {"rank": rank, "node": rank, "host": "h", "pid": 1, "steps": 3, "world_size": 2}
        record = {**about, "state": state, "clean": clean, "time": time.time(), "still": 0}
        (watch / f"rank-{rank}.json").write_text(json.dumps({**record, "process_group": False}))

    record(1, "ended", True)
    record(0, "running", False)
    assert died_after_end(tmp_path, TOPO, [0, 1], since=0) is None
    record(0, "ended", True)
    assert "The run finished" in died_after_end(tmp_path, TOPO, [0, 1], since=0)
    record(1, "running", False)  # the rank that died had not ended its script: a failure
    assert died_after_end(tmp_path, TOPO, [0, 1], since=0) == ""


def test_a_worker_log_missing_empty_binary_or_huge_is_diagnosed_in_seconds(tmp_path):
    """Bad input: the diagnosis reads what it can and never raises an error of its own."""
    logs = tmp_path / "logs"
    for node, content in enumerate([None, b"", bytes(range(256)) * 64, "huge"]):
        folder = logs / f"node-{node}" / "none_x" / "attempt_0" / "0"
        folder.mkdir(parents=True)
        if content == "huge":  # 4 GB, sparse: only its end is read
            with open(folder / "stderr.log", "wb") as f:
                f.seek(4 << 30)
                f.write(b"\nterminate called after throwing an instance of 'c10::Error'\n")
                f.write(b"  what():  CUDA error: an illegal memory access was encountered\n")
        elif content is not None:
            (folder / "stderr.log").write_bytes(content)
    topology = Topology(nnodes=4, nproc_per_node=1, master_addr="127.0.0.1", master_port=29500)
    start = time.monotonic()
    err = diagnose_failure(tmp_path, topology, [0, 1, 2, 3], {0: 1, 1: 1, 2: 1, 3: 1}, 0)
    assert time.monotonic() - start < 5
    assert isinstance(err, WorkerFailed) and err.cause == "cuda"
    assert "CUDA error: an illegal memory access was encountered" in str(err).splitlines()[0]


READY_TWICE = (
    "[rank0]: RuntimeError: Expected to mark a variable ready only once. This error is caused by "
    "one of the following reasons: 1) Use of a module parameter outside the `forward` function. "
    "... DDP does not support such use cases in default. You can try to use _set_static_graph() "
    "as a workaround if your module graph does not change over iterations.\n"
    "[rank0]: Parameter at index 1 with name layer.bias has been marked as ready twice. This "
    "means that multiple autograd engine  hooks have fired for this particular parameter during "
    "this iteration.\n"
)
NO_PROCESS_GROUP = (
    "    raise ValueError(\nValueError: Default process group has not been initialized, please "
    "make sure to call init_process_group.\n"
)


@pytest.mark.parametrize(
    ("said", "cause", "head"),
    [
        (READY_TWICE, "ready_twice", "RuntimeError: Expected to mark a variable ready only once."),
        (NO_PROCESS_GROUP, "no_process_group", "ValueError: Default process group has not been"),
    ],
)
def test_ddp_before_init_and_a_parameter_ready_twice_are_known_from_a_worker_log(
    tmp_path, said, cause, head
):
    """torch's words (2.14, as a worker under torchrun prints them) name the cause and its fix."""
    folder = tmp_path / "logs" / "node-0" / "none_x" / "attempt_0" / "0"
    folder.mkdir(parents=True)
    trace = 'Traceback (most recent call last):\n  File "/x/train.py", line 7, in <module>\n'
    (folder / "stderr.log").write_text(trace + said)
    topology = Topology(nnodes=1, nproc_per_node=1, master_addr="127.0.0.1", master_port=29500)
    err = diagnose_failure(tmp_path, topology, [0], {0: 1}, 0)
    assert isinstance(err, WorkerFailed) and err.cause == cause, str(err)
    assert head in str(err).splitlines()[0], str(err)
    fix = {"ready_twice": "use_reentrant=False", "no_process_group": "init_process_group(backend)"}
    assert fix[cause] in str(err), str(err)
