"""A launched run: followed to its end, stopped, diagnosed — whatever runs its nodes.

:class:`Job` is what :func:`ddpnb.launch` and :func:`ddpnb.submit_slurm` return. What
differs between simulated nodes, SSH hosts and a Slurm job is one :class:`Backend` class
each: how the nodes start, how they are asked how they are (``poll``), stopped, and how
files move (``sync``, ``fetch``); everything else — the panel, the hang watch, the
diagnosis of a failure — is written once, here.

The lifeline ties every node's agent to this process: the agents hold the read end of
a pipe whose write end only this process holds, so they stop their nodes when it ends,
however it ends (a Slurm job belongs to the cluster instead, and has none).
"""

from __future__ import annotations

import atexit
import os
import re
import signal
import subprocess
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from .agent import descendants
from .diagnosis import check_stalled, diagnose_failure, log_tail, resume_hint
from .errors import RunFailed, RunHung, RunInterrupted
from .hang import Stacks, Verdict, read_ranks, stacks, verdict
from .metrics import RunMetrics, load_metrics, read_progress
from .progress import make_progress
from .topology import Topology

if TYPE_CHECKING:
    from .plan import Plan

AGENT = Path(__file__).with_name("agent.py")  # each node's torchrun; its source goes over ssh
POLL_SECONDS = 0.2
WATCH_SECONDS = 1.0  # how often the hang watch reads the ranks' snapshots
HANG_DEFAULT = 60.0  # the quiet time a verdict needs when the watch has no limit of its own
STOP_GRACE_SECONDS = 4.0
WORKER_LINE = re.compile(rb"^\[rank\d+\]", re.M)  # torchrun's prefix on a worker's output
TRACEBACK = "Traceback (most recent call last):"


class Backend(Protocol):
    """One way a run's nodes run: simulated on this machine (``ddpnb.local.Local``), on SSH
    hosts (``ddpnb.remote.Hosts``), or as a Slurm job (``ddpnb.slurm.Slurm``).

    The pipeline (``ddpnb.pipeline.run``) calls ``check``, ``preflight`` and ``start``;
    the Job it returns follows the nodes through the rest. A new backend is one class.
    """

    data_here: bool  # the worker's dataset must be on this machine

    def check(self, plan: Plan) -> None:
        """What can be checked before the run directory exists (a cluster's limits)."""

    def preflight(self, plan: Plan) -> Topology:
        """Check everything else the nodes need (hosts, ports, the network): the final topology."""

    def start(self, plan: Plan) -> Job:
        """Place the files, start every node; the Job that follows them (its backend: this)."""

    hosts: list[str] | None  # per node, as the user named them (None: this machine)
    watch_stalls: bool  # a silent run is a stalled one (not while a scheduler queues it)
    outlives_launcher: bool  # the run belongs to a scheduler, not to this process
    procs: dict[int, subprocess.Popen]  # this machine's process of each node ({}: none)
    job_id: str | None  # the scheduler's id of the run (Slurm's job id), else None
    master_addr: str | None  # node 0's address once a scheduler names it, else None
    state: str | None  # the scheduler's state of the run ("RUNNING", ...), else None

    def batch_log(self) -> Path | None:
        """The scheduler's own log of the run (sbatch's output), or None."""

    def poll(self) -> dict[int, int | None]:
        """Each node's exit code, None while it runs (or waits to)."""

    def pending(self) -> str | None:
        """Why the nodes have not started (a scheduler's queue), or None."""

    def since(self) -> float | None:
        """When the nodes of this attempt started (None: when the Job was created)."""

    def stop(self) -> None:
        """End every process of the run, wherever it runs; return once they are gone."""

    def sync(self) -> None:
        """Bring node 0's progress files here while the run goes on (if not shared)."""

    def sync_stacks(self, force: bool) -> None:
        """Bring every rank's stack snapshots here (if not shared); ``force``: now, or raise."""

    def fetch(self) -> None:
        """Bring every node's results and logs here once the run has ended."""

    def explain(self, error: RunFailed, failed: dict[int, int]) -> RunFailed:
        """The diagnosed error with what only the backend knows (host, scheduler state)."""

    def pids(self) -> list[int]:
        """Processes of the run on this machine that are still alive."""


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
        if not job.backend.outlives_launcher:  # a Slurm job does
            job.stop()


