"""Where every rank is, and whether the run hangs: read from the workers' snapshots.

Each worker writes ``RUN_DIR/.ddpnb/watch/rank-<R>.json`` every few seconds
(``ddpnb.watch``): its Python stack, how long that stack has stayed the same, its optimizer
steps. This module turns those files into :class:`Stacks` (``job.stacks()``, ``ddpnb
stacks``): per rank, the innermost line of the user's script and what it waits in, torch's
frames folded; and a verdict when nothing has moved for a while:

- every rank waits in a collective (or has ended): the run **hangs**, and the verdict says
  why (different collectives, a rank gone, ``torch.multiprocessing.spawn`` under torchrun);
- some ranks wait while others work (rank 0 writes a checkpoint, the others wait at a
  barrier): a **slow** phase, described as what it is, never called a bug.

Pure functions of the snapshot files, so every verdict can be tested on fixture files.
"""

from __future__ import annotations

import dataclasses
import html
import json
import os
import socket
import time
from pathlib import Path

from .errors import RunDirError
from .script import HOOKS_DIR  # in the run directory: ddpnb's hooks, on every worker's PYTHONPATH

WATCH_DIR = Path(HOOKS_DIR) / "watch"  # the ranks' snapshots
# What the hooks folder holds: its name there, and the package file it is a copy of.
HOOKS = {
    "sitecustomize.py": "site_hooks.py",
    "ddpnb_watch.py": "watch.py",
    "ddpnb_observe.py": "observe.py",
}
CLOCK_SKEW = 5.0  # seconds another host's clock may be behind this one's
STALE_SECONDS = 15.0  # a snapshot older than this: the rank has not reported (gone, or held)
C10D = "torch/distributed/distributed_c10d.py"
DDP = "torch/nn/parallel/distributed.py"
BUFFER_SYNC = ("_sync_buffers", "_sync_module_buffers", "_default_broadcast_coalesced")
JOIN = ("init_process_group", "_store_based_barrier", "new_group", "rendezvous")


@dataclasses.dataclass(frozen=True)
class Frame:
    file: str  # the path in the run directory for the user's files, else the full path
    line: int
    function: str
    source: str
    mine: bool  # the user's code (the script's folder), not torch or Python's

    @property
    def at(self) -> str:
        return f"{self.file}:{self.line}"


@dataclasses.dataclass(frozen=True)
class RankState:
    """One rank's latest snapshot and what it means."""

    rank: int
    node: int
    host: str
    pid: int
    state: str  # "running", "ended", or "silent" (no snapshot for STALE_SECONDS)
    still: float  # seconds without an optimizer step or a change of stack
    steps: int
    process_group: bool
    frames: tuple[Frame, ...]
    age: float  # seconds since the snapshot was written

    @property
    def mine(self) -> Frame | None:
        """The innermost frame of the user's code."""
        return next((f for f in reversed(self.frames) if f.mine), None)

    @property
    def inside(self) -> list[Frame]:
        """The frames below the innermost user frame (torch's, Python's), outermost first."""
        mine = self.mine
        if mine is None:
            return list(self.frames)
        return list(self.frames[self.frames.index(mine) + 1 :])

    @property
    def waits_in(self) -> str | None:
        """The collective this rank waits in, as a reader names it; None when it is not in one."""
        inside = self.inside
        paths = [(f.file.replace(os.sep, "/"), f.function) for f in inside]
        if any(p.endswith("torch/multiprocessing/spawn.py") for p, _ in paths):
            return "torch.multiprocessing.spawn (waiting for the processes it started)"
        if any(p.endswith(DDP) and fn in BUFFER_SYNC for p, fn in paths):
            return "DDP's buffer broadcast in forward"
        if any(p.endswith(DDP) and fn == "__init__" for p, fn in paths):
            return "DDP's parameter broadcast (wrapping the model)"
        c10d = [fn for p, fn in paths if p.endswith(C10D)]
        if any(fn in JOIN for fn in c10d):
            return "init_process_group (waiting for every rank to join)"
        public = [fn for fn in c10d if not fn.startswith("_")]
        if public:
            return public[0]
        backward = any(fn in ("backward", "_engine_run_backward") for _, fn in paths)
        if backward and self.process_group:
            return "DDP's gradient all-reduce inside backward"
        return None

    @property
    def doing(self) -> str:
        """What a rank outside any collective is doing, as far as its frames tell."""
        paths = [(f.file.replace(os.sep, "/"), f.function) for f in self.inside]
        if any(p.endswith("torch/serialization.py") and fn == "save" for p, fn in paths):
            return "writing a checkpoint (torch.save)"
        if any(p.endswith("torch/serialization.py") and fn == "load" for p, fn in paths):
            return "reading a checkpoint (torch.load)"
        if any("torch/utils/data/" in p for p, _ in paths):
            return "loading data (DataLoader)"
        if any(fn in ("backward", "_engine_run_backward") for _, fn in paths):
            return "computing backward"
        return "working outside any collective"

    def where(self) -> str:
        """``train.py:21 (dist.barrier())``: the user's innermost line and its text."""
        f = self.mine
        if f is None:
            return "outside the script's files"
        return f"{f.at} ({f.source})" if f.source else f.at

    def line(self) -> str:
        """One line: where the rank is and what it does there."""
        if self.state == "ended":
            return f"rank {self.rank} has ended"
        if self.state == "silent":
            return (
                f"rank {self.rank} has not reported for {self.age:.0f} s (its process is gone, "
                "or busy in code that holds Python's lock)"
            )
        waits = self.waits_in
        if waits:
            return f"rank {self.rank} waits in {waits} at {self.where()}"
        return f"rank {self.rank} is {self.doing} at {self.where()}"


