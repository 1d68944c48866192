"""Diagnosis from fixture files: no process is started."""

from __future__ import annotations

import json
import time

from ddpnb.diagnosis import check_stalled, diagnose_failure
from ddpnb.errors import NodeLost, RendezvousTimeout, RunFailed, RunStalled, WorkerFailed
from ddpnb.topology import Topology

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
