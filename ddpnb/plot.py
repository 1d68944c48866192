"""Plots: pure functions of run directories that return matplotlib Figures."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

from matplotlib.axes import Axes
from matplotlib.figure import Figure
from matplotlib.ticker import FuncFormatter, LogLocator, MaxNLocator, NullFormatter

from .constants import IMAGE_EXTENSIONS
from .data import DatasetSummary, inspect_dataset
from .tables import RunLike, _labelled, rank_table, scaling_table


def _runs(runs, labels) -> list:  # (label, RunMetrics); the default label: the world size
    return _labelled(runs, labels, lambda m: m.label)


def label_log_axis(ax: Axes) -> None:
    """Label a log-scale y axis at 1, 2 and 5 of each decade as plain numbers (0.5, 2, 20); fewer
    over many decades, more within one. Call it after plotting: it reads the axis's limits."""
    low, high = ax.get_ylim()
    decades = math.log10(high / low) if low > 0 and high > low else 0.0
    subs = (1.0, 2.0, 5.0) if decades <= 3.5 else (1.0, 3.0) if decades <= 6 else (1.0,)
    if decades < 1:  # within one decade 1, 2 and 5 may leave a single label: label them all
        subs = (1.0, 1.5, *(float(k) for k in range(2, 10)))  # 1.5: between 0.1 and 0.2
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_formatter(NullFormatter())


