"""Launching on real hosts over SSH: one ``torchrun`` per host, followed from here. A host that
does not see this run directory gets the files copied and its results brought back."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import shlex
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from .agent import LIFELINE_ENV
from .config import TrainConfig
from .diagnosis import log_tail, resume_hint
from .errors import ConfigError, HostError, NodeLost, RunFailed
from .hang import WATCH_DIR
from .log import logger
from .network import check_network
from .preflight import as_config, check_run
from .rundir import PRODUCTS
from .scheduler import AGENT, Processes
from .script import Script
from .ssh import SSH_FAILED, Host, Ssh, pack, parse_hosts, remote_line, unpack
from .tables import Table
from .topology import Topology

PROBE_TIMEOUT = 15.0  # seconds a host has to answer the probe
REMOTE_STOP_SECONDS = 8.0  # a host's agent stops its node within its own grace (5 s)
SYNC_SECONDS = 2.0  # how often node 0's progress is copied here (one SSH login each)
STACKS_SYNC_SECONDS = 5.0  # how often the ranks' stacks are copied here (one login per host)
FORWARDED_ENV_PREFIXES = (
    "NCCL_",
    "GLOO_",
    "TORCH_NCCL_",
    "TORCH_FR_",  # the flight recorder's (TORCH_FR_BUFFER_SIZE)
    "TORCH_DISTRIBUTED_",
    "TORCH_CPP_LOG",
)


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The distributed-backend settings of ``environ`` (``NCCL_DEBUG``...) that hosts receive."""
    return {k: v for k, v in environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}


