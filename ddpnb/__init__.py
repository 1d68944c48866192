"""ddpnb: from one process to multi-node DistributedDataParallel, from a notebook."""

from .cluster import node_commands, slurm_script
from .config import TrainConfig
from .data import inspect_dataset, prepare_digits
from .errors import DdpnbError, WorkerFailed
from .launch import Job, launch, train_single
from .metrics import load_metrics
from .plot import plot_curves, plot_scaling, plot_throughput
from .rundir import write_worker

__all__ = [
    "DdpnbError",
    "Job",
    "TrainConfig",
    "WorkerFailed",
    "inspect_dataset",
    "launch",
    "load_metrics",
    "node_commands",
    "plot_curves",
    "plot_scaling",
    "plot_throughput",
    "prepare_digits",
    "slurm_script",
    "train_single",
    "write_worker",
]

__version__ = "0.1.0"
