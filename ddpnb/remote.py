"""Launching on real hosts over SSH: one ``torchrun`` per host, followed from here.

Before anything starts, every host is probed in parallel (reachable, logs in, has the
interpreter with torch and torchvision, holds the same dataset as node 0; node 0's port
is free). A host that sees this machine's run directory (a shared filesystem) uses it
as it is; any other gets ``train_ddp.py`` and ``config.json`` copied to the same path
(or ``remote_run_dir``), and its results are brought back when the run ends. Node 0's
progress is copied here while it runs, so the panel and the plots work unchanged.

Each host's agent reads its SSH session's input as its lifeline: the local ``ssh``
client's input is the read end of the launcher's pipe. When the launcher ends, or the
connection does, the agent sees end-of-file and stops its node (see ddpnb.agent).
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
from .constants import threads_for_host
from .diagnosis import log_tail, resume_hint
from .errors import ConfigError, HostError, LaunchError, NodeLost, RunFailed
from .job import Job, close_lifeline, open_lifeline
from .log import logger
from .preflight import as_config, check_run, warn_pitfalls
from .rundir import PRODUCTS, WORKER_NAME, prepare_run_dir, write_worker
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
from .topology import Topology

AGENT = Path(__file__).with_name("agent.py")
SYNC_SECONDS = 2.0  # how often node 0's progress is copied here (one SSH login each)
# torch.distributed's and the backends' own settings travel from this machine's
# environment to the hosts (NCCL_SOCKET_IFNAME, NCCL_DEBUG, GLOO_SOCKET_IFNAME, ...).
FORWARDED_ENV_PREFIXES = ("NCCL_", "GLOO_", "TORCH_NCCL_", "TORCH_DISTRIBUTED_", "TORCH_CPP_LOG")
CLEAN = """
import os, shutil, sys
root = sys.argv[1]
for name in sys.argv[2:]:
    path = os.path.join(root, name)
    if os.path.isdir(path):
        shutil.rmtree(path)
    elif os.path.exists(path):
        os.unlink(path)
