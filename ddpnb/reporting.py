"""Report a training script's progress to ddpnb: one small file, stdlib only.

ddpnb places this file beside every script it launches, as ``ddpnb_reporting.py``. Every
rank may call it and only global rank 0 writes; launched by anything else (plain
``torchrun``, ``python script.py``) every call does nothing::

    import ddpnb_reporting as report

    for epoch in range(1, epochs + 1):
        for step, (x, y) in enumerate(loader, 1):
            ...
            report.step(step, len(loader), epoch=epoch, epochs=epochs, loss=loss.item())
        report.epoch(epoch, train_loss=train_loss, val_loss=val_loss, val_acc=val_acc)

It writes ``progress.json`` (the latest step, replaced atomically) and ``metrics.jsonl``
(a row per epoch) into ``DDPNB_RUN_DIR``, for ddpnb's panel, plots and report tables.
Two things ride on ``step()``, on every rank, so a script needs no more than that call:

- ``DDPNB_FAULT`` (a teaching and testing aid, notebook 04): ``rank=1,epoch=3,step=5``
  SIGKILLs global rank 1 right after step 5 of epoch 3 of the first attempt;
  ``mode=raise`` raises instead, ``restart=N`` picks attempt N.
- The agent watchdog: under torchrun, a rank whose torchrun agent is gone (its node lost)
  stops with a clear error instead of training on alone.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

RUN_DIR_ENV = "DDPNB_RUN_DIR"  # set by ddpnb's launcher on every node
INTERVAL = 0.25  # seconds between progress.json writes at most (the last step is always written)
FAULT_ENV = "DDPNB_FAULT"

# The agent is this process's parent when torchrun started it: noted at import.
_state = {"run_dir": None, "last": 0.0, "first_step_time": None, "agent_pid": os.getppid()}


def use_run_dir(path: str | os.PathLike | None) -> None:
    """Write into ``path`` even when not launched by ddpnb (its own worker run by hand)."""
    _state["run_dir"] = path


def run_dir() -> Path | None:
    """Where global rank 0 writes; None on other ranks and outside ddpnb."""
    if os.environ.get("RANK", "0") != "0":
        return None
    found = _state["run_dir"] or os.environ.get(RUN_DIR_ENV)
    return Path(found) if found else None


def _write_progress(record: dict) -> None:
    if (folder := run_dir()) is None:
        return
    record.update(time=time.time(), first_step_time=_state["first_step_time"])
    record["restart_count"] = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", 0))
    tmp = folder / f".progress.json.{os.getpid()}"
    tmp.write_text(json.dumps(record))
    os.replace(tmp, folder / "progress.json")  # a reader never sees half a record


def joined(world_size: int | None = None) -> None:
    """Every rank has joined the process group (the rendezvous is complete)."""
    size = world_size or int(os.environ.get("WORLD_SIZE", 1))
    _write_progress({"phase": "joined", "world_size": size})


def step(step: int, steps: int, *, epoch: int = 1, epochs: int = 1, loss=None) -> None:
    """Step ``step`` of ``steps`` in epoch ``epoch`` of ``epochs`` is done (1-based). ``loss``,
    a number or a one-element tensor, is read (a device sync) only when a record is written: at
    most every INTERVAL seconds, on rank 0."""
    if _state["first_step_time"] is None:
        _state["first_step_time"] = time.time()
        _state["under_torchrun"] = "TORCHELASTIC_RUN_ID" in os.environ
        # DDPNB_FAULT, read once, if it names this rank and attempt: the steps compare numbers.
        fault = parse_fault(os.environ.get(FAULT_ENV, ""))
        here = [int(os.environ.get(k, 0)) for k in ("RANK", "TORCHELASTIC_RESTART_COUNT")]
        _state["fault"] = fault if fault and [fault["rank"], fault["restart"]] == here else None
    if _state["under_torchrun"] and os.getppid() != _state["agent_pid"]:
        raise RuntimeError(
            f"The torchrun agent (pid {_state['agent_pid']}) of node "
            f"{os.environ.get('GROUP_RANK', '?')} is gone: this node is lost, so its worker "
            "stops too. Relaunch with resume=True."
        )
    fault = _state["fault"]
    if fault is not None and (fault["epoch"], fault["step"]) == (epoch, step):
        print(f"{FAULT_ENV}: {fault['mode']} at epoch {epoch} step {step}", flush=True)
        if fault["mode"] == "raise":
            raise RuntimeError(f"{FAULT_ENV} injected failure at epoch {epoch} step {step}")
        os.kill(os.getpid(), signal.SIGKILL)
    now = time.monotonic()
    if run_dir() is None or (now - _state["last"] < INTERVAL and step < steps):
        return
    _state["last"] = now
    record = {"phase": "train", "epoch": epoch, "epochs": epochs, "step": step, "steps": steps}
    if loss is not None:  # a tensor's item(): no autograd warning, one number
        record["loss"] = loss.item() if hasattr(loss, "item") else float(loss)
    _write_progress(record)


def parse_fault(spec: str) -> dict | None:
    """``DDPNB_FAULT`` as a dict (``rank=1,epoch=3,step=5[,mode=kill|raise][,restart=0]``)."""
    if not spec.strip():
        return None
    fault = {"rank": 0, "epoch": 1, "step": 1, "mode": "kill", "restart": 0}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        key, _, value = item.partition("=")
        number = value.isdigit() or key == "mode"
        if key not in fault or not number or (key == "mode" and value not in ("kill", "raise")):
            raise ValueError(
                f"{FAULT_ENV}={spec!r}: {item!r} is not understood. Write it as "
                "rank=R,epoch=E,step=S (S counts from 1), optionally ,mode=kill|raise,restart=N."
            )
        fault[key] = value if key == "mode" else int(value)
    return fault


def epoch(epoch: int, **metrics: float) -> None:
    """Epoch ``epoch`` is done: one row of ``metrics.jsonl`` (``train_loss``, ``val_acc``, ...).
    Reduce the numbers over all ranks first (sums and counts, then divide)."""
    if (folder := run_dir()) is None:
        return
    row = {"epoch": epoch, "world_size": int(os.environ.get("WORLD_SIZE", 1)), **metrics}
    with open(folder / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def done(epochs: int | None = None, steps: int | None = None) -> None:
    """Training has finished (the panel shows the run as done)."""
    counts = {"epoch": epochs, "epochs": epochs, "step": steps, "steps": steps}
    _write_progress({"phase": "done", **{k: v for k, v in counts.items() if v is not None}})
