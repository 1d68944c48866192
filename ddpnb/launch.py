"""Launching a run: one ``torchrun`` per node, followed until it ends or fails.

The kernel never joins the process group: it starts each node's torchrun agent as a
fresh process (no fork), from an explicit copy of the environment, and watches the
files the workers write.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import warnings
import weakref
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from .agent import LIFELINE_ENV, descendants, loopback_bind_address
from .config import PITFALL_SWITCHES, TrainConfig
from .data import require_valid_dataset
from .errors import (
    ConfigError,
    LaunchError,
    NodeLost,
    PortInUseError,
    RendezvousTimeout,
    WorkerFailed,
)
from .log import logger
from .metrics import RunMetrics, load_metrics, read_progress
from .progress import make_progress
from .rundir import WORKER_NAME, prepare_run_dir, write_worker

AGENT = Path(__file__).with_name("agent.py")
POLL_SECONDS = 0.2
STOP_GRACE_SECONDS = 4.0
# Messages of ranks that failed only because a peer died first.
SECONDARY_ERRORS = (
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out waiting",  # gloo: a peer did not answer within timeout_seconds
    "this node is lost",  # the worker of a killed agent stopping itself
)


# -- validation -------------------------------------------------------------------


def _positive_int(name: str, value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}.")
    return value


def as_config(config: TrainConfig | Mapping[str, Any]) -> TrainConfig:
    """Accept a TrainConfig or a plain dict of its fields."""
    if isinstance(config, TrainConfig):
        return config
    if isinstance(config, Mapping):
        return TrainConfig.from_dict(dict(config))
    raise ConfigError(f"config must be a TrainConfig or a dict, got {type(config).__name__}.")


def check_model(config: TrainConfig) -> None:
    """Raise ConfigError for an unknown model name or unusable weights."""
    import torchvision

    known = torchvision.models.list_models(module=torchvision.models)
    if config.model not in known:
        close = [m for m in known if m.startswith(config.model[:4])][:8]
        raise ConfigError(
            f"Unknown model {config.model!r}. Use a torchvision classification model name"
            + (f", e.g. {', '.join(close)}" if close else ", e.g. resnet18 or resnet50")
            + " (see torchvision.models.list_models())."
        )
    if config.weights is None:
        return
    if config.weights == "DEFAULT":
        _check_default_weights_reachable(config.model)
        return
    path = Path(config.weights)
    if not path.is_file():
        raise ConfigError(
            f"weights file {config.weights!r} does not exist. Pass the path of a saved state dict "
            "(torch.save(model.state_dict(), path)), weights='DEFAULT', or weights=None."
        )
    from .worker import read_state_dict

    try:
        read_state_dict(str(path))
    except ValueError as e:
        raise ConfigError(f"{e} Save it with torch.save(model.state_dict(), path).") from None


def _check_default_weights_reachable(model: str) -> None:
    import torch
    import torchvision

    weights = torchvision.models.get_model_weights(model).DEFAULT
    cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(weights.url).name
    if cached.exists():
        return
    host = re.sub(r"^https?://([^/]+)/.*$", r"\1", weights.url)
    try:
        socket.create_connection((host, 443), timeout=3).close()
    except OSError as e:
        raise ConfigError(
            f"weights='DEFAULT' needs to download {weights.url}, but no network is available "
            f"({e}). Pass weights=None to train from scratch, or the path of a local state-dict "
            f"file (or place the file at {cached})."
        ) from None


def check_batch_size(config: TrainConfig, train_size: int, world_size: int) -> None:
    shard = -(-train_size // world_size)
    if config.batch_size > shard:
        raise ConfigError(
            f"batch_size={config.batch_size} per process is larger than each rank's shard of the "
            f"train split ({train_size} images / world size {world_size} = {shard}). Use "
            f"batch_size <= {shard}, or fewer processes."
        )


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def check_port_free(host: str, port: int) -> None:
    """Raise PortInUseError if ``port`` cannot be bound on ``host``."""
    if not isinstance(port, int) or isinstance(port, bool) or not 1 <= port <= 65535:
        raise ConfigError(f"master_port must be an integer in 1..65535, got {port!r}.")
    with socket.socket() as s:
        # SO_REUSEADDR as the TCPStore sets it: a port in TIME_WAIT is not busy.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise PortInUseError(
                f"master_port {port} on {host} is already in use ({e.strerror}). Pass another "
                "port, or master_port=None to pick a free one."
            ) from None


def warn_if_cuda_initialised() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        warnings.warn(
            "This kernel has initialised CUDA. ddpnb's workers are separate processes and are "
            "not affected, but the kernel holds GPU memory they may need: restart the kernel "
            "and avoid touching CUDA in it before launching.",
            stacklevel=3,
        )


# -- commands ---------------------------------------------------------------------


def torchrun_args(
    *,
    nnodes: int,
    node_rank: int,
    nproc_per_node: int,
    master_addr: str,
    master_port: int,
    max_restarts: int,
    rdzv_timeout: int,
    log_dir: str | None = None,
) -> list[str]:
    """torchrun's options for one node under static rendezvous (node 0 hosts it)."""
    args = [
        f"--nnodes={nnodes}",
        f"--node_rank={node_rank}",
        f"--nproc_per_node={nproc_per_node}",
        f"--master_addr={master_addr}",
        f"--master_port={master_port}",
        f"--max_restarts={max_restarts}",
        f"--rdzv_conf=timeout={rdzv_timeout}",
    ]
    if log_dir:
        args += [f"--log_dir={log_dir}", "--tee=3", "--log_line_prefix_template=[rank${rank}] "]
    return args


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


