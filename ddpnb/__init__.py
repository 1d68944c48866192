"""ddpnb: from one process to multi-node DistributedDataParallel, from a notebook.

``import ddpnb`` is light: everything but the plots imports only the standard library
(torch is imported where a check needs it), so ``ddpnb check`` answers at once.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .cluster import node_commands, slurm_script
from .config import TrainConfig
from .data import inspect_dataset, prepare_digits
from .errors import DdpnbError, WorkerFailed
from .job import Job
from .launch import launch, train_single
from .metrics import load_metrics
from .remote import check_hosts, ssh_commands
from .rundir import write_worker
from .script import Script
from .scriptcheck import check_script
from .slurm import attach, submit_slurm
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
    "train_single",
    "write_worker",
]

__version__ = "0.1.0"

# The plots need matplotlib: loaded on first use, so that ``import ddpnb`` stays light.
_LAZY = {"plot_curves": "plot", "plot_scaling": "plot", "plot_throughput": "plot"}


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(importlib.import_module(f".{_LAZY[name]}", __name__), name)
        globals()[name] = value  # later lookups skip this function
        return value
    raise AttributeError(f"module 'ddpnb' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])


if TYPE_CHECKING:  # for type checkers and IDEs; never runs
    from .plot import plot_curves, plot_scaling, plot_throughput
