"""A hang is named, not waited out: each rank's line, on simulated nodes, in seconds.

Real torchrun runs of tests/hangs/ (gloo on loopback) with a short ``hang_timeout`` and
snapshots every half second, so no test waits on a long timeout. The verdicts themselves
are pure functions of the snapshots, tested on hand-made ranks first.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import ddpnb
from ddpnb.errors import ConfigError, RunHung
from ddpnb.hang import Frame, RankState, Stacks, read_ranks, verdict
from ddpnb.script import Script

HANGS = Path(__file__).with_name("hangs")
FAST = {"DDPNB_WATCH_INTERVAL": "0.5"}  # snapshots twice a second
HANG_SECONDS = 4.0


def line_of(name: str, snippet: str) -> int:
    lines = (HANGS / name).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if snippet in line)


def launch(name: str, run_dir: Path, args=(), **kwargs) -> ddpnb.Job:
    kwargs.setdefault("hang_timeout", HANG_SECONDS)
    return ddpnb.launch(
        Script(HANGS / name, args=args), run_dir, nnodes=2, env=FAST, progress="text", **kwargs
    )


def assert_nothing_left(job: ddpnb.Job) -> None:
    deadline = time.monotonic() + 10
    while job.pids() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert job.pids() == []


# -- verdicts on hand-made snapshots --------------------------------------------------------


def rank(r: int, *inside: tuple[str, str], user: str = "train.py", line: int = 10, **kw):
    """Rank r at ``user:line``, with torch's frames ``inside`` (file, function) below it."""
    frames = [Frame(user, line, "<module>", "the call", True)]
    frames += [Frame(f"/venv/site-packages/{f}", 1, fn, "", False) for f, fn in inside]
    fields = dict(state="running", still=90.0, steps=5, process_group=True, age=0.5)
    fields.update(kw)
    return RankState(r, r, "host", 100 + r, frames=tuple(frames), **fields)


BARRIER = ("torch/distributed/distributed_c10d.py", "barrier")
BACKWARD = ("torch/autograd/graph.py", "_engine_run_backward")
BUFFERS = ("torch/nn/parallel/distributed.py", "_sync_buffers")
SAVE = ("torch/serialization.py", "save")


def test_different_collectives_hang():
    v = verdict([rank(0, BARRIER, line=21), rank(1, BACKWARD, line=18)], 70, 60)
    assert v.kind == "hang"
    assert "rank 0 waits in barrier at train.py:21 (the call)" in v.message
    assert "rank 1 waits in DDP's gradient all-reduce inside backward at train.py:18" in v.message
    assert "different collectives" in v.message


def test_before_the_limit_waiting_ranks_are_shown_waiting_and_nothing_is_called_a_hang():
    v = verdict([rank(0, BARRIER, idle=12.0), rank(1, BACKWARD, idle=12.0)], 12, 60)
    assert v.kind == "waiting" and not v.cause
    assert v.message.startswith("rank 0 waits in barrier at train.py:10 (the call) for 12 s;")
    assert verdict([rank(0, BARRIER, idle=0.5), rank(1, idle=0.5)], 0.5, 60).kind == "ok"


def test_a_rank_that_computes_inside_backward_never_waits():
    """Its stack stands still in backward, but its main thread's CPU time advances."""
    busy = [rank(r, BACKWARD, idle=0.4, still=90.0) for r in (0, 1)]
    assert not any(r.waits for r in busy)
    assert busy[0].line() == "rank 0 is computing backward at train.py:10 (the call) for 90 s"
    # Even if the quiet time were long, computing ranks are never a hang.
    assert verdict(busy, 500, 60).kind != "hang"
    assert verdict([busy[0], rank(1, BARRIER, idle=90.0)], 500, 60).kind == "slow"


def test_a_rank_writing_a_checkpoint_is_a_slow_phase_not_a_bug():
    v = verdict([rank(0, SAVE, line=40), rank(1, BARRIER, line=41)], 70, 60)
    assert v.kind == "slow" and "not a bug" in v.message
    assert "rank 0 is writing a checkpoint (torch.save) at train.py:40" in v.message


