"""The launch pipeline: check, prepare the run directory, start the nodes, follow them.

Written once for every backend (``ddpnb.local.Local``, ``ddpnb.remote.Hosts``,
``ddpnb.slurm.Slurm``), none of which it imports: a backend is handed to :func:`run`,
which calls it in this order. The kernel never joins the process group: each node runs
one ``torchrun`` agent as a fresh process (no fork), from an explicit environment, and the
Job follows the files the workers write.
"""

from __future__ import annotations

import os
import shutil

from .hang import WATCH_DIR, hooks_payload
from .job import Backend, Job
from .plan import Plan
from .preflight import check_run, warn_if_cuda_initialised
from .rundir import prepare_run_dir
from .script import worker_script


def run(plan: Plan, run_dir: str | os.PathLike, backend: Backend, *, wait: bool) -> Job:
    """The pipeline every launch goes through; nothing starts before every check passed."""
    plan.script.check()
    if plan.config is not None:
        plan.config = check_run(plan.config, plan.topology, here=backend.data_here)
        plan.script = worker_script(plan.config)  # its config.json holds the checked paths
    plan.payload = plan.script.payload()  # read once: the run directory's and the hosts' files
    backend.check(plan)  # nothing written yet
    plan.run_dir = prepare_run_dir(
        run_dir, plan.payload, plan.config, resume=plan.resume, overwrite=plan.overwrite
    ).resolve()
    plan.topology = backend.preflight(plan)
    warn_if_cuda_initialised()
    plan.payload.update(hooks_payload())  # ddpnb's own files: replaced at every launch
    shutil.rmtree(plan.run_dir / WATCH_DIR, ignore_errors=True)  # an earlier launch's stacks
    for name, data in plan.payload.items():
        (plan.run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (plan.run_dir / name).write_bytes(data)
    (plan.run_dir / "logs").mkdir(exist_ok=True)
    job = backend.start(plan)
    return job.wait() if wait else job