class Hosts(Processes):
    """The SSH backend: one host per node, its torchrun agent run through a local ``ssh``."""

    data_here = False

    def __init__(
        self,
        hosts: list[Host],
        topology: Topology,
        ssh: Ssh,
        python: str | None,
        remote_run_dir: str | None = None,
    ) -> None:
        super().__init__()
        self.parsed, self.topology, self.ssh = hosts, topology, ssh  # node 0's address: preflight's
        self.python = python or sys.executable
        if remote_run_dir is not None and not str(remote_run_dir).startswith("/"):
            raise ConfigError(
                f"remote_run_dir must be an absolute path on the hosts, got {remote_run_dir!r}."
            )
        self.remote_run_dir = remote_run_dir
        self.hosts = [h.spec for h in hosts]
        self._synced = self._stacks_synced = 0.0

    def host(self, node: int) -> str:
        return self.hosts[node]

    def preflight(self, plan, run_dir: Path) -> None:
        """Probe every host (and what its copy of the run directory holds), prove the network:
        node 0's address and port are those it proved."""
        remote_dir = str(self.remote_run_dir or run_dir)
        env = {**forwarded_env(os.environ), **plan.env}
        held = (remote_dir, [*PRODUCTS, *plan.payload], not (plan.resume or plan.overwrite))
        self.reports, self.network = self.survey(plan.config, run_dir, env, held)
        self.run_dir = run_dir
        self.shared = [r["shared"] for r in self.reports]
        self.dirs = [str(run_dir) if s else remote_dir for s in self.shared]
        logger.info("network check:\n%s", self.network.table())
        where = {"master_addr": self.network.master_addr, "master_port": self.network.master_port}
        self.topology = dataclasses.replace(self.topology, **where)

    def survey(self, config, folder: Path | None, user_env: Mapping[str, str], launch=None):
        """Probe every host at once, then prove the network: a report per host and the
        NetworkReport, or one HostError naming every host that cannot run the job, and why.

        ``config``: the worker's, or None. ``folder``: does each host see this folder here?
        ``launch``: a launch's remote run directory, the names to look for there, and whether
        a host without this run directory may not hold them (neither resume nor overwrite).
        """
        data_dir = config.data_dir if config is not None else None
        backend = config.backend if config is not None else "auto"
        remote_dir, held, refuse_held = launch or ("", [], False)
        port = self.topology.master_port  # None: node 0's probe picks a free one
        asked = {"data_dir": data_dir, "gpus": backend == "nccl", "dir": remote_dir, "held": held}
        asked["free_port"] = port is None
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".ddpnb-shared-") as marker:
            asked["marker"] = marker.name if folder else ""  # does the host see this file?
            outs = self._on(range(self.nnodes), "probe", lambda n: [asked], PROBE_TIMEOUT)
        found = [re.search(rb"^DDPNB-PROBE (.*)$", out, re.M) for out, _ in outs]
        got = [
            json.loads(f[1]) if f else why or "sent no report" for f, (_, why) in zip(found, outs)
        ]
        problems = [(h, r) for h, r in zip(self.hosts, got) if isinstance(r, str)]
        reports = [(h, r) for h, r in zip(self.hosts, got) if isinstance(r, dict)]
        needed = ("torch", "torchvision") if data_dir is not None else ("torch",)
        release = lambda r: {k: (r[k] or "").split("+")[0] for k in needed}
        versions = lambda r: f"torch {r['torch']}, torchvision {r['torchvision']}"
        node0 = got[0] if isinstance(got[0], dict) else {}  # the others must match it
        for host, r in reports:
            why, missing = "", " or ".join(pkg for pkg in needed if not r[pkg])
            if missing:
                why = f"has no {missing} for {r['python']}: pip install {' '.join(needed)} there "
                why += "(or pass python= naming an interpreter that has it)"
            elif refuse_held and r["held"] and not r["shared"]:
                why = f"already holds a run (found {', '.join(r['held'])}) in {remote_dir}: pass"
                why += " resume=True to continue it, overwrite=True to replace it, or another"
                why += " remote_run_dir"
            elif data_dir is not None and r["fingerprint"] is None:
                why = f"has no dataset at {data_dir} (train/ and val/): copy it there with rsync -a"
            elif backend == "nccl" and r.get("gpus", 0) < self.nproc_per_node:
                why = f"has {r.get('gpus', 0)} GPU(s), fewer than nproc_per_node={self.nproc_per_node}"
            elif node0 and release(r) != release(node0) and all(node0[k] for k in needed):
                why = f"has {versions(r)}, node 0 {versions(node0)}: install the same on every host"
            elif node0.get("fingerprint") and r["fingerprint"] != node0["fingerprint"]:
                why = f"holds a dataset at {data_dir} that differs from node 0's ({self.hosts[0]}, "
                why += f"fingerprint {node0['fingerprint'][:12]}): copy node 0's data there, e.g. "
                why += f"rsync -a {data_dir}/ HOST:{data_dir}/"
            problems += [(host, why)] if why else []
        _refuse("Preflight failed; nothing was started", problems)
        addr = self.topology.master_addr or self.ssh.hostname(self.parsed[0])
        port, backend = port or got[0]["port"], "gloo" if backend == "gloo" else "nccl"
        return got, check_network(self.ssh, self.parsed, self.python, addr, port, backend, user_env)

    def start(self, plan, run_dir: Path) -> None:
        files = io.BytesIO()  # a tar stream of the files (the pipeline wrote them here)
        pack(str(run_dir), list(plan.files), files)
        todo = [n for n, shared in enumerate(self.shared) if not shared]
        clean = lambda n: self.reports[n]["held"] if plan.overwrite else []  # removed first
        copied = self._on(todo, "unpack", lambda n: [self.dirs[n], clean(n)], 60, files.getvalue())
        failed = [
            (self.hosts[n], f"({self.dirs[n]}) {why}") for n, (_, why) in zip(todo, copied) if why
        ]
        _refuse("Could not copy the files to the hosts; nothing was started", failed)
        agent = [self.python, "-c", AGENT.read_text()]  # the hosts need nothing of ddpnb

        def command(n: int, lifeline: int) -> tuple:
            folder = self.dirs[n]
            env = plan.node_env(folder, self.nproc_per_node, self.reports[n]["cpus"])
            env = {LIFELINE_ENV: "0", **forwarded_env(os.environ), **self.network.env(n), **env}
            log_dir = f"{folder}/logs/node-{n}"
            argv = self.topology.command(agent, n, plan.script, folder, log_dir=log_dir)
            cmd = self.ssh.command(self.parsed[n], remote_line(argv, cwd=folder, env=env))
            shown = remote_line([*argv[:2], "<ddpnb agent>", *argv[3:]], cwd=folder, env=env)
            shown = f"{shlex.join(cmd[:-1])}  # runs, on that host:\n    {shown}"
            return cmd, shown, {"stdin": lifeline}  # its EOF reaches the host: the agent stops

        self.spawn_all(run_dir, "ssh", lambda fd: {n: command(n, fd) for n in range(self.nnodes)})

    def _on(self, nodes: Sequence[int], name: str, args, timeout: float, input: bytes = b""):
        """``name(*args(node))`` of :func:`helpers` on each of ``nodes``, all at once: a list of
        (its output, why it failed or None)."""
        one = lambda n: self.ssh.helper(self.parsed[n], self.python, name, args(n), timeout, input)
        with ThreadPoolExecutor(max_workers=min(32, self.nnodes)) as pool:
            return list(pool.map(one, nodes))

    def _pull(self, names: dict[int, list[str]], timeout: float) -> list[int]:
        """Copy ``names[node]`` here from those hosts without this run directory, all at once;
        the nodes that could not be read."""
        todo = [n for n in names if not self.shared[n]]
        outs = self._on(todo, "pack", lambda n: [self.dirs[n], names[n]], timeout)
        for out, why in outs:
            if why is None:
                unpack(str(self.run_dir), stream=io.BytesIO(out))
        return [n for n, (_, why) in zip(todo, outs) if why]

    def sync_stacks(self, force: bool) -> None:
        if not force and time.monotonic() - self._stacks_synced < STACKS_SYNC_SECONDS:
            return
        self._stacks_synced = time.monotonic()
        lost = self._pull({n: [str(WATCH_DIR)] for n in range(self.nnodes)}, timeout=10)
        if force and lost:
            names = ", ".join(f"node {n} ({self.hosts[n]})" for n in lost)
            raise HostError(
                f"Could not read the ranks' stacks from {names}: the host cannot be reached over "
                "SSH. The other hosts' stacks are in job.stacks() once it answers again.",
                host=self.hosts[lost[0]],
            )

    def stop(self) -> None:
        """Cut the lifeline first (each agent stops its node), then the ssh clients."""
        self.cut_lifeline()
        deadline = time.monotonic() + REMOTE_STOP_SECONDS
        while time.monotonic() < deadline and any(p.poll() is None for p in self.procs.values()):
            time.sleep(0.05)
        super().stop()

    def sync(self) -> None:
        if time.monotonic() - self._synced >= SYNC_SECONDS:
            self._synced = time.monotonic()
            self._pull({0: ["progress.json", "metrics.jsonl"]}, timeout=10)

    def fetch(self) -> None:
        names = {n: ["ranks", f"logs/node-{n}"] for n in range(1, self.nnodes)}
        for n in self._pull({0: ["."], **names}, timeout=60):
            logger.warning("could not copy the results of node %d back from %s", n, self.hosts[n])

    def explain(self, error: RunFailed, failed: dict[int, int]) -> RunFailed:
        n = min((n for n, rc in failed.items() if rc == SSH_FAILED), default=None)
        if n is not None:
            last = log_tail(self.run_dir, n, 1).strip()
            error = NodeLost(
                f"Node {n} ({self.hosts[n]}) was lost: its SSH connection ended ({last or 'no message'}). "
                "The host is down, unreachable, or the network was cut. The other nodes were "
                f"stopped.{resume_hint(self.run_dir)}",
                node_rank=n,
                exit_code=SSH_FAILED,
                log_tail=log_tail(self.run_dir, n, 20),
            )
        if error.node_rank is not None and error.host is None:
            error.host = self.hosts[error.node_rank]
        return error


