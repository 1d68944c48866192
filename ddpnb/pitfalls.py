"""Notebook 06's pitfalls: the classic DDP mistakes, each a small edit of the worker script.

Each edit is marked ``# MISTAKE``; the correct worker holds no switch for any of them.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from matplotlib.figure import Figure

from .config import TrainConfig
from .errors import ConfigError
from .script import Script
from .source import WORKER_PATH
from .tables import as_metrics
from .text import diff


class Pitfall:
    """What goes wrong, and ``edits`` given flat: old, new, ...: a text found on exactly one line
    of the worker, what replaces that whole line at its indentation (empty: deletes it)."""

    def __init__(self, harm: str, *edits: str) -> None:
        self.harm, self.edits = harm, tuple(zip(edits[::2], edits[1::2]))


PITFALLS = {
    "no_sampler": Pitfall(
        "no DistributedSampler: every rank trains on the whole split, in the same order",
        "DataLoader(train_set, sampler=train_sampler, **loader)",
        "train_loader = DataLoader(train_set, shuffle=True, **loader)  # MISTAKE: no sampler",
    ),
    "no_set_epoch": Pitfall(
        "sampler.set_epoch is never called: every epoch repeats epoch 0's order",
        "data.train_sampler.set_epoch(epoch)",
        "pass  # MISTAKE: data.train_sampler.set_epoch(epoch) is missing",
    ),
    "padded_validation": Pitfall(
        "validation through a padded DistributedSampler: some images count twice",
        "    val_set = Subset(val_set, range(me.global_rank, len(val_set), me.world_size))\n",
        "",
        "DataLoader(val_set, shuffle=False, **loader)",
        "val_loader = DataLoader(val_set, sampler=DistributedSampler(val_set, shuffle=False),"
        " **loader)  # MISTAKE: padded shards",
    ),
    "mean_of_means": Pitfall(
        "metrics are the mean of per-rank means, not reduced sums and counts",
        "totals = torch.cat([train_sums, val_sums])",
        "totals = torch.cat([s / s[2] / me.world_size for s in (train_sums, val_sums)])"
        "  # MISTAKE: each rank's means",
    ),
    "no_thread_budget": Pitfall(
        "no thread budget: every process takes all of the host's cores (oversubscribed)",
        'torch.set_num_threads(cfg["threads"] or cpu_share(me))',
        "pass  # MISTAKE: torch.set_num_threads(...) is missing",
    ),
    "barrier_on_rank0": Pitfall(
        "dist.barrier() on rank 0 only: the ranks wait in different collectives and the run "
        "hangs after its first epoch",
        "        if me.distributed:\n",  # the guard of the end-of-epoch barrier
        "if me.master_process:  # MISTAKE: the barrier on rank 0 only",
    ),
}


def variant(name: str) -> str:
    """The worker's source with pitfall ``name``'s edits."""
    if name not in PITFALLS:
        raise ConfigError(f"No pitfall {name!r}; the pitfalls are: {', '.join(PITFALLS)}.")
    lines = WORKER_PATH.read_text().splitlines(keepends=True)
    for old, new in PITFALLS[name].edits:
        found = [i for i, line in enumerate(lines) if old in line]
        if len(found) != 1:  # tests/test_pitfalls.py keeps every edit applicable
            raise ValueError(f"pitfall {name}: {len(found)} lines of the worker hold {old!r}")
        line = lines[found[0]]
        indent = line[: len(line) - len(line.lstrip())]
        lines[found[0]] = indent + new + "\n" if new else ""
    return "".join(lines)


def edit(name: str, context: int = 1) -> str:
    """The edit that makes pitfall ``name``, as a unified diff of ``train_ddp.py``."""
    names = ("train_ddp.py", f"train_ddp.py ({name})")
    return diff(WORKER_PATH.read_text(), variant(name), context, names)


def script(config: TrainConfig, name: str, folder: str | os.PathLike) -> Script:
    """Pitfall ``name`` as a Script to launch: the edited worker, written to ``folder``."""
    path = Path(folder) / f"train_ddp_{name}.py"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(variant(name))
    # The worker runs in the run directory: a relative data_dir must not depend on that.
    return Script.worker(config.replace(data_dir=os.path.abspath(config.data_dir)), path)


def _per_epoch_rank_mean(run, key: str) -> list[float]:
    epochs = zip(*as_metrics(run).ranks.values())  # each epoch's records, one a rank
    return [sum(record[key] for record in epoch) / len(epoch) for epoch in epochs]


def epoch_seconds(run) -> float:
    """A rank's training seconds per epoch: the mean over ranks, the best (shortest) epoch."""
    return min(_per_epoch_rank_mean(run, "train_seconds"))


def rank_images_per_second(run) -> float:
    """One rank's training images/s: the mean over ranks, the best (fastest) epoch."""
    return max(_per_epoch_rank_mean(run, "images_per_second"))


def plot_epoch_seconds(runs: Mapping[str, object]) -> Figure:
    """Bars of each rank's training seconds in the last epoch, one colour per run."""
    fig = Figure(figsize=(max(5, 1.5 * len(runs) + 3), 4), layout="constrained")
    ax = fig.subplots()
    x, ticks = 0.0, {}
    for i, (label, run) in enumerate(runs.items()):
        for rank, records in as_metrics(run).ranks.items():
            seconds = records[-1]["train_seconds"]
            ax.bar(x, seconds, color=f"C{i}", label=label if rank == 0 else None)
            ax.text(x, seconds, f"{seconds:.1f}", ha="center", va="bottom", fontsize=8)
            ticks[x] = f"r{rank}"
            x += 1
        x += 0.8
    ax.set_xticks(list(ticks), list(ticks.values()))
    ax.set(ylabel="seconds", title="Training time of one epoch, per rank (last epoch)")
    ax.legend(fontsize=8)
    return fig
