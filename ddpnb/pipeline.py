"""The launch pipeline: check, prepare the run directory, start the nodes, follow them.

Every launch of every scheduler goes through :func:`run`; it imports no scheduler."""

from __future__ import annotations

import os
import shutil
from typing import Any

from .hang import WATCH_DIR
from .job import Job
from .plan import Plan
from .preflight import as_config, check_run, warn_if_cuda_initialised
from .rundir import prepare_run_dir
from .scheduler import Scheduler
from .script import Script


def run(
    what: Any, run_dir: str | os.PathLike, scheduler: Scheduler, *, wait: bool, **options
) -> Job:
    """The one path of every launch, every check first; ``options``: :class:`Plan`'s fields."""
    script, config = what, None
    if not isinstance(what, Script):  # ddpnb's worker: a TrainConfig or its dict
        config = check_run(as_config(what), scheduler.topology.world_size, here=scheduler.data_here)
        script = Script.worker(config)
    script.check()
    plan = Plan(script, config, **options)
    scheduler.check(plan)
    run_dir = prepare_run_dir(
        run_dir, plan.payload, plan.config, resume=plan.resume, overwrite=plan.overwrite
    ).resolve()
    scheduler.preflight(plan, run_dir)
    warn_if_cuda_initialised()
    shutil.rmtree(run_dir / WATCH_DIR, ignore_errors=True)
    for name, data in plan.files.items():  # ddpnb's hooks: fresh at every launch
        (run_dir / name).parent.mkdir(parents=True, exist_ok=True)
        (run_dir / name).write_bytes(data)
    (run_dir / "logs").mkdir(exist_ok=True)
    scheduler.start(plan, run_dir)
    job = Job(run_dir, plan.script, plan.config, scheduler.topology, scheduler, **plan.follow)
    return job.wait() if wait else job
