"""Notebook 06's helpers: runs with pitfall switches off, side by side with a correct one."""

from __future__ import annotations

import os
from collections.abc import Mapping

from matplotlib.figure import Figure

from .metrics import RunMetrics, load_metrics

RunLike = str | os.PathLike | RunMetrics


def _metrics(run) -> RunMetrics:
    if isinstance(run, RunMetrics):
        return run
    return load_metrics(getattr(run, "run_dir", run))  # a Job, or a run directory


def _per_epoch_rank_mean(run, key: str) -> list[float]:
    ranks = list(_metrics(run).ranks.values())
    epochs = min(len(records) for records in ranks)
    return [sum(records[e][key] for records in ranks) / len(ranks) for e in range(epochs)]


def epoch_seconds(run) -> float:
    """A rank's training seconds per epoch: the mean over ranks, the best epoch.

    The best (shortest) epoch, because on a shared machine noise only ever adds time.
    """
    return min(_per_epoch_rank_mean(run, "train_seconds"))


def rank_images_per_second(run) -> float:
    """One rank's training images/s: the mean over ranks, the best (fastest) epoch."""
    return max(_per_epoch_rank_mean(run, "images_per_second"))


def plot_epoch_seconds(runs: Mapping[str, object]) -> Figure:
    """Bars of each rank's training seconds in the last epoch, one colour per run.

    Example
    -------
    >>> plot_epoch_seconds({"correct": "runs/ok", "no sampler": "runs/bad"})  # doctest: +SKIP
    """
    fig = Figure(figsize=(max(5, 1.5 * len(runs) + 3), 4), layout="constrained")
    ax = fig.subplots()
    x = 0.0
    ticks, ticklabels = [], []
    for i, (label, run) in enumerate(runs.items()):
        for rank, records in _metrics(run).ranks.items():
            seconds = records[-1]["train_seconds"]
            ax.bar(x, seconds, color=f"C{i}", label=label if rank == 0 else None)
            ax.text(x, seconds, f"{seconds:.1f}", ha="center", va="bottom", fontsize=8)
            ticks.append(x)
            ticklabels.append(f"r{rank}")
            x += 1
        x += 0.8
    ax.set_xticks(ticks, ticklabels)
    ax.set(ylabel="seconds", title="Training time of one epoch, per rank (last epoch)")
    ax.legend(fontsize=8)
    return fig
