"""A launched run: its processes, their lifeline, and following it to the end.

:class:`Job` is what :func:`ddpnb.launch` returns, for simulated nodes and for real
hosts alike. The lifeline ties every node's agent to this process: the agents hold
the read end of a pipe whose write end only this process holds, so they stop their
nodes when it ends, however it ends.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import time
import weakref
from pathlib import Path
from typing import Protocol

from .agent import descendants
from .config import TrainConfig
from .diagnosis import check_stalled, diagnose_failure, log_tail
from .errors import RunFailed
from .metrics import RunMetrics, load_metrics, read_progress
from .progress import make_progress
from .topology import Topology

POLL_SECONDS = 0.2
STOP_GRACE_SECONDS = 4.0
REMOTE_STOP_SECONDS = 8.0  # a host's agent stops its node within its own grace (5 s)


class Remote(Protocol):
    """What a Job on real hosts adds (``ddpnb.remote`` has it): files and hosts over SSH."""

    hosts: list[str]  # per node, as the user named them
    checkpoint_dir: str  # where node 0 keeps the checkpoints ("host:path" when not here)

    def sync(self) -> None:
        """Bring node 0's progress files here if they are not on a shared filesystem."""

    def fetch(self) -> None:
        """Bring every node's metrics, rank records and logs here once the run has ended."""

    def explain(self, error: RunFailed, failed: dict[int, int]) -> RunFailed:
        """The error with its host named (and an ended SSH connection as a lost node)."""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False


_live_jobs: weakref.WeakSet[Job] = weakref.WeakSet()
_lifelines: set[int] = set()  # write ends held by this process, one per running job
_fork_hook_registered = False


def open_lifeline() -> tuple[int, int]:
    """A pipe (read, write): the agents get the read end, only this process the write end.

    Both ends are non-inheritable, so no other child of this process holds the write
    end; a forked child closes its copies, so it cannot keep a run alive either.
    """
    global _fork_hook_registered
    if not _fork_hook_registered:
        os.register_at_fork(after_in_child=_close_lifelines_in_child)
        _fork_hook_registered = True
    read_fd, write_fd = os.pipe()
    _lifelines.add(write_fd)
    return read_fd, write_fd


def close_lifeline(fd: int) -> None:
    _lifelines.discard(fd)
    try:
        os.close(fd)
    except OSError:
        pass


def _close_lifelines_in_child() -> None:
    for fd in list(_lifelines):
        close_lifeline(fd)


@atexit.register
def _stop_live_jobs() -> None:  # a kernel restart must not leave workers behind
    for job in list(_live_jobs):
        job.stop()


