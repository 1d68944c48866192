"""Where every rank is, and whether the run hangs, from the workers' snapshots (``ddpnb.watch``).

A rank **waits** when its stack is in a collective and its main thread does not compute (its CPU
time stands still: measured by the watch, not inferred from the stack). Every live rank waiting
for ``limit`` seconds: a **hang**; some waiting, others standing still elsewhere: a **slow**
phase. A rank that computes is never waiting, so a run whose every rank computes is never hung."""

from __future__ import annotations

import dataclasses
import html
import itertools
import os
import socket
import time
from pathlib import Path

from .errors import RunDirError
from .metrics import read_json
from .script import HOOKS_DIR  # in the run directory: ddpnb's hooks, on every worker's PYTHONPATH
from .watch import DIR_ENV, INTERVAL_ENV

WATCH_DIR = Path(HOOKS_DIR) / "watch"  # the ranks' snapshots
HOOKS = {
    "sitecustomize.py": "site_hooks.py",
    "ddpnb_watch.py": "watch.py",
    "ddpnb_observe.py": "observe.py",
}
CLOCK_SKEW = 5.0  # seconds another host's clock may be behind this one's
STALE_SECONDS = 15.0  # a snapshot older than this: the rank has not reported (gone, or held)
SHOW_SECONDS = 5.0  # a rank's line says how long it has waited or computed from this on
C10D = "torch/distributed/distributed_c10d.py"
DDP = "torch/nn/parallel/distributed.py"
BACKWARD = ("backward", "_engine_run_backward")
BUFFER_SYNC = ("_sync_buffers", "_sync_module_buffers", "_default_broadcast_coalesced")
JOIN = ("init_process_group", "_store_based_barrier", "new_group", "rendezvous")
SPAWN = "torch.multiprocessing.spawn (waiting for the processes it started)"
# What the frames below the user's line mean, first match wins: (path part, functions (None:
# any), name). A collective a rank waits in; then, outside any, what it does.
COLLECTIVES = (
    ("torch/multiprocessing/spawn.py", None, SPAWN),
    (DDP, BUFFER_SYNC, "DDP's buffer broadcast in forward"),
    (DDP, ("__init__",), "DDP's parameter broadcast (wrapping the model)"),
    (C10D, JOIN, "init_process_group (waiting for every rank to join)"),
)
WORK = (
    ("torch/serialization.py", ("save",), "writing a checkpoint (torch.save)"),
    ("torch/serialization.py", ("load",), "reading a checkpoint (torch.load)"),
    ("torch/utils/data/", None, "loading data (DataLoader)"),
    ("", BACKWARD, "computing backward"),
)


def nccl_pending(summary: dict | None) -> dict | None:
    """The oldest NCCL collective not completed in a rank's recorder summary; None if none."""
    if not isinstance(summary, dict) or "error" in summary:
        return None
    return (summary.get("pending") or [None])[0]


