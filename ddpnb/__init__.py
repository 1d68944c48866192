"""ddpnb: from one process to multi-node DistributedDataParallel, from a notebook."""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING

from .config import TrainConfig
from .data import inspect_dataset, prepare_digits
from .errors import DdpnbError, WorkerFailed
from .job import Job
from .launch import launch, train_single  # noqa: F401 (train_single: deprecated, launch(nnodes=1))
from .metrics import load_metrics
from .rundir import write_worker
from .script import Script
from .sweep import sweep

__all__ = [
    "DdpnbError",
    "Job",
    "Script",
    "TrainConfig",
    "WorkerFailed",
    "attach",
    "check_hosts",
    "check_script",
    "inspect_dataset",
    "launch",
    "load_metrics",
    "node_commands",
    "plot_curves",
    "plot_scaling",
    "plot_throughput",
    "prepare_digits",
    "slurm_script",
    "ssh_commands",
    "submit_slurm",
    "sweep",
    "write_worker",
]

__version__ = "0.1.0"

# Loaded on first use, so that ``import ddpnb`` stays light.
_LAZY = {
    "plot_curves": "plot",
    "plot_scaling": "plot",
    "plot_throughput": "plot",
    "check_hosts": "remote",
    "ssh_commands": "remote",
    "attach": "slurm",
    "submit_slurm": "slurm",
    "check_script": "scriptcheck",
    "node_commands": "cluster",
    "slurm_script": "slurm",
}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    if not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}"):
        return importlib.import_module(f".{name}", __name__)  # a module: ddpnb.cluster.X
    raise AttributeError(f"module 'ddpnb' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


if TYPE_CHECKING:
    from .cluster import node_commands
    from .plot import plot_curves, plot_scaling, plot_throughput
    from .remote import check_hosts, ssh_commands
    from .scriptcheck import check_script
    from .slurm import attach, slurm_script, submit_slurm