@dataclasses.dataclass
class Verdict:
    """What the ranks' positions mean: ``kind`` is "hang", "slow", "quiet" or "ok"."""

    kind: str
    message: str
    quiet_for: float = 0.0
    # For a hang: "different" collectives, a rank "ended", "spawn" under torchrun, or the
    # "same" collective on every rank (a peer or the network stopped answering).
    cause: str = ""

    @property
    def title(self) -> str:
        return {
            "hang": "the run hangs",
            "slow": "a slow phase",
            "quiet": "no progress",
            "ok": "running",
        }[self.kind]


def verdict(ranks: list[RankState], quiet_for: float, limit: float) -> Verdict:
    """Whether the ranks hang, given they have all been still for ``quiet_for`` seconds."""
    if not ranks or quiet_for < limit:
        return Verdict("ok", "", quiet_for)
    live = [r for r in ranks if r.state == "running"]
    waiting = [r for r in live if r.waits_in]
    others = [r for r in ranks if r.state != "ended" and not r.waits_in]
    ended = [r for r in ranks if r.state == "ended"]
    lines = "; ".join(r.line() for r in ranks)
    quiet = f"No rank has made progress for {quiet_for:.0f} s: {lines}"
    if not waiting:
        return Verdict(
            "quiet", f"{quiet}. No rank waits in a collective: the ranks are busy.", quiet_for
        )
    if others:
        busy, them = _ranks(others), "it" if len(others) == 1 else "they"
        return Verdict(
            "slow",
            f"{quiet}. {busy} still working while the others wait: a slow phase (a large "
            "checkpoint, a slow disk, a long evaluation on one rank) is not a bug; if "
            f"{them} never get past that line, {them} are stuck there.",
            quiet_for,
        )
    spawn = [r for r in waiting if r.waits_in.startswith("torch.multiprocessing.spawn")]
    cause = "spawn" if spawn else "ended" if ended else "different"
    if spawn:
        why = (
            f"{_ranks(spawn)} started processes of their own with torch.multiprocessing.spawn "
            f"at {spawn[0].where()}: under torchrun every rank is already one process of the job, "
            "so each starts a second job that never meets the others. Drop mp.spawn and read "
            "RANK, LOCAL_RANK and WORLD_SIZE from torchrun's environment."
        )
    elif ended:
        why = (
            f"{_ranks(ended)} ended while {_ranks(waiting)} "
            f"{'waits' if len(waiting) == 1 else 'wait'} in a collective: the ranks "
            "ran different numbers of steps (uneven batches per rank, a rank that stopped early), "
            "and a collective waits for a rank that is gone."
        )
    elif len({(r.waits_in, r.where()) for r in waiting}) > 1:
        why = (
            "the ranks are in different collectives — one of them is called on some ranks only "
            "(a collective inside `if rank == 0:`, an evaluation through the DDP wrapper on "
            "one rank, or shards with different numbers of batches, so that one rank is still "
            "in its loop). Call every collective on every rank, in the same order."
        )
    else:
        cause = "same"
        why = (
            "every rank waits in the same collective and it does not complete: a node or "
            "the network between the nodes stopped answering (or earlier collectives paired "
            "up wrongly: one rank called one more)."
        )
    return Verdict("hang", f"{quiet}: {why}", quiet_for, cause)


