"""Slurm from the notebook: submit a run with ``sbatch``, follow it, cancel it, attach to it.

A batch job belongs to the cluster, not to the kernel that submitted it: it keeps
running when the kernel ends (unlike local and SSH runs), and :func:`attach` follows
it again from a new kernel. The run directory must be on a filesystem that the
submit host and every node share (as ``/home`` or ``/scratch`` are on most Slurm
clusters): the job's progress, metrics and logs are read from there. A marker file
written at submission checks it; a node that cannot see it stops the job at once.

Slurm is asked gently, no more than every :data:`POLL_SECONDS`: ``scontrol show job``
answers for running jobs and for ended ones (until ``MinJobAge``), with the state,
Slurm's reason and the exit code; ``sacct`` is used once a job has left slurmctld.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from .cluster import slurm_script
from .config import TrainConfig
from .diagnosis import SECONDARY_ERRORS, log_tail, read_error_file, resume_hint
from .errors import ConfigError, LaunchError, RunFailed, WorkerFailed
from .log import logger
from .metrics import RunMetrics, load_metrics, read_progress
from .preflight import as_config, check_run, warn_pitfalls
from .progress import make_progress
from .rundir import prepare_run_dir, write_worker
from .topology import Topology

POLL_SECONDS = 2.0  # between questions to slurmctld: a shared service, asked gently
FILE_POLL_SECONDS = 0.5  # between reads of the run directory (progress, metrics)
STOP_TIMEOUT = 60.0  # scancel: Slurm's KillWait plus its epilog, with room to spare
FIRST_NODE = "<first node>"  # the rendezvous host until Slurm names it
JOB_FILE = "slurm_job.json"  # what attach() needs: the job id, the shape, the cluster
SCRIPT_NAME = "train.sbatch"
MARKER_NAME = ".ddpnb-submit-marker"
NOT_SHARED_EXIT = 97  # the batch script's exit code when a node cannot see the marker
# States in which the job may still run (or run again, after a requeue).
ALIVE = {
    "PENDING",
    "CONFIGURING",
    "RUNNING",
    "COMPLETING",
    "SUSPENDED",
    "REQUEUED",
    "REQUEUE_HOLD",
    "REQUEUE_FED",
    "RESIZING",
    "SIGNALING",
    "STAGE_OUT",
    "STOPPED",
}
# What to do when Slurm itself ended the job, by Slurm's state.
ENDED_HINTS = {
    "TIMEOUT": "it ran into its time limit: submit again with a longer time= and resume=True",
    "NODE_FAIL": "a node of the allocation failed: submit again with resume=True",
    "PREEMPTED": "a higher-priority job took its nodes: submit with sbatch_args=['--requeue']",
    "CANCELLED": "it was cancelled (scancel) outside this session: submit again with resume=True",
    "OUT_OF_MEMORY": "a node ran out of memory: ask for more with sbatch_args=['--mem=...']",
    "DEADLINE": "it reached its --deadline",
    "BOOT_FAIL": "a node failed to boot: submit again with resume=True",
}


class SlurmError(LaunchError):
    """Slurm cannot be used from here (no ``sbatch``), or one of its commands failed."""


class SlurmRequestError(ConfigError):
    """The job asks for what the cluster does not have (partition, nodes, GPUs)."""


class SlurmJobEnded(RunFailed):
    """Slurm ended the job before the run finished: time limit, node failure, cancelled.

    ``state`` is Slurm's job state (``TIMEOUT``, ``NODE_FAIL``, ``CANCELLED``,
    ``PREEMPTED``, ...), ``reason`` Slurm's reason, ``job_id`` the job.
    """

    def __init__(self, message: str, *, state: str, reason: str, job_id: str, **kw: Any) -> None:
        self.state = state
        self.reason = reason
        self.job_id = job_id
        super().__init__(message, **kw)


class RunDirNotShared(RunFailed):
    """A node of the job could not see the run directory: it is not on a shared filesystem."""


# -- talking to Slurm ----------------------------------------------------------------------


def _slurm_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of this process's environment (SLURM_CONF included), never modified in place."""
    env = dict(os.environ)
    env.update(extra or {})
    return env


