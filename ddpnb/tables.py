"""Tables of finished runs: pure functions of run directories (no torch), which plot.py draws."""

from __future__ import annotations

import html
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path

from .metrics import RunMetrics, load_metrics

#: A finished run: a run directory, its RunMetrics, or a :class:`~ddpnb.Job`.
RunLike = str | os.PathLike | RunMetrics | object

#: What notebook 03 shows per rank: where it ran and how much it did.
RANK_KEYS = ("node_rank", "local_rank", "train_samples", "val_samples", "images_per_second")


class Table(list):
    """A list of row dicts that prints as an aligned text table (numbers right, words left)."""

    def _cells(self) -> list[list[str]]:  # the header, then each row's cells
        header = list(dict.fromkeys(k for row in self for k in row))
        return [header] + [[_cell(row.get(k, "")) for k in header] for row in self]

    def __str__(self) -> str:
        cells = self._cells()
        widths = [max(map(len, column)) for column in zip(*cells)]
        left = [any(isinstance(row.get(k), str) for row in self) for k in cells[0]]
        lines = (
            "  ".join(c.ljust(w) if lj else c.rjust(w) for c, w, lj in zip(row, widths, left))
            for row in cells
        )
        return "\n".join(line.rstrip() for line in lines)

    def _repr_pretty_(self, p, cycle) -> None:  # IPython shows the table, not a list
        p.text(str(self))

    def html(self, caption: str = "") -> str:
        """The table as an HTML ``<table>``, with ``caption`` above it."""
        (header, *rows), e = self._cells(), html.escape
        cells = lambda values, tag: "".join(f"<{tag}>{e(v)}</{tag}>" for v in values)
        head = f"<caption>{e(caption)}</caption>" if caption else ""
        head += f"<thead><tr>{cells(header, 'th')}</tr></thead>"
        body = "".join(f"<tr>{cells(row, 'td')}</tr>" for row in rows)
        return f"<table>{head}<tbody>{body}</tbody></table>"


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.4g}"
    return str(value)


def as_metrics(run: RunLike) -> RunMetrics:
    """The RunMetrics of a run directory, a :class:`~ddpnb.Job` or RunMetrics itself."""
    if isinstance(run, RunMetrics):
        return run
    return load_metrics(getattr(run, "run_dir", run))


def _labelled(
    runs, labels: Sequence[str] | None = None, name: Callable = lambda m: m.run_dir.name
) -> list[tuple[str, RunMetrics]]:
    """``(label, RunMetrics)`` of one run, several, or a ``{label: run}`` mapping."""
    if isinstance(runs, Mapping):
        return [(str(label), as_metrics(run)) for label, run in runs.items()]
    if isinstance(runs, (str, os.PathLike, RunMetrics)) or hasattr(runs, "run_dir"):
        runs = [runs]
    metrics = [as_metrics(r) for r in runs]
    return list(zip(list(labels) if labels is not None else map(name, metrics), metrics))


def rank_table(
    runs: RunLike | Sequence[RunLike] | Mapping[str, RunLike],
    keys: Iterable[str] = RANK_KEYS,
    *,
    last_epoch: bool = False,
) -> Table:
    """One row per run, epoch and global rank: those keys of the per-rank records. A
    ``{label: run}`` mapping adds a ``run`` column; ``last_epoch`` keeps each rank's last record."""
    keys = list(keys)
    table = Table()
    for label, m in _labelled(runs):
        rows = []
        for rank, records in m.ranks.items():
            for rec in records[-1:] if last_epoch else records:
                row = {"run": label} if isinstance(runs, Mapping) else {}
                row |= {"epoch": rec.get("epoch"), "rank": rank}
                rows.append(row | {k: rec.get(k, "") for k in keys})
        table.extend(sorted(rows, key=lambda r: (r["epoch"] or 0, r["rank"])))
    return table