def _match(paths: list[tuple[str, str]], table: tuple) -> str | None:
    """The name in the first row of ``table`` that a (path, function) of ``paths`` matches."""
    for part, fns, name in table:
        if any(part in p and (fns is None or fn in fns) for p, fn in paths):
            return name
    return None


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
    # seconds without a step, a change of stack or the main thread computing (None: not measured)
    idle: float | None = None
    interval: float = 2.0  # seconds between the rank's snapshots
    clean: bool = False  # ended without an uncaught exception (its script's work is done)
    nccl: dict | None = None  # NCCL's flight recorder in brief (ddpnb.watch.nccl_collectives)

    @property
    def computing(self) -> bool:
        """The rank moved, or its main thread used CPU, within its last two snapshots."""
        return (
            self.state == "running" and self.idle is not None and self.idle < 2 * self.interval + 1
        )

    @property
    def waits(self) -> bool:
        """In a collective, and not computing: measured, not inferred from the stack alone."""
        return self.state == "running" and bool(self.waits_in) and not self.computing

    @property
    def mine(self) -> Frame | None:
        """The innermost frame of the user's code."""
        return next((f for f in reversed(self.frames) if f.mine), None)

    def _paths(self) -> list[tuple[str, str]]:
        """(path, function) of the frames below the user's innermost (torch's, Python's)."""
        inside = self.frames[self.frames.index(self.mine) + 1 :] if self.mine else self.frames
        return [(f.file.replace(os.sep, "/"), f.function) for f in inside]

    @property
    def waits_in(self) -> str | None:
        """The collective this rank waits in, as a reader names it; None when it is not in one.
        On NCCL the flight recorder's oldest pending collective (the stack sits elsewhere)."""
        if isinstance(self.nccl, dict) and "error" not in self.nccl:
            p = nccl_pending(self.nccl)
            return (
                None
                if p is None
                else f"NCCL's {p.get('op')} #{p.get('seq')} ({p.get('size')} elements)"
            )
        paths = self._paths()
        public = (fn for p, fn in paths if p.endswith(C10D) and not fn.startswith("_"))
        backward = self.process_group and any(fn in BACKWARD for _, fn in paths)
        # A collective inside backward is DDP's (its comm hook's), whoever's code calls it.
        ddp = "DDP's gradient all-reduce inside backward" if backward else None
        return _match(paths, COLLECTIVES) or ddp or next(public, None)

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
        if self.waits:
            return (
                f"rank {self.rank} waits in {self.waits_in} at {self.where()}{self._for(self.idle)}"
            )
        doing = _match(self._paths(), WORK)
        if self.computing:
            doing = doing if doing and doing.startswith("computing") else "computing"
        doing = doing or "working outside any collective"
        return f"rank {self.rank} is {doing} at {self.where()}{self._for(self.still)}"

    @staticmethod
    def _for(seconds: float | None) -> str:
        return f" for {seconds:.0f} s" if seconds is not None and seconds >= SHOW_SECONDS else ""

    def stack(self) -> list[str]:
        """The user's frames (file:line and the call); torch's, Python's and the script's helpers'
        (its Part 2: ``ddpnb.watch.PART2_BANNER``) folded into one line."""
        out = []
        for mine, group in itertools.groupby(self.frames, key=lambda f: f.mine):
            frames = list(group)
            if mine:
                out += [f"{f.at} in {f.function}: {f.source}" for f in frames]
            else:
                inner = frames[-1]
                out.append(
                    f"... {len(frames)} frame(s) of torch/Python{_helpers(frames)}, innermost "
                    f"{inner.function} ({Path(inner.file).name}:{inner.line})"
                )
        return out


TITLES = {
    "hang": "The run hangs",
    "slow": "Slow phase",
    "quiet": "No progress",
    "waiting": "Waiting",
    "ok": "Running",
}


@dataclasses.dataclass
class Verdict:
    """What the ranks' positions mean: ``kind`` is "hang", "slow", "quiet", "waiting" (ranks wait,
    not yet for the limit) or "ok"."""

    kind: str
    message: str
    quiet_for: float = 0.0
    # For a hang: "different" collectives, a rank "ended", "spawn", or the "same" on every rank.
    cause: str = ""


# Why the ranks stand still, by verdict kind or hang cause (after each rank's line).
WHY = {
    "quiet": "No rank waits in a collective: the ranks are busy.",
    "slow": (
        "{busy} still working while the others wait: a slow phase (a large "
        "checkpoint, a slow disk, a long evaluation on one rank) is not a bug; if "
        "{them} never get past that line, {them} are stuck there."
    ),
    "spawn": (
        "{spawn} started processes of their own with torch.multiprocessing.spawn "
        "at {at}: under torchrun every rank is already one process of the job, "
        "so each starts a second job that never meets the others. Drop mp.spawn and read "
        "RANK, LOCAL_RANK and WORLD_SIZE from torchrun's environment."
    ),
    "ended": (
        "{ended} ended while {waiting} {wait} in a collective: the ranks "
        "ran different numbers of steps (uneven batches per rank, a rank that stopped early), "
        "and a collective waits for a rank that is gone."
    ),
    "different": (
        "the ranks are in different collectives — one of them is called on some ranks only "
        "(a collective inside `if rank == 0:`, an evaluation through the DDP wrapper on "
        "one rank, or shards with different numbers of batches, so that one rank is still "
        "in its loop). Call every collective on every rank, in the same order."
    ),
    "same": (
        "every rank waits in the same collective and it does not complete: a node or "
        "the network between the nodes stopped answering (or earlier collectives paired "
        "up wrongly: one rank called one more)."
    ),
}