def _open_lifeline() -> tuple[int, int]:
    """A pipe (read, write): the agents get the read end, only this process the write end.

    Both ends are non-inheritable, so no other child of this process holds the write
    end; a forked child closes its copies, so it cannot keep a run alive either.
    """
    if not _lifelines:
        os.register_at_fork(after_in_child=_close_lifelines_in_child)
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
        log_paths: dict[int, Path],
        *,
        nnodes: int,
        nproc_per_node: int,
        master_addr: str,
        master_port: int,
        rdzv_timeout: int,
        max_restarts: int,
        progress: str,
        lifeline: int | None = None,
    ) -> None:
        self.run_dir = run_dir
        self.config = config
        self.procs = procs
        self.log_paths = log_paths
        self.nnodes = nnodes
        self.nproc_per_node = nproc_per_node
        self.world_size = nnodes * nproc_per_node
        self.master_addr = master_addr
        self.master_port = master_port
        self.rdzv_timeout = rdzv_timeout
        self.max_restarts = max_restarts
        self.progress_mode = progress
        self.started_at = time.time()
        self.ended_at: float | None = None
        self.error: BaseException | None = None
        self._known_pids: set[int] = set()
        self._lifeline = lifeline  # write end of the pipe the agents watch
        _live_jobs.add(self)

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
        try:
            text = self.log_paths[node].read_text(errors="replace")
        except (KeyError, OSError):
            return ""
        return "\n".join(text.splitlines()[-lines:])

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

    def _missing_nodes_hint(self) -> str:
        missing = [n for n in range(self.nnodes) if n not in self.procs]
        if not missing:
            return ""
        return (
            f" Nodes {missing} are not started by this launch: run their commands "
            "(ddpnb.node_commands) on their hosts."
        )

    def _check_stalled(self) -> WorkerFailed | None:
        progress = read_progress(self.run_dir)
        now = time.time()
        if not progress or progress.get("time", 0) < self.started_at:
            limit = self.rdzv_timeout + 30
            if now - self.started_at > limit:
                hint = self._missing_nodes_hint()
                return RendezvousTimeout(
                    f"The rendezvous at {self.master_addr}:{self.master_port} did not complete "
                    f"within {limit} s: not all {self.nnodes} nodes joined.{hint} Check that every "
                    "node can reach master_addr:master_port and uses the same --nnodes.",
                    log_tail=self.log_tail(0),
                )
            return None
        quiet = now - progress.get("time", now)
        limit = self.config.timeout_seconds + 30
        if progress.get("phase") != "done" and quiet > limit:
            return RendezvousTimeout(
                f"Rank 0 has reported no progress for {quiet:.0f} s (limit: timeout_seconds + 30 = "
                f"{limit} s): a node or rank stopped answering. See the node logs in "
                f"{self.run_dir / 'logs'}.{self._resume_hint()}",
                log_tail=self.log_tail(0),
            )
        return None

    def _resume_hint(self) -> str:
        if not (self.run_dir / "checkpoints" / "last.pt").exists():
            return ""
        done = len(self.metrics.epochs)
        return (
            f" The checkpoint {self.run_dir / 'checkpoints' / 'last.pt'} holds the finished "
            f"epochs ({done} recorded): relaunch with resume=True to continue from it."
        )

    def _lost_node(self, failed: dict[int, int], errors: list) -> NodeLost | None:
        """A NodeLost when no worker failed on its own: a peer vanished under them."""
        if any(not secondary for (secondary, _), *_ in errors):
            return None
        if read_progress(self.run_dir).get("time", 0) < self.started_at:
            return None  # the nodes never all joined: a rendezvous problem, not a lost node
        killed = sorted(n for n, rc in failed.items() if rc < 0)  # agent ended by a signal
        unwatched = [n for n in range(self.nnodes) if n not in self.procs]
        suspects = killed or (unwatched if errors else [])
        if not suspects:
            return None
        if killed:
            sig = signal.Signals(-failed[killed[0]]).name
            what = f"Node {killed[0]} was lost: its torchrun agent was killed ({sig})"
        else:
            what = "A node or rank stopped answering (crashed, killed, or the network was cut)"
            if unwatched:
                what += f"; nodes {unwatched} run elsewhere: check them first"
        if errors:
            _, node, rank, info = min(errors, key=lambda e: e[0])
            what += f". Worker global rank {rank} on node {node} saw: {info['message'].rstrip('.')}"
        return NodeLost(
            f"{what}. The other nodes were stopped.{self._resume_hint()}",
            node_rank=suspects[0] if len(suspects) == 1 else None,
            log_tail=self.log_tail(min(failed), 20),
        )

    def _failure(self, failed: dict[int, int]) -> WorkerFailed:
        # Give the other agents a moment to write their error files, then pick the root
        # cause: peers that lost their connection to a dead rank fail later and say so.
        time.sleep(0.5)
        errors = []
        for node in self.procs:
            for path in (self.run_dir / "logs" / f"node-{node}").glob("*/attempt_*/*/error.json"):
                info = _read_error_file(path)
                if info:
                    rank = node * self.nproc_per_node + int(path.parent.name)
                    secondary = any(w in info["message"] for w in SECONDARY_ERRORS)
                    errors.append(((secondary, path.stat().st_mtime), node, rank, info))
        node = min(failed)
        tail = self.log_tail(node, 200)
        lost = self._lost_node(failed, errors)
        if lost is not None:
            return lost
        if errors:
            _, node, rank, info = min(errors, key=lambda e: e[0])
            exit_code = _worker_exit_code(self.log_tail(node, 200), rank)
            return WorkerFailed(
                f"Worker global rank {rank} on node {node} failed (exit code {exit_code}): "
                f"{info['message']}. The other nodes were stopped.",
                node_rank=node,
                global_rank=rank,
                exit_code=exit_code,
                traceback=info["traceback"],
                log_tail=self.log_tail(node),
            )
        joined = re.search(r"Timed out after \d+ seconds waiting for clients\. (\d+)/(\d+)", tail)
        if joined or "RendezvousTimeoutError" in tail:
            counted = f" ({joined.group(1)} of {joined.group(2)} nodes joined)" if joined else ""
            hint = self._missing_nodes_hint()
            return RendezvousTimeout(
                f"The rendezvous at {self.master_addr}:{self.master_port} timed out after "
                f"{self.rdzv_timeout} s{counted}: not all {self.nnodes} nodes joined.{hint} "
                "Check that every node can reach master_addr:master_port and uses the same "
                "nnodes. The other nodes were stopped.",
                node_rank=node,
                exit_code=failed[node],
                log_tail=self.log_tail(node, 5),
            )
        rank = _first_failed_rank(tail)
        exit_code = _worker_exit_code(tail, rank) if rank is not None else failed[node]
        return WorkerFailed(
            f"Node {node}'s torchrun exited with code {failed[node]}"
            + (f" (worker global rank {rank}, exit code {exit_code})" if rank is not None else "")
            + ". The other nodes were stopped.",
            node_rank=node,
            global_rank=rank,
            exit_code=exit_code,
            log_tail=self.log_tail(node, 40),
        )

    def __repr__(self) -> str:
        state = "running" if self.running else "finished"
        return f"<ddpnb.Job {self.run_dir} {self.nnodes}x{self.nproc_per_node} {state}>"


