"""The launch pipeline (check, prepare, start, follow) and the processes it owns: ``torchrun``
agents, which the lifeline (a pipe only this process writes) stops however this process ends."""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import Any

from .agent import descendants
from .errors import LaunchError
from .hang import WATCH_DIR
from .job import Job, Scheduler
from .plan import Plan
from .preflight import as_config, check_run, warn_if_cuda_initialised
from .rundir import prepare_run_dir
from .script import Script

AGENT = Path(__file__).with_name("agent.py")
STOP_GRACE_SECONDS = 4.0


def run(
    what: Any, run_dir: str | os.PathLike, scheduler: Scheduler, *, wait: bool, **options
) -> Job:
    """The one path of every launch, every check first; ``options``: :class:`Plan`'s fields."""
    script, config = what, None
    if not isinstance(what, Script):  # ddpnb's worker: a TrainConfig or its dict
        config = check_run(as_config(what), scheduler.topology.world_size, here=scheduler.data_here)
        script = Script.worker(config)
    script.check()
    plan = Plan(script, config, **options)
    scheduler.check(plan)
    run_dir = prepare_run_dir(
        run_dir, plan.payload, plan.config, resume=plan.resume, overwrite=plan.overwrite
    ).resolve()
    scheduler.preflight(plan, run_dir)
    warn_if_cuda_initialised()
    shutil.rmtree(run_dir / WATCH_DIR, ignore_errors=True)
    for name, data in plan.files.items():  # ddpnb's hooks: fresh at every launch
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_bytes(data)
    (run_dir / "logs").mkdir(exist_ok=True)
    scheduler.start(plan, run_dir)
    job = Job(run_dir, plan.script, plan.config, scheduler.topology, scheduler, **plan.follow)
    return job.wait() if wait else job


def alive(pid: int) -> bool:
    """True while ``pid`` runs (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:  # no /proc (macOS)
        with suppress(OSError):
            os.kill(pid, 0)
            return True
        return False


_lifelines: set[int] = set()  # write ends, one per running job


def _close_lifelines() -> None:  # in a forked child: no other process may keep a run alive
    for fd in _lifelines:
        with suppress(OSError):
            os.close(fd)
    _lifelines.clear()


@functools.cache  # once per process, at its first launch (nothing happens on import)
def _close_lifelines_in_children() -> None:
    os.register_at_fork(after_in_child=_close_lifelines)


class Processes(Scheduler):
    """Nodes that are processes of this machine: torchrun agents, or ssh clients running them."""

    def __init__(self) -> None:
        self.procs: dict[int, subprocess.Popen] = {}
        self.lifeline: int | None = None
        self._known: set[int] = set()

    def spawn_all(self, run_dir: Path, program: str, commands: Callable[[int], dict]) -> None:
        """Start every node; ``commands(lifeline_fd)``: ``{node: (argv, shown, popen_kwargs)}``."""
        _close_lifelines_in_children()
        lifeline_read, self.lifeline = os.pipe()
        _lifelines.add(self.lifeline)
        try:
            for node, (cmd, shown, popen) in commands(lifeline_read).items():
                with open(run_dir / "logs" / f"node-{node}.log", "ab", buffering=0) as out:
                    out.write(f"$ {shown}\n".encode())
                    self.procs[node] = subprocess.Popen(
                        cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **popen
                    )
        except BaseException as e:  # an OSError, or Ctrl-C/SIGTERM before the Job exists
            for proc in self.procs.values():  # nothing to save yet: no grace
                with suppress(OSError):
                    os.killpg(proc.pid, signal.SIGKILL)
            self.cut_lifeline()
            if isinstance(e, OSError):
                raise LaunchError(f"Could not start {program}: {e}") from e
            raise
        finally:
            os.close(lifeline_read)

    def poll(self) -> dict[int, int | None]:
        self.pids()
        return {n: p.poll() for n, p in self.procs.items()}

    def pids(self) -> list[int]:
        for proc in self.procs.values():
            if proc.poll() is None:
                self._known.add(proc.pid)
                self._known.update(descendants(proc.pid))
        return sorted(p for p in self._known if alive(p))

    def cut_lifeline(self) -> None:
        if self.lifeline is not None:
            _lifelines.discard(self.lifeline)
            with suppress(OSError):
                os.close(self.lifeline)
            self.lifeline = None

    def stop(self) -> None:
        """SIGTERM every agent's group, SIGKILL what is left after a short grace."""
        self.pids()
        for proc in self.procs.values():
            if proc.poll() is None:  # the agent forwards it to its workers
                with suppress(OSError):
                    os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        while time.monotonic() < deadline and any(alive(p) for p in self._known):
            for proc in self.procs.values():
                proc.poll()  # reap agents so they stop counting as alive
            time.sleep(0.05)
        for pid in filter(alive, self._known):
            with suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        for proc in self.procs.values():
            with suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=5)
        self.cut_lifeline()