def verdict(ranks: list[RankState], quiet_for: float, limit: float) -> Verdict:
    """Whether the ranks hang, given none has computed or moved for ``quiet_for`` seconds."""
    waiting = [r for r in ranks if r.waits]
    ended = [r for r in ranks if r.state == "ended"]
    # A rank seen waiting before another ended may have left its collective as that one
    # ended (a barrier that released both): only a snapshot taken since shows it still there.
    unseen = ended and waiting and max(r.age for r in waiting) >= min(r.age for r in ended)
    if not ranks or quiet_for < limit or unseen:
        if not waiting:
            return Verdict("ok", "", quiet_for)
        return Verdict("waiting", "; ".join(r.line() for r in ranks) + ".", quiet_for)
    others = [r for r in ranks if r.state != "ended" and not r.waits]
    spawn = [r for r in waiting if r.waits_in == SPAWN]
    kind = "hang" if waiting and not others else "slow" if waiting else "quiet"
    apart = len({(r.waits_in, r.where()) for r in waiting}) > 1
    cause = ""
    if kind == "hang":
        cause = "spawn" if spawn else "ended" if ended else "different" if apart else "same"
    why = WHY[cause or kind].format(
        busy=_ranks(others),
        them="it" if len(others) == 1 else "they",
        spawn=_ranks(spawn),
        at=spawn[0].where() if spawn else "",
        ended=_ranks(ended),
        waiting=_ranks(waiting),
        wait="waits" if len(waiting) == 1 else "wait",
    )
    lines = "; ".join(r.line() for r in ranks) + (": " if cause else ". ")
    message = f"No rank has made progress for {quiet_for:.0f} s: {lines}{why}"
    return Verdict(kind, message, quiet_for, cause)


def _helpers(frames: list[Frame]) -> str:
    """`` and the script's helpers (hook, agree)`` for those of ``frames`` in the script's Part 2
    (they keep their run-directory path; torch's and Python's are full paths), else ''."""
    names = [f.function for f in frames if not (os.path.isabs(f.file) or f.file.startswith("<"))]
    return f" and the script's helpers ({', '.join(dict.fromkeys(names))})" if names else ""


def _ranks(ranks: list[RankState]) -> str:
    numbers = [str(r.rank) for r in ranks]
    return f"rank {numbers[0]}" if len(numbers) == 1 else f"ranks {', '.join(numbers)}"


def hooks_payload() -> dict[str, bytes]:
    """ddpnb's hooks by their run-directory path (written, and copied to hosts, each launch)."""
    here = Path(__file__).parent
    return {f"{HOOKS_DIR}/{name}": (here / src).read_bytes() for name, src in HOOKS.items()}


def watch_env(node_dir: str, interval: float, pythonpath: str | None = None) -> dict[str, str]:
    """The variables that load the hooks into a node's workers (``pythonpath``: kept after ours)."""
    path = os.pathsep.join([f"{node_dir}/{HOOKS_DIR}", *filter(None, [pythonpath])])
    return {"PYTHONPATH": path, DIR_ENV: f"{node_dir}/{WATCH_DIR}", INTERVAL_ENV: f"{interval:g}"}


