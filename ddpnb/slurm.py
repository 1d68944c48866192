"""Slurm from the notebook: submit a run with ``sbatch``, follow it, cancel it, attach to it.

A batch job outlives the kernel that submitted it: :func:`attach` follows it from a new one."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import secrets
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from .cluster import FINGERPRINT_NOTE, TRUST_NOTE
from .config import TrainConfig
from .diagnosis import log_tail, resume_hint, tail
from .errors import (
    ConfigError,
    LaunchError,
    NetworkError,
    RunDirNotShared,
    RunFailed,
    SlurmError,
    SlurmJobEnded,
    SlurmRequestError,
)
from .job import Job
from .log import logger
from .metrics import read_json, read_progress
from .pipeline import run
from .plan import HANG_TIMEOUT
from .preflight import as_config, check_progress
from .reporting import RUN_DIR_ENV
from .rundir import WORKER_NAME
from .scheduler import Scheduler
from .script import CONSTANTS_NAME, MESHCHECK_NAME, Script
from .topology import Topology, launcher

POLL_SECONDS = 2.0  # between questions to slurmctld: a shared service, asked gently
STOP_TIMEOUT = 60.0  # scancel: Slurm's KillWait plus its epilog, with room to spare
SLURM_RDZV_TIMEOUT = 300  # seconds the nodes have to join: Slurm starts them one by one
JOB_FILE = "slurm_job.json"  # what attach() needs: the job id, the shape, the cluster
SCRIPT_NAME = "train.sbatch"
MARKER_NAME = ".ddpnb-submit-marker"
NOT_SHARED_EXIT = 97  # the batch script's exit code when a node cannot see the marker
NETWORK_EXIT = 96  # ... when the network check of its first step failed
ALIVE = set(
    "PENDING CONFIGURING RUNNING COMPLETING SUSPENDED REQUEUED REQUEUE_HOLD REQUEUE_FED "
    "RESIZING SIGNALING STAGE_OUT STOPPED".split()
)
QUEUED = ("PENDING", "REQUEUED", "REQUEUE_HOLD", "CONFIGURING", "")
NO_VALUE = ("", "None", "(null)")  # Slurm's words for an empty field
ENDED_HINTS = {
    "TIMEOUT": "it ran into its time limit: submit again with a longer time= and resume=True",
    "NODE_FAIL": "a node of the allocation failed: submit again with resume=True",
    "PREEMPTED": "a higher-priority job took its nodes: submit with sbatch_args=['--requeue']",
    "CANCELLED": "it was cancelled (scancel) outside this session: submit again with resume=True",
    "OUT_OF_MEMORY": "a node ran out of memory: ask for more with sbatch_args=['--mem=...']",
    "DEADLINE": "it reached its --deadline",
    "BOOT_FAIL": "a node failed to boot: submit again with resume=True",
}


def _slurm(
    argv: list[str],
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    check: bool = True,
) -> subprocess.CompletedProcess:
    """Run a Slurm command; SlurmError if it is missing, does not answer or (``check``) fails."""
    try:  # subprocess looks ``argv[0]`` up on ``env``'s PATH
        r = subprocess.run(
            argv, cwd=cwd, env=env, input="", capture_output=True, text=True, timeout=60
        )
    except FileNotFoundError:
        raise SlurmError(
            f"{argv[0]} was not found on PATH: Slurm's commands are needed to submit and follow "
            "a batch job. Run this on a Slurm cluster's login node (or load its module, e.g. "
            "`module load slurm`); without Slurm, print the script with ddpnb.slurm_script()."
        ) from None
    except subprocess.TimeoutExpired:
        raise SlurmError(f"{argv[0]} did not answer within 60 s: is slurmctld reachable?") from None
    if check and r.returncode != 0:
        raise SlurmError(f"`{' '.join(argv)}` failed (exit {r.returncode}): {r.stderr.strip()}")
    return r


def job_state(job_id: str, env: Mapping[str, str] | None = None) -> dict[str, str] | None:
    """Slurm's fields for a job (``JobState`` ``UNKNOWN`` once forgotten); None: no answer."""
    r = _slurm(["scontrol", "show", "job", "-o", str(job_id)], env, check=False)
    if r.returncode == 0 and r.stdout.strip():
        return dict(re.findall(r"(\S+?)=(\S*)", r.stdout.splitlines()[0]))
    if "Invalid job id" not in r.stderr:
        logger.debug("scontrol show job %s: %s", job_id, r.stderr.strip())
        return None  # slurmctld busy or restarting: ask again later
    # Purged (MinJobAge passed): the accounting, where there is one, still knows it.
    if shutil.which("sacct", path=(env or os.environ).get("PATH")):
        fields = "State,ExitCode,NodeList,Start"
        r = _slurm(["sacct", "-n", "-P", "-X", "-j", str(job_id), "-o", fields], env, check=False)
        if r.returncode == 0 and r.stdout.strip():
            state, *rest = r.stdout.splitlines()[0].split("|")  # "CANCELLED by 0"
            info = dict(zip(("ExitCode", "NodeList", "StartTime"), rest), Reason="None")
            return {"JobState": state.partition(" ")[0], **info}
    return {"JobState": "UNKNOWN", "Reason": "Slurm no longer knows the job"}


