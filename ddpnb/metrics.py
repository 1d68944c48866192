"""Reading what a run wrote: per-epoch metrics, per-rank records, live progress."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from pathlib import Path


@dataclasses.dataclass
class RunMetrics:
    """One run directory's numbers: ``epochs`` from ``metrics.jsonl``, ``ranks`` by global rank."""

    run_dir: Path
    epochs: list[dict]
    ranks: dict[int, list[dict]]
    config: dict
    # effective_config.json: the config with what "auto" resolved to on this run; {} before.
    effective: dict = dataclasses.field(default_factory=dict)

    @property
    def final(self) -> dict:
        """The last epoch's record (empty before the first epoch ends)."""
        return self.epochs[-1] if self.epochs else {}

    def series(self, key: str) -> list[float]:
        return [e[key] for e in self.epochs]

    @property
    def label(self) -> str:
        ws = self.final.get("world_size")
        return f"{self.run_dir.name} (world size {ws})" if ws else self.run_dir.name


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    """Records of a JSON-lines file; a torn last line (a write in progress) is skipped."""
    try:
        lines = Path(path).read_text().splitlines()
    except FileNotFoundError:
        return []
    out = []
    for line in lines:
        with contextlib.suppress(json.JSONDecodeError):
            out.append(json.loads(line))
    return out


def read_json(path: str | os.PathLike) -> dict:
    """A JSON object from a file, or ``{}`` when it is missing, unreadable or not an object."""
    try:
        value = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def load_metrics(run_dir: str | os.PathLike) -> RunMetrics:
    """Load ``metrics.jsonl``, the rank files and the config of a run directory."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"Run directory {run_dir} does not exist.")
    ranks = {
        int(p.stem.split("-")[1]): read_jsonl(p) for p in (run_dir / "ranks").glob("rank-*.jsonl")
    }
    return RunMetrics(
        run_dir,
        read_jsonl(run_dir / "metrics.jsonl"),
        dict(sorted(ranks.items())),
        read_json(run_dir / "config.json"),
        read_json(run_dir / "effective_config.json"),
    )


def read_progress(run_dir: str | os.PathLike) -> dict:
    """The worker's latest progress record, or ``{}`` before it writes one."""
    return read_json(Path(run_dir) / "progress.json")
