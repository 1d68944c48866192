"""The network between the hosts of a run, checked over SSH before anything starts (about 20 s
at most): what :mod:`ddpnb.meshcheck` proves, its agent sent to each host as ``python -c``."""

from __future__ import annotations

import dataclasses
import json
import subprocess
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from . import meshcheck
from .errors import NetworkError
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

    host: str  # as the user wrote it
    address: str | None
    interface: str | None
    reaches_node0: str  # 'ok', 'refused', 'timed out', 'no route', or '-' (not checked)
    mesh: str  # 'ok', or the peers it could not connect to
    versions: str
    why: str  # why this interface (or why the host could not be checked)
    env: dict[str, str]  # the interface variables its agent gets


@dataclasses.dataclass
class NetworkReport:
    """What :func:`check_network` found: ``rows`` (one per host), ``problems``, a table."""

    rows: list[HostRow]
    problems: list[tuple[str, str]]
    master_addr: str
    master_port: int
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.problems

    def env(self, node: int) -> dict[str, str]:
        """The interface variables to add to node ``node``'s agent (none the user set)."""
        return dict(self.rows[node].env)

    def hosts(self) -> Table:
        """A row per host: its node, host, and the columns of :data:`CHECKS`."""
        return Table(
            dict(node=n, host=r.host, address=r.address or "?", interface=r.interface or "?")
            | {"reaches node 0": r.reaches_node0, "mesh": r.mesh, "versions": r.versions}
            for n, r in enumerate(self.rows)
        )

    def table(self) -> str:
        """:meth:`hosts`, then each host's interface, why, and the variables it sets."""
        where = f"node 0 at {self.master_addr}:{self.master_port}; checked in {self.seconds:.1f} s"
        lines = [str(self.hosts()), f"{where}. Interfaces:"]
        for r in self.rows:
            chosen = " ".join(f"{k}={v}" for k, v in r.env.items()) or "nothing set"
            lines.append(f"  {r.host}: {r.interface or '?'}, {r.why} ({chosen})")
        return "\n".join(lines)

    __str__ = table


def check_network(
    ssh: Ssh,
    hosts: list[Host],
    python: str,
    master_addr: str,
    master_port: int,
    backend: str = "gloo",
    user_env: Mapping[str, str] = {},  # noqa: B006 (read only)
) -> NetworkReport:
    """Check that every host reaches node 0 and every other host; choose each interface.

    ``hosts``: node 0 first. ``backend``: 'gloo' or 'nccl' (which variables are set).
    ``user_env``: what the hosts get (an interface variable set there is kept). Raises
    :class:`~ddpnb.errors.NetworkError` naming each failing host and the fix.
    """
    start = time.monotonic()
    args = dict(master_addr=master_addr, master_port=master_port, timeout=CHECK_TIMEOUT)
    args["ifname"] = user_env.get("GLOO_SOCKET_IFNAME") or None
    args["connect_timeout"] = min(meshcheck.CONNECT_TIMEOUT, CHECK_TIMEOUT / 4)
    nodes, problems = run_agents(ssh, hosts, python, args)
    rows = [_row(node, backend, user_env) for node in nodes]
    report = NetworkReport(rows, problems, master_addr, master_port, time.monotonic() - start)
    if problems:
        head = meshcheck.explain(problems, "The network check failed; nothing was started")
        raise NetworkError(f"{head}\n\n{report}", host=problems[0][0], report=report)
    return report


def run_agents(ssh: Ssh, hosts: Sequence[Host], python: str, args: dict):
    """:func:`meshcheck.relay` with one agent per host over SSH: its nodes and problems."""
    program = Path(meshcheck.__file__).read_text()
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT}
    agents = []  # each in a session of its own: ours to end, by its process group
    for n, host in enumerate(hosts):
        line = remote_line([python, "-c", program, "--agent", json.dumps({**args, "rank": n})])
        cmd = ssh.command(host, line)
        agents.append(subprocess.Popen(cmd, text=True, start_new_session=True, **pipes))
    why_ended = lambda code, said: ssh_failure(code, said, python)
    return meshcheck.relay([h.spec for h in hosts], agents, args, why_ended)


def _row(node: dict, backend: str, user_env: Mapping[str, str]) -> HostRow:
    facts, connects = node.get("facts") or {}, node.get("connects") or {}
    failed = sorted(k for k, seen in connects.items() if k != "master" and seen != "ok")
    mesh = "ok" if not failed else "cannot reach node " + ", ".join(failed)
    return HostRow(
        host=node["name"],
        address=facts.get("address"),
        interface=facts.get("iface"),
        reaches_node0=connects.get("master", "-"),
        mesh="-" if node.get("error") else mesh,
        versions=meshcheck.show_versions(node.get("versions")),
        why=node.get("error") or facts.get("why", ""),
        env=meshcheck.ifname_env(facts.get("iface"), backend, user_env),
    )