def slurm_available(env: Mapping[str, str] | None = None) -> bool:
    """True when Slurm's commands are here and a controller answers (``sinfo``)."""
    try:
        _slurm(["sinfo", "-h", "-o", "%P"], env)
    except SlurmError:
        return False
    return shutil.which("sbatch", path=(env or os.environ).get("PATH")) is not None


def _exit_code(info: Mapping[str, str]) -> int | None:
    """Slurm's ``ExitCode=1:0`` (exit status : signal) as the exit status."""
    m = re.match(r"(\d+):(\d+)", info.get("ExitCode", ""))
    return int(m.group(1)) if m else None


BATCH = """#!/bin/bash
{header}

# One torchrun agent per node (ntasks-per-node=1); each starts {t.nproc_per_node} worker(s).
# The first node of the allocation hosts the c10d rendezvous.
{note}
set -euo pipefail
{marker}
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
# The address Slurm itself uses for that node (a node name need not resolve everywhere).
head_addr=$(scontrol show node "$head_node" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')
export head_node=${{head_addr:-$head_node}}  # exported: run_node reads it on every node
{port_line}export run_dir={run_dir} PYTHONUNBUFFERED=1  # exported: run_node reads it
mkdir -p "$run_dir/logs"
{ddpnb_env}{exports}
{network}# After a torchrun restart the agents meet in a new rendezvous round. Each round's workers
# get a store of their own (hosted by rank 0) rather than the agents' shared one, whose
# keys outlive the round: under c10d each agent counts only its own restarts, so a
# per-attempt key prefix could differ between nodes and they would never meet.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
# What srun runs on each node: its torchrun, naming the node's own address (Slurm's
# NodeAddr; torchrun would otherwise go by the host name, which on clusters with a separate
# training network resolves to the other one) and whether it hosts the store (node 0).
run_node() {{
    addr=$(scontrol show node "$SLURMD_NODENAME" | sed -n 's/.*NodeAddr=\\([^ ]*\\).*/\\1/p')
    net="$run_dir/logs/net-env-$SLURM_NODEID.sh"; if [ -f "$net" ]; then . "$net"; fi
    # Each worker's threads: the CPUs this node gives the job (nproc: Slurm's cpuset) shared by
    # its {t.nproc_per_node} worker(s), unless the job brought OMP_NUM_THREADS.
    cpus=$(nproc)
    export OMP_NUM_THREADS=${{OMP_NUM_THREADS:-$(( cpus > {t.nproc_per_node} ? cpus / {t.nproc_per_node} : 1 ))}}
    exec {launcher} \\
        {torchrun}
}}
# srun runs it on every node, stops them all when one fails, and appends each node's output
# to logs/node-N.log (N: the node's index in the job; appended to after a requeue).
srun --kill-on-bad-exit=1 --open-mode=append --output={node_log} \\
    bash -c "$(declare -f run_node); run_node"
"""
SUBMITTED = """
# The run directory must be on a filesystem every node shares: each node checks that it
# sees the marker the submit host wrote there, else the job ends at once (exit 97).
srun --ntasks-per-node=1 bash -c 'grep -qx "$1" "$0" 2>/dev/null || {{ echo "ddpnb: node \
$SLURMD_NODENAME cannot see $0, the marker written at submission: the run directory must \
be on a filesystem shared by the submit host and every node." >&2; exit 97; }}' \\
    {marker_path} {token}
"""
NETWORK = """# The network, proven before training, from this node: one check per node (srun)
# relayed through this one. Every node reaches the first node's port and every peer on its
# interface toward the first node (written to logs/net-env-N.sh for torchrun below), then a
# gloo all-reduce runs over those interfaces. A node that cannot stops the job at once
# (exit 96), named in this log.
{python} "$run_dir/ddpnb_meshcheck.py" --nnodes "$SLURM_NNODES" \\
    --master-addr "$head_node" --master-port "{port}" --timeout 20 --backend gloo \\
    --env-file "$run_dir/logs/net-env-{{node_rank}}.sh" || exit 96

"""


