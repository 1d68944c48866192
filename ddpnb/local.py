"""Simulated nodes: every node's torchrun agent on this machine, the store on loopback."""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

from .agent import LIFELINE_ENV, loopback_bind_address
from .config import check_int
from .errors import ConfigError
from .log import logger
from .pipeline import AGENT, Processes
from .plan import Plan
from .preflight import check_port_free, free_port
from .topology import Topology


class Local(Processes):
    """Simulated nodes: ``local_nodes`` (default all) of ``nnodes`` start here.

    ``master_port`` None picks a free port; a given one must be free when node 0 runs here.
    """

    def __init__(
        self,
        nnodes: int,
        nproc_per_node: int,
        master_addr: str | None,
        master_port: int | None,
        rdzv_timeout: int,
        max_restarts: int,
        local_nodes: Iterable[int] | None = None,
    ) -> None:
        super().__init__()
        check_int("nnodes", nnodes)
        self.nodes = sorted(set(range(nnodes) if local_nodes is None else local_nodes))
        for n in self.nodes:
            if not isinstance(n, int) or not 0 <= n < nnodes:
                raise ConfigError(
                    f"node_rank {n!r} must be in 0..{nnodes - 1} (node_rank < nnodes)."
                )
        master_addr = master_addr or "127.0.0.1"
        bind_host = loopback_bind_address(master_addr) if isinstance(master_addr, str) else None
        if master_port is None:
            master_port = free_port(bind_host or "")  # "": every interface
        elif 0 in self.nodes and isinstance(master_port, int):
            check_port_free(bind_host or "", master_port)
        self.topology = Topology(
            nnodes, nproc_per_node, master_addr, master_port, rdzv_timeout, max_restarts
        )
        self.nnodes, self.nproc_per_node = nnodes, nproc_per_node

    def preflight(self, plan: Plan, run_dir: Path) -> Topology:
        return self.topology

    def start(self, plan: Plan, run_dir: Path, topology: Topology) -> None:
        logger.info(
            "launching %d node(s) x %d process(es); node 0 is the master and hosts the "
            "rendezvous at %s:%d",
            *dataclasses.astuple(topology)[:4],  # nnodes, nproc_per_node, master_addr, _port
        )
        procs_here = len(self.nodes) * topology.nproc_per_node
        node_env = plan.node_env(str(run_dir), procs_here, pythonpath=os.environ.get("PYTHONPATH"))
        agent = [sys.executable, str(AGENT)]  # torchrun, its store bound to loopback
        cmds = {}
        for n in self.nodes:
            log_dir = str(run_dir / "logs" / f"node-{n}")
            cmds[n] = topology.command(agent, n, plan.script, str(run_dir), log_dir=log_dir)

        def commands(lifeline: int) -> dict:  # every agent stops its node when this process ends
            env = {**os.environ, **node_env, LIFELINE_ENV: str(lifeline)}
            popen = dict(cwd=run_dir, env=env, stdin=subprocess.DEVNULL, pass_fds=(lifeline,))
            return {n: (cmd, shlex.join(cmd), popen) for n, cmd in cmds.items()}

        self.spawn_all(run_dir, "torchrun", commands)