class Processes:
    """Nodes that are processes of this machine: torchrun agents, or ssh clients running them.

    The base of the simulated nodes' backend (``ddpnb.local.Local``) and the SSH hosts'
    (``ddpnb.remote.Hosts``), which differ only in the command that starts a node; this
    class watches and stops either kind.
    """

    hosts: list[str] | None = None
    watch_stalls = True
    outlives_launcher = False
    job_id = master_addr = state = None  # no scheduler

    def __init__(self) -> None:
        self.procs: dict[int, subprocess.Popen] = {}
        self.lifeline: int | None = None  # write end of the pipe the agents watch
        self._known: set[int] = set()

    def spawn(self, node: int, cmd: list[str], log: Path, shown: str, **popen: Any) -> None:
        """Start node ``node``'s command, its output appended to ``log``, in its own group."""
        with open(log, "ab") as out:
            out.write(f"$ {shown}\n".encode())
            out.flush()
            self.procs[node] = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **popen
            )

    def poll(self) -> dict[int, int | None]:
        self.pids()
        return {n: p.poll() for n, p in self.procs.items()}

    def pending(self) -> str | None:
        return None

    def since(self) -> float | None:
        return None

    def pids(self) -> list[int]:
        for proc in self.procs.values():
            if proc.poll() is None:
                self._known.add(proc.pid)
                self._known.update(descendants(proc.pid))
        return sorted(p for p in self._known if _alive(p))

    def cut_lifeline(self) -> None:
        if self.lifeline is not None:
            close_lifeline(self.lifeline)
            self.lifeline = None

    def kill_all(self) -> None:
        """Processes started before a Job existed (a failed start): no grace."""
        for proc in self.procs.values():
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except OSError:
                pass
        self.cut_lifeline()

    def stop(self) -> None:
        """SIGTERM every agent's group, SIGKILL what is left after a short grace."""
        self.pids()
        for proc in self.procs.values():
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)  # the agent forwards it to its workers
                except OSError:
                    pass
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        while time.monotonic() < deadline and any(_alive(p) for p in self._known):
            for proc in self.procs.values():
                proc.poll()  # reap agents so they stop counting as alive
            time.sleep(0.05)
        for pid in self._known:
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
        self.cut_lifeline()

    def sync(self) -> None:
        pass

    def sync_stacks(self, force: bool) -> None:
        pass

    def fetch(self) -> None:
        pass

    def explain(self, error: RunFailed, failed: dict[int, int]) -> RunFailed:
        return error

    def batch_log(self) -> Path | None:
        return None