@dataclasses.dataclass(eq=False)
class Slurm(Scheduler):
    """A run as one batch job (``job_id``: one submitted earlier); the rest: sbatch's options."""

    topology: Topology
    env: Mapping[str, str]  # Slurm's commands run with it
    run_dir: Path = Path()
    job_id: str = ""  # the job's, once submitted
    partition: str | None = None  # None: the cluster's default
    time: str = "01:00:00"
    account: str | None = None
    gpus_per_node: int | None = None
    sbatch_args: Sequence[str] = ()
    python: str | None = None  # the nodes' (None: torchrun on PATH)
    job_name: str = "ddpnb"
    watch_stalls = False  # a queued job is silent for as long as Slurm makes it wait
    outlives_launcher = True  # a batch job belongs to the cluster, not to this process

    def __post_init__(self) -> None:
        self._state: dict[str, str] = {}
        self._asked = 0.0

    @property
    def master_addr(self) -> str | None:
        """The allocation's first node, where the batch script runs (None until it runs)."""
        return self.slurm_state().get("BatchHost") or None

    @property
    def master_port(self) -> int | None:
        """The rendezvous port the batch script derives from its job id."""
        return 20000 + int(re.sub(r"\D.*", "", self.job_id) or 0) % 20000 if self.job_id else None

    def check(self, plan) -> None:
        """Check that sbatch exists and the partition can hold the job; pick the partition."""
        _slurm(["sbatch", "--version"], self.env)
        out = _slurm(["sinfo", "-h", "-o", "%P|%D|%G|%a"], self.env).stdout
        rows = [line.split("|") for line in out.splitlines()]  # one per group of alike nodes
        names = ", ".join(sorted({row[0].rstrip("*") for row in rows}))
        if self.partition is None:
            self.partition = next((row[0][:-1] for row in rows if row[0].endswith("*")), None)
        if self.partition is None:
            raise SlurmRequestError(
                "This cluster has no default partition: pass partition= (one of "
                f"{names or 'none found'}; `sinfo` lists them)."
            )
        mine = [row for row in rows if row[0].rstrip("*") == self.partition]
        if not mine:
            raise SlurmRequestError(
                f"Slurm has no partition {self.partition!r}. Partitions here: "
                f"{names or 'none'} (`sinfo` lists them)."
            )
        if not any(avail == "up" for *_, avail in mine):
            logger.warning("partition %s is not up: the job will wait until it is", self.partition)
        nodes = sum(int(row[1] or 0) for row in mine)
        gres = r"gpu(?::[^:,(]+)?:(\d+)"
        gpus = max((int(n) for row in mine for n in re.findall(gres, row[2])), default=0)
        if self.nnodes > nodes:
            raise SlurmRequestError(
                f"nnodes={self.nnodes}, but partition {self.partition!r} has {nodes} node(s): "
                f"ask for at most {nodes}, or choose a bigger partition."
            )
        if self.gpus_per_node and self.gpus_per_node > gpus:
            raise SlurmRequestError(
                f"gpus_per_node={self.gpus_per_node}, but the nodes of partition "
                f"{self.partition!r} have at most {gpus} GPU(s) (sinfo's GRES): ask for fewer, "
                "or choose a GPU partition."
            )

    def preflight(self, plan, run_dir: Path) -> None:
        old = read_json(run_dir / JOB_FILE).get("job_id")  # a job of this run directory
        state = (job_state(old, self.env) or {}).get("JobState", "") if old else ""
        if state in ALIVE:
            raise SlurmError(
                f"Slurm job {old} still runs in {run_dir} ({state}). Follow it with "
                f"ddpnb.attach({str(run_dir)!r}), or cancel it (scancel {old}) before submitting again."
            )

    def start(self, plan, run_dir: Path) -> None:
        token = secrets.token_hex(16)
        (run_dir / MARKER_NAME).write_text(token + "\n")
        shutil.copyfile(Path(__file__).with_name("meshcheck.py"), run_dir / MESHCHECK_NAME)
        env = plan.user_env(str(run_dir), os.environ.get("PYTHONPATH"))
        (run_dir / SCRIPT_NAME).write_text(self.batch_script(plan.script, run_dir, env, token))
        # sbatch's --output goes on its command line: a #SBATCH line cannot hold a space.
        output = f"--output={run_dir / 'logs' / 'slurm-%j.out'}"
        argv = ["sbatch", "--parsable", output, *self.sbatch_args, str(run_dir / SCRIPT_NAME)]
        submitted_at = time.time()
        r = _slurm(argv, self.env, cwd=run_dir, check=False)
        if r.returncode != 0 or not r.stdout.strip():
            raise SlurmError(
                f"sbatch refused the job (exit {r.returncode}): {r.stderr.strip()} "
                f"The script is {run_dir / SCRIPT_NAME}."
            )
        self.run_dir, self.job_id = run_dir, r.stdout.strip().split(";")[0]
        shape = (self.job_id, self.nnodes, self.nproc_per_node)
        logger.info("submitted Slurm job %s: %d node(s) x %d process(es)", *shape)
        record = {"job_id": self.job_id, **dataclasses.asdict(self.topology), "sbatch": argv}
        record |= {"partition": self.partition, "slurm_conf": self.env.get("SLURM_CONF")}
        record |= {"submitted_at": submitted_at, "script": plan.script.name}
        record |= {"args": list(plan.script.args), "hang_timeout": plan.hang_timeout}
        record["on_hang"] = plan.on_hang
        (run_dir / JOB_FILE).write_text(json.dumps(record, indent=2) + "\n")

    def slurm_state(self, fresh: bool = False) -> dict[str, str]:
        """Slurm's fields for the job, asked at most every POLL_SECONDS unless ``fresh``."""
        if fresh or time.monotonic() - self._asked >= POLL_SECONDS:
            self._state = job_state(self.job_id, self.env) or self._state  # None: ask later
            self._asked = time.monotonic()
        return self._state

    @property
    def state(self) -> str:
        """Slurm's job state: ``PENDING``, ``RUNNING``, ``COMPLETED``, ``TIMEOUT``, ..."""
        return self.slurm_state().get("JobState", "UNKNOWN")

    def batch_log(self) -> Path:
        return self.run_dir / "logs" / f"slurm-{self.job_id}.out"

    def pending(self) -> str | None:
        info = self.slurm_state()
        if info.get("JobState", "") not in QUEUED:
            return None
        reason = info.get("Reason", "")
        return "pending" if reason in NO_VALUE else f"pending ({reason})"

    def since(self) -> float | None:
        try:
            return datetime.fromisoformat(self.slurm_state().get("StartTime", "")).timestamp()
        except ValueError:
            return None

    def poll(self) -> dict[int, int | None]:
        state, code = self.state, _exit_code(self._state)
        if state in ALIVE:
            return dict.fromkeys(range(self.nnodes))
        done = state == "UNKNOWN" and read_progress(self.run_dir).get("phase") == "done"
        if done or (state == "COMPLETED" and code in (0, None)):
            return dict.fromkeys(range(self.nnodes), 0)
        return dict.fromkeys(range(self.nnodes), code or 1)  # the job ended without completing

    def stop(self, timeout: float = STOP_TIMEOUT) -> None:
        """Cancel the job (``scancel``); return once Slurm reports that it ended."""
        if self.slurm_state(fresh=True).get("JobState") in ALIVE:
            _slurm(["scancel", self.job_id], self.env)
        deadline = time.monotonic() + timeout
        while self.slurm_state(fresh=True).get("JobState") in ALIVE:
            if time.monotonic() > deadline:
                raise SlurmError(
                    f"Slurm still reports job {self.job_id} as {self.state} {timeout:.0f} s "
                    f"after scancel; check `squeue -j {self.job_id}`."
                )
            time.sleep(1.0)

    def explain(self, error: RunFailed, failed: dict[int, int]) -> RunFailed:
        info = self.slurm_state(fresh=True)
        state, exit_code, log = info.get("JobState", "UNKNOWN"), _exit_code(info), self.batch_log()
        if exit_code == NOT_SHARED_EXIT:
            return RunDirNotShared(
                f"Slurm job {self.job_id} stopped at once: a node could not see the run directory "
                f"{self.run_dir} (the marker written at submission was missing there). The run "
                "directory must be on a filesystem shared by this host and every node (e.g. "
                "/home or /scratch on most clusters); choose such a run_dir.",
                log_tail=tail(log, 10),
            )
        if exit_code == NETWORK_EXIT:
            return NetworkError(
                f"Slurm job {self.job_id} stopped before training: the network check of its "
                f"first step failed. From the batch log ({log}):\n" + tail(log, 30)
            )
        if state == "FAILED":
            if not any((self.run_dir / "logs").glob("node-*.log")):
                error.args = (
                    f"{error} No node log was written: check the batch log ({log}) and that "
                    "the run directory is on a shared filesystem.",
                )
            return error
        nodes = info.get("NodeList", "")
        hint = ENDED_HINTS.get(state, "see `scontrol show job` and the batch log")
        reason = info.get("Reason", "None")
        fields = dict(state=state, reason=reason, job_id=self.job_id, exit_code=exit_code)
        return SlurmJobEnded(
            f"Slurm ended job {self.job_id} with state {state} (reason: {reason}) on "
            f"{'no node' if nodes in NO_VALUE else nodes}: {hint}.{resume_hint(self.run_dir)}",
            log_tail=log_tail(self.run_dir, 0, 20) or tail(log, 20),
            **fields,
        )

    def batch_script(
        self, script: Script, run_dir: Path, env: Mapping[str, str] | None = None, marker: str = ""
    ) -> str:
        """The sbatch script: ``#SBATCH`` lines, then one torchrun per node.

        ``marker``: the submission's token (adds the marker and network steps; sbatch's command
        line names the output). No ``master_port``: one from the job id, so jobs do not collide.
        """
        q, t = shlex.quote, self.topology
        port = str(t.master_port or "$master_port")
        c10d = {"rendezvous": "c10d", "rdzv_id": "$SLURM_JOB_ID", "endpoint": f"$head_node:{port}"}
        c10d["local_addr"] = "${addr:-$SLURMD_NODENAME}"
        start = launcher(self.python)
        log_dir = "$run_dir/logs/node-$SLURM_NODEID"
        args = t.command(start, "$SLURM_NODEID", script, str(run_dir), log_dir, **c10d)
        own = re.compile(r"\$\W*(head_node|master_port|addr\b|SLURM_|run_dir)")  # on nodes
        output = None if marker else "%x-%j.out"  # submitted: on sbatch's command line
        sbatch = {"job-name": self.job_name, "nodes": t.nnodes, "ntasks-per-node": 1}
        sbatch |= {"time": self.time, "open-mode": "append", "output": output}
        sbatch |= {"partition": self.partition, "account": self.account}
        sbatch["gpus-per-node"] = self.gpus_per_node
        # ddpnb's worker and a submission read these; a script of the user's, printed, needs
        # neither (nor the note on the worker's dataset check).
        worker = CONSTANTS_NAME in script.generated  # ddpnb's tutorial worker
        note = FINGERPRINT_NOTE if worker else TRUST_NOTE
        v = dict(t=t, port=port, note=note, python=q(self.python or "python3"))
        ours = f'export {RUN_DIR_ENV}="$run_dir" DDPNB_LAUNCHED=1\n'
        v["ddpnb_env"] = ours if marker or worker else ""
        v |= dict(
            token=q(marker), marker_path=q(str(run_dir / MARKER_NAME)), run_dir=q(str(run_dir))
        )
        v["header"] = "\n".join(f"#SBATCH --{k}={x}" for k, x in sbatch.items() if x)
        derived = "export master_port=$((20000 + SLURM_JOB_ID % 20000))\n"  # from the job id
        v["port_line"] = "" if t.master_port else derived
        v["exports"] = "".join(f"export {k}={q(x)}\n" for k, x in (env or {}).items())
        v["node_log"] = q(str(run_dir / "logs" / "node-%n.log"))
        v["launcher"] = shlex.join(start)
        quoted = [f'"{a}"' if own.search(a) else q(a) for a in args[len(start) :]]
        v["torchrun"] = " \\\n        ".join(quoted)
        v["marker"] = marker and SUBMITTED.format(**v)
        v["network"] = marker and NETWORK.format(**v)
        return BATCH.format(**v)


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
    rdzv_timeout: int = SLURM_RDZV_TIMEOUT,
) -> str:
    """An sbatch script that runs ``what`` with one torchrun per node (c10d rendezvous).

    Writes it to ``path`` when given. ``master_port=None``: a port from the job id.
    ``python`` runs ``python -m torch.distributed.run`` (default: ``torchrun`` on PATH).
    Node output goes to ``run_dir/logs/node-N.log``, the script's to ``%x-%j.out``.
    """
    script = what if isinstance(what, Script) else Script.worker(as_config(what))
    topology = Topology(
        nnodes=nnodes,
        nproc_per_node=nproc_per_node,
        master_port=master_port,
        rdzv_timeout=rdzv_timeout,
        max_restarts=max_restarts,
    )
    named = {"partition": partition, "account": account, "python": python, "job_name": job_name}
    slurm = Slurm(topology, os.environ, time=time_limit, gpus_per_node=gpus_per_node, **named)
    text = slurm.batch_script(script, Path(run_dir))
    if path is not None:
        Path(path).write_text(text)
    return text


