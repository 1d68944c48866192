"""Launching on real hosts over SSH: one ``torchrun`` per host, followed from here.

A host that does not see this machine's run directory gets the files copied and its results
brought back. Each host's agent reads its SSH session's input as its lifeline: at its
end-of-file (the launcher or the connection ended) it stops its node.
"""

from __future__ import annotations

import os
import secrets
import shlex
import subprocess
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
from .network import NetworkReport, check_network
from .pipeline import AGENT, Processes
from .preflight import as_config, check_run
from .rundir import PRODUCTS
from .script import Script
from .ssh import (
    SSH_FAILED,
    Host,
    Probe,
    Ssh,
    check_probes,
    parse_hosts,
    probe_all,
    pull,
    push,
    remote_line,
)
from .tables import Table
from .topology import Topology, check_meeting_point, check_shape

REMOTE_STOP_SECONDS = 8.0  # a host's agent stops its node within its own grace (5 s)
SYNC_SECONDS = 2.0  # how often node 0's progress is copied here (one SSH login each)
STACKS_SYNC_SECONDS = 5.0  # how often the ranks' stacks are copied here (one login per host)
FORWARDED_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "TORCH_CPP_LOG")
HELD = """
import os, shutil, sys
root, clean, names = sys.argv[1], sys.argv[2] == "True", sys.argv[3:]
held = [n for n in names if os.path.lexists(os.path.join(root, n))]
for path in [os.path.join(root, n) for n in held] if clean else []:
    shutil.rmtree(path) if os.path.isdir(path) and not os.path.islink(path) else os.unlink(path)
print(" ".join(held))
"""


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The distributed-backend settings of ``environ`` that SSH hosts receive.

    >>> forwarded_env({"NCCL_DEBUG": "INFO", "HOME": "/root"})
    {'NCCL_DEBUG': 'INFO'}
    """
    return {k: v for k, v in environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}


class Hosts(Processes):
    """The SSH backend: one host per node, its torchrun agent run through a local ``ssh``."""

    data_here = False

    def __init__(
        self,
        hosts: Sequence[str],
        nproc_per_node: int,
        master_addr: str | None,
        master_port: int | None,
        rdzv_timeout: int,
        max_restarts: int,
        ssh_config: str | os.PathLike | None,
        ssh_options: Sequence[str],
        python: str | None,
        remote_run_dir: str | None,
    ) -> None:
        super().__init__()
        self.parsed = parse_hosts(hosts)
        self.nnodes, self.nproc_per_node = len(self.parsed), nproc_per_node
        check_shape(self.nnodes, nproc_per_node, rdzv_timeout, max_restarts)
        check_meeting_point(master_addr, master_port)
        self.shape = (master_addr, master_port, rdzv_timeout, max_restarts)
        self.ssh = Ssh(None if ssh_config is None else str(ssh_config), tuple(ssh_options))
        self.python = python or sys.executable
        if remote_run_dir is not None and not str(remote_run_dir).startswith("/"):
            raise ConfigError(
                f"remote_run_dir must be an absolute path on the hosts, got {remote_run_dir!r}."
            )
        self.remote_run_dir = remote_run_dir
        self.hosts = [h.spec for h in self.parsed]
        self._synced = self._stacks_synced = 0.0

    def check(self, plan) -> None:
        pass  # the hosts are asked in preflight, with the run directory's marker

    def preflight(self, plan, run_dir: Path) -> Topology:
        """Probe every host, then prove the network; nothing starts."""
        master_addr, master_port, rdzv_timeout, max_restarts = self.shape
        probes, master_addr, self.network = _survey(
            self.ssh, self.parsed, self.python, plan.config, run_dir, self.nproc_per_node,
            master_addr, master_port, {**forwarded_env(os.environ), **plan.env}, probe_port=True,
        )  # fmt: skip
        self.run_dir = run_dir
        self.shared = [p.report["shared"] for p in probes]
        self.cpus = [p.report["cpus"] for p in probes]
        self.dirs = [str(run_dir if s else self.remote_run_dir or run_dir) for s in self.shared]
        _check_remote_dirs(self.ssh, self.parsed, self.python, self.dirs, self.shared, plan)
        logger.info("network check:\n%s", self.network.table())
        port = self.network.master_port
        return Topology(
            self.nnodes, self.nproc_per_node, master_addr, port, rdzv_timeout, max_restarts
        )

    def start(self, plan, run_dir: Path, topology: Topology) -> None:
        todo = [n for n, s in enumerate(self.shared) if not s]
        with ThreadPoolExecutor(max_workers=len(self.parsed)) as pool:
            for _ in pool.map(
                lambda n: push(self.ssh, self.parsed[n], self.python, self.dirs[n], plan.files),
                todo,
            ):
                pass
        logger.info(
            "launching %d host(s) x %d process(es) over SSH; node 0 (%s) hosts the rendezvous "
            "at %s:%d",
            topology.nnodes,
            topology.nproc_per_node,
            self.parsed[0].spec,
            topology.master_addr,
            topology.master_port,
        )

        def commands(lifeline: int) -> dict:
            out = {}
            for n, host in enumerate(self.parsed):
                env = plan.node_env(self.dirs[n], topology.nproc_per_node, self.cpus[n])
                env = {LIFELINE_ENV: "0", **forwarded_env(os.environ), **self.network.env(n), **env}
                cmd, shown = agent_command(
                    self.ssh, host, self.python, self.dirs[n], topology, n, env, plan.script
                )
                # ssh forwards its input's EOF: the host's agent then stops its node.
                out[n] = (cmd, shown, {"stdin": lifeline, "env": dict(os.environ)})
            return out

        self.spawn_all(run_dir, "ssh", commands)

    def sync_stacks(self, force: bool) -> None:
        """Copy the ranks' stack snapshots from unshared hosts; ``force``: now, or HostError."""
        todo = [n for n, shared in enumerate(self.shared) if not shared]
        if not todo or (not force and time.monotonic() - self._stacks_synced < STACKS_SYNC_SECONDS):
            return
        self._stacks_synced = time.monotonic()

        def one(n: int) -> bool:
            names = [str(WATCH_DIR)]
            return pull(
                self.ssh, self.parsed[n], self.python, self.dirs[n], names, self.run_dir, timeout=10
            )

        with ThreadPoolExecutor(max_workers=len(todo)) as pool:
            read = dict(zip(todo, pool.map(one, todo)))
        lost = [n for n, ok in read.items() if not ok]
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
        if self.shared[0] or time.monotonic() - self._synced < SYNC_SECONDS:
            return
        self._synced = time.monotonic()
        pull(
            self.ssh,
            self.parsed[0],
            self.python,
            self.dirs[0],
            ["progress.json", "metrics.jsonl"],
            self.run_dir,
            timeout=10,
        )

    def fetch(self) -> None:

        def one(n: int) -> None:
            names = ["."] if n == 0 else ["ranks", f"logs/node-{n}"]
            if not pull(
                self.ssh, self.parsed[n], self.python, self.dirs[n], names, self.run_dir, timeout=60
            ):
                logger.warning(
                    "could not copy the results of node %d back from %s", n, self.hosts[n]
                )

        todo = [n for n, shared in enumerate(self.shared) if not shared]
        if todo:
            with ThreadPoolExecutor(max_workers=len(todo)) as pool:
                list(pool.map(one, todo))

    def explain(self, error: RunFailed, failed: dict[int, int]) -> RunFailed:
        cut = sorted(n for n, rc in failed.items() if rc == SSH_FAILED)
        if cut:
            n = cut[0]
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