def check_hosts(
    config: TrainConfig | Mapping | None,
    hosts: Sequence[str],
    nproc_per_node: int = 1,
    run_dir: str | os.PathLike | None = None,
    ssh_config: str | os.PathLike | None = None,
    ssh_options: Sequence[str] = (),
    python: str | None = None,
    master_addr: str | None = None,
    master_port: int = 29500,
) -> Table:
    """The preflight of ``launch(hosts=...)``, starting no training: a row per host.

    ``config``: the worker's TrainConfig (its dataset is checked), or None for your own
    script. ``run_dir`` (an existing folder here): each row says if that host sees it.
    Raises :class:`~ddpnb.errors.HostError` (or :class:`~ddpnb.errors.NetworkError`) naming
    every host or pair that cannot run the job.
    """
    parsed = parse_hosts(hosts)
    topology = Topology(
        nnodes=len(parsed),
        nproc_per_node=nproc_per_node,
        master_addr=master_addr,
        master_port=master_port,
    )
    nodes = Hosts(parsed, topology, Ssh(ssh_config, ssh_options), python)
    if config is not None:
        config = check_run(as_config(config), nodes.nnodes * nproc_per_node, here=False)
    folder = Path(run_dir) if run_dir is not None and Path(run_dir).is_dir() else None
    reports, network = nodes.survey(config, folder, forwarded_env(os.environ))
    rows = network.hosts()
    for row, r in zip(rows, reports):
        row |= {k: r[k] for k in ("cpus", "gpus") if k in r}  # gpus: asked of nccl's hosts only
        if config is not None:
            row["dataset"] = r["fingerprint"][:12]
        if run_dir is not None:
            row["sees run_dir"] = r["shared"]
    rows.network = network  # the interfaces chosen, and why: print(rows.network)
    return rows


