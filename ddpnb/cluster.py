"""Commands for real clusters: per-node torchrun lines and a SLURM batch script."""

from __future__ import annotations

import hashlib
import ipaddress
import os
import re
import shlex
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .config import TrainConfig
from .errors import ConfigError
from .preflight import as_config
from .reporting import RUN_DIR_ENV
from .script import Script, worker_script
from .topology import Topology

FINGERPRINT_NOTE = (
    "# Every node must hold the identical dataset at data_dir (copy it with rsync -a, or use a\n"
    "# shared filesystem). At start-up the ranks compare dataset fingerprints and stop with an\n"
    "# error naming the nodes whose data differ. `ddpnb check DIR` prints a node's fingerprint.\n"
    "# The rendezvous store is unauthenticated: use a trusted, private network only."
)


def _is_public(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_global
    except ValueError:
        return False  # a hostname: cannot tell


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
) -> list[str]:
    """The exact ``torchrun`` command to paste on each host (``hosts[0]`` is the master).

    ``what``: a :class:`~ddpnb.Script` or the worker's TrainConfig. ``rendezvous="static"``
    gives each host its ``--node_rank`` and ``--master_addr``; ``"c10d"`` uses an elastic
    rendezvous hosted on the first host. Each c10d line names its own host
    (``--local_addr``) and the first says it hosts the store (``is_host=1``): torchrun
    would otherwise guess both from the machine's host name, which on clusters with a
    separate training network resolves elsewhere. ``run_dir`` is where the script and
    its files sit on every node. ``node_rank`` returns that one node's line only.

    Example
    -------
    >>> cmds = node_commands(TrainConfig(), "/shared/run", hosts=["10.0.0.1", "10.0.0.2"])
    >>> cmds[1].split()[:3]
    ['torchrun', '--nnodes=2', '--node_rank=1']
    """
    argvs = node_argvs(
        what, run_dir, hosts, nproc_per_node, master_port, rendezvous, max_restarts, rdzv_timeout
    )
    if node_rank is not None and not (isinstance(node_rank, int) and 0 <= node_rank < len(argvs)):
        raise ConfigError(
            f"node_rank must be in 0..{len(argvs) - 1} (node_rank < nnodes = len(hosts)), "
            f"got {node_rank!r}."
        )
    lines = [shlex.join(argv) for argv in argvs]
    return lines if node_rank is None else [lines[node_rank]]


def node_argvs(
    what: Script | TrainConfig | Mapping[str, Any],
    run_dir: str | os.PathLike,
    hosts: Sequence[str],
    nproc_per_node: int = 1,
    master_port: int = 29500,
    rendezvous: str = "static",
    max_restarts: int = 0,
    rdzv_timeout: int = 60,
    *,
    launcher: Sequence[str] = ("torchrun",),
) -> list[list[str]]:
    """:func:`node_commands`' lines as argument lists, each starting with ``launcher``."""
    script = what if isinstance(what, Script) else worker_script(as_config(what))
    hosts = list(hosts)
    if not hosts or not all(isinstance(h, str) and h for h in hosts):
        raise ConfigError("hosts must be a non-empty list of host names or addresses.")
    topology = Topology(
        len(hosts), nproc_per_node, hosts[0], master_port, rdzv_timeout, max_restarts
    )
    if _is_public(hosts[0]):
        warnings.warn(
            f"master address {hosts[0]} is a public address. torch.distributed's TCPStore has no "
            "authentication: run multi-node jobs only on a trusted private network.",
            stacklevel=3,  # the caller of node_commands or ssh_commands
        )
    # Unique per run directory, so two jobs on one endpoint cannot collide.
    rdzv_id = f"ddpnb-{hashlib.sha256(str(run_dir).encode()).hexdigest()[:12]}"
    return [
        topology.command(
            launcher,
            rank,
            script,
            str(run_dir),
            rendezvous=rendezvous,
            rdzv_id=rdzv_id,
            local_addr=host,
        )
        for rank, host in enumerate(hosts)
    ]