def _survey(
    ssh: Ssh, hosts: list[Host], python: str, config, folder: Path, nproc: int,
    master_addr: str | None, port: int | None, user_env: Mapping[str, str], probe_port: bool,
) -> tuple[list[Probe], str, NetworkReport]:  # fmt: skip
    """Probe every host, then prove the network; ``probe_port``: find or check node 0's port."""
    data_dir = config.data_dir if config is not None else None
    gpus = config is not None and config.backend == "nccl"
    token = secrets.token_hex(8)
    marker = f".ddpnb-shared-{token}"
    (folder / marker).write_text(token)
    try:
        asked = {"data_dir": data_dir, "run_dir": str(folder), "marker": marker, "gpus": gpus}
        probes = probe_all(ssh, hosts, python, port=(port or 0) if probe_port else None, **asked)
    finally:
        (folder / marker).unlink()
    asked_port = port if probe_port else None  # a given port must be free on node 0
    check_probes(probes, data_dir=data_dir, nproc_per_node=nproc, gpus=gpus, port=asked_port)
    port = probes[0].report["port"] if probe_port else port
    for p in probes:
        p.report["shared"] = p.report["marker"] == token
    master_addr = master_addr or ssh.hostname(hosts[0])
    ifnames = "gloo" if config is not None and config.backend == "gloo" else "nccl"
    network = check_network(
        ssh, hosts, python, master_addr=master_addr, master_port=port, backend=ifnames,
        user_env=user_env,
    )  # fmt: skip
    return probes, master_addr, network


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

    >>> print(check_hosts(None, ["gpu1", "gpu2"]))                  # doctest: +SKIP
    node  host  address   interface  reaches node 0  mesh  torch   ...
    """
    parsed = parse_hosts(hosts)
    ssh = Ssh(None if ssh_config is None else str(ssh_config), tuple(ssh_options))
    if config is not None:
        config = check_run(as_config(config), len(parsed) * nproc_per_node, here=False)
    folder = Path(run_dir) if run_dir is not None else None
    if folder is None or not folder.is_dir():
        folder = Path(tempfile.mkdtemp(prefix="ddpnb-check-"))  # no host sees a fresh folder here
    try:
        probes, _, network = _survey(
            ssh, parsed, python or sys.executable, config, folder, nproc_per_node, master_addr,
            master_port, forwarded_env(os.environ), probe_port=False,
        )  # fmt: skip
    finally:
        if run_dir is None or folder != Path(run_dir):
            folder.rmdir()
    rows = Table()
    for n, (p, net) in enumerate(zip(probes, network.rows)):
        row = {"node": n, "host": p.host.spec, "address": net.address, "interface": net.interface}
        row |= {"reaches node 0": net.reaches_node0, "mesh": net.mesh, "versions": net.versions}
        row["cpus"] = p.report.get("cpus")
        if config is not None and config.backend == "nccl":
            row["gpus"] = p.report.get("gpus")
        if config is not None:
            row["dataset"] = (p.report["fingerprint"] or "")[:12]
        if run_dir is not None:
            row["sees run_dir"] = p.report["shared"]
        rows.append(row)
    rows.network = network  # the interfaces chosen, and why: print(rows.network)
    return rows


def _check_remote_dirs(ssh: Ssh, hosts: list[Host], python: str, dirs, shared, plan) -> None:
    """Refuse (or clean, with ``overwrite``) a host's copy of the run directory holding a run."""
    names = [*PRODUCTS, *plan.payload]
    for n, host in enumerate(hosts):
        held = [] if shared[n] else _held(ssh, host, python, dirs[n], names, clean=False)
        if held and not (plan.resume or plan.overwrite):
            raise HostError(
                f"{host.spec}:{dirs[n]} already holds a run (found {', '.join(held)}). Nothing was "
                "changed. Pass resume=True to continue it, overwrite=True to replace it there, or "
                "another remote_run_dir.",
                host=host.spec,
            )
        if held and plan.overwrite:
            _held(ssh, host, python, dirs[n], held, clean=True)