def _read_error_file(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    msg = data.get("message", {})
    if isinstance(msg, str):
        return {"message": msg, "traceback": "", "timestamp": 0}
    extra = msg.get("extraInfo", {})
    return {
        "message": msg.get("message", "").strip(),
        "traceback": extra.get("py_callstack", ""),
        "timestamp": int(extra.get("timestamp", 0) or 0),
    }


def _first_failed_rank(text: str) -> int | None:
    m = re.search(r"^\s*rank\s*:\s*(\d+) \(local_rank", text, re.M)
    return int(m.group(1)) if m else None


def _worker_exit_code(text: str, rank: int | None) -> int | None:
    # torchrun's failure summary: "rank : 1 (local_rank: 0)" then "exitcode : 1 (pid: ...)".
    pattern = r"^\s*rank\s*:\s*(\d+) \(local_rank.*\n\s*exitcode\s*:\s*(-?\d+)"
    for m in re.finditer(pattern, text, re.M):
        if rank is None or int(m.group(1)) == rank:
            return int(m.group(2))
    return None


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
    config = as_config(config)
    _positive_int("nnodes", nnodes)
    _positive_int("nproc_per_node", nproc_per_node)
    _positive_int("rdzv_timeout", rdzv_timeout)
    if not isinstance(max_restarts, int) or isinstance(max_restarts, bool) or max_restarts < 0:
        raise ConfigError(f"max_restarts must be an integer >= 0, got {max_restarts!r}.")
    nodes = sorted(set(range(nnodes) if local_nodes is None else local_nodes))
    for n in nodes:
        if not isinstance(n, int) or not 0 <= n < nnodes:
            raise ConfigError(f"node_rank {n!r} must be in 0..{nnodes - 1} (node_rank < nnodes).")
    if progress not in ("auto", "widgets", "text", "none"):
        raise ConfigError("progress must be 'auto', 'widgets', 'text' or 'none'.")
    data_dir = Path(config.data_dir).resolve()
    summary = require_valid_dataset(data_dir)
    config = config.replace(data_dir=str(data_dir))
    world_size = nnodes * nproc_per_node
    check_batch_size(config, summary.split_size("train"), world_size)
    check_model(config)
    bind_host = loopback_bind_address(master_addr) or ""  # "": every interface, as the store
    if master_port is None:
        master_port = free_port(bind_host)
    elif 0 in nodes:
        check_port_free(bind_host, master_port)
    run_dir = prepare_run_dir(config, run_dir, resume=resume, overwrite=overwrite).resolve()
    warn_if_cuda_initialised()

    write_worker(config, run_dir)
    (run_dir / "logs").mkdir(exist_ok=True)
    procs_on_host = len(nodes) * nproc_per_node
    threads = config.threads or max(1, (os.cpu_count() or 1) // procs_on_host)
    child_env = dict(os.environ)  # a copy: the kernel's own environment is never touched
    child_env.update(
        {
            "DDPNB_PROCS_ON_HOST": str(procs_on_host),
            "OMP_NUM_THREADS": str(threads),
            "PYTHONUNBUFFERED": "1",
            "DDPNB_LAUNCHED": "1",
        }
    )
    if not config.thread_budget:  # pitfall: torch's default, one thread per core per process
        del child_env["OMP_NUM_THREADS"]
    child_env.update(env or {})
    warn_pitfalls(config)
    procs: dict[int, subprocess.Popen] = {}
    log_paths: dict[int, Path] = {}
    # The run's lifetime is tied to this process: when it ends, however it ends, the
    # pipe's write end closes and every agent stops its node (see agent.watch_lifeline).
    lifeline_read, lifeline = _open_lifeline()
    child_env[LIFELINE_ENV] = str(lifeline_read)
    logger.info(
        "launching %d node(s) x %d process(es); node 0 is the master and hosts the rendezvous at %s:%d",
        nnodes,
        nproc_per_node,
        master_addr,
        master_port,
    )
    try:
        for node in nodes:
            log_paths[node] = run_dir / "logs" / f"node-{node}.log"
            cmd = [
                sys.executable,
                str(AGENT),  # torchrun; binds a loopback rendezvous to loopback only
                *torchrun_args(
                    nnodes=nnodes,
                    node_rank=node,
                    nproc_per_node=nproc_per_node,
                    master_addr=master_addr,
                    master_port=master_port,
                    max_restarts=max_restarts,
                    rdzv_timeout=rdzv_timeout,
                    log_dir=str(run_dir / "logs" / f"node-{node}"),
                ),
                str(run_dir / WORKER_NAME),
                "--config",
                str(run_dir / "config.json"),
            ]
            with open(log_paths[node], "ab") as log_file:
                log_file.write(f"$ {shlex.join(cmd)}\n".encode())
                log_file.flush()
                procs[node] = subprocess.Popen(
                    cmd,
                    cwd=run_dir,
                    env=child_env,
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # its own process group: we stop it as a whole
                    pass_fds=(lifeline_read,),
                )
    except OSError as e:
        for p in procs.values():
            os.killpg(p.pid, signal.SIGKILL)
        _close_lifeline(lifeline)
        raise LaunchError(f"Could not start torchrun: {e}") from e
    finally:
        os.close(lifeline_read)  # the agents hold it now
    job = Job(
        run_dir,
        config,
        procs,
        log_paths,
        nnodes=nnodes,
        nproc_per_node=nproc_per_node,
        master_addr=master_addr,
        master_port=master_port,
        rdzv_timeout=rdzv_timeout,
        max_restarts=max_restarts,
        progress=progress,
        lifeline=lifeline,
    )
    return job.wait() if wait else job


def warn_pitfalls(config: TrainConfig) -> None:
    """Log a loud warning for each pitfall switch turned off (see notebook 06)."""
    for name in config.pitfalls_off:
        logger.warning(
            "PITFALL SWITCH OFF: %s=False (%s). This run reproduces the mistake on purpose; "
            "leave %s=True for correct training.",
            name,
            PITFALL_SWITCHES[name],
            name,
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