def epoch_table(
    run: RunLike, keys: Iterable[str] = ("restart_count", "train_loss", "val_loss", "val_acc")
) -> Table:
    """One row per recorded epoch (``metrics.jsonl``) with those keys."""
    keys = list(keys)
    return Table(
        {"epoch": e["epoch"], **{k: e.get(k, "") for k in keys}} for e in as_metrics(run).epochs
    )


def run_table(
    runs: Mapping[str, RunLike],
    keys: Iterable[str] = ("world_size", "images_per_second", "val_acc"),
) -> Table:
    """One row per run: those keys of its last epoch."""
    keys = list(keys)
    return Table(
        {"run": label, **{k: m.final.get(k, "") for k in keys}} for label, m in _labelled(runs)
    )


def samples_seen(run: RunLike) -> dict[str, int]:
    """Training and validation images summed over every rank's last epoch (training: with
    ``DistributedSampler``'s padding; validation: the split, when each image counts once)."""
    last = [records[-1] for records in as_metrics(run).ranks.values() if records]
    return {split: sum(r[f"{split}_samples"] for r in last) for split in ("train", "val")}


def scaling_table(
    runs: Sequence[RunLike] | Mapping[str, RunLike], labels: Sequence[str] | None = None
) -> Table:
    """Per run: images/s, efficiency (over the first run's images/s), val_acc, and the
    communication share: the part of all ranks' last-epoch seconds spent waiting for gradients."""
    labelled = _labelled(runs, labels)
    base = (labelled[0][1].final.get("images_per_second") if labelled else None) or 1.0
    table = Table()
    for label, m in labelled:
        ips = m.final.get("images_per_second", 0.0)
        last = [records[-1] for records in m.ranks.values() if records]
        comm = sum(r.get("comm_seconds", 0.0) for r in last)
        parts = ("data_wait_seconds", "compute_seconds", "comm_seconds")
        busy = sum(r.get(k, 0.0) for r in last for k in parts)
        table.append(
            {
                "layout": label,
                "world_size": m.final.get("world_size"),
                "images/s": round(ips),
                "efficiency": round(ips / base, 2),
                "communication share": round(comm / busy, 2) if busy else 0.0,
                "val_acc": round(m.final.get("val_acc", 0.0), 4),
            }
        )
    return table


def same_weights(a: RunLike, b: RunLike) -> bool:
    """Whether two runs hold bit-identical parameters after every epoch (rank 0's checksums)."""
    sums = [[r["param_checksum"] for r in as_metrics(run).ranks.get(0, [])] for run in (a, b)]
    return bool(sums[0]) and sums[0] == sums[1]


def run_figures(run: RunLike | None, prefix: str = "") -> dict:
    """A run's headline numbers, each key after ``prefix``; ``None`` values for ``run=None``."""
    keys = ("val_acc", "images_per_second", "train_seconds", "epochs", "world_size")
    if run is None:
        return {prefix + k: None for k in keys}
    m = as_metrics(run)
    values = [m.final.get("val_acc"), m.final.get("images_per_second")]
    values += [sum(m.series("epoch_seconds")), len(m.epochs), m.final.get("world_size")]
    return {prefix + k: v for k, v in zip(keys, values)}


def node_log_lines(
    run: RunLike, words: Iterable[str] = (), *, head: int = 0, width: int | None = None
) -> str:
    """Lines of every node's log (``logs/node-<n>.log``): the first ``head``, then
    those that contain any of ``words``; each cut to ``width`` characters."""
    words = list(words)
    logs = Path(getattr(run, "run_dir", run)) / "logs"  # a Job and RunMetrics have run_dir
    out = []
    for path in sorted(logs.glob("node-*.log"), key=lambda p: int(p.stem.split("-")[1])):
        lines = path.read_text(errors="replace").splitlines()
        chosen = lines[:head] + [ln for ln in lines[head:] if any(w in ln for w in words)]
        out.append(f"--- {path.stem.replace('-', ' ')}")
        out.extend(ln.rstrip()[:width] for ln in chosen)
    return "\n".join(out)
