"""A throwaway Slurm on this machine: munged, slurmctld and two slurmd, in a temp folder.

Real daemons (Debian's ``slurm-wlm`` and ``munge``), each with its own key, socket,
pid, log and spool paths under one folder, found by ``SLURM_CONF``; nothing under
/etc or /run is used. Two Slurm nodes share this host: two ``slurmd -N <name>`` on
their own ports, both reached at 127.0.0.1. Ended by PID, the folder removed.

``python tests/slurm_cluster.py`` starts one and prints how to use it (Ctrl-C ends it).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from ddpnb.constants import free_port

NODES = ("n1", "n2")
CPUS_PER_NODE = 2
PARTITION = "debug"


def _free_ports(n: int) -> list[int]:
    """Ports below the ephemeral range (see ddpnb.constants.free_port), all different."""
    ports: list[int] = []
    while len(ports) < n:
        port = free_port()
        ports += [port] if port not in ports else []
    return ports


def _conf(root: Path, ports: list[int]) -> str:
    ctld_port, *node_ports = ports
    host = socket.gethostname().split(".")[0]
    nodes = "\n".join(
        f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} "
        f"CPUs={CPUS_PER_NODE} State=UNKNOWN"
        for name, port in zip(NODES, node_ports)
    )
    return f"""\
ClusterName=ddpnbtest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={root}/munge/munge.socket
StateSaveLocation={root}/state
SlurmdSpoolDir={root}/spool-%n
SlurmctldPidFile={root}/slurmctld.pid
SlurmdPidFile={root}/slurmd-%n.pid
SlurmctldLogFile={root}/slurmctld.log
SlurmdLogFile={root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MpiDefault=none
ReturnToService=2
SchedulerType=sched/backfill
MessageTimeout=5
KillWait=2
InactiveLimit=0
OverTimeLimit=0
MinJobAge=300
SlurmdTimeout=30
SlurmctldTimeout=30
{nodes}
PartitionName={PARTITION} Nodes=ALL Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """A running throwaway cluster; ``env`` points Slurm's commands at it."""

    def __init__(self, root: Path | None = None) -> None:
        self.root = Path(root or tempfile.mkdtemp(prefix="ddpnb-slurm-"))
        self.procs: list[subprocess.Popen] = []
        self.env = {**os.environ, "SLURM_CONF": str(self.root / "slurm.conf")}

    def start(self, timeout: float = 60) -> SlurmCluster:
        for name in ("munge", "state", *(f"spool-{n}" for n in NODES)):
            (self.root / name).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o700)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        (self.root / "slurm.conf").write_text(_conf(self.root, _free_ports(1 + len(NODES))))
        m = self.root / "munge"
        self._start(
            [
                "munged",
                "--foreground",
                "--force",
                f"--socket={m}/munge.socket",
                f"--key-file={key}",
                f"--pid-file={m}/munged.pid",
                f"--log-file={m}/munged.log",
                f"--seed-file={m}/munged.seed",
            ],
            "munged",
        )
        self._wait_for(lambda: (m / "munge.socket").exists(), timeout, "munged's socket")
        self._start(["slurmctld", "-D", "-i"], "slurmctld")
        for node in NODES:
            self._start(["slurmd", "-D", "-N", node], f"slurmd-{node}")
        self._wait_for(self._nodes_idle, timeout, "both nodes idle in sinfo")
        return self

    def _start(self, argv: list[str], name: str) -> None:
        log = open(self.root / f"{name}.out", "wb")  # noqa: SIM115 (the daemon holds it)
        self.procs.append(
            subprocess.Popen(
                argv,
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )
        log.close()

    def _wait_for(self, predicate, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(
                    f"== {p.name}\n{p.read_text(errors='replace')[-2000:]}"
                    for p in sorted(self.root.glob("*.log")) + sorted(self.root.glob("*.out"))
                )
                self.stop()
                raise RuntimeError(f"throwaway Slurm: no {what} (exited: {dead})\n{logs}")
            time.sleep(0.3)

    def _nodes_idle(self) -> bool:
        r = self.run(["sinfo", "-h", "-N", "-o", "%N %t"], check=False)
        states = dict(line.split() for line in r.stdout.splitlines() if line.strip())
        return all(states.get(n) == "idle" for n in NODES)

    def run(self, argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
        """A Slurm command (sinfo, squeue, scontrol, ...) against this cluster."""
        return subprocess.run(argv, env=self.env, capture_output=True, text=True, check=check)

    def stop(self) -> None:
        """Cancel every job left (a failed test's), end every daemon by PID (SIGTERM,
        then SIGKILL) and remove the folder."""
        if self.procs and all(p.poll() is None for p in self.procs):
            # A job's processes belong to slurmstepd, which outlives slurmd: cancel first.
            self.run(["scancel", "--user", "root"], check=False)
            deadline = time.monotonic() + 30
            while self.run(["squeue", "-h"], check=False).stdout.strip():
                if time.monotonic() > deadline:
                    break
                time.sleep(0.5)
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        self.procs = []
        shutil.rmtree(self.root, ignore_errors=True)


def _interrupt(signum, frame):
    raise KeyboardInterrupt


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _interrupt)
    cluster = SlurmCluster().start()
    print(f"export SLURM_CONF={cluster.env['SLURM_CONF']}")
    print(cluster.run(["sinfo"]).stdout, flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