def _held(ssh: Ssh, host: Host, python: str, root: str, names, clean: bool) -> list[str]:
    """Which of ``names`` ``root`` on ``host`` holds (``clean``: removed)."""
    argv = [python, "-c", HELD, root, str(clean), *names]
    out = subprocess.run(
        ssh.command(host, remote_line(argv)),
        capture_output=True,
        text=True,
        timeout=30,
        env=dict(os.environ),
        stdin=subprocess.DEVNULL,
    )
    return out.stdout.split()


def agent_command(
    ssh: Ssh,
    host: Host,
    python: str,
    remote_dir: str,
    topology: Topology,
    node: int,
    env: dict[str, str],
    script: Script,
) -> tuple[list[str], str]:
    """The ssh command that runs node ``node``'s agent on ``host``, and how to show it.

    The agent's source travels in the command line, so the hosts need nothing of ddpnb.
    """
    log_dir = f"{remote_dir}/logs/node-{node}"
    argv = topology.command([python, "-c", "AGENT"], node, script, remote_dir, log_dir=log_dir)
    remote = remote_line([*argv[:2], AGENT.read_text(), *argv[3:]], cwd=remote_dir, env=env)
    cmd = ssh.command(host, remote)
    shown = remote_line(argv, cwd=remote_dir, env=env)
    shown = shown.replace(" -c AGENT ", " -c '<ddpnb agent>' ")
    return cmd, f"{shlex.join(cmd[:-1])}  # runs, on that host:\n    {shown}"


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

    >>> ssh_commands(Script("train.py"), "/shared/run", ["gpu1", "gpu2"])[1]   # doctest: +SKIP
    "ssh -t -- gpu2 'cd /shared/run && torchrun --nnodes=2 --node_rank=1 ... /shared/run/train.py'"
    """
    from .cluster import node_commands

    parsed = parse_hosts(hosts)
    ssh = Ssh(None if ssh_config is None else str(ssh_config), tuple(ssh_options))
    addresses = [ssh.hostname(h) for h in parsed]
    launcher = [python, "-m", "torch.distributed.run"] if python else ["torchrun"]
    lines = node_commands(what, run_dir, addresses, nproc_per_node, master_port, launcher=launcher)
    out = []
    for n, (host, line) in enumerate(zip(parsed, lines)):
        env = network.env(n) if network is not None else {}
        prefix = shlex.join(["env", *(f"{k}={v}" for k, v in env.items())]) + " " if env else ""
        remote = f"cd {shlex.quote(str(run_dir))} && {prefix}{line}"
        cmd = ["ssh", *(["-F", str(ssh.config)] if ssh.config else []), *ssh.options]
        cmd += [*(["-p", str(host.port)] if host.port else []), "-t", "--", host.destination]
        out.append(shlex.join([*cmd, remote]))
    return out
