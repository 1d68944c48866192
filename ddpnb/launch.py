"""Launching a run: one ``torchrun`` per node, followed until it ends or fails.

The kernel never joins the process group: it starts each node's torchrun agent as a
fresh process (no fork), from an explicit copy of the environment, and watches the
files the workers write.
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .agent import LIFELINE_ENV
from .config import TrainConfig
from .constants import threads_for_host
from .errors import ConfigError, LaunchError
from .job import Job, close_lifeline, open_lifeline
from .log import logger
from .preflight import check_launch, warn_if_cuda_initialised, warn_pitfalls
from .remote import launch_on_hosts
from .rundir import WORKER_NAME, prepare_run_dir, write_worker
from .topology import Topology

__all__ = ["Job", "launch", "train_single"]

AGENT = Path(__file__).with_name("agent.py")


# -- the public entry points ---------------------------------------------------------------


def launch(
    config: TrainConfig | Mapping[str, Any],
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
    local_nodes: Iterable[int] | None = None,
    env: Mapping[str, str] | None = None,
    hosts: Sequence[str] | None = None,
    ssh_config: str | os.PathLike | None = None,
    ssh_options: Sequence[str] = (),
    python: str | None = None,
    remote_run_dir: str | None = None,
) -> Job:
    """Train with DDP: write the worker, start one ``torchrun`` per node, follow it.

    Node 0 is the master and hosts the rendezvous at ``master_addr:master_port``.
    Without ``hosts`` the ``nnodes`` nodes (default 2) are simulated on this machine,
    on loopback, and its cores are split over all their processes; ``local_nodes``
    limits which nodes start here (the others run :func:`node_commands` on their own
    hosts). With ``hosts`` (``["gpu1", "alice@gpu2", "10.0.0.3:2222"]``) each host runs
    one node, started over SSH (``ssh_config``: ``ssh -F``; ``ssh_options``: extra ssh
    arguments; ``python``: the hosts' interpreter, default this one's path); the first
    host is node 0 and ``master_addr`` defaults to its address. ``env`` is added to
    every node's environment. Everything is validated before any process starts.

    Returns a :class:`Job` (already finished when ``wait``); raises
    :class:`~ddpnb.errors.WorkerFailed` if a worker fails.

    Example
    -------
    >>> job = launch(TrainConfig(data_dir="data/digits"), "runs/ddp", nnodes=2)   # doctest: +SKIP
    >>> job.metrics.final["val_acc"]                                              # doctest: +SKIP
    0.97
    >>> launch(cfg, "runs/lab", hosts=["gpu1", "gpu2"], nproc_per_node=4)        # doctest: +SKIP
    """
    if hosts is not None:
        if nnodes is not None and nnodes != len(hosts):
            raise ConfigError(
                f"nnodes={nnodes} but {len(hosts)} hosts were given: with hosts, each host is "
                "one node; leave nnodes out."
            )
        if local_nodes is not None:
            raise ConfigError("local_nodes applies to simulated nodes; with hosts every host runs.")
        return launch_on_hosts(
            config, run_dir, hosts, nproc_per_node=nproc_per_node, master_addr=master_addr,
            master_port=master_port, max_restarts=max_restarts, rdzv_timeout=rdzv_timeout,
            wait=wait, resume=resume, overwrite=overwrite, progress=progress, env=env,
            ssh_config=ssh_config, ssh_options=ssh_options, python=python,
            remote_run_dir=remote_run_dir,
        )  # fmt: skip
    if ssh_config is not None or ssh_options or python or remote_run_dir:
        raise ConfigError("ssh_config, ssh_options, python and remote_run_dir need hosts=[...].")
    nnodes = 2 if nnodes is None else nnodes
    master_addr = master_addr or "127.0.0.1"
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
    lifeline_read, lifeline = open_lifeline()
    child_env = _agent_env(config, len(nodes) * nproc_per_node, env)
    child_env[LIFELINE_ENV] = str(lifeline_read)
    procs: dict[int, subprocess.Popen] = {}
    try:
        for n in nodes:
            procs[n] = _start_agent(run_dir, topology, n, child_env, lifeline_read)
    except BaseException as e:  # an OSError, or Ctrl-C/SIGTERM before the Job exists
        for proc in procs.values():
            os.killpg(proc.pid, signal.SIGKILL)  # nothing to save yet; its workers see EOF too
        close_lifeline(lifeline)
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