def read_ranks(run_dir: str | os.PathLike, since: float = 0.0) -> list[RankState]:
    """Every rank's latest snapshot of the last attempt; ``since`` drops earlier launches'."""
    now = time.time()
    # A file being replaced reads as {}: the next read has it.
    records = [read_json(p) for p in sorted((Path(run_dir) / WATCH_DIR).glob("rank-*.json"))]
    records = [r for r in records if r and r.get("time", 0) >= since - CLOCK_SKEW]
    world = max((r.get("world_size", 1) for r in records), default=1)
    restart = max((r.get("restart", 0) for r in records), default=0)
    out = []
    for r in sorted(records, key=lambda r: r["rank"]):
        if r["rank"] >= world or r.get("restart", 0) != restart:
            continue  # a previous attempt's, or a larger world's
        age = max(0.0, now - r["time"])
        state = r["state"]
        if state == "running" and age > max(STALE_SECONDS, 4 * r.get("interval", 2)):
            state = "silent"
        fields = {k: r[k] for k in ("rank", "node", "host", "pid", "steps", "process_group")}
        fields["interval"], fields["clean"] = r.get("interval", 2.0), r.get("clean", False)
        late = age if state == "running" else 0.0
        still, idle = r["still"] + late, r.get("idle", r["still"]) + late
        fields["nccl"] = r.get("nccl")
        pending = nccl_pending(fields["nccl"])
        if pending is not None:  # on NCCL waiting is the recorder's: a spinning sync computes
            idle = float(pending.get("for", 0.0)) + late
        frames = tuple(Frame(*f) for f in r.get("stack", []))
        out.append(RankState(**fields, state=state, still=still, frames=frames, age=age, idle=idle))
    return out


# A stack's lines wrap between words (JupyterLab's outputs break a <pre> anywhere, mid-word),
# inside a word only when it is longer than the column, and paths after a '/'; a line's
# continuation is indented under it.
PRE_STYLE = "margin:0;white-space:pre-wrap;word-break:normal;overflow-wrap:break-word"
LINE_STYLE = "display:block;padding-left:2ch;text-indent:-2ch"
CELL_STYLE = "text-align:left;vertical-align:top"


def _stack_html(lines: list[str]) -> str:
    spans = (
        f"<span style='{LINE_STYLE}'>{html.escape(s).replace('/', '/<wbr>')}</span>" for s in lines
    )
    return f"<pre style='{PRE_STYLE}'>{''.join(spans)}</pre>"


@dataclasses.dataclass(repr=False)
class Stacks:
    """Where every rank is: ``str()`` a text, ``_repr_html_`` a table (in a notebook)."""

    run_dir: Path
    ranks: list[RankState]
    verdict: Verdict

    def __str__(self) -> str:
        out = [f"ddpnb stacks: {self.run_dir}"]
        if self.verdict.message:
            out += ["", f"{TITLES[self.verdict.kind]}: {self.verdict.message}"]
        return "\n".join([*out, "", self.per_rank()])

    __repr__ = __str__

    def per_rank(self) -> str:
        """Each rank's line and its stack (the user's frames; torch's folded)."""
        out = []
        for r in self.ranks:
            out += [f"{r.line()}  [node {r.node} on {r.host}, pid {r.pid}]"]
            out += [f"    {line}" for line in r.stack()]
        return "\n".join(out)

    def _repr_html_(self) -> str:
        e, v = html.escape, self.verdict
        row = lambda tag, cells: (
            "<tr>" + "".join(f"<{tag} style='{CELL_STYLE}'>{c}</{tag}>" for c in cells) + "</tr>"
        )
        rows = [row("th", ("rank", "node", "where", "stack"))] + [
            row("td", (r.rank, f"{r.node} ({e(r.host)})", e(r.line()), _stack_html(r.stack())))
            for r in self.ranks
        ]
        message = f"<p><b>{e(TITLES[v.kind])}</b>: {e(v.message)}</p>" if v.message else ""
        return f"<div class='ddpnb-stacks'>{message}<table>{''.join(rows)}</table></div>"


