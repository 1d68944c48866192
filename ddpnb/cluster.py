"""Commands for real machines: the torchrun line each node runs, to paste or print."""

from __future__ import annotations

import hashlib
import ipaddress
import os
import shlex
import warnings
from collections.abc import Mapping, Sequence
from contextlib import suppress
from typing import Any

from .config import TrainConfig
from .errors import ConfigError
from .preflight import as_config
from .script import Script
from .topology import Topology, launcher

TRUST_NOTE = "# The rendezvous store is unauthenticated: use a trusted, private network only."
FINGERPRINT_NOTE = (
    "# Every node must hold the identical dataset at data_dir (copy it with rsync -a, or use a\n"
    "# shared filesystem). At start-up the ranks compare dataset fingerprints and stop with an\n"
    "# error naming the nodes whose data differ. `ddpnb check DIR` prints a node's fingerprint.\n"
    + TRUST_NOTE
)


def node_commands(
    what: Script | TrainConfig | Mapping[str, Any],
    run_dir: str | os.PathLike,
    hosts: Sequence[str],
    nproc_per_node: int = 1,
    master_port: int = 29500,
    rendezvous: str = "static",
    max_restarts: int = 0,
    rdzv_timeout: int = 60,
    node_rank: int | None = None,
    *,
    python: str | None = None,
) -> list[str]:
    """The exact ``torchrun`` command to paste on each host (``hosts[0]`` is the master).

    ``what``: a :class:`~ddpnb.Script` or the worker's TrainConfig; ``run_dir``: where its
    files sit on every node. ``rendezvous="static"`` gives each host its ``--node_rank``;
    ``"c10d"``: an elastic rendezvous on the first host, each line naming its own
    ``--local_addr``. ``node_rank``: only that node's line. ``python``: the hosts'
    interpreter, to run ``python -m torch.distributed.run`` (default ``torchrun`` on PATH).
    """
    script = what if isinstance(what, Script) else Script.worker(as_config(what))
    hosts = list(hosts)
    if not hosts or not all(isinstance(h, str) and h for h in hosts):
        raise ConfigError("hosts must be a non-empty list of host names or addresses.")
    topology = Topology(
        nnodes=len(hosts),
        nproc_per_node=nproc_per_node,
        master_addr=hosts[0],
        master_port=master_port,
        rdzv_timeout=rdzv_timeout,
        max_restarts=max_restarts,
    )
    if node_rank is not None:
        topology.check_node(node_rank)
    with suppress(ValueError):  # a hostname: cannot tell
        if ipaddress.ip_address(hosts[0]).is_global:
            warnings.warn(
                f"master address {hosts[0]} is a public address. torch.distributed's TCPStore has "
                "no authentication: run multi-node jobs only on a trusted private network.",
                stacklevel=2,
            )
    # Unique per run directory: two jobs on one endpoint cannot collide.
    rdzv_id = f"ddpnb-{hashlib.sha256(str(run_dir).encode()).hexdigest()[:12]}"
    options = {"rendezvous": rendezvous, "rdzv_id": rdzv_id}
    start = launcher(python)
    lines = [
        shlex.join(topology.command(start, n, script, str(run_dir), local_addr=h, **options))
        for n, h in enumerate(hosts)
    ]
    return lines if node_rank is None else [lines[node_rank]]


def format_node_commands(hosts: Sequence[str], commands: Sequence[str]) -> str:
    """Commands with a header per host, ready to print."""
    parts = [FINGERPRINT_NOTE]
    for rank, (host, cmd) in enumerate(zip(hosts, commands)):
        role = " (master: hosts the rendezvous)" if rank == 0 else ""
        parts.append(f"# on {host}, node_rank {rank}{role}\n{cmd}")
    return "\n\n".join(parts)