def ssh_commands(
    what: Script | TrainConfig | Mapping,
    run_dir: str | os.PathLike,
    hosts: Sequence[str],
    nproc_per_node: int = 1,
    master_port: int = 29500,
    ssh_config: str | os.PathLike | None = None,
    ssh_options: Sequence[str] = (),
    python: str | None = None,
    network=None,
) -> list[str]:
    """One line per host to paste into a terminal: ssh to it, go to ``run_dir``, run torchrun.

    The script's files must already be at ``run_dir`` on every host. ``python``: the hosts'
    interpreter (runs ``python -m torch.distributed.run``; default ``torchrun`` on PATH).
    ``network``: :func:`check_hosts`' ``rows.network``, whose interface variables
    (``GLOO_SOCKET_IFNAME``...) each line sets: a host whose name resolves to loopback needs
    them. No host is contacted.
    """
    from .cluster import node_commands

    parsed, ssh = parse_hosts(hosts), Ssh(ssh_config, ssh_options)
    addresses = [ssh.hostname(h) for h in parsed]
    lines = node_commands(what, run_dir, addresses, nproc_per_node, master_port, python=python)
    out = []
    for n, (host, line) in enumerate(zip(parsed, lines)):
        env = network.env(n) if network is not None else None
        remote = remote_line(shlex.split(line), cwd=str(run_dir), env=env)
        out.append(shlex.join([*ssh.args(host, "-t", defaults=False), remote]))
    return out


def _refuse(head: str, found: Sequence[tuple[str, str]]) -> None:
    """Raise a HostError naming each host of ``found`` and why, if any."""
    if found:
        lines = "\n".join(f"  - {h} {why}." for h, why in found)
        raise HostError(f"{head}:\n{lines}", host=found[0][0])