def stacks(run_dir: str | os.PathLike, limit: float = 60.0) -> Stacks:
    """Where every rank of the run in ``run_dir`` is now (``ddpnb stacks RUN_DIR``).

    Raises RunDirError when there is no run, it has ended, or a node's ranks stopped reporting.
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
        raise RunDirError(
            f"The run in {run_dir} has ended (its last stack is {min(r.age for r in ranks):.0f} s "
            "old): no rank is running. Its logs are in logs/; a failure is in the node logs' "
            "tracebacks."
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
    quiet = min(r.idle for r in ranks if r.state == "running")
    return Stacks(run_dir, ranks, verdict(ranks, quiet, limit))


def _gone(r: RankState) -> RankState:
    """A running rank of this machine whose process no longer exists has ended."""
    if r.state == "running" and r.host == socket.gethostname():
        try:
            os.kill(r.pid, 0)
        except ProcessLookupError:
            return dataclasses.replace(r, state="ended")
        except OSError:  # another user's process has its pid: it runs
            pass
    return r


# -- NCCL: what the flight recorder says (each snapshot's "nccl": watch.nccl_collectives) ----


@dataclasses.dataclass(frozen=True)
class NcclWaits:
    """Where the ranks' NCCL collectives stand (:func:`nccl_waits`)."""

    waiting: tuple[int, ...]  # a collective not completed for >= limit seconds
    free: tuple[int, ...]  # nothing pending that long: computing, or between collectives
    unknown: tuple[int, ...]  # no summary: not NCCL, no snapshot, the recorder off or failing
    apart: bool  # the waiting ranks wait in different collectives
    pending_for: dict[int, float]  # seconds the oldest pending collective has waited (0: none)
    at: dict[int, str]  # each known rank's oldest pending collective, or its last ones


def nccl_waits(summaries: dict[int, dict | None], limit: float) -> NcclWaits:
    """Which ranks wait in an NCCL collective, and whether in the same one.

    ``summaries``: each rank's snapshot's ``"nccl"`` (``ddpnb.watch.nccl_collectives``), by
    rank. A rank waits when its oldest collective not completed was enqueued ``limit``
    seconds ago or more (its Python stack and CPU time say nothing on NCCL). Waiting ranks
    are apart when their oldest pending collectives differ in process group, sequence id
    (one rank reached a collective the other did not), op or size: NCCL pairs collectives
    by their order alone, so a barrier on one rank pairs with the other's next all-reduce.

    >>> barrier = {"pg": "0", "seq": 7, "op": "nccl:all_reduce_barrier", "size": 1, "for": 70.0}
    >>> nccl_waits({0: {"groups": {"0": [7, 6]}, "pending": [barrier]}, 1: None}, 60).waiting
    (0,)
    """
    known = {r: s for r, s in summaries.items() if isinstance(s, dict) and "error" not in s}
    oldest = {r: (s.get("pending") or [None])[0] for r, s in known.items()}
    waited = {r: float(p["for"]) if p else 0.0 for r, p in oldest.items()}
    waiting = sorted(r for r in known if oldest[r] and waited[r] >= limit)
    keys = {_nccl_key(oldest[r]) for r in waiting}
    return NcclWaits(
        waiting=tuple(waiting),
        free=tuple(sorted(r for r in known if r not in waiting)),
        unknown=tuple(sorted(r for r in summaries if r not in known)),
        apart=len(keys) > 1,
        pending_for=waited,
        at={r: _nccl_at(oldest[r], known[r]) for r in sorted(known)},
    )


def _nccl_key(p: dict) -> tuple:
    """What makes two ranks' pending collectives one collective: group, number, op, size."""
    return (p.get("pg"), bool(p.get("p2p")), p.get("seq"), str(p.get("op")).strip(), p.get("size"))


def _nccl_at(p: dict | None, summary: dict) -> str:
    """``nccl:all_reduce #7 (1 element), not completed for 63 s``, or the last ones."""
    if p is None:
        groups = summary.get("groups") or {}
        enqueued, completed = groups.get("0") or next(iter(groups.values()), ["-", "-"])
        return f"no NCCL collective pending (last enqueued #{enqueued}, completed #{completed})"
    size = p.get("size", 0)
    group = "" if p.get("pg") in ("0", None) else f" of group {p['pg']}"
    p2p = " (p2p)" if p.get("p2p") else ""
    return (
        f"{str(p.get('op')).strip()} #{p.get('seq')}{group}{p2p} ({size} element"
        f"{'' if size == 1 else 's'}), not completed for {float(p.get('for', 0)):.0f} s"
    )
