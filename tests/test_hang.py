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
from ddpnb.hang import Frame, RankState, Stacks, verdict
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
    v = verdict([rank(0, BACKWARD), rank(1, state="ended")], 70, 60)
    assert v.kind == "hang" and "rank 1 ended while rank 0 waits in a collective" in v.message


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
        launch("barrier_rank0.py", tmp_path / "run")
    e = caught.value
    barrier = line_of("barrier_rank0.py", "dist.barrier()")
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
    assert f"ddpnb: waiting: rank 0 waits in barrier at barrier_rank0.py:{barrier}" in out
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
    job = launch("barrier_rank0.py", tmp_path / "run", on_hang="wait", wait=False)
    try:
        seen, panels = follow(job, "hang", 40)
        assert ("waiting", {0: "waiting", 1: "waiting"}) in seen, seen  # before the verdict
        rows, box = [p.value for p in panels["waiting"].node_rows], panels["waiting"].waiting.value
        assert all(">waiting</span>" in row for row in rows), rows
        assert "<b>Waiting</b>: rank 0 waits in barrier at barrier_rank0.py:" in box, box
        assert "<b>The run hangs</b>: No rank has made progress" in panels["hang"].waiting.value
        assert set(job.node_status().values()) == {"hung"}
        out = subprocess.run(
            [sys.executable, "-m", "ddpnb", "stacks", str(job.run_dir)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        barrier = line_of("barrier_rank0.py", "dist.barrier()")
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
    assert all(rc == 0 for rc in job.returncodes.values())
    out = capsys.readouterr().out
    assert "hang" not in out.lower() and "waits in" not in out
    assert (tmp_path / "run" / "logs").is_dir() and "step 1 done" in job.log_tail(0, 60)


@pytest.mark.slow
def test_a_slow_rank_is_described_and_the_run_finishes(tmp_path, capsys):
    job = launch("slow_checkpoint.py", tmp_path / "run", hang_timeout=2.0, wait=False)
    seen, _ = follow(job, None, 60)
    assert ("slow", {0: "running", 1: "waiting"}) in seen, seen  # rank 1 waits for rank 0
    assert all(rc == 0 for rc in job.returncodes.values())
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
