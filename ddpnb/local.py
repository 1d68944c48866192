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
from .constants import free_port
from .plan import Plan
from .preflight import check_port_free
from .scheduler import AGENT, Processes
from .topology import Topology


class Local(Processes):
    """Simulated nodes: ``local_nodes`` (default all) of the topology's start here; ``master_port``
    None picks a free port, a given one must be free when node 0 runs here."""

    def __init__(self, topology: Topology, local_nodes: Iterable[int] | None = None) -> None:
        super().__init__()
        nodes = range(topology.nnodes) if local_nodes is None else local_nodes
        self.nodes = sorted({topology.check_node(n) for n in nodes})
        addr = topology.master_addr or "127.0.0.1"
        bind_host = loopback_bind_address(addr) or ""  # "": every interface
        port = topology.master_port or free_port(bind_host)
        if topology.master_port and 0 in self.nodes:  # a given port
            check_port_free(bind_host, port)
        self.topology = dataclasses.replace(topology, master_addr=addr, master_port=port)

    def start(self, plan: Plan, run_dir: Path) -> None:
        procs_here = len(self.nodes) * self.topology.nproc_per_node
        node_env = plan.node_env(str(run_dir), procs_here, pythonpath=os.environ.get("PYTHONPATH"))
        agent = [sys.executable, str(AGENT)]  # torchrun, its store bound to loopback
        cmds = {}
        for n in self.nodes:
            log_dir = str(run_dir / "logs" / f"node-{n}")
            cmds[n] = self.topology.command(agent, n, plan.script, str(run_dir), log_dir=log_dir)

        def commands(lifeline: int) -> dict:  # every agent stops its node when this process ends
            env = {**os.environ, **node_env, LIFELINE_ENV: str(lifeline)}
            popen = dict(cwd=run_dir, env=env, stdin=subprocess.DEVNULL, pass_fds=(lifeline,))
            return {n: (cmd, shlex.join(cmd), popen) for n, cmd in cmds.items()}

        self.spawn_all(run_dir, "torchrun", commands)