def submit_slurm(
    what: Script | TrainConfig | Mapping[str, Any],
    run_dir: str | os.PathLike,
    nnodes: int,
    nproc_per_node: int = 1,
    gpus_per_node: int | None = None,
    partition: str | None = None,
    time: str = "01:00:00",  # noqa: A002 (sbatch's own name for it)
    account: str | None = None,
    sbatch_args: Sequence[str] = (),
    python: str | None = None,
    wait: bool = True,
    progress: str = "auto",
    resume: bool = False,
    overwrite: bool = False,
    max_restarts: int = 0,
    rdzv_timeout: int = SLURM_RDZV_TIMEOUT,
    env: Mapping[str, str] | None = None,
    hang_timeout: float | None = HANG_TIMEOUT,
    on_hang: str = "stop",
) -> Job:
    """Submit a run as a Slurm batch job (``sbatch``) and follow it like :func:`ddpnb.launch`.

    ``what``: a :class:`~ddpnb.Script` or the worker's TrainConfig. ``run_dir`` must be on
    a filesystem every node shares. ``python``: the nodes' interpreter (default: this one).
    ``sbatch_args=["--requeue"]``: a requeued job resumes from its checkpoint;
    ``max_restarts``: torchrun restarts failed workers inside the allocation.
    ``hang_timeout``, ``on_hang``: as in :func:`ddpnb.launch` (``"stop"`` cancels the job).
    Raises :class:`~ddpnb.errors.WorkerFailed` or :class:`SlurmJobEnded` on failure; the
    job outlives this process (:func:`attach` follows it again).
    """
    if not isinstance(sbatch_args, (list, tuple)) or any(
        not isinstance(a, str) for a in sbatch_args
    ):
        raise ConfigError("sbatch_args must be a list of strings, e.g. ['--qos=short'].")
    topology = Topology(
        nnodes=nnodes,
        nproc_per_node=nproc_per_node,
        rdzv_timeout=rdzv_timeout,
        max_restarts=max_restarts,
    )
    sbatch = {"partition": partition, "time": time, "account": account, "sbatch_args": sbatch_args}
    sbatch |= {"gpus_per_node": gpus_per_node, "python": python or sys.executable}
    scheduler = Slurm(topology, os.environ, **sbatch)
    options = {"progress": progress, "env": env, "resume": resume, "overwrite": overwrite}
    options |= {"hang_timeout": hang_timeout, "on_hang": on_hang}
    return run(what, Path(run_dir).resolve(), scheduler, wait=wait, **options)