def format_node_commands(hosts: Sequence[str], commands: Sequence[str]) -> str:
    """Commands with a header per host, ready to print."""
    parts = [FINGERPRINT_NOTE]
    for rank, (host, cmd) in enumerate(zip(hosts, commands)):
        role = " (master: hosts the rendezvous)" if rank == 0 else ""
        parts.append(f"# on {host}, node_rank {rank}{role}\n{cmd}")
    return "\n\n".join(parts)


def _batch_word(word: str) -> str:
    """A word of the batch script: quoted, but the job's own variables expand."""
    if re.search(r"\$(head_node|master_port|SLURM_\w+)", word):
        return '"' + word + '"'
    return shlex.quote(word)


def slurm_script(
    what: Script | TrainConfig | Mapping[str, Any],
    run_dir: str | os.PathLike,
    nnodes: int = 2,
    nproc_per_node: int = 1,
    master_port: int | None = 29500,
    job_name: str = "ddpnb",
    time_limit: str = "01:00:00",
    gpus_per_node: int = 0,
    path: str | os.PathLike | None = None,
    *,
    partition: str | None = None,
    account: str | None = None,
    python: str | None = None,
    max_restarts: int = 0,
    rdzv_timeout: int = 300,
    marker: str | None = None,
    network_check: bool = False,
    batch_log: str | None = "%x-%j.out",
    env: Mapping[str, str] | None = None,
) -> str:
    """An sbatch script that runs the worker with one torchrun per node (c10d rendezvous).

    Writes it to ``path`` when given. Submit with ``sbatch train.sbatch`` (or let
    :func:`ddpnb.submit_slurm` do it). ``master_port=None`` derives the rendezvous
    port from the job id, so two jobs sharing a first node do not collide. ``python``
    runs torchrun as ``python -m torch.distributed.run`` (default: ``torchrun`` on
    PATH). ``marker``: a token the run directory's ``.ddpnb-submit-marker`` must hold
    on every node, else the job exits at once with code 97 (no shared filesystem).
    Each node's output goes to ``run_dir/logs/node-N.log``, lines prefixed by rank;
    the script's own to ``batch_log`` (in the submit directory unless absolute; its
    folder must exist before the job starts). ``env`` is exported to every node.
    ``network_check``: the job's first step runs ``ddpnb_meshcheck.py`` (which must be in
    ``run_dir``) on every node: each reaches the first node's rendezvous port and every
    peer, or the job stops at once (exit 96) with the problems named in the batch log;
    each node's interface toward the first node becomes its ``GLOO_SOCKET_IFNAME`` (and
    NCCL's) unless set.

    Example
    -------
    >>> "torchrun" in slurm_script(TrainConfig(), "/shared/run", nnodes=4)
    True
    """
    script = what if isinstance(what, Script) else worker_script(as_config(what))
    # The head node's address is known only inside the allocation: a placeholder here.
    topology = Topology(
        nnodes, nproc_per_node, "$head_node", master_port or 1, rdzv_timeout, max_restarts
    )
    run_dir = Path(run_dir)
    q = shlex.quote
    options = [
        f"--job-name={job_name}",
        f"--nodes={topology.nnodes}",
        "--ntasks-per-node=1",
        f"--time={time_limit}",
        "--open-mode=append",  # a requeued job adds to its logs
    ]
    # The batch script's own output, which Slurm opens first (None: given to sbatch itself,
    # as a #SBATCH line cannot hold a path with spaces).
    options += [f"--output={batch_log}"] if batch_log else []
    options += [f"--partition={partition}"] if partition else []
    options += [f"--account={account}"] if account else []
    options += [f"--gpus-per-node={gpus_per_node}"] if gpus_per_node else []
    header = "\n".join(f"#SBATCH {o}" for o in options)
    launcher = f"{q(python)} -m torch.distributed.run" if python else "torchrun"
    # None: a port from the job id, so two jobs whose first node is the same do not collide.
    port = str(master_port) if master_port else "$master_port"
    port_line = "" if master_port else "master_port=$((20000 + SLURM_JOB_ID % 20000))\n"
    check = ""
    if marker:
        marker_path = q(str(run_dir / ".ddpnb-submit-marker"))
        check = f"""
# The run directory must be on a filesystem every node shares: each node checks that it
# sees the marker the submit host wrote there, else the job ends at once (exit 97).
srun --ntasks-per-node=1 bash -c 'grep -qx "$1" "$0" 2>/dev/null || {{ echo "ddpnb: node \
$SLURMD_NODENAME cannot see $0, the marker written at submission: the run directory must \
be on a filesystem shared by the submit host and every node." >&2; exit 97; }}' \\
    {marker_path} {q(marker)}
"""
    args = topology.command(
        [],
        None,
        script,
        str(run_dir),
        log_dir="",
        rendezvous="c10d",
        rdzv_id="$SLURM_JOB_ID",
        port=port,
    )
    torchrun = " \\\n    ".join(_batch_word(a) for a in args)
    exports = "".join(f"export {k}={q(v)}\n" for k, v in (env or {}).items())
    network = ""
    if network_check:
        checker = q(python or "python3")
        network = f"""# The network, proven before training: every node reaches the first node's port and
# every peer, on its interface toward the first node (written to logs/net-env-N.sh for
# torchrun below). A node that cannot stops the job at once (exit 96), named in this log.
srun --ntasks-per-node=1 bash -c '"$@" --node-rank "$SLURM_NODEID" \\
    --env-file "$DDPNB_RUN_DIR/logs/net-env-$SLURM_NODEID.sh" || exit 96' bash \\
    {checker} "$DDPNB_RUN_DIR/ddpnb_meshcheck.py" --nnodes "$SLURM_NNODES" \\
    --master-addr "$head_node" --master-port "{port}" --timeout 20 --backend gloo

"""
    text = f"""#!/bin/bash
{header}

# One torchrun agent per node (ntasks-per-node=1); each starts {topology.nproc_per_node} worker(s).
# The first node of the allocation hosts the c10d rendezvous.
{FINGERPRINT_NOTE}
set -euo pipefail
{check}
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# The address Slurm itself uses for that node (a node name need not resolve everywhere).
head_addr=$(scontrol show node "$head_node" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')
head_node=${{head_addr:-$head_node}}
{port_line}mkdir -p {q(str(run_dir))}/logs
export {RUN_DIR_ENV}={q(str(run_dir))} DDPNB_LAUNCHED=1 PYTHONUNBUFFERED=1
{exports}
# srun starts one task per node. Its options, set as its environment variables: stop
# every node when one fails; each node's output to logs/node-N.log (N: the node's index
# in the job), appended to after a requeue.
{network}export SLURM_KILL_ON_BAD_EXIT=1 SLURM_OPEN_MODE=append
export SLURM_STDOUTMODE={q(str(run_dir / "logs" / "node-%n.log"))}
# After a torchrun restart the agents meet in a new rendezvous round. Each round's workers
# get a store of their own (hosted by rank 0) rather than the agents' shared one, whose
# keys outlive the round: under c10d each agent counts only its own restarts, so a
# per-attempt key prefix could differ between nodes and they would never meet.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# Each node names its own address (Slurm's NodeAddr) and the first node says it hosts the
# store (torchrun reads PET_<OPTION> as that option): torchrun would otherwise go by the
# host name, which on clusters with a separate training network resolves to the other one.
srun bash -c 'addr=$(scontrol show node "$SLURMD_NODENAME" | sed -n "s/.*NodeAddr=\\([^ ]*\\).*/\\1/p")
export PET_LOCAL_ADDR="${{addr:-$SLURMD_NODENAME}}"
export PET_RDZV_CONF="join_timeout={topology.rdzv_timeout},is_host=$((SLURM_NODEID == 0))"
export PET_LOG_DIR="$DDPNB_RUN_DIR/logs/node-$SLURM_NODEID"
net="$DDPNB_RUN_DIR/logs/net-env-$SLURM_NODEID.sh"; if [ -f "$net" ]; then . "$net"; fi
exec "$@"' bash {launcher} \\
    {torchrun}
"""
    if path is not None:
        Path(path).write_text(text)
    return text