def plot_curves(runs: RunLike | Sequence[RunLike], labels: Sequence[str] | None = None) -> Figure:
    """Loss and accuracy per epoch (train dashed, val solid) for one or more runs; epochs after
    a torchrun restart get a red ``x``. A script's run draws what it reported."""
    # Figure() rather than pyplot: no global state, no GUI backend, safe in threads.
    fig = Figure(figsize=(10, 4), layout="constrained")
    ax_loss, ax_acc = fig.subplots(1, 2)
    for i, (label, run) in enumerate(_runs(runs, labels)):
        for ax, key in ((ax_loss, "loss"), (ax_acc, "acc")):
            for split, style in (("train", "--o"), ("val", "-o")):
                rows = [(e["epoch"], e.get(f"{split}_{key}")) for e in run.epochs]
                rows = [(x, y) for x, y in rows if isinstance(y, (int, float))]
                if rows:
                    ax.plot(*zip(*rows), style, ms=3, color=f"C{i}", label=f"{label} {split}")
            resumed = [
                (e["epoch"], e[f"val_{key}"])
                for prev, e in zip(run.epochs, run.epochs[1:])
                if e.get("restart_count", 0) > prev.get("restart_count", 0) and f"val_{key}" in e
            ]
            if resumed:
                ax.plot(*zip(*resumed), "x", color="red", ms=10, mew=2, label=f"{label}: restart")
    # Log scale: an untrained first epoch can sit 100x above the rest.
    ax_loss.set(xlabel="epoch", ylabel="cross-entropy loss (log)", title="Loss", yscale="log")
    label_log_axis(ax_loss)
    ax_acc.set(xlabel="epoch", ylabel="accuracy", title="Accuracy", ylim=(0, 1.02))
    for ax in (ax_loss, ax_acc):
        ax.grid(alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # epochs: 1, 2, never 1.5
    # One legend for both plots, below them: inside, a sweep's many entries covered the curves.
    entries = dict(zip(*reversed(ax_loss.get_legend_handles_labels())))
    entries |= dict(zip(*reversed(ax_acc.get_legend_handles_labels())))
    if entries:
        fig.legend(entries.values(), entries.keys(), loc="outside lower center", fontsize=8,
                   ncols=min(4, len(entries)))  # fmt: skip
    return fig


def plot_throughput(
    runs: RunLike | Sequence[RunLike], labels: Sequence[str] | None = None
) -> Figure:
    """Bars of images/s per rank (last epoch) and the run's total, for each run."""
    runs = _runs(runs, labels)
    fig = Figure(figsize=(max(5, 1.6 * len(runs) + 3), 4), layout="constrained")
    ax = fig.subplots()
    x, ticks = 0.0, {}  # x: label
    for i, (label, run) in enumerate(runs):
        per_rank = {r: recs[-1]["images_per_second"] for r, recs in run.ranks.items() if recs}
        for r, ips in per_rank.items():
            ax.bar(x, ips, color=f"C{i}", alpha=0.6)
            ticks[x] = f"r{r}"
            x += 1
        total = run.final.get("images_per_second", 0.0)
        ax.bar(x, total, color=f"C{i}", label=f"{label} total")
        ax.text(x, total, f"{total:.0f}", ha="center", va="bottom", fontsize=8)
        ticks[x] = "all"
        x += 1.8
    ax.set_xticks(list(ticks), list(ticks.values()))
    ax.set(ylabel="training images/s", title="Throughput per rank and in total")
    ax.margins(y=0.12)  # room for the numbers above the bars
    # Beside the axes, not over them: inside, it covered the first total's number.
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return fig


def plot_scaling(runs: RunLike | Sequence[RunLike], labels: Sequence[str] | None = None) -> Figure:
    """Left: :func:`~ddpnb.tables.scaling_table`'s images/s and efficiency per run. Right: each
    rank's last-epoch seconds: data wait, compute, and communication backward waited for."""
    runs = _runs(runs, labels)
    labels = [label for label, _ in runs]
    fig = Figure(figsize=(11, 4), layout="constrained")
    ax_ips, ax_split = fig.subplots(1, 2, width_ratios=[1, 1.6])
    for i, row in enumerate(scaling_table([m for _, m in runs], labels)):
        ips = row["images/s"]
        ax_ips.bar(i, ips, color=f"C{i}")
        text = f"{ips:.0f}\n{row['efficiency']:.0%}"
        ax_ips.text(i, ips, text, ha="center", va="bottom", fontsize=8)
    ax_ips.set_xticks(range(len(runs)), labels)
    ax_ips.set(ylabel="training images/s (last epoch)", title="Throughput (efficiency vs first)")
    ax_ips.margins(y=0.2)
    parts = (("data_wait_seconds", "data wait"), ("compute_seconds", "compute"))
    parts += (("comm_seconds", "communication (not overlapped)"),)
    x, ticks = 0.0, {}  # x: label
    for label, run in runs:
        for row in rank_table(run, [key for key, _ in parts], last_epoch=True):
            bottom = 0.0
            for j, (key, name) in enumerate(parts):
                value = row[key] or 0.0  # "" where a record lacks the key
                legend = None if ticks else name  # one legend entry per part
                ax_split.bar(x, value, bottom=bottom, color=f"C{j + 3}", label=legend)
                bottom += value
            ticks[x] = f"{label}\nr{row['rank']}"
            x += 1
        x += 0.6
    ax_split.legend(fontsize=8, loc="upper center", ncol=3)
    ax_split.margins(y=0.15)
    ax_split.set_xticks(list(ticks), list(ticks.values()), fontsize=8)
    ax_split.set(ylabel="seconds in the last epoch", title="Where each rank's time goes")
    return fig


def plot_class_counts(data) -> Figure:
    """Grouped bars: images per class in ``train`` and ``val`` of a dataset folder or a
    :class:`~ddpnb.data.DatasetSummary` (then nothing is read again)."""
    if not isinstance(data, DatasetSummary):
        data = inspect_dataset(data, show=False, write_manifest=False)
    classes, counts = data.classes, data.counts
    fig = Figure(figsize=(9, 3.5), layout="constrained")
    ax = fig.subplots()
    width = 0.4
    for i, split in enumerate(["train", "val"]):
        values = [counts.get(split, {}).get(c, 0) for c in classes]
        offsets = [p + (i - 0.5) * width for p in range(len(classes))]
        ax.bar(offsets, values, width, label=f"{split} ({sum(values)})")
    ax.set_xticks(list(range(len(classes))), classes)
    ax.set(xlabel="class", ylabel="images", title="Images per class and split")
    top = max([0, *counts.get("train", {}).values(), *counts.get("val", {}).values()])
    ax.set_ylim(top=1.25 * top or 1)  # room for the legend above the bars
    ax.legend(loc="upper center", ncols=2)
    return fig


def plot_samples(
    data_dir: str | os.PathLike, split: str = "train", per_class: int = 2, max_classes: int = 10
) -> Figure:
    """A grid of images from the files: the first ``per_class`` of each of ``max_classes``."""
    from PIL import Image

    root = os.path.join(data_dir, split)
    classes = sorted(d for d in os.listdir(root) if os.path.isdir(os.path.join(root, d)))
    shown = classes[:max_classes]
    fig = Figure(figsize=(1.3 * max(len(shown), 2), 1.5 * per_class), layout="constrained")
    axes = fig.subplots(per_class, max(len(shown), 1), squeeze=False)
    for col, cls in enumerate(shown):
        folder = os.path.join(root, cls)
        names = sorted(n for n in os.listdir(folder) if n.lower().endswith(IMAGE_EXTENSIONS))
        for row, name in enumerate(names[:per_class]):
            with Image.open(os.path.join(folder, name)) as im:
                axes[row][col].imshow(im.convert("RGB") if im.mode != "L" else im, cmap="gray")
        axes[0][col].set_title(cls, fontsize=10)
    for ax in axes.flat:
        ax.axis("off")
    return fig
