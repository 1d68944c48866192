"""Typed errors. Every message names the problem and the fix."""

from __future__ import annotations

from typing import Any


class DdpnbError(Exception):
    """Base class of every error ddpnb raises on purpose; keywords set the class's fields."""

    def __init__(self, *args: Any, **fields: Any) -> None:
        super().__init__(*args)
        for name, value in fields.items():
            if not hasattr(type(self), name):
                raise TypeError(f"{type(self).__name__} has no field {name!r}")
            setattr(self, name, value)


class ConfigError(DdpnbError, ValueError):
    """A training or launch setting is invalid (raised before any process starts)."""


class DatasetError(DdpnbError):
    """The dataset folder is missing, malformed, or holds a different dataset."""


class RunDirError(DdpnbError):
    """The run directory holds another run, or cannot be written."""


class PortInUseError(DdpnbError):
    """The requested master port is already taken on this host."""


class LaunchError(DdpnbError):
    """A run could not be started or stopped as asked."""


class HostError(LaunchError):
    """A host of the run cannot run it (unreachable, login refused, no torch, other data)."""

    host: str | None = None  # the first such host as the user wrote it; the message names all


class RunFailed(DdpnbError):
    """A launched run ended without finishing: the base of the run failures below."""

    host: str | None = None  # the failing node's host (None if unknown or local)
    node_rank: int | None = None  # where the first failure happened (None if unknown)
    global_rank: int | None = None
    exit_code: int | None = None  # how it ended (None if unknown)
    traceback = ""  # the failing worker's traceback
    log_tail = ""  # the last lines of its node's log
    cause: str | None = (
        None  # a known error's name (ddpnb.diagnosis.KNOWN), e.g. "unused_parameters"
    )

    def __init__(self, message: str, **fields: Any) -> None:
        super().__init__(message, **fields)
        if self.traceback:
            message += "\n\nThe failing worker's traceback follows:\n" + self.traceback.rstrip()
        elif self.log_tail:
            message += "\n\nThe last lines of the node's log follow:\n" + self.log_tail.rstrip()
        self.args = (message,)


class RunInterrupted(KeyboardInterrupt):
    """The user stopped a run (Ctrl-C, the stop button): its processes ended; Run All stops."""

    def __init__(self, run_dir, epochs_done: int) -> None:
        self.run_dir = run_dir
        message = f"the run in {run_dir} was stopped; no process of it is left running."
        if epochs_done:
            message += (
                f" {epochs_done} epoch(s) are recorded; launch it again with resume=True (CLI: "
                "--resume) to continue from its checkpoint."
            )
        super().__init__(message)

    def _render_traceback_(self) -> list[str]:  # IPython shows these lines instead
        return [f"KeyboardInterrupt: {self}"]


class WorkerFailed(RunFailed):
    """A worker process of the run failed (raised, or exited non-zero)."""


class RendezvousTimeout(RunFailed):
    """Not every node joined the rendezvous in time."""


class RunStalled(RunFailed):
    """The run had started, then stopped making progress (a rank or node stopped answering)."""


class RunHung(RunFailed):
    """No rank made progress for ``hang_timeout`` seconds, every one waiting in a collective."""

    stacks = None  # a ddpnb.hang.Stacks: where each rank waited (print(e.stacks))

    def __str__(self) -> str:
        text = super().__str__()
        return f"{text}\n\n{self.stacks.per_rank()}" if self.stacks is not None else text


class NodeLost(RunFailed):
    """A node stopped answering (agent killed, host down, network cut); ``node_rank``: which."""


class NetworkError(HostError):
    """The hosts cannot reach node 0 or each other as a run needs (found before it starts)."""

    report = None  # the ddpnb.network.NetworkReport (str(report) is its table)


class SlurmError(LaunchError):
    """Slurm cannot be used from here (no ``sbatch``), or one of its commands failed."""


class SlurmRequestError(ConfigError):
    """The job asks for what the cluster does not have (partition, nodes, GPUs)."""


class SlurmJobEnded(RunFailed):
    """Slurm ended the job before the run finished: time limit, node failure, cancelled."""

    state = ""  # Slurm's job state: TIMEOUT, NODE_FAIL, PREEMPTED, ...
    reason = job_id = ""


class RunDirNotShared(RunFailed):
    """A node of the job could not see the run directory: it is not on a shared filesystem."""
