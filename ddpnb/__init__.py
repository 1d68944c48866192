"""ddpnb: from one process to multi-node DistributedDataParallel, from a notebook.

``import ddpnb`` is light: the public names load their module (and torch, or
matplotlib) on first use, so ``ddpnb check`` answers before torch is imported.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .config import TrainConfig
from .errors import DdpnbError, WorkerFailed

# Eager, and light (stdlib only): the function must shadow its module's name, which
# any ``import ddpnb.launch`` would otherwise bind on the package.
from .launch import Job, launch, train_single

# public name -> the module that defines it (imported on first access)
_LAZY = {
    "inspect_dataset": "data",
    "prepare_digits": "data",
    "load_metrics": "metrics",
    "node_commands": "cluster",
    "slurm_script": "cluster",
    "plot_curves": "plot",
    "plot_scaling": "plot",
    "plot_throughput": "plot",
    "write_worker": "rundir",
    "check_hosts": "remote",
    "ssh_commands": "remote",
    "submit_slurm": "slurm",
    "attach": "slurm",
}

__all__ = [
    "DdpnbError",
    "Job",
    "TrainConfig",
    "WorkerFailed",
    "attach",
    "check_hosts",
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
    "train_single",
    "write_worker",
]

__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'ddpnb' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


if TYPE_CHECKING:  # for type checkers and IDEs; never runs
    from .cluster import node_commands, slurm_script
    from .data import inspect_dataset, prepare_digits
    from .metrics import load_metrics
    from .plot import plot_curves, plot_scaling, plot_throughput
    from .remote import check_hosts, ssh_commands
    from .rundir import write_worker
    from .slurm import attach, submit_slurm
