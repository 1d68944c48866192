"""The network between the hosts of a run, checked over SSH before anything starts.

In about 20 s, every host at once: master_addr resolves, node 0's port and every peer answer
on the host's interface toward node 0 (its ``GLOO_SOCKET_IFNAME`` unless the user set one),
torch versions match. Hosts need Python only: :mod:`ddpnb.meshcheck` goes as ``python -c``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from . import meshcheck
from .errors import ConfigError, NetworkError
from .ssh import Host, Ssh, remote_line, ssh_failure
from .tables import Table

CHECK_TIMEOUT = 20.0  # seconds the whole check may take, whatever hangs
#: What the check fills in for each host: the columns of its table, and what each proves.
CHECKS = {
    "address": "where the peers reach this host (its address toward node 0)",
    "interface": "the interface its traffic to node 0 takes (ip route get): its GLOO/NCCL_SOCKET_IFNAME",
    "reaches node 0": "a TCP connection to master_addr:master_port: ok, refused, timed out, no route",
    "mesh": "a TCP connection to every other host's ephemeral port, as gloo and NCCL make",
    "versions": "torch, CUDA and NCCL, compared with node 0's",
}


@dataclasses.dataclass(frozen=True)
class HostRow:
    """One host of the check: what it resolved, chose and reached."""

    node: int
    host: str  # as the user wrote it
    address: str | None
    interface: str | None
    why: str
    master: str | None  # master_addr as this host resolves it
    reaches_node0: str  # 'ok', 'refused', 'timed out', 'no route', or '-' (not checked)
    mesh: str  # 'ok', or the peers it could not connect to
    versions: str
    env: dict[str, str]  # the interface variables its agent gets


@dataclasses.dataclass
class NetworkReport:
    """What :func:`check_network` found: ``rows`` (one per host), ``problems``, a table."""

    rows: list[HostRow]
    problems: list[tuple[str, str]]
    master_addr: str
    master_port: int
    backend: str
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.problems

    def env(self, node: int) -> dict[str, str]:
        """The interface variables to add to node ``node``'s agent (none the user set)."""
        return dict(self.rows[node].env)

    def table(self) -> str:
        rows = Table(
            {"node": str(r.node), "host": r.host, "address": r.address or "?",
             "interface": r.interface or "?", "reaches node 0": r.reaches_node0, "mesh": r.mesh,
             "versions": r.versions}
            for r in self.rows
        )  # fmt: skip
        lines = [str(rows)]
        lines.append(f"node 0 at {self.master_addr}:{self.master_port}; checked in "
                     f"{self.seconds:.1f} s. Interfaces:")  # fmt: skip
        for r in self.rows:
            chosen = " ".join(f"{k}={v}" for k, v in r.env.items()) or "nothing set"
            lines.append(f"  {r.host}: {r.interface or '?'}, {r.why} ({chosen})")
        if self.problems:
            lines.append("Problems:")
            lines += [f"  - {host} {text}" for host, text in self.problems]
        return "\n".join(lines)

    __str__ = table


def check_network(
    ssh: Ssh,
    hosts: list[Host],
    python: str,
    *,
    master_addr: str,
    master_port: int,
    backend: str = "gloo",
    user_env: Mapping[str, str] = {},  # noqa: B006 (read only)
    timeout: float = CHECK_TIMEOUT,
) -> NetworkReport:
    """Check that every host reaches node 0 and every other host; choose each interface.

    ``hosts``: node 0 first. ``user_env``: what the hosts get (an interface variable set there
    is kept). Raises :class:`~ddpnb.errors.NetworkError` naming each failing host and the fix.

    >>> check_network(Ssh(), parse_hosts(["gpu1", "gpu2"]), "python3", master_addr="gpu1",
    ...               master_port=29500).env(1)  # doctest: +SKIP
    {'GLOO_SOCKET_IFNAME': 'ib0'}
    """
    if not hosts:
        raise ConfigError("check_network needs at least one host (node 0 first).")
    if not isinstance(master_port, int) or not 0 < master_port < 65536:
        raise ConfigError(f"master_port must be a port number 1..65535, got {master_port!r}.")
    if backend not in ("gloo", "nccl"):
        raise ConfigError(f"backend must be 'gloo' or 'nccl', got {backend!r}.")
    start = time.monotonic()
    args = {
        "master_addr": master_addr,
        "master_port": master_port,
        "timeout": timeout,
        "ifname": user_env.get("GLOO_SOCKET_IFNAME") or None,
        "connect_timeout": min(meshcheck.CONNECT_TIMEOUT, timeout / 4),
    }
    nodes, problems = run_agents(ssh, hosts, python, args)
    rows = [_row(n, node, backend, user_env) for n, node in enumerate(nodes)]
    report = NetworkReport(
        rows, problems, master_addr, master_port, backend, time.monotonic() - start
    )
    if problems:
        head = meshcheck.explain(problems, "The network check failed; nothing was started")
        raise NetworkError(f"{head}\n\n{report}", host=problems[0][0], report=report)
    return report


def run_agents(ssh: Ssh, hosts: Sequence[Host], python: str, args: dict):
    """:func:`meshcheck.relay` with one agent per host over SSH: its nodes and problems."""
    agents, program = [], Path(meshcheck.__file__).read_text()
    for n, host in enumerate(hosts):
        line = remote_line([python, "-c", program, "--agent", json.dumps({**args, "rank": n})])
        pipe = subprocess.PIPE  # a session of its own: ours to end, by its process group
        agents.append(subprocess.Popen(ssh.command(host, line), stdin=pipe, stdout=pipe,
                      stderr=subprocess.STDOUT, text=True, start_new_session=True))  # fmt: skip
    why_ended = functools.partial(ssh_failure, python=python)
    return meshcheck.relay([h.spec for h in hosts], agents, args, why_ended)


def _row(n: int, node: dict, backend: str, user_env: Mapping[str, str]) -> HostRow:
    facts = node.get("facts") or {}
    iface = facts.get("iface")
    connects = node.get("connects") or {}
    failed = [k for k, seen in connects.items() if k != "master" and seen != "ok"]
    if node.get("error"):
        mesh, why = "-", node["error"]
    else:
        mesh = "ok" if not failed else "cannot reach node " + ", ".join(sorted(failed))
        why = facts.get("why", "")
    return HostRow(
        node=n,
        host=node["name"],
        address=facts.get("address"),
        interface=iface,
        why=why,
        master=facts.get("master"),
        reaches_node0=connects.get("master", "-"),
        mesh=mesh,
        versions=meshcheck.show_versions(node.get("versions")),
        env=meshcheck.ifname_env(iface, backend, user_env),
    )
