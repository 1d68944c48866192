"""Launching a run: one ``torchrun`` per node, followed until it ends or fails.

The kernel never joins the process group: it starts each node's torchrun agent as a
fresh process (no fork), from an explicit copy of the environment, and watches the
files the workers write.
"""

from __future__ import annotations

import atexit
import os
import shlex
import signal
import subprocess
import sys
import time
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .agent import LIFELINE_ENV, descendants
from .config import TrainConfig
from .constants import threads_for_host
from .diagnosis import check_stalled, diagnose_failure, log_tail
from .errors import LaunchError, RunFailed
from .log import logger
from .metrics import RunMetrics, load_metrics, read_progress
from .preflight import check_launch, warn_if_cuda_initialised, warn_pitfalls
from .progress import make_progress
from .rundir import WORKER_NAME, prepare_run_dir, write_worker
from .topology import Topology

AGENT = Path(__file__).with_name("agent.py")
POLL_SECONDS = 0.2
STOP_GRACE_SECONDS = 4.0


# -- the running job ------------------------------------------------------------------


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


def _open_lifeline() -> tuple[int, int]:
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


def _close_lifeline(fd: int) -> None:
    _lifelines.discard(fd)
    try:
        os.close(fd)
    except OSError:
        pass


def _close_lifelines_in_child() -> None:
    for fd in list(_lifelines):
        _close_lifeline(fd)


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
        """Stop every process of the run: SIGTERM, then SIGKILL after a short grace."""
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

    def _cut_lifeline(self) -> None:
        if self._lifeline is not None:
            _close_lifeline(self._lifeline)
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
        return diagnose_failure(
            self.run_dir, self.topology, list(self.procs), failed, self.started_at
        )

    def __repr__(self) -> str:
        state = "running" if self.running else "finished"
        return f"<ddpnb.Job {self.run_dir} {self.nnodes}x{self.nproc_per_node} {state}>"


# -- the public entry points ---------------------------------------------------------------


def launch(
    config: TrainConfig | Mapping[str, Any],
    run_dir: str | os.PathLike,
    nnodes: int = 2,
    nproc_per_node: int = 1,
    master_addr: str = "127.0.0.1",
    master_port: int | None = None,
    max_restarts: int = 0,
    rdzv_timeout: int = 60,
    wait: bool = True,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: str = "auto",
    local_nodes: Iterable[int] | None = None,
    env: Mapping[str, str] | None = None,
) -> Job:
    """Train with DDP: write the worker, start one ``torchrun`` per node, follow it.

    Node 0 is the master and hosts the rendezvous at ``master_addr:master_port``. On
    one machine the nodes are simulated on loopback and the host's cores are split
    over all their processes. ``local_nodes`` limits which nodes start here (the
    others run :func:`node_commands` on their own hosts). Everything is validated
    before any process starts.

    Returns a :class:`Job` (already finished when ``wait``); raises
    :class:`~ddpnb.errors.WorkerFailed` if a worker fails.

    Example
    -------
    >>> job = launch(TrainConfig(data_dir="data/digits"), "runs/ddp", nnodes=2)   # doctest: +SKIP
    >>> job.metrics.final["val_acc"]                                              # doctest: +SKIP
    0.97
    """
    config, topology, nodes = check_launch(
        config,
        nnodes=nnodes,
        nproc_per_node=nproc_per_node,
        master_addr=master_addr,
        master_port=master_port,
        max_restarts=max_restarts,
        rdzv_timeout=rdzv_timeout,
        local_nodes=local_nodes,
        progress=progress,
    )
    run_dir = prepare_run_dir(config, run_dir, resume=resume, overwrite=overwrite).resolve()
    warn_if_cuda_initialised()
    write_worker(config, run_dir)
    (run_dir / "logs").mkdir(exist_ok=True)
    warn_pitfalls(config)
    logger.info(
        "launching %d node(s) x %d process(es); node 0 is the master and hosts the rendezvous at %s:%d",
        nnodes,
        nproc_per_node,
        topology.master_addr,
        topology.master_port,
    )
    # The run's lifetime is tied to this process: when it ends, however it ends, the
    # pipe's write end closes and every agent stops its node (see agent.watch_lifeline).
    lifeline_read, lifeline = _open_lifeline()
    child_env = _agent_env(config, len(nodes) * nproc_per_node, env)
    child_env[LIFELINE_ENV] = str(lifeline_read)
    procs: dict[int, subprocess.Popen] = {}
    try:
        for n in nodes:
            procs[n] = _start_agent(run_dir, topology, n, child_env, lifeline_read)
    except BaseException as e:  # an OSError, or Ctrl-C/SIGTERM before the Job exists
        for proc in procs.values():
            os.killpg(proc.pid, signal.SIGKILL)  # nothing to save yet; its workers see EOF too
        _close_lifeline(lifeline)
        if isinstance(e, OSError):
            raise LaunchError(f"Could not start torchrun: {e}") from e
        raise
    finally:
        os.close(lifeline_read)  # the agents hold it now
    job = Job(run_dir, config, procs, topology, progress=progress, lifeline=lifeline)
    return job.wait() if wait else job


def _agent_env(
    config: TrainConfig, procs_on_host: int, extra: Mapping[str, str] | None
) -> dict[str, str]:
    """The agents' environment: a copy of ours (never modified) plus the thread budget."""
    env = dict(os.environ)
    env.update(
        {
            "DDPNB_PROCS_ON_HOST": str(procs_on_host),
            "OMP_NUM_THREADS": str(config.threads or threads_for_host(procs_on_host)),
            "PYTHONUNBUFFERED": "1",
            "DDPNB_LAUNCHED": "1",
        }
    )
    if not config.thread_budget:  # pitfall: torch's default, one thread per core per process
        del env["OMP_NUM_THREADS"]
    env.update(extra or {})
    return env


def _start_agent(
    run_dir: Path, topology: Topology, node: int, env: dict[str, str], lifeline_read: int
) -> subprocess.Popen:
    """Start node ``node``'s torchrun agent, its output appended to ``logs/node-N.log``."""
    cmd = [
        sys.executable,
        str(AGENT),  # torchrun; binds a loopback rendezvous to loopback only
        *topology.torchrun_args(node, log_dir=str(run_dir / "logs" / f"node-{node}")),
        str(run_dir / WORKER_NAME),
        "--config",
        str(run_dir / "config.json"),
    ]
    with open(run_dir / "logs" / f"node-{node}.log", "ab") as log_file:
        log_file.write(f"$ {shlex.join(cmd)}\n".encode())
        log_file.flush()
        return subprocess.Popen(
            cmd,
            cwd=run_dir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: we stop it as a whole
            pass_fds=(lifeline_read,),
        )


def train_single(
    config: TrainConfig | Mapping[str, Any], run_dir: str | os.PathLike, **kwargs: Any
) -> Job:
    """Run the worker as one process (``torchrun --nnodes 1 --nproc_per_node 1``).

    The single-node baseline; takes :func:`launch`'s keyword arguments.

    Example
    -------
    >>> job = train_single(TrainConfig(data_dir="data/digits"), "runs/baseline")  # doctest: +SKIP
    >>> job.metrics.final["val_acc"] > 0.9                                          # doctest: +SKIP
    True
    """
    return launch(config, run_dir, nnodes=1, nproc_per_node=1, **kwargs)