"""


def forwarded_env(environ: Mapping[str, str]) -> dict[str, str]:
    """The distributed-backend settings of ``environ`` that SSH hosts receive.

    >>> forwarded_env({"NCCL_DEBUG": "INFO", "HOME": "/root"})
    {'NCCL_DEBUG': 'INFO'}
    """
    return {k: v for k, v in environ.items() if k.startswith(FORWARDED_ENV_PREFIXES)}


class RemoteNodes:
    """The hosts of a running Job: their files, brought here, and their failures, named."""

    def __init__(
        self,
        ssh: Ssh,
        hosts: list[Host],
        python: str,
        dirs: list[str],
        shared: list[bool],
        run_dir: Path,
    ) -> None:
        self.ssh, self._hosts, self.python = ssh, hosts, python
        self.dirs, self.shared, self.run_dir = dirs, shared, run_dir
        self.hosts = [h.spec for h in hosts]
        ckpt = f"{dirs[0]}/checkpoints"
        self.checkpoint_dir = ckpt if shared[0] else f"{hosts[0].spec}:{ckpt}"
        self._synced = 0.0

    def sync(self) -> None:
        if self.shared[0] or time.monotonic() - self._synced < SYNC_SECONDS:
            return
        self._synced = time.monotonic()
        pull(
            self.ssh,
            self._hosts[0],
            self.python,
            self.dirs[0],
            ["progress.json", "metrics.jsonl"],
            self.run_dir,
            timeout=10,
        )

    def fetch(self) -> None:
        def one(n: int) -> None:
            names = ["ranks", f"logs/node-{n}"]
            if n == 0:
                names += ["metrics.jsonl", "progress.json", "effective_config.json"]
            if not pull(
                self.ssh, self._hosts[n], self.python, self.dirs[n], names, self.run_dir, timeout=20
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


def launch_on_hosts(
    config: TrainConfig | Mapping,
    run_dir: str | os.PathLike,
    hosts: Sequence[str],
    *,
    nproc_per_node: int = 1,
    master_addr: str | None = None,
    master_port: int | None = None,
    max_restarts: int = 0,
    rdzv_timeout: int = 60,
    wait: bool = True,
    resume: bool = False,
    overwrite: bool = False,
    progress: str = "auto",
    env: Mapping[str, str] | None = None,
    ssh_config: str | os.PathLike | None = None,
    ssh_options: Sequence[str] = (),
    python: str | None = None,
    remote_run_dir: str | None = None,
) -> Job:
    """:func:`ddpnb.launch` with ``hosts=``: one torchrun per host, started over SSH."""
    parsed = parse_hosts(hosts)
    ssh = Ssh(None if ssh_config is None else str(ssh_config), tuple(ssh_options))
    python = python or sys.executable
    if remote_run_dir is not None and not str(remote_run_dir).startswith("/"):
        raise ConfigError(
            f"remote_run_dir must be an absolute path on the hosts, got {remote_run_dir!r}."
        )
    config = as_config(config)
    checked = Topology(
        len(parsed), nproc_per_node, "hosts", master_port or 1, rdzv_timeout, max_restarts
    )
    config = check_run(config, checked, progress, here=False)
    run_dir = prepare_run_dir(config, run_dir, resume=resume, overwrite=overwrite).resolve()
    probes = _preflight(ssh, parsed, python, config, run_dir, nproc_per_node, master_port)
    shared = [p.report["shared"] for p in probes]
    port, cpus = probes[0].report["port"], [p.report["cpus"] for p in probes]
    dirs = [str(run_dir) if s else str(remote_run_dir or run_dir) for s in shared]
    _check_remote_dirs(ssh, parsed, python, dirs, shared, resume, overwrite)
    topology = Topology(
        len(parsed),
        nproc_per_node,
        master_addr or ssh.hostname(parsed[0]),
        port,
        rdzv_timeout,
        max_restarts,
    )
    warn_pitfalls(config)
    write_worker(config, run_dir)
    (run_dir / "logs").mkdir(exist_ok=True)
    files = {
        WORKER_NAME: (run_dir / WORKER_NAME).read_bytes(),
        "config.json": (run_dir / "config.json").read_bytes(),
    }
    with ThreadPoolExecutor(max_workers=len(parsed)) as pool:
        list(
            pool.map(
                lambda n: push(ssh, parsed[n], python, dirs[n], files),
                [n for n, s in enumerate(shared) if not s],
            )
        )
    logger.info(
        "launching %d host(s) x %d process(es) over SSH; node 0 (%s) hosts the rendezvous at %s:%d",
        len(parsed),
        nproc_per_node,
        parsed[0].spec,
        topology.master_addr,
        topology.master_port,
    )
    lifeline_read, lifeline = open_lifeline()
    procs: dict[int, subprocess.Popen] = {}
    try:
        for n, host in enumerate(parsed):
            node_env = _host_env(config, nproc_per_node, cpus[n], env)
            cmd, shown = agent_command(ssh, host, python, dirs[n], topology, n, node_env)
            procs[n] = _start_ssh_agent(cmd, shown, n, lifeline_read, run_dir)
    except BaseException as e:
        for proc in procs.values():
            os.killpg(proc.pid, 9)  # its host's agent sees its session end, and stops
        close_lifeline(lifeline)
        if isinstance(e, OSError):
            raise LaunchError(f"Could not start ssh: {e}") from e
        raise
    finally:
        os.close(lifeline_read)
    remote = RemoteNodes(ssh, parsed, python, dirs, shared, run_dir)
    job = Job(run_dir, config, procs, topology, progress=progress, lifeline=lifeline, remote=remote)
    return job.wait() if wait else job


def _preflight(
    ssh: Ssh,
    hosts: list[Host],
    python: str,
    config: TrainConfig,
    run_dir: Path,
    nproc: int,
    port: int | None,
) -> list[Probe]:
    """Probe every host; each report says if it sees run_dir (``shared``); node 0's has the port."""
    token = secrets.token_hex(8)
    marker = f".ddpnb-shared-{token}"
    (run_dir / marker).write_text(token)
    try:
        probes = probe_all(
            ssh,
            hosts,
            python,
            data_dir=config.data_dir,
            run_dir=str(run_dir),
            marker=marker,
            products=PRODUCTS,
            port=port or 0,
            gpus=config.backend == "nccl",
        )
    finally:
        (run_dir / marker).unlink()
    check_probes(
        probes,
        data_dir=config.data_dir,
        nproc_per_node=nproc,
        gpus=config.backend == "nccl",
        port=port,
    )
    for p in probes:
        p.report["shared"] = p.report["marker"] == token
    return probes


