"""The seam between the pipeline and the schedulers: :class:`Scheduler`, what each one
implements, and :class:`Processes`, the base of those whose nodes are processes here
(``torchrun`` agents, or the ``ssh`` clients running them), which the lifeline (a pipe only
this process writes) stops however this process ends."""

from __future__ import annotations

import abc
import functools
import os
import signal
import subprocess
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

from .agent import descendants
from .errors import LaunchError

if TYPE_CHECKING:
    from .errors import RunFailed
    from .plan import Plan
    from .topology import Topology

AGENT = Path(__file__).with_name("agent.py")
STOP_GRACE_SECONDS = 4.0


class Scheduler(abc.ABC):
    """Where a run's nodes run. ``pipeline.run`` calls check, preflight and start; the
    :class:`~ddpnb.Job` the rest. Every state is the instance's own; a scheduler's extras
    (an SSH host list, a Slurm job id) are reached through ``job.scheduler``."""

    topology: Topology  # each scheduler sets it; final once preflight has run
    data_here: ClassVar[bool] = True  # the nodes read the dataset at this machine's path
    watch_stalls: ClassVar[bool] = True  # not while a cluster queues the run
    outlives_launcher: ClassVar[bool] = False  # a batch job belongs to the cluster

    nnodes = property(lambda self: self.topology.nnodes)
    nproc_per_node = property(lambda self: self.topology.nproc_per_node)

    # What every scheduler does:
    @abc.abstractmethod
    def start(self, plan: Plan, run_dir: Path) -> None:
        """Start every node of the run (place it, then start it)."""

    @abc.abstractmethod
    def poll(self) -> dict[int, int | None]:
        """Each node's exit code, None while it runs."""

    @abc.abstractmethod
    def stop(self) -> None:
        """End every process of the run; return once they are gone."""

    # What some do (a cluster's limits, queue and log; nodes whose files are elsewhere):
    def check(self, plan: Plan) -> None:
        """Check what can be checked before the run directory exists (a cluster's limits)."""
        return None

    def preflight(self, plan: Plan, run_dir: Path) -> None:
        """Check the nodes and where they meet; ``topology`` is final after it."""
        return None

    def pending(self) -> str | None:
        """Why the nodes have not started (a queue), or None."""
        return None

    def since(self) -> float | None:
        """When this attempt's nodes started (None: when the Job began)."""
        return None

    def sync(self) -> None:
        """Bring node 0's progress files here while the run goes on."""
        return None

    def sync_stacks(self, force: bool) -> None:
        """Bring the ranks' stack snapshots here (``force``: now, or raise)."""
        return None

    def fetch(self) -> None:
        """Bring every node's results and logs here once the run ended."""
        return None

    def explain(self, error: RunFailed, failed: dict[int, int]) -> RunFailed:  # add host, state
        return error

    def pids(self) -> list[int]:  # the run's processes on this machine that are still alive
        return []

    def host(self, node: int) -> str | None:  # where ``node`` runs, as the user named it
        return None  # this machine (simulated nodes), or a cluster's choice

    @property
    def master_addr(self) -> str | None:  # node 0's address, when only the running job knows it
        return None

    @property
    def master_port(self) -> int | None:
        return None


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
