"""Plots: pure functions of run directories that return matplotlib Figures."""

from __future__ import annotations

import os
from collections.abc import Sequence

from matplotlib.figure import Figure

from .metrics import RunMetrics, load_metrics

RunLike = str | os.PathLike | RunMetrics


def _runs(runs: RunLike | Sequence[RunLike]) -> list[RunMetrics]:
    if isinstance(runs, (str, os.PathLike, RunMetrics)):
        runs = [runs]
    return [r if isinstance(r, RunMetrics) else load_metrics(r) for r in runs]


def plot_curves(runs: RunLike | Sequence[RunLike], labels: Sequence[str] | None = None) -> Figure:
    """Loss and accuracy per epoch (train dashed, val solid) for one or more runs.

    Epochs that followed a torchrun restart are marked with a red ``x``.

    Example
    -------
    >>> fig = plot_curves(["runs/baseline", "runs/ddp"], labels=["1 process", "DDP"])  # doctest: +SKIP
    >>> fig.savefig("curves.png")                                                     # doctest: +SKIP
    """
    runs = _runs(runs)
    labels = list(labels) if labels is not None else [r.label for r in runs]
    # Figure() rather than pyplot: no global state, no GUI backend, safe in threads.
    fig = Figure(figsize=(10, 4), layout="constrained")
    ax_loss, ax_acc = fig.subplots(1, 2)
    for i, (run, label) in enumerate(zip(runs, labels)):
        color = f"C{i}"
        ep = run.series("epoch")
        for ax, key in ((ax_loss, "loss"), (ax_acc, "acc")):
            ax.plot(ep, run.series(f"train_{key}"), "--", color=color, label=f"{label} train")
            ax.plot(ep, run.series(f"val_{key}"), "-o", ms=3, color=color, label=f"{label} val")
            resumed = [
                (e["epoch"], e[f"val_{key}"])
                for prev, e in zip(run.epochs, run.epochs[1:])
                if e.get("restart_count", 0) > prev.get("restart_count", 0)
            ]
            if resumed:
                xs, ys = zip(*resumed)
                ax.plot(xs, ys, "x", color="red", ms=10, mew=2, label=f"{label}: restart")
    # Log scale: an untrained first epoch can sit 100x above the rest.
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy loss (log)", title="Loss", yscale="log")
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="Accuracy", ylim=(0, 1.02))
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return fig


def plot_throughput(
    runs: RunLike | Sequence[RunLike], labels: Sequence[str] | None = None
) -> Figure:
    """Bars of images/s per rank (last epoch) and the run's total, for each run.

    Example
    -------
    >>> plot_throughput("runs/ddp").savefig("throughput.png")   # doctest: +SKIP
    """
    runs = _runs(runs)
    labels = list(labels) if labels is not None else [r.label for r in runs]
    fig = Figure(figsize=(max(5, 1.6 * len(runs) + 3), 4), layout="constrained")
    ax = fig.subplots()
    x = 0.0
    ticks, ticklabels = [], []
    for i, (run, label) in enumerate(zip(runs, labels)):
        per_rank = {r: recs[-1]["images_per_second"] for r, recs in run.ranks.items() if recs}
        for r, ips in per_rank.items():
            ax.bar(x, ips, color=f"C{i}", alpha=0.6)
            ticks.append(x)
            ticklabels.append(f"r{r}")
            x += 1
        total = run.final.get("images_per_second", 0.0)
        ax.bar(x, total, color=f"C{i}", label=f"{label} total")
        ax.text(x, total, f"{total:.0f}", ha="center", va="bottom", fontsize=8)
        ticks.append(x)
        ticklabels.append("all")
        x += 1.8
    ax.set_xticks(ticks, ticklabels)
    ax.set(ylabel="training images/s", title="Throughput per rank and in total")
    ax.legend(fontsize=8)
    return fig


def plot_scaling(runs: RunLike | Sequence[RunLike], labels: Sequence[str] | None = None) -> Figure:
    """Throughput and scaling efficiency per run, and where each rank's epoch time goes.

    Left: images/s of the last epoch, annotated with the efficiency against the first
    run (the efficiency is ``images/s / first run's images/s``: the simulated nodes share
    one host's cores, so the ideal is to lose nothing). Right: each rank's last-epoch
    seconds split into data wait, compute and communication that backward had to wait for.

    Example
    -------
    >>> plot_scaling(["runs/scaling/1x1", "runs/scaling/1x2"]).savefig("scaling.png")  # doctest: +SKIP
    """
    runs = _runs(runs)
    labels = list(labels) if labels is not None else [r.label for r in runs]
    fig = Figure(figsize=(11, 4), layout="constrained")
    ax_ips, ax_split = fig.subplots(1, 2, width_ratios=[1, 1.6])
    base = runs[0].final.get("images_per_second") or 1.0
    for i, run in enumerate(runs):
        ips = run.final.get("images_per_second", 0.0)
        ax_ips.bar(i, ips, color=f"C{i}")
        ax_ips.text(i, ips, f"{ips:.0f}\n{ips / base:.0%}", ha="center", va="bottom", fontsize=8)
    ax_ips.set_xticks(range(len(runs)), labels)
    ax_ips.set(ylabel="training images/s (last epoch)", title="Throughput (efficiency vs first)")
    ax_ips.margins(y=0.2)

    parts = (("data_wait_seconds", "data wait"), ("compute_seconds", "compute"))
    parts += (("comm_seconds", "communication (not overlapped)"),)
    x, ticks, ticklabels = 0.0, [], []
    for run, label in zip(runs, labels):
        for r, recs in run.ranks.items():
            if not recs:
                continue
            bottom = 0.0
            for j, (key, name) in enumerate(parts):
                value = recs[-1].get(key, 0.0)
                ax_split.bar(x, value, bottom=bottom, color=f"C{j + 3}", label=name)
                bottom += value
            ticks.append(x)
            ticklabels.append(f"{label}\nr{r}")
            x += 1
        x += 0.6
    handles, names = ax_split.get_legend_handles_labels()
    unique = dict(zip(names, handles))
    ax_split.legend(unique.values(), unique.keys(), fontsize=8, loc="upper center", ncol=3)
    ax_split.margins(y=0.15)
    ax_split.set_xticks(ticks, ticklabels, fontsize=8)
    ax_split.set(ylabel="seconds in the last epoch", title="Where each rank's time goes")
    return fig