def check_hosts(
    config: TrainConfig | Mapping,
    hosts: Sequence[str],
    nproc_per_node: int = 1,
    run_dir: str | os.PathLike | None = None,
    ssh_config: str | os.PathLike | None = None,
    ssh_options: Sequence[str] = (),
    python: str | None = None,
) -> list[dict]:
    """The preflight of ``launch(hosts=...)``, starting nothing: one row per host.

    Raises :class:`~ddpnb.errors.HostError` naming every host that cannot run the job.
    With ``run_dir`` (an existing folder here) each row says whether that host sees it.

    Example
    -------
    >>> check_hosts(TrainConfig(data_dir="/data/digits"), ["gpu1", "gpu2"])  # doctest: +SKIP
    [{'node_rank': 0, 'host': 'gpu1', 'address': '10.0.0.1', 'torch': '2.14.1', ...}, ...]
    """
    parsed = parse_hosts(hosts)
    ssh = Ssh(None if ssh_config is None else str(ssh_config), tuple(ssh_options))
    python = python or sys.executable
    config = as_config(config)
    config = check_run(
        config, Topology(len(parsed), nproc_per_node, "hosts", 1), "none", here=False
    )
    folder = Path(run_dir) if run_dir is not None else None
    if folder is None or not folder.is_dir():
        folder = Path(tempfile.mkdtemp(prefix="ddpnb-check-"))  # no host sees a fresh folder here
    probes = _preflight(ssh, parsed, python, config, folder, nproc_per_node, None)
    if run_dir is None or folder != Path(run_dir):
        folder.rmdir()
    keys = ("hostname", "python", "torch", "torchvision", "cpus", "gpus")
    return [
        {
            "node_rank": n,
            "host": p.host.spec,
            "address": ssh.hostname(p.host),
            **{k: p.report.get(k) for k in keys},
            "dataset": p.report["fingerprint"][:12],
            "sees_run_dir": p.report["shared"] if run_dir is not None else None,
        }
        for n, p in enumerate(probes)
    ]


def _check_remote_dirs(
    ssh: Ssh,
    hosts: list[Host],
    python: str,
    dirs: list[str],
    shared: list[bool],
    resume: bool,
    overwrite: bool,
) -> None:
    """A host's own copy of the run directory follows the same rules as the local one."""
    # The probe listed what each host holds at run_dir; remote_run_dir may differ from it.
    for n, host in enumerate(hosts):
        if shared[n]:
            continue
        held = _remote_products(ssh, host, python, dirs[n])
        if held and not (resume or overwrite):
            raise HostError(
                f"{host.spec}:{dirs[n]} already holds a run (found {', '.join(held)}). Nothing was "
                "changed. Pass resume=True to continue it, overwrite=True to replace it there, or "
                "another remote_run_dir.",
                host=host.spec,
            )
        if held and overwrite:
            cmd = ssh.command(host, remote_line([python, "-c", CLEAN, dirs[n], *held]))
            subprocess.run(
                cmd, capture_output=True, timeout=30, env=dict(os.environ), stdin=subprocess.DEVNULL
            )


def _remote_products(ssh: Ssh, host: Host, python: str, remote_dir: str) -> list[str]:
    code = "import os, sys; print(' '.join(p for p in sys.argv[2:] if os.path.exists(os.path.join(sys.argv[1], p))))"
    cmd = ssh.command(host, remote_line([python, "-c", code, remote_dir, *PRODUCTS]))
    out = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=30,
        env=dict(os.environ),
        stdin=subprocess.DEVNULL,
    )
    return out.stdout.split()


