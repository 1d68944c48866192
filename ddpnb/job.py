"""A launched run, followed, stopped and diagnosed here; each :class:`Scheduler` runs its nodes."""

from __future__ import annotations

import atexit
import dataclasses
import re
import time
import warnings
import weakref
from contextlib import suppress
from pathlib import Path
from typing import Any

from .diagnosis import check_stalled, diagnose_failure, died_after_end, log_tail, resume_hint
from .errors import RunFailed, RunHung, RunInterrupted
from .hang import Stacks, Verdict, read_ranks, stacks, verdict
from .metrics import load_metrics, read_progress
from .plan import HANG_TIMEOUT
from .progress import make_progress
from .scheduler import Scheduler
from .topology import Topology

POLL_SECONDS = 0.2
WATCH_SECONDS = 1.0  # how often the hang watch reads the ranks' snapshots
EXIT_GRACE_SECONDS = 10.0  # for the other ranks' records at exit, once one died after its own
WORKER_LINE = re.compile(rb"^\[rank\d+\]", re.M)  # torchrun's prefix on a worker's output
TRACEBACK = "Traceback (most recent call last):"


_live_jobs: weakref.WeakSet[Job] = weakref.WeakSet()


@atexit.register
def _stop_live_jobs() -> None:  # a kernel restart must not leave workers behind
    for job in list(_live_jobs):
        if not job.scheduler.outlives_launcher:  # a Slurm job does
            job.stop()


