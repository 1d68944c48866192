"""The shape of a run: how many nodes and processes, where they meet, and torchrun's options.

One value instead of six keywords passed around together. :meth:`Topology.command` is
the one place a node's torchrun command line is built: the simulated nodes, the SSH
hosts, the sbatch script and the printed per-node and ssh lines all take it from here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from .config import check_int
from .errors import ConfigError


@dataclasses.dataclass(frozen=True)
class Topology:
    """``nnodes`` x ``nproc_per_node`` processes meeting at ``master_addr:master_port``.

    Example
    -------
    >>> Topology(nnodes=2, nproc_per_node=2, master_addr="127.0.0.1", master_port=29500).world_size
    4
    """

    nnodes: int
    nproc_per_node: int
    master_addr: str
    master_port: int
    rdzv_timeout: int = 60
    max_restarts: int = 0

    def __post_init__(self) -> None:
        check_int("nnodes", self.nnodes)
        check_int("nproc_per_node", self.nproc_per_node)
        check_int("rdzv_timeout", self.rdzv_timeout)
        check_int("max_restarts", self.max_restarts, low=0)
        check_int("master_port", self.master_port, low=1, high=65535)
        if not isinstance(self.master_addr, str) or not self.master_addr:
            raise ConfigError(
                f"master_addr must be a host name or address, got {self.master_addr!r}."
            )

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def command(
        self, launcher: Sequence[str], node_rank: int | None, script: Any, run_dir: str, **options
    ) -> list[str]:
        """One node's whole command line: ``launcher`` (``["torchrun"]``, or an interpreter
        running torchrun), torchrun's options (:meth:`torchrun_args` with ``options``), then
        the script (a :class:`ddpnb.Script` in ``run_dir``) and its arguments.

        >>> from ddpnb.script import Script
        >>> Topology(1, 1, "127.0.0.1", 29500).command(["torchrun"], 0, Script("t.py"), "/r")[:2]
        ['torchrun', '--nnodes=1']
        """
        return [*launcher, *self.torchrun_args(node_rank, **options), *script.command(run_dir)]

    def torchrun_args(
        self,
        node_rank: int | None,
        log_dir: str | None = None,
        *,
        rendezvous: str = "static",
        rdzv_id: str = "",
        local_addr: str | None = None,
        port: str | None = None,
    ) -> list[str]:
        """torchrun's options for one node (node 0 hosts the rendezvous).

        ``static``: each node gets its ``--node_rank``. ``c10d``: an elastic rendezvous
        at ``master_addr:master_port`` named ``rdzv_id``; ``local_addr`` names this
        node's own address, and ``node_rank`` 0 says it hosts the store (``is_host=1``).
        A ``node_rank`` of None leaves both to the environment (``PET_RDZV_CONF``,
        ``PET_LOCAL_ADDR``: the sbatch script sets them per node). ``port`` replaces
        the port's text (a shell variable in a batch script).

        >>> Topology(1, 1, "127.0.0.1", 29500).torchrun_args(0)[:2]
        ['--nnodes=1', '--node_rank=0']
        """
        port = port or str(self.master_port)
        if rendezvous == "static":
            args = [
                f"--nnodes={self.nnodes}",
                f"--node_rank={node_rank}",
                f"--nproc_per_node={self.nproc_per_node}",
                f"--master_addr={self.master_addr}",
                f"--master_port={port}",
                f"--max_restarts={self.max_restarts}",
                f"--rdzv_conf=timeout={self.rdzv_timeout}",
            ]
        elif rendezvous == "c10d":
            args = [
                f"--nnodes={self.nnodes}",
                f"--nproc_per_node={self.nproc_per_node}",
                "--rdzv_backend=c10d",
                f"--rdzv_endpoint={self.master_addr}:{port}",
                f"--rdzv_id={rdzv_id}",
            ]
            if node_rank is not None:
                args.append(
                    f"--rdzv_conf=join_timeout={self.rdzv_timeout},is_host={int(node_rank == 0)}"
                )
            if local_addr:
                args.append(f"--local_addr={local_addr}")
            args.append(f"--max_restarts={self.max_restarts}")
        else:
            raise ConfigError("rendezvous must be 'static' or 'c10d'.")
        if log_dir is not None:  # "": the folder comes from the environment (PET_LOG_DIR)
            args += [f"--log_dir={log_dir}"] if log_dir else []
            args += ["--tee=3", "--log_line_prefix_template=[rank${rank}] "]
        return args