def _ranks(ranks: list[RankState]) -> str:
    numbers = [str(r.rank) for r in ranks]
    return f"rank {numbers[0]}" if len(numbers) == 1 else f"ranks {', '.join(numbers)}"


def hooks_payload() -> dict[str, bytes]:
    """ddpnb's hooks, by their path in the run directory (written, and copied to hosts, each launch)."""
    here = Path(__file__).parent
    return {f"{HOOKS_DIR}/{name}": (here / src).read_bytes() for name, src in HOOKS.items()}


def watch_env(node_dir: str, interval: float, pythonpath: str | None = None) -> dict[str, str]:
    """The variables that load the hooks into a node's workers (``pythonpath``: kept after ours)."""
    from .watch import DIR_ENV, INTERVAL_ENV

    path = [f"{node_dir}/{HOOKS_DIR}", *filter(None, [pythonpath])]
    return {
        "PYTHONPATH": os.pathsep.join(path),
        DIR_ENV: f"{node_dir}/{WATCH_DIR}",
        INTERVAL_ENV: f"{interval:g}",
    }


# -- the snapshot files --------------------------------------------------------------------


def read_ranks(
    run_dir: str | os.PathLike, since: float = 0.0, now: float | None = None
) -> list[RankState]:
    """Every rank's latest snapshot in ``run_dir``, by rank (the last attempt's only).

    ``since``: ignore snapshots written before then (an earlier launch's, on a host).
    """
    now = time.time() if now is None else now
    records = []
    for path in sorted((Path(run_dir) / WATCH_DIR).glob("rank-*.json")):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue  # being replaced: the next read has it
        if record.get("time", 0) >= since - CLOCK_SKEW:
            records.append(record)
    if not records:
        return []
    world = max(r.get("world_size", 1) for r in records)
    restart = max(r.get("restart", 0) for r in records)
    out = []
    for r in sorted(records, key=lambda r: r["rank"]):
        if r["rank"] >= world or r.get("restart", 0) != restart:
            continue  # a previous attempt's, or a larger world's
        age = max(0.0, now - r["time"])
        state = r["state"]
        if state == "running" and age > max(STALE_SECONDS, 4 * r.get("interval", 2)):
            state = "silent"
        frames = tuple(Frame(*f) for f in r.get("stack", []))
        out.append(
            RankState(
                r["rank"],
                r["node"],
                r["host"],
                r["pid"],
                state,
                r["still"] + (age if state == "running" else 0.0),
                r["steps"],
                r["process_group"],
                frames,
                age,
            )
        )
    return out