@dataclasses.dataclass(eq=False)  # eq=False: hashable, for _live_jobs
class Job:
    """A launched run (:func:`ddpnb.launch`, :func:`ddpnb.submit_slurm`): nodes, files, metrics."""

    run_dir: Path
    script: Any
    config: Any  # None unless it is ddpnb's worker
    topology: Topology
    scheduler: Scheduler
    _: dataclasses.KW_ONLY
    progress: str = "none"
    hang_timeout: float | None = None
    on_hang: str = "stop"
    started_at: float | None = None

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        self.log_paths = {n: self.run_dir / "logs" / f"node-{n}.log" for n in range(self.nnodes)}
        self._log_start = {n: _size(p) for n, p in self.log_paths.items()}
        self.started_at = self.started_at or time.time()
        self.ended_at: float | None = None
        self.error: BaseException | None = None
        self.warnings: list[str] = []  # what went wrong without failing the run
        self.waiting: Verdict | None = None
        self._watched = 0.0
        self._ranks: list = []  # ddpnb.hang.RankState per rank
        self._output: tuple = ()  # the node logs' sizes and the progress file's time
        self._output_moved = time.time()
        self._failed_at: float | None = None  # when a node was first seen failed
        _live_jobs.add(self)

    nnodes = property(lambda self: self.topology.nnodes)
    nproc_per_node = property(lambda self: self.topology.nproc_per_node)
    world_size = property(lambda self: self.topology.world_size)
    # A Slurm job's first node and port are the cluster's, named once it runs.
    master_addr = property(lambda self: self.topology.master_addr or self.scheduler.master_addr)
    master_port = property(lambda self: self.topology.master_port or self.scheduler.master_port)
    rdzv_timeout = property(lambda self: self.topology.rdzv_timeout)
    max_restarts = property(lambda self: self.topology.max_restarts)
    host = property(lambda self: self.scheduler.host)  # job.host(node): where it runs, as named
    pids = property(lambda self: self.scheduler.pids)  # job.pids(): its live processes here
    returncodes = property(lambda self: self.scheduler.poll())  # per node; None: running
    running = property(lambda self: any(rc is None for rc in self.returncodes.values()))
    metrics = property(lambda self: load_metrics(self.run_dir))  # RunMetrics, re-read each time

    @property
    def epochs(self) -> int | None:
        """How many epochs the run trains, when it says."""
        return self.config.epochs if self.config else read_progress(self.run_dir).get("epochs")

    def node_status(self) -> dict[int, str]:
        """``pending``, ``starting``, ``running``, ``waiting``, ``hung``, ``done``, ``failed`` or
        ``stopped`` per node (``waiting``: every rank of it waits in a collective)."""
        if waiting := self.scheduler.pending():
            return dict.fromkeys(range(self.nnodes), waiting)
        since = self.scheduler.since() or self.started_at
        joined = read_progress(self.run_dir).get("time", 0) >= since - 1
        codes = self.returncodes
        hung = self.waiting is not None and self.waiting.kind == "hang"
        waits = self._waiting_nodes()
        ended = "stopped" if isinstance(self.error, KeyboardInterrupt) else "failed"
        out = {}
        for n in range(self.nnodes):
            if n not in codes:  # started elsewhere (local_nodes): seen in the progress file only
                out[n] = "running" if joined else "external"
            elif codes[n] is not None:
                out[n] = "done" if codes[n] == 0 else ended
            else:
                state = "running" if joined or self._worker_output(n) else "starting"
                out[n] = "hung" if hung else "waiting" if n in waits else state
        return out

    def _waiting_nodes(self) -> set[int]:
        """The nodes whose every live rank waits, while the hang watch says ranks wait."""
        if self.waiting is None or self.waiting.kind not in ("waiting", "slow"):
            return set()
        live = [r for r in self._ranks if r.state == "running"]
        return {r.node for r in live if r.waits} - {r.node for r in live if not r.waits}

    def _worker_output(self, node: int) -> bool:
        with suppress(OSError), open(self.log_paths[node], "rb") as f:
            f.seek(self._log_start[node])
            return bool(WORKER_LINE.search(f.read()))
        return False

    def last_line(self, node: int) -> str:
        """The node's last worker line (``[rankN] ...``); before any, torchrun's last line."""
        lines = [ln.strip() for ln in log_tail(self.run_dir, node, 60).splitlines()]
        lines = [ln for ln in lines if ln and not ln.startswith("$ ")]
        workers = [ln for ln in lines if WORKER_LINE.match(ln.encode())]
        if not workers and TRACEBACK in lines:  # a stopped torchrun's own traceback comes last
            lines = lines[: lines.index(TRACEBACK)]
        return (workers or lines or [""])[-1]

    def log_tail(self, node: int = 0, lines: int = 20) -> str:
        return log_tail(self.run_dir, node, lines)

    def steps(self) -> int | None:
        """The run's optimizer steps so far (None before the watch's first snapshot): the most
        any rank made. DDP's ranks step together; each count is from its rank's last snapshot
        (every 2 s, not at the same moment), so per rank they would seem to differ."""
        return max((r.steps for r in self._ranks), default=None)

    def stacks(self) -> Stacks:
        """Where every rank is now: the user's line and what it waits in, torch's frames folded
        (RunDirError once the run has ended, or with the watch off: ``hang_timeout=None``)."""
        self.scheduler.sync()
        self.scheduler.sync_stacks(True)
        return stacks(self.run_dir, self.hang_timeout or HANG_TIMEOUT)

    def stop(self) -> None:
        """Stop every process of the run, wherever it runs."""
        self.scheduler.stop()
        self._end()

    def _end(self) -> None:
        _live_jobs.discard(self)
        if self.ended_at is None:
            self.ended_at = time.time()
            self.scheduler.fetch()

    def wait(self, timeout: float | None = None) -> Job:
        """Follow the run to its end, showing progress; return self.

        Raises :class:`WorkerFailed` or :class:`RendezvousTimeout` on failure; stops every
        process on KeyboardInterrupt. ``timeout`` (seconds): TimeoutError, the run going on."""
        display = make_progress(self.progress, self)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while not self._finished():
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(
                        f"The run did not finish within {timeout} s (still running); "
                        "wait() again, or stop() it."
                    )
                time.sleep(POLL_SECONDS)
                self.scheduler.sync()
                display.update()
        except KeyboardInterrupt as e:  # or a signal the CLI names (SIGTERM, SIGHUP)
            self.error = e
        if self.error is not None:
            self.stop()
        self._end()
        display.close(self)
        if type(self.error) is KeyboardInterrupt:
            raise RunInterrupted(self.run_dir, len(self.metrics.epochs)) from None
        if self.error:
            raise self.error
        return self

    def _finished(self) -> bool:
        """True once every node ended, or one failed (then self.error is set)."""
        codes = self.returncodes
        if failed := {n: rc for n, rc in codes.items() if rc not in (None, 0)}:
            time.sleep(0.5)  # give the other agents a moment to write their error files
            self.scheduler.fetch()
            self.scheduler.sync_stacks(False)
            note = died_after_end(self.run_dir, self.topology, [*codes], self.started_at)
            # The ranks that died had ended their scripts: the others' records at exit decide.
            self._failed_at = self._failed_at or time.monotonic()
            waited = time.monotonic() - self._failed_at
            if note is None and None in codes.values() and waited < EXIT_GRACE_SECONDS:
                return False
            if note:
                if None in codes.values():  # their ranks ended: torchrun waits for the lost agent
                    self.scheduler.stop()
                self.warnings.append(note)
                warnings.warn(note, RuntimeWarning, stacklevel=5)
                return True
            error = diagnose_failure(self.run_dir, self._met(), [*codes], failed, self.started_at)
            self.error = self.scheduler.explain(error, failed)
        elif codes and all(rc == 0 for rc in codes.values()):
            return True
        elif self.scheduler.pending() is None:
            self.error = self._watch_hang() or self._check_stalled([*codes])
        return self.error is not None

    def _watch_hang(self) -> RunFailed | None:
        """RunHung when no rank has moved for hang_timeout and they all wait in collectives."""
        now = time.time()
        if self.hang_timeout is None or now - self._watched < WATCH_SECONDS:
            return None
        self._watched = now
        self.scheduler.sync_stacks(False)
        ranks = self._ranks = read_ranks(self.run_dir, since=self.started_at)
        live = [r for r in ranks if r.state == "running"]
        self.waiting = None
        if not live:
            return None
        # The quiet time: since the run last printed a line or reported progress.
        seen = (*map(_size, self.log_paths.values()), read_progress(self.run_dir).get("time"))
        if seen != self._output:
            self._output, self._output_moved = seen, now
        limit = self.hang_timeout
        if self.config is not None:  # named before gloo ends the run with a bare 'Timed out'
            limit = min(limit, self.config.timeout_seconds / 2)
        # A rank that computes (its main thread's CPU time advances) is not quiet.
        found = verdict(ranks, min(*(r.idle for r in live), now - self._output_moved), limit)
        self.waiting = found if found.kind != "ok" else None
        # ddpnb's worker times out its own collectives: the diagnosis then names the node.
        worker_names_it = found.cause == "same" and self.config is not None
        if found.kind != "hang" or self.on_hang != "stop" or worker_names_it:
            return None
        return RunHung(
            f"The run hangs. {found.message} The run was stopped (on_hang='stop'; on_hang='wait' "
            f"keeps it waiting).{resume_hint(self.run_dir)}",
            stacks=Stacks(self.run_dir, ranks, found),
            host=self.scheduler.host(live[0].node),
            node_rank=live[0].node,
            global_rank=live[0].rank,
        )

    def _check_stalled(self, nodes: list[int]) -> RunFailed | None:
        # Not while queued, nor for a script that does not report (torchrun's timeouts apply).
        if not self.scheduler.watch_stalls or not (self.config or read_progress(self.run_dir)):
            return None
        timeout = self.config.timeout_seconds if self.config is not None else 300
        return check_stalled(self.run_dir, self._met(), nodes, self.started_at, timeout)

    def _met(self) -> Topology:  # the topology with where the nodes met, once a cluster named it
        addr = self.master_addr or "its first node"
        return dataclasses.replace(self.topology, master_addr=addr, master_port=self.master_port)

    def __repr__(self) -> str:
        state = "running" if self.running else "finished"
        return f"<ddpnb.Job {self.run_dir} {self.nnodes}x{self.nproc_per_node} {state}>"


def _size(path: Path) -> int:
    with suppress(OSError):
        return path.stat().st_size
    return 0