def _host_env(
    config: TrainConfig, nproc: int, cores: int, extra: Mapping[str, str] | None
) -> dict[str, str]:
    """A host's agent environment: the host's own, plus the run's settings (never ours)."""
    env = {
        "DDPNB_PROCS_ON_HOST": str(nproc),
        "PYTHONUNBUFFERED": "1",
        "DDPNB_LAUNCHED": "1",
        LIFELINE_ENV: "0",  # the SSH session's input: EOF when the launcher or the link ends
        **forwarded_env(os.environ),
    }
    if config.threads or config.thread_budget:
        env["OMP_NUM_THREADS"] = str(config.threads or threads_for_host(nproc, cores))
    env.update(extra or {})
    return env


def agent_command(
    ssh: Ssh,
    host: Host,
    python: str,
    remote_dir: str,
    topology: Topology,
    node: int,
    env: dict[str, str],
) -> tuple[list[str], str]:
    """The ssh command that runs node ``node``'s agent on ``host``, and how to show it.

    The agent's source travels in the command line (``python -c``), so the hosts need
    nothing of ddpnb; the shown line abbreviates it to ``<ddpnb agent>``.
    """
    torchrun = [
        *topology.torchrun_args(node, log_dir=f"{remote_dir}/logs/node-{node}"),
        f"{remote_dir}/{WORKER_NAME}",
        "--config",
        f"{remote_dir}/config.json",
    ]
    remote = remote_line([python, "-c", AGENT.read_text(), *torchrun], cwd=remote_dir, env=env)
    cmd = ssh.command(host, remote)
    shown = remote_line([python, "-c", "AGENT", *torchrun], cwd=remote_dir, env=env)
    shown = shown.replace(" -c AGENT ", " -c '<ddpnb agent>' ")
    return cmd, f"{shlex.join(cmd[:-1])}  # runs, on that host:\n    {shown}"


def ssh_commands(
    config: TrainConfig | Mapping,
    run_dir: str | os.PathLike,
    hosts: Sequence[str],
    nproc_per_node: int = 1,
    master_port: int = 29500,
    ssh_config: str | os.PathLike | None = None,
    ssh_options: Sequence[str] = (),
    python: str | None = None,
) -> list[str]:
    """What ``launch(hosts=...)`` runs on each host (the agent's source abbreviated).

    Nothing is started and no host is contacted (``ssh -G`` only reads the client
    config). Shown for a shared filesystem: run_dir at the same path on every host.

    Example
    -------
    >>> ssh_commands(TrainConfig(), "/shared/run", ["gpu1", "gpu2"])[1]   # doctest: +SKIP
    "ssh -o BatchMode=yes ... -T -- gpu2 'cd /shared/run && exec env ... --node_rank=1 ...'"
    """
    config = as_config(config)
    parsed = parse_hosts(hosts)
    ssh = Ssh(None if ssh_config is None else str(ssh_config), tuple(ssh_options))
    python = python or sys.executable
    topology = Topology(len(parsed), nproc_per_node, ssh.hostname(parsed[0]), master_port)
    env = _host_env(config, nproc_per_node, None, None)
    env.pop("OMP_NUM_THREADS", None)  # each host's own share of its cores, known at launch
    return [
        agent_command(ssh, host, python, str(run_dir), topology, n, env)[1]
        for n, host in enumerate(parsed)
    ]


def _start_ssh_agent(
    cmd: list[str], shown: str, node: int, lifeline_read: int, run_dir: Path
) -> subprocess.Popen:
    """Run ``cmd`` (from :func:`agent_command`), its output streamed to logs/node-N.log."""
    with open(run_dir / "logs" / f"node-{node}.log", "ab") as log_file:
        log_file.write(f"$ {shown}\n".encode())
        log_file.flush()
        return subprocess.Popen(
            cmd,
            stdin=lifeline_read,  # ssh forwards its EOF: the host's agent then stops its node
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=dict(os.environ),
        )