def attach(run_dir: str | os.PathLike, wait: bool = True, progress: str = "auto") -> Job:
    """Follow a submitted Slurm job again, from any process (a new kernel, the CLI).

    Reads ``run_dir/slurm_job.json``; follows the job to its end when ``wait``.
    """
    run_dir = Path(run_dir).resolve()
    record = read_json(run_dir / JOB_FILE)
    if "job_id" not in record:
        raise LaunchError(
            f"{run_dir} holds no submitted Slurm job ({JOB_FILE} missing or unreadable). "
            "Submit one with ddpnb.submit_slurm()."
        )
    old = {"rdzv_timeout": SLURM_RDZV_TIMEOUT, "max_restarts": 0, "script": WORKER_NAME, "args": ()}
    old |= {"hang_timeout": HANG_TIMEOUT, "on_hang": "stop", "submitted_at": None}
    r = old | record  # older records: these defaults
    conf = {"SLURM_CONF": r["slurm_conf"]} if r.get("slurm_conf") else {}
    env = {**conf, **os.environ}  # the cluster it was submitted to, unless SLURM_CONF names one
    shape = ("nnodes", "nproc_per_node", "rdzv_timeout", "max_restarts")
    topology = Topology(**{k: r[k] for k in shape})  # node 0 and its port: the job's
    name = r["script"]  # its path in the run directory
    worker = name == WORKER_NAME and (run_dir / "config.json").exists()
    config = TrainConfig.load(run_dir / "config.json") if worker else None
    script = Script(run_dir / name, r["args"], rename=name)
    follow = {"hang_timeout": r["hang_timeout"], "on_hang": r["on_hang"]}
    follow |= {"progress": check_progress(progress), "started_at": r["submitted_at"]}
    scheduler = Slurm(topology, env, run_dir, r["job_id"])
    job = Job(run_dir, script, config, topology, scheduler, **follow)
    return job.wait() if wait else job
