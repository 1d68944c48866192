"""The run directory: its rules (never overwrite a run silently) and the worker files."""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path

from .config import TrainConfig
from .constants import RESUMABLE_KEYS
from .errors import RunDirError
from .metrics import read_json, read_jsonl
from .script import Script

WORKER_NAME = "train_ddp.py"
# What every run writes besides its script's files (overwrite=True removes both, nothing else).
PRODUCTS = "metrics.jsonl progress.json effective_config.json ranks checkpoints logs".split()


def write_worker(config: TrainConfig, run_dir: str | os.PathLike) -> Path:
    """Write ``train_ddp.py``, ``config.json`` and the reporting file: a folder torch alone runs."""
    run_dir = Path(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    for name, data in Script.worker(config).payload().items():
        (run_dir / name).write_bytes(data)
    return run_dir / WORKER_NAME


def prepare_run_dir(
    run_dir: str | os.PathLike,
    payload: Mapping[str, bytes],
    config: TrainConfig | None = None,
    *,
    resume: bool = False,
    overwrite: bool = False,
) -> Path:
    """Apply the run-dir rules: a run there needs ``resume`` (same config) or ``overwrite``."""
    run_dir = Path(run_dir)
    if resume and overwrite:
        raise RunDirError("Pass either resume=True or overwrite=True, not both.")
    found = [p for p in (*payload, *PRODUCTS) if (run_dir / p).exists()]  # the script's too
    if "logs" not in found and "metrics.jsonl" not in found and config is None:
        theirs = {n: run_dir / n for n in found if n in payload}  # named like the script's files
        clash = [n for n, p in theirs.items() if not p.is_file() or p.read_bytes() != payload[n]]
        found = [n for n in found if n not in payload]  # the user's own files, not a run
        if clash:
            raise RunDirError(
                f"{run_dir} holds other files named {', '.join(clash)}: the run would overwrite "
                "them with the script's. Nothing was changed. Choose another run_dir, or move them."
            )
    if found and not (resume or overwrite):
        done = len(read_jsonl(run_dir / "metrics.jsonl"))
        raise RunDirError(
            f"{run_dir} already holds a run ({done} epoch(s) recorded; found {', '.join(found)}). "
            "Nothing was changed. Pass resume=True (CLI: --resume) to continue it from its "
            "checkpoint, overwrite=True (CLI: --overwrite) to replace it, or choose another run_dir."
        )
    if resume and config is not None and (run_dir / "config.json").exists():
        new = config.to_dict()
        # A run written before a field existed ran with that field's default.
        before = {**TrainConfig().to_dict(), **read_json(run_dir / "config.json")}
        changed = sorted(k for k in new if k not in RESUMABLE_KEYS and before.get(k) != new[k])
        if changed:
            raise RunDirError(
                f"{run_dir} holds a run with a different config (differs in: "
                f"{', '.join(changed)}). Resume with the same settings (only epochs, timeouts and "
                "comm settings may change), or pass overwrite=True to replace that run, or choose "
                "another run_dir."
            )
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        probe = run_dir / f".ddpnb-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise RunDirError(
            f"Run directory {run_dir} is not writable ({e.strerror}). Choose a folder you can "
            "write to, or fix its permissions."
        ) from e
    if overwrite:
        for name in found:
            path = run_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return run_dir