def _run_slurm(
    argv: list[str], env: Mapping[str, str] | None, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Run a Slurm command (explicit argv, a copy of the environment); SlurmError if it is
    missing or does not answer."""
    exe = shutil.which(argv[0], path=(env or os.environ).get("PATH"))
    if exe is None:
        raise SlurmError(
            f"{argv[0]} was not found on PATH: Slurm's commands are needed to submit and follow "
            "a batch job. Run this on a Slurm cluster's login node (or load its module, e.g. "
            "`module load slurm`); without Slurm, print the script with ddpnb.slurm_script()."
        )
    try:
        return subprocess.run(
            [exe, *argv[1:]],
            cwd=cwd,
            env=dict(env or _slurm_env()),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{argv[0]} did not answer within 60 s: is slurmctld reachable?") from None


def _slurm(argv: list[str], env: Mapping[str, str] | None = None) -> str:
    """A Slurm command's stdout; SlurmError (naming the command) when it fails."""
    r = _run_slurm(argv, env)
    if r.returncode != 0:
        raise SlurmError(f"`{' '.join(argv)}` failed (exit {r.returncode}): {r.stderr.strip()}")
    return r.stdout


def _fields(text: str) -> dict[str, str]:
    """``Key=Value Key=Value`` (``scontrol show -o``) as a dict; values may hold spaces only
    at the end of the line (Reason is always followed by another key)."""
    return dict(re.findall(r"(\S+?)=(\S*)", text))


def job_state(job_id: str, env: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """Slurm's view of a job: JobState, Reason, NodeList, ExitCode, Restarts, StartTime.

    ``{}`` when Slurm no longer knows the job, ``None`` when it did not answer this
    time. ``scontrol`` first; ``sacct`` (where accounting is on) for a job that has
    left slurmctld.

    >>> job_state("12345")["JobState"]                     # doctest: +SKIP
    'RUNNING'
    """
    r = _run_slurm(["scontrol", "show", "job", "-o", str(job_id)], env)
    if r.returncode == 0 and r.stdout.strip():
        return _fields(r.stdout.splitlines()[0])
    if "Invalid job id" not in r.stderr:
        logger.debug("scontrol show job %s: %s", job_id, r.stderr.strip())
        return None  # slurmctld busy or restarting: ask again later
    if shutil.which("sacct", path=(env or os.environ).get("PATH")) is None:
        return {}
    r = _run_slurm(
        ["sacct", "-n", "-P", "-X", "-j", str(job_id), "-o", "State,ExitCode,NodeList,Start"], env
    )
    for line in r.stdout.splitlines() if r.returncode == 0 else []:
        state, exit_code, nodes, start = (line.split("|") + ["", "", "", ""])[:4]
        # sacct writes "CANCELLED by 0": the state is the first word.
        return {
            "JobState": state.split()[0] if state else "",
            "Reason": "None",
            "ExitCode": exit_code,
            "NodeList": nodes,
            "StartTime": start,
        }
    return {}


def hostnames(nodelist: str, env: Mapping[str, str] | None = None) -> list[str]:
    """``n[1-3]`` as ``['n1', 'n2', 'n3']`` (``scontrol show hostnames``)."""
    if not _known(nodelist):
        return []
    return _slurm(["scontrol", "show", "hostnames", nodelist], env).split()


def slurm_available(env: Mapping[str, str] | None = None) -> bool:
    """True when Slurm's commands are here and a controller answers (``sinfo``).

    >>> slurm_available()                                   # doctest: +SKIP
    False
    """
    try:
        return _run_slurm(["sinfo", "-h", "-o", "%P"], env).returncode == 0 and bool(
            shutil.which("sbatch", path=(env or os.environ).get("PATH"))
        )
    except SlurmError:
        return False


# -- preflight ----------------------------------------------------------------------------


def _partitions(env: Mapping[str, str]) -> dict[str, dict]:
    """Every partition: node count, CPUs and GPUs per node, whether it is up and the default."""
    out = _slurm(["sinfo", "-h", "-o", "%P|%D|%c|%G|%a"], env)
    parts: dict[str, dict] = {}
    for line in out.splitlines():
        name, nodes, _cpus, gres, avail = (line.split("|") + [""] * 5)[:5]
        default = name.endswith("*")
        name = name.rstrip("*")
        gpus = [int(m) for m in re.findall(r"gpu(?::[^:,(]+)?:(\d+)", gres)]
        part = parts.setdefault(name, {"nodes": 0, "gpus": 0, "up": False, "default": default})
        part["nodes"] += int(nodes or 0)  # one line per group of alike nodes
        part["gpus"] = max([part["gpus"], *gpus])
        part["up"] |= avail == "up"
    return parts


def check_slurm_request(
    nnodes: int,
    partition: str | None,
    gpus_per_node: int | None,
    env: Mapping[str, str] | None = None,
) -> str:
    """Check that sbatch exists and the partition can hold the job; return the partition.

    Raises :class:`SlurmError` without Slurm, :class:`SlurmRequestError` for an unknown
    partition, or more nodes or GPUs per node than it has.

    >>> check_slurm_request(2, "gpu", 4)                    # doctest: +SKIP
    'gpu'
    """
    env = env or _slurm_env()
    _slurm(["sbatch", "--version"], env)
    parts = _partitions(env)
    if partition is None:
        partition = next((n for n, p in parts.items() if p["default"]), None)
        if partition is None:
            raise SlurmRequestError(
                "This cluster has no default partition: pass partition= (one of "
                f"{', '.join(sorted(parts)) or 'none found'}; `sinfo` lists them)."
            )
    part = parts.get(partition)
    if part is None:
        raise SlurmRequestError(
            f"Slurm has no partition {partition!r}. Partitions here: "
            f"{', '.join(sorted(parts)) or 'none'} (`sinfo` lists them)."
        )
    if not part["up"]:
        logger.warning("partition %s is not up: the job will wait until it is", partition)
    if nnodes > part["nodes"]:
        raise SlurmRequestError(
            f"nnodes={nnodes}, but partition {partition!r} has {part['nodes']} node(s): ask for "
            f"at most {part['nodes']}, or choose a bigger partition."
        )
    if gpus_per_node and gpus_per_node > part["gpus"]:
        raise SlurmRequestError(
            f"gpus_per_node={gpus_per_node}, but the nodes of partition {partition!r} have at "
            f"most {part['gpus']} GPU(s) (sinfo's GRES): ask for fewer, or choose a GPU partition."
        )
    return partition


# -- the job -------------------------------------------------------------------------------


def _timestamp(text: str) -> float | None:
    try:
        return datetime.fromisoformat(text).timestamp()
    except (TypeError, ValueError):
        return None


class SlurmJob:
    """A submitted batch job, followed like a :class:`ddpnb.Job`.

    Returned by :func:`submit_slurm` and :func:`attach`. ``wait()`` follows it to the
    end (raising :class:`~ddpnb.errors.WorkerFailed` or :class:`SlurmJobEnded`),
    ``stop()`` cancels it with ``scancel``. ``node_status()`` gives each node's state,
    ``pending (Resources)`` while Slurm has not started the job.
    """

    def __init__(
        self,
        run_dir: Path,
        config: TrainConfig,
        job_id: str,
        nnodes: int,
        nproc_per_node: int,
        *,
        master_port: int | None = None,
        progress: str = "none",
        submitted_at: float | None = None,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.config = config
        self.job_id = str(job_id)
        self.nnodes = nnodes
        self.nproc_per_node = nproc_per_node
        self.world_size = nnodes * nproc_per_node
        self.master_addr = FIRST_NODE  # the allocation's first node, known once it runs
        self.master_port = master_port or port_for_job(self.job_id)
        self.progress_mode = progress
        self.started_at = submitted_at or time.time()
        self.ended_at: float | None = None
        self.error: BaseException | None = None
        self.env = dict(env or _slurm_env())
        self.log_paths = {n: self.run_dir / "logs" / f"node-{n}.log" for n in range(nnodes)}
        self.script_path = self.run_dir / SCRIPT_NAME
        self._state: dict[str, str] = {}
        self._asked = 0.0
        self._cancelled_here = False

    # -- state ---------------------------------------------------------------------------

    def slurm_state(self, fresh: bool = False) -> dict[str, str]:
        """Slurm's fields for the job (``JobState``, ``Reason``, ...), asked at most every
        POLL_SECONDS unless ``fresh``."""
        if fresh or time.monotonic() - self._asked >= POLL_SECONDS:
            state = job_state(self.job_id, self.env)
            self._asked = time.monotonic()
            if state == {}:  # purged (MinJobAge passed) and no accounting to ask
                state = {"JobState": "UNKNOWN", "Reason": "Slurm no longer knows the job"}
            self._state = self._state if state is None else state  # None: ask again later
            nodes = self._state.get("NodeList", "")
            if self.master_addr == FIRST_NODE and _known(nodes):
                self.master_addr = (hostnames(nodes, self.env) or [FIRST_NODE])[0]
        return self._state

    @property
    def state(self) -> str:
        """Slurm's job state: ``PENDING``, ``RUNNING``, ``COMPLETED``, ``TIMEOUT``, ..."""
        return self.slurm_state().get("JobState", "UNKNOWN")

    @property
    def running(self) -> bool:
        return self.state in ALIVE

    @property
    def metrics(self) -> RunMetrics:
        """The run's gathered metrics (re-read on every access)."""
        return load_metrics(self.run_dir)

    def node_status(self) -> dict[int, str]:
        """Per node: ``pending (<Slurm's reason>)``, ``starting``, ``running``, ``done``,
        ``failed`` or ``stopped``."""
        info = self.slurm_state()
        state = info.get("JobState", "")
        if state in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "CONFIGURING", ""):
            reason = info.get("Reason", "")
            reason = "" if reason in ("None", "(null)") else reason  # Slurm's word for no reason
            return {n: f"pending ({reason})" if reason else "pending" for n in range(self.nnodes)}
        if state in ALIVE:
            started = _timestamp(info.get("StartTime", "")) or self.started_at
            joined = read_progress(self.run_dir).get("time", 0) >= started - 1
            return {n: "running" if joined else "starting" for n in range(self.nnodes)}
        finished = state == "COMPLETED" or (state == "UNKNOWN" and self._finished_on_disk())
        if finished and self.error is None:
            return dict.fromkeys(range(self.nnodes), "done")
        failed = {n for n, _, _ in _failed_ranks(self.run_dir, self.nnodes)}
        stopped = "stopped" if self._cancelled_here else "failed"
        return {n: "failed" if n in failed else stopped for n in range(self.nnodes)}

    def log_tail(self, node: int = 0, lines: int = 20) -> str:
        """The last ``lines`` lines of a node's log (``logs/node-N.log``, srun's output)."""
        return log_tail(self.run_dir, node, lines)

    def batch_log(self) -> Path:
        """The batch script's own output (``logs/slurm-<job id>.out``)."""
        return self.run_dir / "logs" / f"slurm-{self.job_id}.out"

    # -- control --------------------------------------------------------------------------

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Cancel the job (``scancel``); return once Slurm reports that it ended.

        Slurm signals every process of the job on every node, SIGKILLs what is left
        after its KillWait, and only then reports the job as ended.
        """
        if self.slurm_state(fresh=True).get("JobState") in ALIVE:
            self._cancelled_here = True
            _slurm(["scancel", self.job_id], self.env)
        deadline = time.monotonic() + timeout
        while self.slurm_state(fresh=True).get("JobState") in ALIVE:
            if time.monotonic() > deadline:
                raise SlurmError(
                    f"Slurm still reports job {self.job_id} as {self.state} {timeout:.0f} s "
                    f"after scancel; check `squeue -j {self.job_id}`."
                )
            time.sleep(1.0)
        self.ended_at = self.ended_at or time.time()

    def wait(self, timeout: float | None = None) -> SlurmJob:
        """Follow the job to its end, showing progress; return self.

        Raises :class:`WorkerFailed` when a worker fails, :class:`SlurmJobEnded` when
        Slurm ends the job (time limit, node failure, cancelled elsewhere),
        :class:`RunDirNotShared` when a node cannot see the run directory. On
        KeyboardInterrupt it cancels the job, waits until Slurm reports it ended,
        and re-raises. ``timeout`` (seconds) raises TimeoutError and leaves the job
        running: :func:`attach` follows it again.
        """
        display = make_progress(self.progress_mode, self)
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            while self.running:
                display.update()
                if deadline is not None and time.monotonic() > deadline:
                    raise TimeoutError(
                        f"Job {self.job_id} did not end within {timeout} s; it is still "
                        f"{self.state}. Follow it again with ddpnb.attach({str(self.run_dir)!r})."
                    )
                time.sleep(FILE_POLL_SECONDS)
        except KeyboardInterrupt as e:
            self.error = e
            self.stop()
            display.close(self)
            print(f"Interrupted: cancelled Slurm job {self.job_id} (scancel); it has ended.")
            raise
        self.ended_at = self.ended_at or time.time()
        self.error = self._failure()
        display.close(self)
        if self.error:
            raise self.error
        return self

    # -- failures -------------------------------------------------------------------------

    def _failure(self) -> RunFailed | None:
        info = self.slurm_state(fresh=True)
        state = info.get("JobState", "UNKNOWN")
        exit_code = _exit_code(info.get("ExitCode", ""))
        if state == "COMPLETED" and exit_code in (0, None):
            return None
        if state == "UNKNOWN" and self._finished_on_disk():
            return None  # ended long ago (Slurm forgot it), and the run directory says done
        if exit_code == NOT_SHARED_EXIT:
            return RunDirNotShared(
                f"Slurm job {self.job_id} stopped at once: a node could not see the run directory "
                f"{self.run_dir} (the marker written at submission was missing there). The run "
                "directory must be on a filesystem shared by this host and every node (e.g. "
                "/home or /scratch on most clusters); choose such a run_dir.",
                log_tail=_read_tail(self.batch_log(), 10),
            )
        if state == "FAILED":
            return self._worker_failure(exit_code)
        nodes = hostnames(info.get("NodeList", ""), self.env)
        hint = ENDED_HINTS.get(state, "see `scontrol show job` and the batch log")
        reason = info.get("Reason", "None")
        return SlurmJobEnded(
            f"Slurm ended job {self.job_id} with state {state} (reason: {reason}) on "
            f"{', '.join(nodes) or 'no node'}: {hint}.{resume_hint(self.run_dir)}",
            state=state,
            reason=reason,
            job_id=self.job_id,
            exit_code=exit_code,
            log_tail=self.log_tail(0, 20) or _read_tail(self.batch_log(), 20),
        )

    def _finished_on_disk(self) -> bool:
        done = read_progress(self.run_dir).get("phase") == "done"
        return done and len(self.metrics.epochs) >= self.config.epochs

    def _worker_failure(self, exit_code: int | None) -> RunFailed:
        errors = _failed_ranks(self.run_dir, self.nnodes)
        infos = []
        for node, rank, path in errors:
            info = read_error_file(path) if path else None
            if info:
                secondary = any(w in info["message"] for w in SECONDARY_ERRORS)
                infos.append(((secondary, Path(path).stat().st_mtime), node, rank, info))
        infos.sort(key=lambda e: e[0])
        if infos:
            _, node, rank, info = infos[0]
            code = next((c for n, r, c in _rank_exit_codes(self.run_dir, node) if r == rank), None)
            return WorkerFailed(
                f"Worker global rank {rank} on node {node} of Slurm job {self.job_id} failed "
                f"(exit code {code}): {info['message']}. Slurm stopped the other nodes "
                f"(srun --kill-on-bad-exit).{resume_hint(self.run_dir)}",
                node_rank=node,
                global_rank=rank,
                exit_code=code,
                traceback=info["traceback"],
                log_tail=self.log_tail(node),
            )
        node, rank = (errors[0][0], errors[0][1]) if errors else (None, None)
        no_logs = not any(p.exists() for p in self.log_paths.values())
        why = (
            " No node log was written: check the batch log and that the run directory is on "
            "a shared filesystem."
            if no_logs
            else ""
        )
        return WorkerFailed(
            f"Slurm job {self.job_id} failed (exit code {exit_code})"
            + (
                f"; worker global rank {rank} on node {node} failed first"
                if rank is not None
                else ""
            )
            + f".{why}{resume_hint(self.run_dir)}",
            node_rank=node,
            global_rank=rank,
            exit_code=exit_code,
            log_tail=self.log_tail(node or 0, 40) or _read_tail(self.batch_log(), 40),
        )

    def __repr__(self) -> str:
        return (
            f"<ddpnb.SlurmJob {self.job_id} {self.run_dir} {self.nnodes}x{self.nproc_per_node} "
            f"{self._state.get('JobState', 'submitted')}>"
        )


def _known(nodelist: str) -> bool:
    return nodelist not in ("", "(null)", "None")


def port_for_job(job_id: str) -> int:
    """The rendezvous port the batch script derives from its job id (as in the script)."""
    return 20000 + int(re.sub(r"\D.*", "", job_id) or 0) % 20000


def _exit_code(text: str) -> int | None:
    """Slurm's ``ExitCode=1:0`` (exit status : signal) as the exit status."""
    m = re.match(r"(\d+):(\d+)", text or "")
    return int(m.group(1)) if m else None


def _read_tail(path: Path, lines: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


# torchrun's failure summary: "rank : 1 (local_rank: 1)", "exitcode : 1 (pid: 9)",
# "error_file: /path/error.json". With every node's torchrun writing into one shared
# log folder, the summary (in that node's srun output) says which file is whose.
_SUMMARY = re.compile(
    r"^\s*rank\s*:\s*(\d+) \(local_rank.*\n\s*exitcode\s*:\s*(-?\d+).*\n\s*error_file\s*:\s*(\S+)",
    re.M,
)


def _rank_exit_codes(run_dir: Path, node: int) -> list[tuple[int, int, int]]:
    """(node, global rank, exit code) of each failed worker in a node's torchrun summary."""
    text = log_tail(run_dir, node, 400)
    return [(node, int(m.group(1)), int(m.group(2))) for m in _SUMMARY.finditer(text)]


def _failed_ranks(run_dir: Path, nnodes: int) -> list[tuple[int, int, str | None]]:
    """(node, global rank, error file or None) of each failed worker, from the node logs."""
    out = []
    for node in range(nnodes):
        text = log_tail(run_dir, node, 400)
        for m in _SUMMARY.finditer(text):
            path = m.group(3) if m.group(3) != "<N/A>" else None
            out.append((node, int(m.group(1)), path))
    return out


# -- the public entry points --------------------------------------------------------------


def submit_slurm(
    config: TrainConfig | Mapping[str, Any],
    run_dir: str | os.PathLike,
    nnodes: int,
    nproc_per_node: int = 1,
    gpus_per_node: int | None = None,
    partition: str | None = None,
    time: str = "01:00:00",  # noqa: A002 (sbatch's own name for it)
    account: str | None = None,
    sbatch_args: Sequence[str] = (),
    python: str | None = None,
    wait: bool = True,
    progress: str = "auto",
    resume: bool = False,
    overwrite: bool = False,
    max_restarts: int = 0,
    rdzv_timeout: int = 300,
) -> SlurmJob:
    """Submit a run as a Slurm batch job (``sbatch``) and follow it like :func:`ddpnb.launch`.

    Checks first (the config, the dataset, ``sbatch``, the partition, the nodes and
    GPUs asked for), then writes the worker, ``config.json`` and ``train.sbatch``
    into ``run_dir`` (which must be on a filesystem every node shares) and submits.
    One torchrun per node (``srun``), the c10d rendezvous on the first node.
    ``python`` is the interpreter the nodes run (default: this one). With
    ``sbatch_args=["--requeue"]`` a requeued job resumes from its checkpoint;
    ``max_restarts`` lets torchrun restart failed workers inside the allocation.

    Returns a :class:`SlurmJob` (finished when ``wait``); raises
    :class:`~ddpnb.errors.WorkerFailed` or :class:`SlurmJobEnded` on failure.
    The job outlives this process: ``attach(run_dir)`` follows it again.

    Example
    -------
    >>> job = submit_slurm(cfg, "/scratch/me/run", nnodes=2, partition="gpu",   # doctest: +SKIP
    ...                    nproc_per_node=4, gpus_per_node=4, time="02:00:00")
    >>> job.metrics.final["val_acc"]                                             # doctest: +SKIP
    0.97
    """
    # The first node and the port are the job's, known once it runs: placeholders here.
    topology = Topology(nnodes, nproc_per_node, FIRST_NODE, 29500, rdzv_timeout, max_restarts)
    config = check_run(as_config(config), topology, progress)  # the dataset, model, batch
    if not isinstance(sbatch_args, (list, tuple)) or not all(
        isinstance(a, str) for a in sbatch_args
    ):
        raise ConfigError("sbatch_args must be a list of strings, e.g. ['--qos=short'].")
    env = _slurm_env({"PYTHONUNBUFFERED": "1", "DDPNB_LAUNCHED": "1"})
    partition = check_slurm_request(nnodes, partition, gpus_per_node, env)
    run_dir = Path(run_dir).resolve()
    _refuse_live_job(run_dir, env)
    run_dir = prepare_run_dir(config, run_dir, resume=resume, overwrite=overwrite)
    write_worker(config, run_dir)
    (run_dir / "logs").mkdir(exist_ok=True)
    warn_pitfalls(config)
    token = secrets.token_hex(16)
    (run_dir / MARKER_NAME).write_text(token + "\n")
    slurm_script(
        config,
        run_dir,
        nnodes,
        nproc_per_node,
        master_port=None,
        time_limit=time,
        gpus_per_node=gpus_per_node or 0,
        path=run_dir / SCRIPT_NAME,
        partition=partition,
        account=account,
        python=python or sys.executable,
        max_restarts=max_restarts,
        rdzv_timeout=rdzv_timeout,
        marker=token,
        batch_log=str(run_dir / "logs" / "slurm-%j.out"),
    )
    argv = ["sbatch", "--parsable", *sbatch_args, str(run_dir / SCRIPT_NAME)]
    submitted_at = _time_now()
    out = _submit(argv, run_dir, env)
    job_id = out.strip().split(";")[0]
    logger.info(
        "submitted Slurm job %s: %d node(s) x %d process(es)", job_id, nnodes, nproc_per_node
    )
    record = {
        "job_id": job_id,
        "nnodes": nnodes,
        "nproc_per_node": nproc_per_node,
        "partition": partition,
        "submitted_at": submitted_at,
        "slurm_conf": env.get("SLURM_CONF"),
        "sbatch": argv,
    }
    (run_dir / JOB_FILE).write_text(json.dumps(record, indent=2) + "\n")
    job = SlurmJob(
        run_dir,
        config,
        job_id,
        nnodes,
        nproc_per_node,
        progress=progress,
        submitted_at=submitted_at,
        env=env,
    )
    return job.wait() if wait else job


def _time_now() -> float:
    return time.time()


def _submit(argv: list[str], run_dir: Path, env: dict[str, str]) -> str:
    # The job's working directory is sbatch's: the run directory.
    r = _run_slurm(argv, env, cwd=run_dir)
    if r.returncode != 0 or not r.stdout.strip():
        raise SlurmError(
            f"sbatch refused the job (exit {r.returncode}): {r.stderr.strip()} "
            f"The script is {run_dir / SCRIPT_NAME}."
        )
    return r.stdout


def _refuse_live_job(run_dir: Path, env: Mapping[str, str]) -> None:
    """A run directory whose job still runs must not get a second job writing into it."""
    try:
        old = json.loads((run_dir / JOB_FILE).read_text())["job_id"]
    except (OSError, ValueError, KeyError):
        return
    state = (job_state(old, env) or {}).get("JobState", "")
    if state in ALIVE:
        raise SlurmError(
            f"Slurm job {old} still runs in {run_dir} ({state}). Follow it with "
            f"ddpnb.attach({str(run_dir)!r}), or cancel it (scancel {old}) before submitting again."
        )


def attach(run_dir: str | os.PathLike, wait: bool = True, progress: str = "auto") -> SlurmJob:
    """Follow a submitted Slurm job again, from any process (a new kernel, the CLI).

    Reads ``run_dir/slurm_job.json`` (written by :func:`submit_slurm`). Returns the
    :class:`SlurmJob`, followed to its end when ``wait``; raises as ``wait()`` does.

    Example
    -------
    >>> job = attach("/scratch/me/run")            # doctest: +SKIP
    >>> job.metrics.final["val_acc"]               # doctest: +SKIP
    0.97
    """
    run_dir = Path(run_dir).resolve()
    try:
        record = json.loads((run_dir / JOB_FILE).read_text())
    except (OSError, ValueError) as e:
        raise LaunchError(
            f"{run_dir} holds no submitted Slurm job ({JOB_FILE} missing or unreadable: {e}). "
            "Submit one with ddpnb.submit_slurm()."
        ) from None
    extra = {}
    if record.get("slurm_conf") and "SLURM_CONF" not in os.environ:
        extra["SLURM_CONF"] = record["slurm_conf"]  # the cluster it was submitted to
    job = SlurmJob(
        run_dir,
        TrainConfig.load(run_dir / "config.json"),
        record["job_id"],
        record["nnodes"],
        record["nproc_per_node"],
        progress=progress,
        submitted_at=record.get("submitted_at"),
        env=_slurm_env(extra),
    )
    return job.wait() if wait else job
