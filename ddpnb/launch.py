"""``launch``: a script or the worker on simulated nodes (``Local``) or SSH hosts (``Hosts``)."""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from .config import TrainConfig
from .errors import ConfigError
from .job import Job
from .local import Local
from .pipeline import run
from .plan import HANG_TIMEOUT
from .scheduler import Scheduler
from .script import Script
from .topology import Topology


def launch(
    what: Script | TrainConfig | Mapping[str, Any],
    run_dir: str | os.PathLike,
    nnodes: int | None = None,
    nproc_per_node: int = 1,
    master_addr: str | None = None,
    master_port: int | None = None,
    max_restarts: int = 0,
    rdzv_timeout: int = 60,
    wait: bool = True,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: str = "auto",
    env: Mapping[str, str] | None = None,
    hang_timeout: float | None = HANG_TIMEOUT,
    on_hang: str = "stop",
    local_nodes: Iterable[int] | None = None,
    hosts: Sequence[str] | None = None,
    ssh_config: str | os.PathLike | None = None,
    ssh_options: Sequence[str] = (),
    python: str | None = None,
    remote_run_dir: str | None = None,
) -> Job:
    """Run a script with DDP: one ``torchrun`` per node, followed to its end.

    ``what``: a :class:`~ddpnb.Script` (any torchrun script) or a :class:`~ddpnb.TrainConfig`
    (ddpnb's worker). ``run_dir``: its working directory on every node (node 0's files come
    back here). Node 0 hosts the rendezvous at ``master_addr:master_port``.

    Without ``hosts``, ``nnodes`` nodes (default 2) are simulated here, on loopback;
    ``local_nodes``: which start here (the others run :func:`node_commands`). With ``hosts``
    (``["gpu1", "alice@gpu2", "10.0.0.3:2222"]``) each runs one node over SSH, the first being
    node 0 and the default ``master_addr``; ``ssh_config`` (``ssh -F``), ``ssh_options``,
    ``python`` (default this one's path) and ``remote_run_dir`` (when they do not share
    ``run_dir``) say how. ``env`` is added to every node's environment.

    When no rank has moved for ``hang_timeout`` seconds and ranks wait in a collective,
    ``on_hang="stop"`` ends the run with :class:`~ddpnb.errors.RunHung` (checkpoint kept),
    ``"wait"`` shows the hang and waits; None turns the watch (and ``job.stacks()``) off.
    Raises :class:`~ddpnb.errors.WorkerFailed` if a worker fails.

    >>> job = launch(Script("train.py", args=["--epochs", "3"]), "runs/a")  # doctest: +SKIP
    """
    shape = dict(nproc_per_node=nproc_per_node, master_addr=master_addr, master_port=master_port)
    shape |= dict(rdzv_timeout=rdzv_timeout, max_restarts=max_restarts)
    if hosts is not None:
        from .remote import Hosts
        from .ssh import Ssh, parse_hosts

        if nnodes is not None and nnodes != len(hosts):
            raise ConfigError(
                f"nnodes={nnodes} but {len(hosts)} hosts were given: with hosts, each host is "
                "one node; leave nnodes out."
            )
        if local_nodes is not None:
            raise ConfigError("local_nodes applies to simulated nodes; with hosts every host runs.")
        parsed, ssh = parse_hosts(hosts), Ssh(ssh_config, ssh_options)
        topology = Topology(nnodes=len(parsed), **shape)
        scheduler: Scheduler = Hosts(parsed, topology, ssh, python, remote_run_dir)
    elif ssh_config is not None or ssh_options or python or remote_run_dir:
        raise ConfigError("ssh_config, ssh_options, python and remote_run_dir need hosts=[...].")
    else:
        scheduler = Local(Topology(nnodes=2 if nnodes is None else nnodes, **shape), local_nodes)
    options = {"progress": progress, "env": env, "resume": resume, "overwrite": overwrite}
    options |= {"hang_timeout": hang_timeout, "on_hang": on_hang}
    return run(what, run_dir, scheduler, wait=wait, **options)


def train_single(config: TrainConfig | Mapping[str, Any], run_dir: str | os.PathLike, **kwargs):
    """Deprecated: ``launch(config, run_dir, nnodes=1)``."""
    new = "ddpnb.train_single(cfg, run_dir) is now ddpnb.launch(cfg, run_dir, nnodes=1)."
    warnings.warn(new, FutureWarning, stacklevel=2)
    return launch(config, run_dir, nnodes=1, nproc_per_node=1, **kwargs)
