"""The shape of a run: nodes, processes, where they meet; ``command`` builds every torchrun line."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from .config import check_int
from .errors import ConfigError


def launcher(python: str | None = None) -> list[str]:
    """What starts torchrun on a node: ``torchrun`` on its PATH, or ``python`` (a path there)
    running ``-m torch.distributed.run`` (the same program, found through that interpreter)."""
    return [python, "-m", "torch.distributed.run"] if python else ["torchrun"]


@dataclasses.dataclass(frozen=True)
class Topology:
    """``nnodes`` x ``nproc_per_node`` processes meeting at ``master_addr:master_port`` (both None
    for a Slurm job: they are the job's, once it runs)."""

    nnodes: int
    nproc_per_node: int
    master_addr: str | None = None
    master_port: int | None = None
    rdzv_timeout: int = 60
    max_restarts: int = 0

    def __post_init__(self) -> None:
        for name in ("nnodes", "nproc_per_node", "rdzv_timeout"):
            check_int(name, getattr(self, name))
        check_int("max_restarts", self.max_restarts, low=0)
        if self.master_port is not None:
            check_int("master_port", self.master_port, low=1, high=65535)
        addr = self.master_addr
        if addr is not None and not (isinstance(addr, str) and addr):
            raise ConfigError(f"master_addr must be a host name or address, got {addr!r}.")

    world_size = property(lambda self: self.nnodes * self.nproc_per_node)

    def check_node(self, node_rank: Any) -> int:
        if not (isinstance(node_rank, int) and 0 <= node_rank < self.nnodes):
            raise ConfigError(
                f"node_rank must be in 0..{self.nnodes - 1} (node_rank < nnodes), got {node_rank!r}."
            )
        return node_rank

    def command(
        self,
        launcher: Sequence[str],
        node_rank: int | str,
        script: Any,
        run_dir: str,
        log_dir: str | None = None,
        *,
        rendezvous: str = "static",
        rdzv_id: str = "",
        local_addr: str | None = None,
        endpoint: str | None = None,
    ) -> list[str]:
        """One node's command line: ``launcher``, torchrun's options, the script and its arguments.

        ``c10d``: an elastic rendezvous named ``rdzv_id``, node 0 hosting the store. For a shell
        script (Slurm's), ``node_rank``, ``endpoint`` (``host:port``) and the others may be
        shell variables, ``node_rank`` such as ``$SLURM_NODEID``."""
        endpoint = endpoint or f"{self.master_addr}:{self.master_port}"
        restarts = self.max_restarts
        args = [*launcher, f"--nnodes={self.nnodes}"]
        if rendezvous == "static":
            addr, port = endpoint.rsplit(":", 1)
            args += [f"--node_rank={node_rank}", f"--nproc_per_node={self.nproc_per_node}"]
            args += [f"--master_addr={addr}", f"--master_port={port}", f"--max_restarts={restarts}"]
            args.append(f"--rdzv_conf=timeout={self.rdzv_timeout}")
        elif rendezvous == "c10d":
            args += [f"--nproc_per_node={self.nproc_per_node}", "--rdzv_backend=c10d"]
            args += [f"--rdzv_endpoint={endpoint}", f"--rdzv_id={rdzv_id}"]
            first = f"$(({node_rank} == 0))" if isinstance(node_rank, str) else int(node_rank == 0)
            args.append(f"--rdzv_conf=join_timeout={self.rdzv_timeout},is_host={first}")
            args += [f"--local_addr={local_addr}"] if local_addr else []
            args.append(f"--max_restarts={restarts}")
        else:
            raise ConfigError("rendezvous must be 'static' or 'c10d'.")
        if log_dir is not None:
            args += [f"--log_dir={log_dir}", "--tee=3", "--log_line_prefix_template=[rank${rank}] "]
        return [*args, *script.command(run_dir)]