def test_a_rank_that_left_while_others_wait_is_named():
    v = verdict([rank(0, BACKWARD), rank(1, state="ended", age=30.0)], 70, 60)
    assert v.kind == "hang" and "rank 1 ended while rank 0 waits in a collective" in v.message
    # Rank 0 last seen waiting before rank 1 ended (a barrier that released both as rank 1
    # left): not a hang until a snapshot since shows rank 0 still waiting.
    v = verdict([rank(0, BARRIER, age=1.5), rank(1, state="ended", age=1.0)], 70, 2)
    assert v.kind == "waiting" and not v.cause


def test_buffer_broadcast_and_spawn_are_named():
    assert "DDP's buffer broadcast in forward" in rank(0, BUFFERS).line()
    spawn = ("torch/multiprocessing/spawn.py", "join")
    v = verdict([rank(0, spawn), rank(1, spawn)], 70, 60)
    assert v.kind == "hang" and "Drop mp.spawn" in v.message


def test_busy_ranks_are_not_a_hang():
    assert verdict([rank(0), rank(1)], 500, 60).kind == "quiet"


def test_frames_below_the_part2_banner_are_the_scripts_helpers_not_its_line(tmp_path):
    """The tutorial worker's Part 2: a rank there stands at the Part 1 line that called it."""
    import ddpnb.watch

    hooks = tmp_path / ".ddpnb"  # where a run directory has ddpnb's hooks
    hooks.mkdir()
    (hooks / "ddpnb_watch.py").write_bytes(Path(ddpnb.watch.__file__).read_bytes())
    (tmp_path / "train.py").write_text(
        "import json, ddpnb_watch\n"
        "def step():\n"
        "    return average()  # the user's line\n"
        f"{ddpnb.watch.PART2_BANNER} (what Part 1 calls)\n"
        "def average():\n"
        "    return ddpnb_watch.main_stack()\n"
        "print(json.dumps(step()))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(hooks)}
    out = subprocess.run(
        [sys.executable, "train.py"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    frames = tuple(Frame(*f) for f in json.loads(out.stdout))
    r = RankState(0, 0, "host", 1, "running", 0.0, 0, False, frames, 0.0)
    assert r.where() == "train.py:3 (return average()  # the user's line)"
    helpers = "... 2 frame(s) of torch/Python and the script's helpers (average), innermost"
    assert r.stack()[-1].startswith(helpers), r.stack()


def test_the_stack_column_wraps_between_words():
    """JupyterLab breaks an output's <pre> anywhere ('train_one_epo/ch'); the table's does not."""
    helper = Frame("src/train.py", 90, "agree", "dist.all_reduce(self.flag)", False)
    r = rank(0, BACKWARD, user="src/train.py")
    r = dataclasses.replace(r, frames=(*r.frames, helper))
    html = Stacks(Path("run"), [r], verdict([r], 1, 60))._repr_html_()
    assert "white-space:pre-wrap;word-break:normal;overflow-wrap:break-word" in html
    assert "src/<wbr>train.py:10 in &lt;module&gt;" in html  # a path breaks after its '/'
    assert "and the script&#x27;s helpers (agree), innermost agree (train.py:90)" in html


# -- real runs ---------------------------------------------------------------------------------


@pytest.mark.slow
def test_a_barrier_on_rank0_is_named_and_stopped(tmp_path, capsys):
    started = time.monotonic()
    with pytest.raises(RunHung) as caught:
        # 8 s: the ranks read "waiting" from 2 s still (two snapshots) until the verdict, a
        # window the job's reads (every second) meet on a loaded machine too.
        launch("barrier_rank0.py", tmp_path / "run", hang_timeout=8.0)
    e = caught.value
    barrier = line_of("barrier_rank0.py", "dist.barrier()  # MISTAKE")  # not the docstring's
    backward = line_of("barrier_rank0.py", ".backward()")
    assert f"rank 0 waits in barrier at barrier_rank0.py:{barrier}" in str(e)
    assert (
        f"waits in DDP's gradient all-reduce inside backward at barrier_rank0.py:{backward}"
        in str(e)
    )
    assert (e.global_rank, e.node_rank) == (0, 0)
    assert [r.rank for r in e.stacks.ranks] == [0, 1]
    assert time.monotonic() - started < 60
    out = capsys.readouterr().out  # the text progress said, live, that the ranks wait
    # Said once, when the first rank was seen waiting (either may be first; later lines of the
    # same kind are not printed again).
    waiting = [ln for ln in out.splitlines() if ln.startswith("ddpnb: waiting: ")]
    assert len(waiting) == 1 and "waits in" in waiting[0], out
    # The verdict's paragraph is said once: by the RunHung raised, not also by the progress.
    assert "No rank has made progress" not in out and "hangs" not in out
    assert str(e).count("No rank has made progress") == 1
    assert "ddpnb: run FAILED" in out and "(RunHung)" in out


def follow(job: ddpnb.Job, until: str | None, limit: float) -> list[tuple[str | None, dict]]:
    """(verdict kind, node states) as ``job`` goes on, until its hang watch says ``until``
    (None: until it ends), with a widget panel drawn at each verdict kind's first sight."""
    from ddpnb.progress import WidgetProgress

    seen, panels, deadline = [], {}, time.monotonic() + limit
    while True:
        assert time.monotonic() < deadline, f"not {until} within {limit} s: {seen[-3:]}"
        try:
            job.wait(timeout=0.5)
        except TimeoutError:
            kind = job.waiting.kind if job.waiting is not None else None
            seen.append((kind, job.node_status()))
            if kind not in panels:
                panels[kind] = WidgetProgress(job)
            if kind == until is not None:
                return seen, panels
            continue
        assert until is None, "the run ended"
        return seen, panels


@pytest.mark.slow
def test_waiting_shows_the_hang_and_ddpnb_stacks_reads_it(tmp_path):
    """on_hang='wait': the nodes read 'waiting', then 'hung'; the run stays up; ddpnb stacks
    shows every rank."""
    # 8 s: a window from 2 s still (two snapshots) to the verdict that polls meet under load.
    job = launch("barrier_rank0.py", tmp_path / "run", on_hang="wait", wait=False, hang_timeout=8)
    try:
        seen, panels = follow(job, "hang", 40)
        assert ("waiting", {0: "waiting", 1: "waiting"}) in seen, seen  # before the verdict
        # The panel drawn at the first sight of "waiting": either rank may have been first.
        rows, box = [p.value for p in panels["waiting"].node_rows], panels["waiting"].waiting.value
        assert any(">waiting</span>" in row for row in rows), rows
        assert "<b>Waiting</b>: rank 0 " in box and " waits in " in box, box
        assert "<b>The run hangs</b>: No rank has made progress" in panels["hang"].waiting.value
        assert set(job.node_status().values()) == {"hung"}
        out = subprocess.run(
            [sys.executable, "-m", "ddpnb", "stacks", str(job.run_dir)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        barrier = line_of("barrier_rank0.py", "dist.barrier()  # MISTAKE")
        assert f"rank 0 waits in barrier at barrier_rank0.py:{barrier}" in out.stdout
        assert "rank 1 waits in DDP's gradient all-reduce" in out.stdout
        assert "frame(s) of torch/Python, innermost barrier" in out.stdout  # torch's, folded
        assert "barrier_rank0.py" in job.stacks()._repr_html_()
    finally:
        job.stop()
    assert_nothing_left(job)
    # The panel's rows show what the nodes said, not torchrun's SignalException on the stop.
    assert not [n for n in (0, 1) if "Exception" in job.last_line(n)], job.log_tail(0)
    ended = subprocess.run(
        [sys.executable, "-m", "ddpnb", "stacks", str(job.run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ended.returncode == 2 and "has ended" in ended.stderr, ended.stderr
    assert "Traceback" not in ended.stderr


@pytest.mark.slow
def test_uneven_batches_leave_one_rank_in_its_loop(tmp_path):
    with pytest.raises(RunHung) as caught:
        launch("uneven_batches.py", tmp_path / "run")
    text = str(caught.value)
    assert "rank 0 waits in DDP's gradient all-reduce inside backward" in text
    assert (
        f"rank 1 waits in barrier at uneven_batches.py:{line_of('uneven_batches.py', 'dist.barrier()')}"
        in text
    )
    assert "different numbers of batches" in text


@pytest.mark.slow
def test_a_healthy_run_whose_steps_take_3x_hang_timeout_runs_to_its_end(tmp_path, capsys):
    """Every rank computes each backward for 3 x hang_timeout: measured CPU time, not a hang."""
    job = launch("slow_steps.py", tmp_path / "run", hang_timeout=2.0, args=["6"])
    assert job.error is None  # finished (an abort at exit would be a warning, not a failure)
    out = capsys.readouterr().out
    # No verdict. Both ranks do the same work, but on a loaded machine one may finish first and
    # wait in the all-reduce for the other: the display then rightly says "waiting", no more.
    said = [ln for ln in out.splitlines() if "waits in" in ln or "hang" in ln.lower()]
    assert all(ln.startswith("ddpnb: waiting: ") for ln in said), said
    assert (tmp_path / "run" / "logs").is_dir() and "step 1 done" in job.log_tail(0, 60)


@pytest.mark.slow
def test_a_slow_rank_is_described_and_the_run_finishes(tmp_path, capsys):
    job = launch("slow_checkpoint.py", tmp_path / "run", hang_timeout=2.0, wait=False)
    seen, _ = follow(job, None, 60)
    # Rank 1 waits for rank 0 (whose node reads "running", or "starting": it printed nothing).
    assert [n for k, n in seen if k == "slow" and n[1] == "waiting" != n[0]], seen
    assert job.error is None and "done" in job.log_tail(0, 60)
    out = capsys.readouterr().out
    sleep = line_of("slow_checkpoint.py", "time.sleep(")
    assert "ddpnb: slow phase: No rank has made progress" in out
    assert f"rank 0 is working outside any collective at slow_checkpoint.py:{sleep}" in out
    assert "not a bug" in out and "hangs" not in out


# -- bad input ----------------------------------------------------------------------------------


def test_bad_hang_settings_are_refused_before_anything_starts(tmp_path):
    with pytest.raises(ConfigError, match="hang_timeout must be a number of seconds"):
        launch("slow_checkpoint.py", tmp_path / "a", hang_timeout=-1)
    with pytest.raises(ConfigError, match="on_hang must be 'stop'"):
        launch("slow_checkpoint.py", tmp_path / "b", on_hang="kill")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda p: p / "missing", "no such folder"),
        (lambda p: p, "holds no run"),
    ],
)
def test_ddpnb_stacks_on_no_run_says_which(tmp_path, make, says):
    out = subprocess.run(
        [sys.executable, "-m", "ddpnb", "stacks", str(make(tmp_path))],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and says in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_ddpnb_stacks_names_a_node_that_stopped_reporting(tmp_path):
    """One node's ranks report, the other's last snapshot is old: that host is named."""
    import json
    import os

    watch = tmp_path / ".ddpnb" / "watch"
    watch.mkdir(parents=True)
    (tmp_path / "logs").mkdir()
    now = time.time()
    for rank, (host, age) in enumerate((("gpu1", 1.0), ("gpu2", 40.0))):
        snapshot = {
            "rank": rank, "local_rank": 0, "node": rank, "world_size": 2, "restart": 0,
            "host": host, "pid": os.getpid(), "state": "running", "seq": 5, "time": now - age,
            "still": 1.0, "steps": 3, "process_group": True, "interval": 2.0, "stack": [],
        }  # fmt: skip
        (watch / f"rank-{rank}.json").write_text(json.dumps(snapshot))
    out = subprocess.run(
        [sys.executable, "-m", "ddpnb", "stacks", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out
    assert "node 1 (gpu2)" in out.stderr and "stopped reporting" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr


def test_the_hooks_start_in_a_worker_once_and_not_in_the_processes_it_starts(tmp_path):
    """site_hooks' one guard: the watch and the observer run in a process with RANK and their
    folders set, and not in a child of it (a subprocess, mp.spawn's, a DataLoader worker)."""
    import os

    from ddpnb.hang import hooks_payload

    for name, data in hooks_payload().items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(data)
    (tmp_path / "observe").mkdir()
    active = (  # a worker and its child say whether their watch and observer run
        "import sys; print(sys.modules['ddpnb_watch'].active, "
        "sys.modules['ddpnb_observe'].active, flush=True)"
    )
    script = f"import subprocess\n{active}\nsubprocess.run([sys.executable, '-c', {active!r}])"
    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "DDPNB_WATCH": str(tmp_path / "watch"),
        "DDPNB_OBSERVE": str(tmp_path / "observe"),
        "PYTHONPATH": str(tmp_path / ".ddpnb"),
    }
    for owner in ("DDPNB_WATCH_OWNER", "DDPNB_OBSERVE_OWNER"):
        env.pop(owner, None)
    out = subprocess.run(
        [sys.executable, "-c", script],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    worker, child = out.stdout.splitlines()
    assert "_Watch object" in worker and "_Observer object" in worker, out
    assert child == "None None", out
    assert (tmp_path / "watch").is_dir() and (tmp_path / "observe" / "rank-0.jsonl").exists()


# -- NCCL: the flight recorder's summary in each snapshot, and what it says -------------------


def nccl(*pending: tuple, groups: dict | None = None) -> dict:
    """A rank's "nccl" summary (watch.nccl_collectives): pending (seq, op, size, seconds)."""
    pend = [
        {"pg": "0", "seq": s, "p2p": False, "op": op, "size": n, "state": "scheduled", "for": t}
        for s, op, n, t in pending
    ]
    last = max((p["seq"] for p in pend), default=6)
    return {
        "groups": groups or {"0": [last, 6]},
        "pending": pend,
        "more": 0,
        "pending_for": pend[0]["for"] if pend else 0.0,
    }


def test_nccl_a_lone_barrier_taken_by_the_next_all_reduce_is_two_collectives():
    from ddpnb.hang import nccl_waits

    ranks = {
        0: nccl((7, "nccl:all_reduce_barrier", 1, 70.4)),
        1: nccl((7, "nccl:all_reduce", 2048, 69.0), (8, "nccl:all_reduce", 2048, 68.0)),
    }
    w = nccl_waits(ranks, 60)
    assert (w.waiting, w.free, w.unknown, w.apart) == ((0, 1), (), (), True)
    assert w.at[0] == "nccl:all_reduce_barrier #7 (1 element), not completed for 70 s"
    assert w.at[1] == "nccl:all_reduce #7 (2048 elements), not completed for 69 s"
    assert w.pending_for == {0: 70.4, 1: 69.0}


def test_nccl_same_op_other_size_or_number_is_apart_and_one_collective_is_not():
    from ddpnb.hang import nccl_waits

    grads, metric = (31, "nccl:all_reduce", 2048, 80.0), (31, "nccl:all_reduce", 1, 80.0)
    assert nccl_waits({0: nccl(grads), 1: nccl(metric)}, 60).apart  # uneven batches
    ahead = (32, "nccl:all_reduce", 2048, 80.0)  # one rank reached a collective the other did not
    assert nccl_waits({0: nccl(ahead), 1: nccl(grads)}, 60).apart
    same = nccl_waits({0: nccl(grads), 1: nccl(grads)}, 60)  # a node or the network is gone
    assert same.waiting == (0, 1) and not same.apart


def test_nccl_waiting_needs_the_limit_and_a_pending_collective():
    from ddpnb.hang import nccl_waits

    w = nccl_waits({0: nccl((7, "nccl:all_reduce", 8, 59.0)), 1: nccl()}, 60)
    assert (w.waiting, w.free) == ((), (0, 1))
    assert w.at[1] == "no NCCL collective pending (last enqueued #6, completed #6)"
    w = nccl_waits({0: nccl((7, "nccl:all_reduce", 8, 61.0)), 1: nccl()}, 60)
    assert (w.waiting, w.free, w.apart) == ((0,), (1,), False)  # rank 1 computes: not a hang


def test_nccl_ranks_without_a_summary_are_unknown():
    from ddpnb.hang import nccl_waits

    off = {"error": "the flight recorder is off (TORCH_FR_BUFFER_SIZE unset or 0)"}
    w = nccl_waits({0: None, 1: off, 2: nccl((3, "nccl:broadcast", 4, 90.0))}, 60)
    assert (w.waiting, w.free, w.unknown) == ((2,), (), (0, 1))
    assert list(w.at) == [2]


class NcclNamed:
    """torch.distributed as the watch sees it, its process group's backend named ``backend``."""

    def __init__(self, backend: str = "nccl", initialized: bool = True) -> None:
        self.backend, self.initialized = backend, initialized

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return self.initialized

    def get_backend(self) -> str:
        return self.backend


def fr_entry(record: int, seq: int, op: str, state: str, retired: bool, **kw) -> dict:
    """One entry as torch 2.14's _dump_nccl_trace_json writes it (the fields the watch reads)."""
    entry = {
        "record_id": record,
        "pg_id": 0,
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "is_p2p": False,
        "profiling_name": op,
        "input_sizes": [[2, 512]],
        "state": state,
        "retired": retired,
        "time_created_ns": int((time.time() - 30) * 1e9),
    }
    return {**entry, **kw}


def test_nccl_collectives_keeps_what_has_not_completed(monkeypatch):
    import json

    import torch._C._distributed_c10d as c10d

    from ddpnb.watch import NCCL_PENDING, nccl_collectives

    entries = [
        fr_entry(0, 5, "nccl:all_reduce", "completed", True),
        fr_entry(1, 6, "nccl:all_reduce", "scheduled", True),  # retired (aborted)
        fr_entry(2, 7, "nccl:all_reduce_barrier", "scheduled", False, input_sizes=[[1]]),
        fr_entry(3, 0, "nccl:send ", "started", False, is_p2p=True, p2p_seq_id=2),
        *(fr_entry(4 + i, 8 + i, "nccl:all_reduce", "scheduled", False) for i in range(9)),
    ]
    status = {"0": {"last_enqueued_collective": "16", "last_completed_collective": "6"}}
    trace = json.dumps({"version": "2.10", "pg_status": status, "entries": entries})
    asked = []
    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", lambda **kw: asked.append(kw) or trace)
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    s = nccl_collectives(NcclNamed("cpu:gloo,cuda:nccl"))
    assert asked == [{"includeCollectives": True, "onlyActive": True}]
    assert s["groups"] == {"0": [16, 6]}
    assert len(s["pending"]) == NCCL_PENDING and s["more"] == 11 - NCCL_PENDING
    barrier, send = s["pending"][:2]
    assert {k: barrier[k] for k in ("pg", "seq", "p2p", "op", "size", "state")} == {
        "pg": "0",
        "seq": 7,
        "p2p": False,
        "op": "nccl:all_reduce_barrier",
        "size": 1,
        "state": "scheduled",
    }
    assert 29 < barrier["for"] < 40 and s["pending_for"] == barrier["for"]
    assert (send["seq"], send["p2p"], send["size"]) == (2, True, 1024)


def test_nccl_collectives_is_off_without_nccl_and_never_raises(monkeypatch):
    import torch._C._distributed_c10d as c10d

    from ddpnb.watch import nccl_collectives

    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "2000")
    assert nccl_collectives(None) is None
    assert nccl_collectives(NcclNamed("gloo")) is None
    assert nccl_collectives(NcclNamed(initialized=False)) is None

    def broken(**kw):
        raise RuntimeError("the recorder is gone")

    monkeypatch.setattr(c10d, "_dump_nccl_trace_json", broken, raising=False)
    assert nccl_collectives(NcclNamed()) == {"error": "RuntimeError: the recorder is gone"}
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "2000")  # the first name set wins
    assert "flight recorder is off" in nccl_collectives(NcclNamed())["error"]


# Two gloo ranks: rank 1 comes late to the second all_reduce, and rank 0 reads torch's own
# recorder (gloo's ring: the same entries as NCCL's, which needs a GPU) the watch's way.
TWO_RANKS = """
import json, sys, time
import torch, torch.distributed as dist
import torch._C._distributed_c10d as c10d
from ddpnb.watch import nccl_collectives

rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method=sys.argv[2], rank=rank, world_size=2)
dist.all_reduce(torch.ones(2))
if rank == 1:
    time.sleep(3)
work = dist.all_reduce(torch.ones(3, 4), async_op=True)
if rank == 0:
    time.sleep(1)
    c10d._dump_nccl_trace_json = c10d._dump_fr_trace_json
    class Nccl:
        is_available = is_initialized = lambda: True
        get_backend = lambda: "nccl"
    print(json.dumps(nccl_collectives(Nccl)), flush=True)
work.wait()
dist.destroy_process_group()
"""


@pytest.mark.slow
def test_nccl_collectives_reads_torch_s_own_recorder(tmp_path):
    import json
    import os

    root = str(Path(__file__).resolve().parents[1])
    env = {**os.environ, "TORCH_FR_BUFFER_SIZE": "2000", "PYTHONPATH": root}
    init = f"file://{tmp_path}/store"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", TWO_RANKS, str(r), init],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for r in (0, 1)
    ]
    (out, err), _ = (p.communicate(timeout=120) for p in procs)
    assert procs[0].returncode == 0, err
    s = json.loads(out.strip().splitlines()[-1])
    assert s["groups"] == {"0": [2, 1]}, s  # the first all_reduce completed, the second not
    (p,) = s["pending"]
    assert (p["pg"], p["seq"], p["op"], p["size"], p["state"]) == (
        "0",
        2,
        "gloo:all_reduce",
        12,
        "scheduled",
    )
    assert 0.5 < p["for"] < 3 and s["more"] == 0


def test_the_flight_recorder_is_on_in_the_workers_unless_the_user_set_it(monkeypatch):
    from ddpnb.plan import Plan

    script = Script(HANGS / "barrier_rank0.py")
    for name in ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert Plan(script, None).user_env("/r")["TORCH_FR_BUFFER_SIZE"] == "2000"
    assert "TORCH_FR_BUFFER_SIZE" not in Plan(script, None, hang_timeout=None).user_env("/r")
    mine = Plan(script, None, env={"TORCH_NCCL_TRACE_BUFFER_SIZE": "50"}).user_env("/r")
    assert "TORCH_FR_BUFFER_SIZE" not in mine and mine["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50"
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")  # the launcher's own: the workers inherit it
    assert "TORCH_FR_BUFFER_SIZE" not in Plan(script, None).user_env("/r")


def test_on_nccl_waiting_is_the_flight_recorders_pending_collective(tmp_path):
    """NCCL ranks spin in a GPU sync (CPU busy) with the stack elsewhere: the recorder decides."""
    pending = lambda seq, op, size: {  # noqa: E731
        "groups": {"0": [seq, seq - 1]},
        "pending": [{"pg": "0", "seq": seq, "op": op, "size": size, "for": 70.0}],
    }
    r0 = rank(0, idle=0.2, nccl=pending(9, "nccl:all_reduce_barrier", 1))
    r1 = rank(1, idle=0.2, nccl=pending(9, "nccl:all_reduce", 65792))
    assert r0.waits_in == "NCCL's nccl:all_reduce_barrier #9 (1 elements)"
    free = rank(1, BARRIER, idle=0.2, nccl={"groups": {"0": [9, 9]}, "pending": []})
    assert free.waits_in is None  # its stack in barrier says nothing on NCCL
    # read_ranks turns the recorder's waiting time into the rank's idle time (CPU spins):
    folder = tmp_path / ".ddpnb" / "watch"
    folder.mkdir(parents=True)
    for r in (r0, r1):
        record = {"rank": r.rank, "node": r.rank, "host": "h", "pid": 1, "steps": 5}
        record.update(state="running", time=time.time(), still=0.2, idle=0.2, interval=2.0)
        record.update(process_group=True, stack=[], world_size=2, nccl=r.nccl)
        (folder / f"rank-{r.rank}.json").write_text(json.dumps(record))
    ranks = read_ranks(tmp_path)
    assert all(r.waits and r.idle >= 70 for r in ranks)
    assert verdict(ranks, min(r.idle for r in ranks), 60).cause == "different"