class Job:
    """A launched run: its nodes, files and gathered metrics.

    Returned by :func:`ddpnb.launch` and :func:`ddpnb.submit_slurm`. ``wait()`` follows
    it to the end (raising :class:`~ddpnb.errors.WorkerFailed` on failure), ``stop()``
    ends every process of it.
    """

    def __init__(
        self,
        run_dir: Path,
        script: Any,
        config: Any,
        topology: Topology,
        backend: Backend,
        *,
        progress: str = "none",
        hang_timeout: float | None = None,
        on_hang: str = "stop",
        started_at: float | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.script = script  # the ddpnb.Script that runs
        self.config = config  # its TrainConfig when it is ddpnb's worker, else None
        self.topology = topology
        self.backend = backend
        self.log_paths = {
            n: self.run_dir / "logs" / f"node-{n}.log" for n in range(topology.nnodes)
        }
        self._log_start = {n: _size(p) for n, p in self.log_paths.items()}
        self.progress_mode = progress
        self.started_at = started_at or time.time()
        self.ended_at: float | None = None
        self.error: BaseException | None = None
        self._ended = False
        self.hang_timeout, self.on_hang = hang_timeout, on_hang
        self.waiting: Verdict | None = None  # the hang watch's latest verdict, when not "ok"
        self._watched = 0.0  # when the hang watch last looked
        self._ranks: list = []  # what it saw (ddpnb.hang.RankState per rank)
        self._output: tuple = ()  # the node logs' sizes and the progress file's time, last seen
        self._output_moved = time.time()
        _live_jobs.add(self)

    # torchrun's names, read from the topology
    nnodes = property(lambda self: self.topology.nnodes)
    nproc_per_node = property(lambda self: self.topology.nproc_per_node)
    world_size = property(lambda self: self.topology.world_size)
    # A Slurm job's first node is known once it runs.
    master_addr = property(lambda self: self.backend.master_addr or self.topology.master_addr)
    master_port = property(lambda self: self.topology.master_port)
    rdzv_timeout = property(lambda self: self.topology.rdzv_timeout)
    max_restarts = property(lambda self: self.topology.max_restarts)
    hosts = property(lambda self: self.backend.hosts)
    procs = property(lambda self: self.backend.procs)
    # A scheduler's (Slurm): the job's id, its state ("PENDING", "RUNNING", ...); else None.
    job_id = property(lambda self: self.backend.job_id)
    state = property(lambda self: self.backend.state)

    def batch_log(self) -> Path | None:
        """A Slurm job's batch script output (``logs/slurm-<job id>.out``); else None."""
        return self.backend.batch_log()

    # -- state -------------------------------------------------------------------

    @property
    def metrics(self) -> RunMetrics:
        """The run's gathered metrics (re-read on every access)."""
        return load_metrics(self.run_dir)

    @property
    def epochs(self) -> int | None:
        """How many epochs the run trains, when it says (the worker's config, or its reports)."""
        if self.config is not None:
            return self.config.epochs
        return read_progress(self.run_dir).get("epochs")

    @property
    def returncodes(self) -> dict[int, int | None]:
        return self.backend.poll()

    @property
    def running(self) -> bool:
        return any(rc is None for rc in self.returncodes.values())

    def node_status(self) -> dict[int, str]:
        """``pending``, ``starting``, ``running``, ``done``, ``failed`` or ``stopped`` per node."""
        waiting = self.backend.pending()
        if waiting:
            return dict.fromkeys(range(self.nnodes), waiting)
        since = self.backend.since() or self.started_at
        joined = read_progress(self.run_dir).get("time", 0) >= since - 1
        codes = self.returncodes
        out = {}
        for n in range(self.nnodes):
            rc = codes.get(n, "external")
            if rc == "external":
                out[n] = "running" if joined else "external"
            elif rc is None and self.waiting is not None and self.waiting.kind == "hang":
                out[n] = "hung"
            elif rc is None:
                out[n] = "running" if joined or self._worker_output(n) else "starting"
            elif rc == 0:
                out[n] = "done"
            else:
                out[n] = "stopped" if isinstance(self.error, KeyboardInterrupt) else "failed"
        return out

    def _worker_output(self, node: int) -> bool:
        """True once a worker of ``node`` has printed a line in this launch."""
        try:
            with open(self.log_paths[node], "rb") as f:
                f.seek(self._log_start[node])
                return bool(WORKER_LINE.search(f.read()))
        except OSError:
            return False

    def last_line(self, node: int) -> str:
        """The node's last worker line (``[rankN] ...``); before any, torchrun's last line.

        A stopped torchrun prints its own traceback last (``SignalException``...): what the
        workers said before it is what a reader wants to see.
        """
        lines = [ln.strip() for ln in log_tail(self.run_dir, node, 60).splitlines()]
        lines = [ln for ln in lines if ln and not ln.startswith("$ ")]
        workers = [ln for ln in lines if WORKER_LINE.match(ln.encode())]
        if not workers and TRACEBACK in lines:  # what torchrun said before its traceback
            lines = lines[: lines.index(TRACEBACK)]
        return (workers or lines or [""])[-1]

    def log_tail(self, node: int = 0, lines: int = 20) -> str:
        """The last ``lines`` lines of a node's log."""
        return log_tail(self.run_dir, node, lines)

    def pids(self) -> list[int]:
        """PIDs of this run's processes on this machine that are still alive."""
        return self.backend.pids()

    def node_steps(self) -> dict[int, int]:
        """Optimizer steps per node so far (its first rank's), as the hang watch saw them."""
        out: dict[int, int] = {}
        for r in self._ranks:
            out.setdefault(r.node, r.steps)
        return out

    def stacks(self) -> Stacks:
        """Where every rank is now: the user's line and what it waits in, torch's frames folded.

        Read from the snapshots each worker writes every few seconds (``ddpnb.watch``), on
        any backend. Raises :class:`~ddpnb.errors.RunDirError` when the run has ended or
        the watch is off (``hang_timeout=None``), :class:`~ddpnb.errors.HostError` when a
        host cannot be reached.

        Example
        -------
        >>> print(job.stacks())   # doctest: +SKIP
        rank 0 waits in barrier at train.py:21 (dist.barrier())  [node 0 on gpu1, pid 4242]
        """
        self.backend.sync()
        self.backend.sync_stacks(True)
        return stacks(self.run_dir, self.hang_timeout or HANG_DEFAULT)

    # -- control -------------------------------------------------------------------

    def stop(self) -> None:
        """Stop every process of the run, wherever it runs."""
        self.backend.stop()
        self._end()

    def _end(self) -> None:
        self.ended_at = self.ended_at or time.time()
        _live_jobs.discard(self)
        if not self._ended:
            self._ended = True
            self.backend.fetch()

    def wait(self, timeout: float | None = None) -> Job:
        """Follow the run to its end, showing progress; return self.

        Raises :class:`WorkerFailed` (with host, node, rank, exit code and traceback)
        when a worker fails, :class:`RendezvousTimeout` when the nodes do not all join,
        and stops every process on KeyboardInterrupt before re-raising it.
        ``timeout`` (seconds) raises TimeoutError and leaves the run going.
        """
        display = make_progress(self.progress_mode, self)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._finished():
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(
                        f"The run did not finish within {timeout} s (still running); "
                        "wait() again, or stop() it."
                    )
                time.sleep(POLL_SECONDS)
                self.backend.sync()
                display.update()
        except KeyboardInterrupt as e:
            self.error = e
            self.stop()
            display.close(self)
            if type(e) is not KeyboardInterrupt:
                raise  # a signal the CLI names (SIGTERM, SIGHUP)
            raise RunInterrupted(self.run_dir, len(self.metrics.epochs)) from None
        if self.error is not None:
            self.stop()
        self._end()
        display.close(self)
        if self.error:
            raise self.error
        return self

    def _finished(self) -> bool:
        """True once every node ended, or one failed (self.error then says how)."""
        codes = self.returncodes
        failed = {n: rc for n, rc in codes.items() if rc not in (None, 0)}
        if failed:
            self.error = self._failure(failed)
            return True
        if codes and all(rc == 0 for rc in codes.values()):
            return True
        if self.backend.pending() is None:
            self.error = self._watch_hang()
        if self.error is None and self.backend.watch_stalls and self.backend.pending() is None:
            self.error = self._check_stalled()
        return self.error is not None

    # -- failures ---------------------------------------------------------------------

    def _watch_hang(self) -> RunFailed | None:
        """RunHung when no rank has moved for hang_timeout and they all wait in collectives."""
        now = time.time()
        if self.hang_timeout is None or now - self._watched < WATCH_SECONDS:
            return None
        self._watched = now
        self.backend.sync_stacks(False)
        ranks = self._ranks = read_ranks(self.run_dir, since=self.started_at)
        live = [r.still for r in ranks if r.state == "running"]
        if not live:
            self.waiting = None
            return None
        quiet = min(min(live), now - self._quiet_floor())
        found = verdict(ranks, quiet, self._hang_limit())
        self.waiting = found if found.kind != "ok" else None
        if found.kind != "hang" or self.on_hang != "stop":
            return None
        if found.cause == "same" and self.config is not None:
            # ddpnb's worker gives its collectives a timeout of its own (timeout_seconds):
            # when it ends them, the diagnosis names the node that stopped answering.
            return None
        first = next(r for r in ranks if r.state == "running")
        return RunHung(
            f"The run hangs. {found.message} The run was stopped (on_hang='stop'; on_hang='wait' keeps it "
            f"waiting).{resume_hint(self.run_dir)}",
            stacks=Stacks(self.run_dir, ranks, found),
            host=None if self.hosts is None else self.hosts[first.node],
            node_rank=first.node,
            global_rank=first.rank,
        )

    def _hang_limit(self) -> float:
        """hang_timeout; for ddpnb's worker at most half its own collective timeout, so that
        the hang is named before gloo's timeout ends the run with a bare 'Timed out'."""
        limit = self.hang_timeout or HANG_DEFAULT
        if self.config is not None:
            limit = min(limit, self.config.timeout_seconds / 2)
        return limit

    def _quiet_floor(self) -> float:
        """When the run last printed a line or reported progress (output counts as progress)."""
        seen = (
            tuple(_size(p) for p in self.log_paths.values()),
            read_progress(self.run_dir).get("time"),
        )
        if seen != self._output:
            self._output, self._output_moved = seen, time.time()
        return self._output_moved

    def _check_stalled(self) -> RunFailed | None:
        if self.config is None and not read_progress(self.run_dir):
            return None  # a script that does not report: torchrun's own timeouts apply
        timeout = self.config.timeout_seconds if self.config is not None else 300
        return check_stalled(
            self.run_dir, self.topology, list(self.returncodes), self.started_at, timeout
        )

    def _failure(self, failed: dict[int, int]) -> RunFailed:
        time.sleep(0.5)  # give the other agents a moment to write their error files
        self.backend.fetch()  # error files and logs of hosts without a shared filesystem
        error = diagnose_failure(
            self.run_dir, self.topology, list(self.returncodes), failed, self.started_at
        )
        return self.backend.explain(error, failed)

    def __repr__(self) -> str:
        state = "running" if self.running else "finished"
        return f"<ddpnb.Job {self.run_dir} {self.nnodes}x{self.nproc_per_node} {state}>"


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0