@dataclasses.dataclass(repr=False)
class Stacks:
    """Where every rank is: ``str()`` a text, ``_repr_html_`` a table (in a notebook)."""

    run_dir: Path
    ranks: list[RankState]
    verdict: Verdict

    def __str__(self) -> str:
        out = [f"ddpnb stacks: {self.run_dir}"]
        if self.verdict.message:
            out += ["", f"{self.verdict.title.capitalize()}: {self.verdict.message}"]
        return "\n".join([*out, "", self.per_rank()])

    __repr__ = __str__

    def per_rank(self) -> str:
        """Each rank's line and its stack (the user's frames; torch's folded)."""
        out = []
        for r in self.ranks:
            out += [f"{r.line()}  [node {r.node} on {r.host}, pid {r.pid}]"]
            out += [f"    {line}" for line in _stack_lines(r)]
        return "\n".join(out)

    def _repr_html_(self) -> str:
        e = html.escape
        rows = "".join(
            f"<tr><td style='text-align:left'>{r.rank}</td>"
            f"<td style='text-align:left'>{r.node} ({e(r.host)})</td>"
            f"<td style='text-align:left'>{e(r.line())}</td>"
            f"<td style='text-align:left'><pre style='margin:0'>"
            f"{e(chr(10).join(_stack_lines(r)))}</pre></td></tr>"
            for r in self.ranks
        )
        head = "".join(
            f"<th style='text-align:left'>{h}</th>" for h in ("rank", "node", "where", "stack")
        )
        v = self.verdict
        message = f"<p><b>{e(v.title.capitalize())}</b>: {e(v.message)}</p>" if v.message else ""
        return f"<div class='ddpnb-stacks'>{message}<table><tr>{head}</tr>{rows}</table></div>"


def _stack_lines(r: RankState) -> list[str]:
    """The user's frames (file:line and the call), torch's and Python's folded into one line."""
    out, folded = [], []
    for f in r.frames:
        if f.mine:
            if folded:
                out.append(_fold(folded))
                folded = []
            out.append(f"{f.at} in {f.function}: {f.source}")
        else:
            folded.append(f)
    if folded:
        out.append(_fold(folded))
    return out


def _fold(frames: list[Frame]) -> str:
    inner = frames[-1]
    return f"... {len(frames)} frame(s) of torch/Python, innermost {inner.function} ({Path(inner.file).name}:{inner.line})"


def stacks(run_dir: str | os.PathLike, limit: float = 60.0) -> Stacks:
    """Where every rank of the run in ``run_dir`` is now (``ddpnb stacks RUN_DIR``).

    Raises :class:`~ddpnb.errors.RunDirError` naming the problem when the folder holds no
    run, the run has ended, or a node's ranks have stopped reporting (its host cannot be
    reached) while the others report.

    Example
    -------
    >>> print(stacks("runs/mine"))   # doctest: +SKIP
    rank 0 waits in barrier at train.py:21 (dist.barrier())  [node 0 on gpu1, pid 4242]
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise RunDirError(f"{run_dir}: no such folder. Pass the run directory of a running job.")
    ranks = read_ranks(run_dir)
    if not ranks:
        what = "holds a run, but its workers wrote no stacks (hang watch off, or not started yet)"
        if not (run_dir / "logs").is_dir():
            what = "holds no run (no logs/ and no .ddpnb/watch/)"
        raise RunDirError(f"{run_dir} {what}. Pass the run directory of a running job.")
    ranks = [_gone(r) for r in ranks]
    if all(r.state != "running" for r in ranks):
        newest = min(r.age for r in ranks)
        raise RunDirError(
            f"The run in {run_dir} has ended (its last stack is {newest:.0f} s old): no rank "
            "is running. Its logs are in logs/; a failure is in the node logs' tracebacks."
        )
    silent = [r for r in ranks if r.state == "silent"]
    if silent:
        nodes = sorted({(r.node, r.host) for r in silent})
        named = ", ".join(f"node {n} ({h})" for n, h in nodes)
        raise RunDirError(
            f"{named} of the run in {run_dir} stopped reporting {min(r.age for r in silent):.0f} s "
            "ago while the others report: the host cannot be reached (or its stacks are not "
            "copied here: only a running launcher copies them from hosts without a shared folder)."
        )
    quiet = min(r.still for r in ranks if r.state == "running")
    return Stacks(run_dir, ranks, verdict(ranks, quiet, limit))


def _gone(r: RankState) -> RankState:
    """A running rank of this machine whose process no longer exists has ended."""
    if r.state != "running" or r.host != socket.gethostname():
        return r
    try:
        os.kill(r.pid, 0)
    except ProcessLookupError:
        return dataclasses.replace(r, state="ended")
    except OSError:
        pass
    return r
