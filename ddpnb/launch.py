"""The launch pipeline: check, prepare the run directory, start the nodes, follow, diagnose.

Written once for every way a run's nodes start. A backend says how: simulated nodes on
this machine (here), real hosts over SSH (``ddpnb.remote``), a Slurm job
(``ddpnb.slurm``). The kernel never joins the process group: each node runs one
``torchrun`` agent as a fresh process (no fork), from an explicit environment, and
the Job follows the files the workers write.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

from .agent import LIFELINE_ENV
from .config import TrainConfig
from .errors import ConfigError, LaunchError
from .hang import WATCH_DIR, hooks_payload
from .job import AGENT, Job, Processes, open_lifeline
from .log import logger
from .plan import FIRST_HOST, HANG_TIMEOUT, Plan
from .preflight import (
    check_launch,
    check_run,
    warn_if_cuda_initialised,
)
from .rundir import prepare_run_dir
from .script import Script, worker_script
from .topology import Topology

__all__ = ["Job", "launch", "train_single"]


class Starter(Protocol):
    """What a backend does for the pipeline (``Local``, ``remote.Hosts``, ``slurm.Batch``)."""

    data_here: bool  # the tutorial's dataset must be on this machine

    def check(self, plan: Plan) -> None:
        """What the backend can check before the run directory exists (the cluster's limits)."""

    def preflight(self, plan: Plan) -> Topology:
        """Check everything the backend needs (hosts, ports, the cluster); the final topology."""

    def start(self, plan: Plan) -> Job:
        """Place the files, start every node; the Job that follows them."""


def run(plan: Plan, run_dir: str | os.PathLike, starter: Starter, *, wait: bool) -> Job:
    """The pipeline every launch goes through; nothing starts before every check passed."""
    plan.script.check()
    if plan.config is not None:
        plan.config = check_run(plan.config, plan.topology, here=starter.data_here)
        plan.script = worker_script(plan.config)  # its config.json holds the checked paths
    plan.payload = plan.script.payload()  # read once: the run directory's and the hosts' files
    starter.check(plan)  # nothing written yet
    plan.run_dir = prepare_run_dir(
        run_dir, plan.payload, plan.config, resume=plan.resume, overwrite=plan.overwrite
    ).resolve()
    plan.topology = starter.preflight(plan)
    warn_if_cuda_initialised()
    plan.payload.update(hooks_payload())  # ddpnb's own files: replaced at every launch
    shutil.rmtree(plan.run_dir / WATCH_DIR, ignore_errors=True)  # an earlier launch's stacks
    for name, data in plan.payload.items():
        (plan.run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (plan.run_dir / name).write_bytes(data)
    (plan.run_dir / "logs").mkdir(exist_ok=True)
    job = starter.start(plan)
    return job.wait() if wait else job


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

    ``what`` is a :class:`~ddpnb.Script` (any torchrun script, its arguments and files)
    or a :class:`~ddpnb.TrainConfig` (ddpnb's tutorial worker). Node 0 is the master and
    hosts the rendezvous at ``master_addr:master_port``. Without ``hosts`` the ``nnodes``
    nodes (default 2) are simulated on this machine, on loopback, and its cores are split
    over all their processes; ``local_nodes`` limits which nodes start here (the others
    run :func:`node_commands` on their own hosts). With ``hosts``
    (``["gpu1", "alice@gpu2", "10.0.0.3:2222"]``) each host runs one node, started over
    SSH (``ssh_config``: ``ssh -F``; ``ssh_options``: extra ssh arguments; ``python``:
    the hosts' interpreter, default this one's path; ``remote_run_dir``: the run
    directory on hosts that do not share this one); the first host is node 0 and
    ``master_addr`` defaults to its address. ``env`` is added to every node's
    environment. When no rank has moved for ``hang_timeout`` seconds and ranks wait in
    a collective, the run hangs: ``on_hang="stop"`` ends it with
    :class:`~ddpnb.errors.RunHung` naming every rank's line (checkpoint kept), ``"wait"``
    shows it and waits until you stop it; ``hang_timeout=None`` turns the watch off
    (``job.stacks()`` needs it). The run directory is the script's working directory on every node;
    what node 0 writes there is here when the run ends. Everything is validated before
    any process starts.

    Returns a :class:`Job` (already finished when ``wait``); raises
    :class:`~ddpnb.errors.WorkerFailed` (host, node, rank, exit code, the script's
    traceback) if a worker fails.

    Example
    -------
    >>> job = launch(Script("train.py", args=["--epochs", "3"]), "runs/mine", nnodes=2)  # doctest: +SKIP
    >>> job = launch(TrainConfig(data_dir="data/digits"), "runs/ddp", nnodes=2)         # doctest: +SKIP
    >>> launch(cfg, "runs/lab", hosts=["gpu1", "gpu2"], nproc_per_node=4)              # doctest: +SKIP
    """
    if hosts is not None:
        from .remote import Hosts

        if nnodes is not None and nnodes != len(hosts):
            raise ConfigError(
                f"nnodes={nnodes} but {len(hosts)} hosts were given: with hosts, each host is "
                "one node; leave nnodes out."
            )
        if local_nodes is not None:
            raise ConfigError("local_nodes applies to simulated nodes; with hosts every host runs.")
        starter: Starter = Hosts(
            hosts, ssh_config, ssh_options, python, remote_run_dir, master_port
        )
        nnodes = len(hosts)
    else:
        if ssh_config is not None or ssh_options or python or remote_run_dir:
            raise ConfigError(
                "ssh_config, ssh_options, python and remote_run_dir need hosts=[...]."
            )
        nnodes = 2 if nnodes is None else nnodes
    # The port is chosen by the backend's preflight; 1 is a placeholder until then.
    topology = Topology(
        nnodes,
        nproc_per_node,
        master_addr or ("127.0.0.1" if hosts is None else FIRST_HOST),
        1,
        rdzv_timeout,
        max_restarts,
    )
    if hosts is None:
        topology, nodes = check_launch(topology, master_port, local_nodes)
        starter = Local(nodes)
    plan = Plan(
        what,
        topology,
        progress=progress,
        env=env,
        resume=resume,
        overwrite=overwrite,
        hang_timeout=hang_timeout,
        on_hang=on_hang,
    )
    return run(plan, run_dir, starter, wait=wait)


class Local:
    """Simulated nodes: every node's torchrun agent on this machine, the store on loopback."""

    data_here = True

    def __init__(self, nodes: list[int]) -> None:
        self.nodes = nodes  # the node ranks started here (checked, with the port, by launch)

    def check(self, plan: Plan) -> None:
        pass  # launch() checked the nodes and the port

    def preflight(self, plan: Plan) -> Topology:
        return plan.topology

    def start(self, plan: Plan) -> Job:
        topology, run_dir = plan.topology, plan.run_dir
        logger.info(
            "launching %d node(s) x %d process(es); node 0 is the master and hosts the "
            "rendezvous at %s:%d",
            topology.nnodes,
            topology.nproc_per_node,
            topology.master_addr,
            topology.master_port,
        )
        nodes = Processes()
        # The run's lifetime is tied to this process: when it ends, however it ends, the
        # pipe's write end closes and every agent stops its node (see agent.watch_lifeline).
        lifeline_read, nodes.lifeline = open_lifeline()
        env = {
            **os.environ,
            **plan.node_env(
                str(run_dir),
                len(self.nodes) * topology.nproc_per_node,
                pythonpath=os.environ.get("PYTHONPATH"),
            ),
            LIFELINE_ENV: str(lifeline_read),
        }
        try:
            for n in self.nodes:
                cmd = topology.command(  # the agent: torchrun, its store bound to loopback
                    [sys.executable, str(AGENT)],
                    n,
                    plan.script,
                    str(run_dir),
                    log_dir=str(run_dir / "logs" / f"node-{n}"),
                )
                nodes.start(
                    n,
                    cmd,
                    run_dir / "logs" / f"node-{n}.log",
                    shlex.join(cmd),
                    cwd=run_dir,
                    env=env,
                    stdin=subprocess.DEVNULL,
                    pass_fds=(lifeline_read,),
                )
        except BaseException as e:  # an OSError, or Ctrl-C/SIGTERM before the Job exists
            nodes.kill_all()  # nothing to save yet; its workers see EOF too
            if isinstance(e, OSError):
                raise LaunchError(f"Could not start torchrun: {e}") from e
            raise
        finally:
            os.close(lifeline_read)  # the agents hold it now
        return Job(run_dir, plan.script, plan.config, topology, nodes, **plan.follow)


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