class Job:
    """A launched run: its processes, files and gathered metrics.

    Returned by :func:`launch`. ``wait()`` follows it to the end (raising
    :class:`~ddpnb.errors.WorkerFailed` on failure), ``stop()`` ends every process.
    """

    def __init__(
        self,
        run_dir: Path,
        config: TrainConfig,
        procs: dict[int, subprocess.Popen],
        topology: Topology,
        *,
        progress: str = "none",
        lifeline: int | None = None,
        remote: Remote | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.config = config
        self.procs = procs
        self.topology = topology
        self.log_paths = {n: run_dir / "logs" / f"node-{n}.log" for n in procs}
        self.progress_mode = progress
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.error: BaseException | None = None
        self._known_pids: set[int] = set()
        self._lifeline = lifeline  # write end of the pipe the agents watch
        self.remote = remote
        self.hosts = remote.hosts if remote else None  # per node, on real hosts
        self._fetched = False
        _live_jobs.add(self)

    # torchrun's names, read from the topology
    nnodes = property(lambda self: self.topology.nnodes)
    nproc_per_node = property(lambda self: self.topology.nproc_per_node)
    world_size = property(lambda self: self.topology.world_size)
    master_addr = property(lambda self: self.topology.master_addr)
    master_port = property(lambda self: self.topology.master_port)
    rdzv_timeout = property(lambda self: self.topology.rdzv_timeout)
    max_restarts = property(lambda self: self.topology.max_restarts)

    # -- state -------------------------------------------------------------------

    @property
    def metrics(self) -> RunMetrics:
        """The run's gathered metrics (re-read on every access)."""
        return load_metrics(self.run_dir)

    @property
    def returncodes(self) -> dict[int, int | None]:
        return {n: p.poll() for n, p in self.procs.items()}

    @property
    def running(self) -> bool:
        return any(rc is None for rc in self.returncodes.values())

    def node_status(self) -> dict[int, str]:
        """``starting`` / ``running`` / ``done`` / ``failed`` (or ``stopped``) per node."""
        joined = bool(read_progress(self.run_dir))
        out = {}
        for n in range(self.nnodes):
            proc = self.procs.get(n)
            if proc is None:
                out[n] = "running" if joined else "external"
                continue
            rc = proc.poll()
            if rc is None:
                out[n] = "running" if joined else "starting"
            elif rc == 0:
                out[n] = "done"
            else:
                out[n] = "stopped" if isinstance(self.error, KeyboardInterrupt) else "failed"
        return out

    def log_tail(self, node: int = 0, lines: int = 20) -> str:
        """The last ``lines`` lines of a node's log."""
        return log_tail(self.run_dir, node, lines)

    def pids(self) -> list[int]:
        """Agent and worker PIDs of this run that are still alive."""
        self._remember_pids()
        return sorted(p for p in self._known_pids if _alive(p))

    def _remember_pids(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                self._known_pids.add(proc.pid)
                self._known_pids.update(descendants(proc.pid))

    # -- control -------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every process of the run: SIGTERM, then SIGKILL after a short grace.

        On SSH hosts the lifeline goes first: each host's agent sees its SSH session's
        input end and stops its node there; the local ssh clients are ended after that.
        """
        if self.remote is not None:
            self._cut_lifeline()
            deadline = time.monotonic() + REMOTE_STOP_SECONDS
            while time.monotonic() < deadline and self.running:
                time.sleep(0.05)
        self._remember_pids()
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)  # the agent forwards it to its workers
                except OSError:
                    pass
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        while time.monotonic() < deadline and any(_alive(p) for p in self._known_pids):
            for proc in self.procs.values():
                proc.poll()  # reap agents so they stop counting as alive
            time.sleep(0.05)
        for pid in self._known_pids:
            if _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        for proc in self.procs.values():
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
        if self.ended_at is None:
            self.ended_at = time.time()
        self._cut_lifeline()
        _live_jobs.discard(self)
        self._fetch()

    def _fetch(self) -> None:
        if self.remote is not None and not self._fetched:
            self._fetched = True
            self.remote.fetch()

    def _cut_lifeline(self) -> None:
        if self._lifeline is not None:
            close_lifeline(self._lifeline)
            self._lifeline = None

    def wait(self, timeout: float | None = None) -> Job:
        """Follow the run to its end, showing progress; return self.

        Raises :class:`WorkerFailed` (with node, rank, exit code and traceback) when
        a worker fails, :class:`RendezvousTimeout` when the nodes do not all join, and
        stops every process on KeyboardInterrupt before re-raising it.
        """
        display = make_progress(self.progress_mode, self)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while True:
                if self.remote is not None:
                    self.remote.sync()
                display.update()
                codes = self.returncodes
                failed = {n: rc for n, rc in codes.items() if rc not in (None, 0)}
                if failed:
                    self.error = self._failure(failed)
                    self.stop()
                    break
                if all(rc == 0 for rc in codes.values()):
                    break
                self.error = self._check_stalled()
                if self.error:
                    self.stop()
                    break
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(
                        f"The run did not finish within {timeout} s (still running)."
                    )
                self._remember_pids()
                time.sleep(POLL_SECONDS)
        except KeyboardInterrupt as e:
            self.error = e
            self.stop()
            display.close(self)
            print(f"Interrupted: stopped every process of the run in {self.run_dir}.")
            raise
        self.ended_at = self.ended_at or time.time()
        self._cut_lifeline()
        _live_jobs.discard(self)
        self._fetch()
        display.close(self)
        if self.error:
            raise self.error
        return self

    # -- failures ---------------------------------------------------------------------

    def _check_stalled(self) -> RunFailed | None:
        return check_stalled(
            self.run_dir,
            self.topology,
            list(self.procs),
            self.started_at,
            self.config.timeout_seconds,
        )

    def _failure(self, failed: dict[int, int]) -> RunFailed:
        time.sleep(0.5)  # give the other agents a moment to write their error files
        if self.remote is None:
            return diagnose_failure(
                self.run_dir, self.topology, list(self.procs), failed, self.started_at
            )
        self.remote.fetch()  # the error files and rank records of hosts without a shared filesystem
        error = diagnose_failure(
            self.run_dir, self.topology, list(self.procs), failed, self.started_at
        )
        return self.remote.explain(error, failed)

    def __repr__(self) -> str:
        state = "running" if self.running else "finished"
        return f"<ddpnb.Job {self.run_dir} {self.nnodes}x{self.nproc_per_node} {state}>"
