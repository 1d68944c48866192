"""The shape of a run: how many nodes and processes, and where they meet.

One value instead of six keywords passed around together: the launcher, the
progress display, the per-node commands and the sbatch script all read it.
"""

from __future__ import annotations

import dataclasses

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

    def torchrun_args(self, node_rank: int, log_dir: str | None = None) -> list[str]:
        """torchrun's options for one node under static rendezvous (node 0 hosts it).

        >>> Topology(1, 1, "127.0.0.1", 29500).torchrun_args(0)[:2]
        ['--nnodes=1', '--node_rank=0']
        """
        args = [
            f"--nnodes={self.nnodes}",
            f"--node_rank={node_rank}",
            f"--nproc_per_node={self.nproc_per_node}",
            f"--master_addr={self.master_addr}",
            f"--master_port={self.master_port}",
            f"--max_restarts={self.max_restarts}",
            f"--rdzv_conf=timeout={self.rdzv_timeout}",
        ]
        if log_dir:
            args += [f"--log_dir={log_dir}", "--tee=3", "--log_line_prefix_template=[rank${rank}] "]
        return args
