"""``check_script``: run a DDP script briefly on simulated nodes and name its classic mistakes.

Each finding names the script's line, what ``ddpnb.observe`` measured, why it matters and the fix.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import html
import os
import re
import shutil
import sys
import tempfile
import textwrap
import time
from collections import Counter, defaultdict
from pathlib import Path
from urllib.parse import urlparse

from . import diagnosis, observe, watch
from .agent import is_loopback
from .errors import DdpnbError, RunFailed, RunHung
from .hang import Frame, RankState
from .launch import launch
from .metrics import read_jsonl
from .script import Script, script_options
from .text import badge

WAIT_MARGIN_SECONDS = 30.0  # beyond the workers' own bound, before the check stops the run
HANG_SECONDS = 10.0  # no rank moved, ranks in collectives: the check calls it a hang
WATCH_INTERVAL = "0.5"  # seconds between the workers' stack snapshots during a check
LAUNCH = dict(
    wait=False, progress="none", overwrite=True, max_restarts=0, hang_timeout=HANG_SECONDS
)

TITLES = {
    1: "Ranks train on the same samples",
    2: "Every epoch repeats the same order",
    3: "Each rank trains its own model",
    4: "Ranks take different numbers of steps per epoch",
    5: "Evaluation counts samples twice or skips them",
    6: "More than one rank writes the same file",
    7: "The rendezvous cannot span nodes",
    8: "The GPU is picked by the global rank",
    9: "Ranks call different collectives (the run hangs)",
    10: "The script starts its own ranks under torchrun (mp.spawn)",
    11: "Parameters get no gradient (DDP's unused parameters)",
    12: "DDP or a collective before init_process_group",
    13: "A parameter's gradient is ready twice in one step (reentrant checkpointing)",
    14: "A rank reads a file before another rank is known to have written it",
}
WHY = {
    2: "DistributedSampler shuffles with seed + epoch: with the same epoch every epoch "
    "repeats epoch 1's order and each rank sees the same shard forever, which hurts "
    "generalisation (pytorch #31771).",
    3: "Without DDP nothing averages the gradients: each rank trains its own model on its "
    "own shard, and the model rank 0 saves has learned from 1/world_size of the data.",
    4: "DDP all-reduces gradients at every step: a rank with an extra batch waits for "
    "peers that have moved on (a hang until the timeout, or collectives that do not "
    "match: gloo aborts), or steps pair up across epochs and batches are silently dropped.",
    6: "Ranks writing one file race: on a shared filesystem the file can end up torn or "
    "mixed, and a reader (a resume) may load it half-written. Every rank holds the same "
    "weights, so one copy is enough.",
    8: "GPUs are numbered per node: on the second node global ranks start at "
    "nproc_per_node, past its last GPU (invalid device ordinal), or ranks of one node "
    "share a GPU while others stay idle.",
    9: "Collectives pair up by their order on each rank, not by their line: a call that some "
    "ranks make and others do not (or make from another place) leaves ranks waiting for "
    "partners that never come — silent until the process group's timeout (30 minutes on "
    "gloo, 10 on NCCL, by default) — or pairs later calls with the wrong partners, so the run "
    "exchanges the wrong tensors and hangs only epochs later.",
    11: "DDP all-reduces gradients bucket by bucket, each bucket once all of its parameters "
    "have their gradient: a parameter the loss does not use never gets one, so its bucket is "
    "never reduced; the ranks step with their own gradients (the replicas drift apart) and "
    "DDP raises at the next forward (RuntimeError: 'Expected to have finished reduction in "
    "the prior iteration').",
    12: "DDP(model), every collective, dist.get_rank() and DistributedSampler() need the "
    "default process group, which dist.init_process_group creates: called before it, they "
    "raise 'Default process group has not been initialized' (ValueError since torch 2.x; "
    "RuntimeError or AssertionError in older releases: pytorch/pytorch #38300) on every rank.",
    13: "DDP all-reduces each parameter's gradient once per backward, when its autograd hook "
    "fires. Reentrant activation checkpointing (torch.utils.checkpoint with "
    "use_reentrant=True, the old default; Hugging Face's gradient_checkpointing) runs each "
    "checkpointed segment's backward as a backward of its own: a parameter used in two "
    "segments (a layer shared or called twice) fires its hook twice in one step, and DDP "
    "raises 'Expected to mark a variable ready only once' (pytorch/pytorch #121594; the "
    "non-reentrant checkpoint made for DDP: #65537).",
    14: "Only a collective that both ranks call orders one rank's torch.load after another's "
    "torch.save: with none between them the reader may open the file before it exists "
    "(FileNotFoundError), half-written, or as the last epoch left it (a silent stale read). "
    "Which one depends on timing: it often works on a laptop and fails on a cluster's shared "
    "filesystem, where a write takes longer and becomes visible later.",
    10: "torchrun already starts one process per rank and sets RANK, LOCAL_RANK, WORLD_SIZE, "
    "MASTER_ADDR and MASTER_PORT. A script written for mp.spawn (pytorch/examples' "
    "multigpu.py) starts nnodes x nproc_per_node jobs of its own, each with its own "
    "address and port: they clash on the port or wait for each other forever.",
}
FIX = {
    1: "sampler = DistributedSampler(train_set) (its num_replicas and rank come from the "
    "process group); DataLoader(train_set, batch_size=..., sampler=sampler) without "
    "shuffle=True; and sampler.set_epoch(epoch) at the start of every epoch.",
    2: "for epoch in range(epochs): sampler.set_epoch(epoch), before iterating the loader.",
    3: "model = DistributedDataParallel(model) (device_ids=[local_rank] on GPUs) after "
    "moving it to its device and before creating the optimizer; call model(x), not a copy.",
    4: "Give every rank the same number of batches: DistributedSampler(train_set) (it pads "
    "the shards to equal length), or drop_last=True, or a per-epoch step count that is "
    "the same on every rank.",
    5: "Shard evaluation exactly: Subset(val_set, range(rank, len(val_set), world_size)) "
    "(no padding), then all_reduce the sums and counts and divide once.",
    6: "if dist.get_rank() == 0: torch.save(...); then dist.barrier() before any rank reads it.",
    7: "dist.init_process_group(backend) with no init_method, rank or world_size: torchrun "
    "sets MASTER_ADDR, MASTER_PORT, RANK and WORLD_SIZE on every node (env://), and "
    "--master_addr names node 0's address that every node can reach.",
    8: "local_rank = int(os.environ['LOCAL_RANK']); torch.cuda.set_device(local_rank); "
    "device = torch.device('cuda', local_rank); DDP(model, device_ids=[local_rank]).",
    9: "Call every collective on every rank, in the same order: keep dist.barrier() and "
    "all_reduce out of `if rank == 0:`; evaluate on rank 0 through model.module (the plain "
    "model: no DDP collectives), or on every rank with a sharded set; give every rank the "
    "same number of batches (DistributedSampler).",
    11: "Use those parameters in the loss, or drop them from the model, or freeze them "
    "(param.requires_grad_(False)) before wrapping it in DDP. Or DDP(model, "
    "find_unused_parameters=True): DDP then walks the autograd graph after every forward to "
    "find the parameters that will get no gradient, which costs time every step and also "
    "hides a parameter left out by mistake.",
    12: "dist.init_process_group(backend) first, before DDP(model), any collective, "
    "dist.get_rank() or DistributedSampler(): under torchrun its env:// needs no other "
    "argument (RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT are set); then "
    "model = DDP(model).",
    13: "torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False) (Hugging Face: "
    "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': "
    "False})); or, when the model's graph is the same every step (no parameter used in some "
    "steps only), DDP(model, static_graph=True), which keeps reentrant checkpointing.",
    14: "if rank == 0: torch.save(...); then dist.barrier() on every rank, outside the `if`, "
    "before any rank calls torch.load on that file.",
    10: "Drop mp.spawn: call main() once; rank = int(os.environ['RANK']), local_rank = "
    "int(os.environ['LOCAL_RANK']), world_size = int(os.environ['WORLD_SIZE']); "
    "dist.init_process_group(backend) without setting MASTER_ADDR or MASTER_PORT.",
}
NOWHERE = "(not in the script's files)"


@dataclasses.dataclass
class Finding:
    """Mistake ``number`` at ``where`` (``file:line``); ``source``: that line's text."""

    number: int
    where: str
    seen: str
    why: str = ""
    fix: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        self.why, self.fix = self.why or WHY.get(self.number, ""), self.fix or FIX[self.number]
        self.title = TITLES[self.number]


WRAP = "white-space:pre-wrap;overflow-wrap:anywhere"  # code that wraps inside its column


def _tr(*cells: str, tag: str = "td") -> str:
    return "".join(
        f"<{tag} style='text-align:left;vertical-align:top'>{c}</{tag}>" for c in cells
    ).join(("<tr>", "</tr>"))


@dataclasses.dataclass
class ScriptReport:
    """What ``check_script`` found; ``exit_code``: 0 clean, 1 mistakes, 2 error or unchecked."""

    script: str
    layout: str
    findings: list[Finding]
    facts: dict[str, str]
    checked: list[str]
    ended: str
    error: str | None = None
    seconds: float = 0.0
    pids: list[int] = dataclasses.field(default_factory=list)  # agents, workers: all ended
    unchecked: str | None = None  # why the run showed too little to call the script clean

    @property
    def ok(self) -> bool:
        return self.error is None and not self.findings and self.unchecked is None

    @property
    def exit_code(self) -> int:
        return 1 if self.findings and self.error is None else 0 if self.ok else 2

    def summary(self) -> str:
        if self.error is not None:
            verdict = "the script could not run"
        elif self.findings:
            verdict = f"{len(self.findings)} mistake(s) found"
        elif self.unchecked is not None:
            verdict = f"could not check: {self.unchecked}"
        else:
            verdict = "no mistake found"
        return f"{self.script} on {self.layout}: {verdict} ({self.seconds:.0f} s; {self.ended})"

    def __str__(self) -> str:
        out = [f"ddpnb check-script: {self.summary()}", "", "Facts"]
        width = max((len(k) for k in self.facts), default=0)
        out += [f"  {k.ljust(width)}  {v}" for k, v in self.facts.items()]
        wrap = functools.partial(textwrap.wrap, width=96)
        for f in self.findings:
            out += ["", f"Mistake {f.number}: {f.title}  [{f.where}]"]
            out += [f"  line  {f.source}"] if f.source else []
            for label, text in (("seen", f.seen), ("why", f.why), ("fix", f.fix)):
                out += wrap(text, initial_indent=f"  {label:5}", subsequent_indent=" " * 7)
        out += ["", "Checked"]
        for note in self.checked:
            out += wrap(note, initial_indent="  - ", subsequent_indent="    ")
        if self.error is not None:
            out += ["", "The script could not run:", self.error.rstrip()]
        return "\n".join(out)

    def _repr_html_(self) -> str:
        e = html.escape
        rows = "".join(
            _tr(
                str(i),
                f"<b>{e(f.title)}</b><br><small>mistake {f.number}</small>",
                "<br>".join(
                    f"<code style='{WRAP}'>{e(x)}</code>" for x in (f.where, f.source) if x
                ),
                *map(e, (f.seen, f.why)),
                f"<code style='{WRAP}'>{e(f.fix)}</code>",
            )
            for i, f in enumerate(self.findings, 1)
        )
        head = _tr("#", "finding", "where", "seen", "why it matters", "fix", tag="th")
        # Widths fixed, code wrapped: else a long fix in <code> takes the row's width and the
        # prose columns get a few words each.
        cols = "".join(f"<col style='width:{w}%'>" for w in (3, 14, 15, 28, 20, 20))
        facts = "".join(_tr(f"<b>{e(k)}</b>", e(v)) for k, v in self.facts.items())
        checked = "".join(f"<li>{e(n)}</li>" for n in self.checked)
        error = f"<p>The script could not run:</p><pre>{e(self.error)}</pre>" if self.error else ""
        # The verdict set apart: green when clean, red with mistakes, grey when unchecked.
        kind = "bad" if self.findings or self.error else "ok"
        kind = "none" if self.unchecked is not None and not self.findings else kind
        return (
            f"<div><p><b>ddpnb check-script</b>: {badge(self.summary(), kind)}</p>"
            + (
                f"<table style='width:100%;table-layout:fixed'><colgroup>{cols}</colgroup>{head}{rows}"
                "</table>"
                if rows
                else ""
            )
            + f"<table>{facts}</table><details><summary>checked</summary><ul>{checked}</ul>"
            f"</details>{error}</div>"
        )


def check_script(
    script,
    nnodes: int = 2,
    nproc_per_node: int = 1,
    *,
    run_dir: str | os.PathLike | None = None,
    steps: int = 2,
    seconds: float = 20.0,
    timeout: float = 90.0,
) -> ScriptReport:
    """Run a DDP script briefly on simulated nodes and check it for the classic mistakes.

    ``script``: a :class:`ddpnb.Script` or a script's path (run unedited). ``run_dir``: where the
    check runs (``run/``, ``observe/``); default a temporary folder, removed afterwards. The
    script ends ``steps`` optimizer steps into epoch 2 or ``seconds`` after its first step; each
    worker after ``timeout`` seconds. ConfigError (nothing started): invalid script or layout.
    """
    script = script if isinstance(script, Script) else Script(script)
    root = Path(run_dir) if run_dir is not None else Path(tempfile.mkdtemp(prefix="ddpnb-check-"))
    observe_dir = root / "observe"
    shutil.rmtree(observe_dir, ignore_errors=True)
    observe_dir.mkdir(parents=True)
    env = {
        watch.INTERVAL_ENV: WATCH_INTERVAL,
        observe.DIR_ENV: str(observe_dir.resolve()),
        observe.STEPS_ENV: str(steps),
        observe.SECONDS_ENV: str(seconds),
        observe.TIMEOUT_ENV: str(timeout),
    }
    started, error, hung, failed = time.monotonic(), None, None, None
    try:
        job = launch(script, root / "run", nnodes, nproc_per_node, env=env, **LAUNCH)
        pids = set(job.pids())
        try:
            job.wait(timeout=timeout + WAIT_MARGIN_SECONDS)
        except RunHung as e:
            hung = e
        except RunFailed as e:
            error, failed = str(e), e  # analyse turns DDP's own errors (e.cause) into findings
        except TimeoutError:
            job.stop()
            error = (
                f"The script did not end within {timeout + WAIT_MARGIN_SECONDS:.0f} s, although "
                "the check asks every rank to stop; it was stopped. A rank may be blocked "
                "outside Python."
            )
        records = load_records(observe_dir)
        pids |= {r["pid"] for rank in records.values() for r in rank if r["kind"] == "start"}
        report = analyse(records, root / "run", nnodes, nproc_per_node, error, hung, failed)
    finally:
        if run_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    report.script, report.seconds = script.name, time.monotonic() - started
    report.pids = sorted(pids)
    return report


def load_records(folder: str | os.PathLike) -> dict[int, list[dict]]:
    """Every rank's records, by global rank."""
    found = {int(p.stem.split("-")[1]): read_jsonl(p) for p in Path(folder).glob("rank-*.jsonl")}
    return {rank: found[rank] for rank in sorted(found) if found[rank]}


def _at(where: dict | None) -> str:
    return f"{where['file']}:{where['line']}" if where else NOWHERE


def _lines(run_dir: Path, file: str) -> list[str]:
    try:
        return (run_dir / file).read_text().splitlines()
    except (OSError, ValueError):
        return []


def _line_text(run_dir: Path, at: str) -> str:
    name, _, line = at.rpartition(":")
    lines = _lines(run_dir, name)
    return lines[int(line) - 1].strip() if line.isdigit() and 0 < int(line) <= len(lines) else ""


class _Rank(defaultdict):
    """One rank's records by kind (``rank["init"]``), and what the checks ask of them."""

    def __init__(self, records: list[dict]) -> None:
        super().__init__(list)
        for r in records:
            self[r["kind"]].append(r)
        start = self["start"][0]
        self.rank = start["rank"]
        self.local_rank = int(start["env"].get("LOCAL_RANK") or 0)
        self.passes = sorted(self["pass"], key=lambda p: p["pass"])
        self.loaders = {r["id"]: r for r in self["loader"]}
        self.samplers = {r["id"]: r for r in self["sampler"]}
        self.train = [p for p in self.passes if p["steps"] > 0]
        self.eval_passes = [
            p
            for p in self.passes
            if p["source"] == "loader" and p["steps"] == 0 and not (p["grad"] and p["training"])
        ]

    def sampler_pass(self, p: dict) -> dict | None:
        """The DistributedSampler pass that gave pass ``p`` its indices (or was ``p``)."""
        return next(
            (s for s in self["sampler_pass"] if p["pass"] in (s["loader_pass"], s["pass"])), None
        )

    def levels(self, p: dict) -> tuple[list[list[int]] | None, list[dict]]:
        """The pass's indices at each Subset level, outermost first (None if none were seen), and
        the datasets of those levels."""
        if p["source"] == "loader":
            indices = p["indices"] if p["indices"] and p["indices"][0] else None
            return indices, self.loaders.get(p["obj"], {}).get("layers") or []
        s, dataset = self.sampler_pass(p), self.samplers.get(p["obj"], {})
        layer = {"len": dataset.get("dataset_len"), "id": p["obj"]}
        return ([s["indices"]] if s else None), [layer]

    def epoch_done(self, k: int) -> bool:
        return any(e["epoch"] == k for e in self["epoch_end"]) or len(self.train) > k

    def first_steps(self) -> str:
        """Epoch 1's optimizer steps, or its loader's length while it is unfinished."""
        p = self.train[0]
        if self.epoch_done(1):
            return str(p["steps"])
        if not p.get("expected"):
            return "?"
        return f"{p['expected']} (len of the loader; epoch 1 not finished)"

    def source(self, p: dict) -> tuple[dict, str]:
        """The record that made the pass (a loader or a sampler) and a short description."""
        if p["source"] == "loader":
            loader = self.loaders.get(p["obj"], {})
            return loader, f"a DataLoader with a {loader.get('sampler', '?')}"
        return self.samplers.get(p["obj"], {}), "a DistributedSampler"


def _common(ranks: list[_Rank], passes: list[dict]) -> tuple[list[list[int]], int | None] | None:
    """The passes' indices and size at the first dataset level every rank shares (not a shard)."""
    levels, layers = zip(*(r.levels(p) for r, p in zip(ranks, passes)))
    if any(lv is None for lv in levels):
        return None
    depth = min(len(lv) for lv in levels)
    for i in range(depth):
        if all(len(la) > i and la[i] == layers[0][i] for la in layers):
            return [lv[i] for lv in levels], layers[0][i].get("len")
    return [lv[depth - 1] for lv in levels], None


def analyse(
    records: dict[int, list[dict]],
    run_dir: Path,
    nnodes: int,
    nproc_per_node: int,
    error: str | None = None,
    hung: RunHung | None = None,
    failed: RunFailed | None = None,
) -> ScriptReport:
    """The report of one observed run (``records``: :func:`load_records`): each check below
    returns its findings and its notes of what it checked. ``failed``: the run's failure; one
    whose cause is a DDP mistake (``failed.cause``) is a finding, not an ``error``."""
    ranks = [_Rank(r) for r in records.values() if any(x["kind"] == "start" for x in r)]
    world = nnodes * nproc_per_node
    layout = f"{nnodes} node(s) x {nproc_per_node} process(es)"
    out: list = []
    if len(ranks) < world:
        out.append(f"Records of {len(ranks)} of {world} ranks: the others never started.")
    checks = (_sharding, _set_epoch, _replicas, _steps, _evaluation, _saves, _reads, _devices)
    for check in (*checks, _rendezvous, _spawn, _collectives) if ranks else ():
        out += check(ranks, world, run_dir)
    out += _stall(ranks, hung)
    aborted = _aborted(ranks, failed, run_dir, nnodes, nproc_per_node)
    if aborted:  # the run failed of a DDP mistake: a finding; its error's first line, a note
        error = None
        out += [f"The run stopped: {str(failed).splitlines()[0]}"]
        # 11 explains the drifted replicas (3); the abort's 9 has each rank's line
        drop = {3, 9} if aborted[0].number == 11 else {9}
        out = [f for f in out if not (isinstance(f, Finding) and f.number in drop)] + aborted
    if failed is not None and not aborted and _stopped_by_read(out, failed, run_dir):
        error = None  # the read that found no file, or not this epoch's: a finding, not an error
        out += [f"The run stopped: {str(failed).splitlines()[0]}"]
    found = [f for f in out if isinstance(f, Finding)]
    findings = [dataclasses.replace(f, source=_line_text(run_dir, f.where)) for f in found]
    findings.sort(key=lambda f: f.number)
    ends = sorted({e["reason"] for r in ranks for e in r["end"]})
    if hung is not None:
        ends.append(f"stopped by the check's hang watch (no rank moved for {HANG_SECONDS:g} s)")
    ended = "; ".join(ends) or "no rank reported how it ended"
    checked = [n for n in out if isinstance(n, str)]
    unchecked = None if findings or error else _unchecked(ranks)
    facts = _facts(ranks, world, layout)
    return ScriptReport("", layout, findings, facts, checked, ended, error, unchecked=unchecked)


def _stopped_by_read(out: list, failed: RunFailed, run_dir: Path) -> bool:
    """Whether the run failed at the line of a read that did not wait for its write (14)."""
    at = _raised_at(failed, run_dir)[0]
    return any(isinstance(f, Finding) and f.number == 14 and f.where == at for f in out)


def _aborted(
    ranks: list[_Rank], failed: RunFailed | None, run_dir: Path, nnodes: int, nproc: int
) -> list[Finding]:
    """11 or 9 from the run's failure, when its cause (diagnosis.KNOWN) is a DDP mistake."""
    cause = getattr(failed, "cause", None)
    if cause == "unused_parameters":
        return [_unused(ranks, failed, run_dir)]
    if cause == "no_process_group":
        return [_no_process_group(failed, run_dir)]
    if cause == "ready_twice":
        return [_ready_twice(ranks, failed, run_dir)]
    if cause != "collective_mismatch":
        return []
    states = diagnosis.rank_states(run_dir, diagnosis.worker_errors(run_dir, range(nnodes), nproc))
    parts = "; ".join(
        f"rank {s.rank} in {s.waits_in or 'its script'} at {s.where()}" for s in states
    )
    # The line of the rank in a collective of the script's own (an all_reduce, a barrier): where
    # the ranks' sequences part; the others wait in DDP's all-reduce, at every step's backward.
    own = [s for s in states if s.waits_in and not s.waits_in.startswith("DDP")]
    first = (own or states or [None])[0]
    seen = (
        "gloo aborted a rank: 'Received data size doesn't match expected size' (a collective "
        f"mismatch). Where the ranks were: {parts or 'not in the script files'}. "
        "Collectives of different sizes or kinds met: typically uneven inputs, a rank with more "
        "batches than another still in DDP's gradient all-reduce while the other has gone on to "
        "its next collective."
    )
    fix = (
        "Give every rank the same number of batches: DistributedSampler(train_set) (it pads the "
        "shards to equal length), or drop_last=True, or the same per-epoch step count on every "
        "rank; with inputs that are uneven by nature, wrap the loop in "
        "torch.distributed.algorithms.Join([model]). And call every collective on every rank, "
        "in the same order."
    )
    at = first.mine.at if first is not None and first.mine is not None else NOWHERE
    return [Finding(9, at, seen, fix=fix)]


_NO_GRAD = re.compile(r"did not receive grad for rank (\d+): ([\d ]+)")


def _unused(ranks: list[_Rank], failed: RunFailed, run_dir: Path) -> Finding:
    """11: the parameters torch's reducer named by index, by their names (observe's record)."""
    said = _NO_GRAD.search(failed.traceback or str(failed))
    rank = int(said[1]) if said else failed.global_rank
    indices = [int(i) for i in said[2].split()] if said else []
    ddp = next((d for r in ranks if r.rank == rank for d in r["ddp"]), None)
    ddp = ddp or next((d for r in ranks for d in r["ddp"]), {})
    names = ddp.get("params") or []
    named = [names[i] if i < len(names) else f"index {i}" for i in indices]
    raised = diagnosis.script_line(failed.traceback, run_dir)
    seen = (
        f"DDP raised 'Expected to have finished reduction in the prior iteration'{raised}: "
        + (
            f"parameter(s) {', '.join(named)} (the reducer's indices {' '.join(map(str, indices))}"
            f" on rank {rank}) got no gradient in the step before."
            if named
            else "some parameters got no gradient in the step before."
        )
        + " Its gradients were never all-reduced: the ranks stepped with their own."
    )
    # At the DDP(...) line: both fixes go there (find_unused_parameters=True, or freezing the
    # parameters just before it); the line that raises is the next step's forward, which is
    # not where the mistake is, and the loss may be computed in many places.
    return Finding(11, _at(ddp.get("where")), seen)


def _raised_at(failed: RunFailed, run_dir: Path) -> tuple[str, str]:
    """``x.py:7`` (or NOWHERE) and `` at x.py:7 in f``: the script's line that raised."""
    raised = diagnosis.script_line(failed.traceback or "", run_dir)
    at = re.match(r" at (.+):(\d+) in ", raised)
    return (f"{at[1]}:{at[2]}" if at else NOWHERE), raised


def _no_process_group(failed: RunFailed, run_dir: Path) -> Finding:
    """12: at the line that needed the process group before init_process_group made it."""
    at, raised = _raised_at(failed, run_dir)
    seen = (
        f"torch raised 'Default process group has not been initialized'{raised}: that line "
        "needs the default process group (DDP, a collective, the rank or world size), and "
        "dist.init_process_group had not been called yet on that rank."
    )
    return Finding(12, at, seen)


_TWICE = re.compile(r"Parameter at index (\d+)(?: with name (\S+))? has been marked as ready twice")


def _ready_twice(ranks: list[_Rank], failed: RunFailed, run_dir: Path) -> Finding:
    """13: the parameter torch's reducer named (by name, or its index mapped to the name
    observe recorded), at the DDP(...) line where static_graph=True would go."""
    text = f"{failed.traceback or ''}\n{failed}"
    said = _TWICE.search(text)
    ddp = next((d for r in ranks for d in r["ddp"]), {})
    names = ddp.get("params") or []
    name = None
    if said:
        index = int(said[1])
        name = said[2] or (names[index] if index < len(names) else f"index {index}")
    _, raised = _raised_at(failed, run_dir)
    seen = (
        f"DDP raised 'Expected to mark a variable ready only once'{raised}: "
        + (f"parameter {name}" if name else "a parameter")
        + " had its gradient marked ready twice in one backward"
        + (
            ", inside torch.utils.checkpoint's reentrant backward: the parameter is used in "
            "more than one checkpointed segment."
            if "checkpoint.py" in text
            else " (a module used twice in one forward, or in two reentrant backward passes)."
        )
    )
    return Finding(13, _at(ddp.get("where")), seen)


def _unchecked(ranks: list[_Rank]) -> str | None:
    """Why a run that showed no mistake cannot be called clean, or None when it can."""
    if not ranks:
        return "no rank of the script was observed (it never imported torch)"
    if not any(r["init"] for r in ranks):
        return "no process group was formed (init_process_group was never called)"
    if not any(r["step"] for r in ranks):
        return (
            "no optimizer step was observed (the script ended, or was stopped, before its first "
            "optimizer.step())"
        )
    return None


def _ddp_at(ranks: list[_Rank]) -> str | None:
    return next((_at(d["where"]) for r in ranks for d in r["ddp"]), None)


def _facts(ranks: list[_Rank], world: int, layout: str) -> dict[str, str]:
    facts = {"world size": f"{world} ({layout})"}
    trained = [r for r in ranks if r.train]
    sizes = {r.rank: max(r.train[0]["batch_sizes"]) for r in trained if r.train[0]["batch_sizes"]}
    if sizes:
        facts["batch size per rank"] = ", ".join(map(str, sorted(set(sizes.values()))))
        facts["global batch size"] = (
            f"{sum(sizes.values())} (the sum over {world} ranks)"
            if len(sizes) == world  # a rank stuck before its first batch reports none
            else f"not seen on every rank (a batch seen on rank {', '.join(map(str, sizes))} only)"
        )
    elif trained:
        facts["batch size per rank"] = "not seen (batches made without a DataLoader)"
    if trained:
        samples = (f"rank {r.rank}: {r.train[0]['n']}" for r in trained)
        facts["training samples per epoch"] = ", ".join(samples)
        facts["steps per epoch"] = ", ".join(f"rank {r.rank}: {r.first_steps()}" for r in trained)
    steps = [e["steps"] for r in ranks for e in r["end"]]
    if steps:
        facts["optimizer steps observed"] = f"{min(steps)} to {max(steps)} per rank"
    facts["DistributedDataParallel"] = _ddp_at(ranks) or "not constructed"
    return facts


def _no_pass(ranks: list[_Rank]) -> str:
    """Why no rank trained in a pass of its data (epochs, shards and their order unseen)."""
    steps = [s for r in ranks for s in r["step"]]
    if any(s.get("pass") for s in steps):  # a pass is recorded when it ends, or the next begins
        return "the run stopped before any rank ended a pass of its training data"
    if steps:
        return "optimizer steps were seen, but no DataLoader or DistributedSampler pass fed them"
    return "no optimizer step"


def _sharding(ranks: list[_Rank], world: int, run_dir: Path) -> list:
    """1: the ranks' training samples in epoch 1 should be disjoint (but for padding)."""
    trained = [r for r in ranks if r.train]
    if world < 2 or len(trained) < 2:
        why = "one rank: nothing to compare" if world < 2 else _no_pass(ranks)
        if world >= 2 and trained:  # the others may well have stepped: their pass did not end
            others = [str(r.rank) for r in ranks if not r.train]
            who = f"rank{'s' * (len(others) > 1)} {', '.join(others)}" if others else "the others"
            why = (
                f"only rank {trained[0].rank} ended a pass of its training data; the run stopped "
                f"before {who} did"
            )
        return [f"Training shards: not checked ({why})."]
    common = _common(trained, [r.train[0] for r in trained])
    if common is None:
        return [
            "Training shards: not checked (the training data has no sample indices: an "
            "IterableDataset, or batches made without a DataLoader or DistributedSampler)."
        ]
    counts = Counter(i for idx in common[0] for i in set(idx))
    shared = sum(1 for c in counts.values() if c > 1)
    if shared <= world - 1:  # a DistributedSampler pads with at most world - 1 repeats
        return [
            f"Training shards: in epoch 1 the ranks' samples overlap in {shared} of "
            f"{len(counts)} (padding adds at most {world - 1}): each rank trains on its own shard."
        ]
    record, what = trained[0].source(trained[0].train[0])
    per_rank = ", ".join(f"rank {r.rank} drew {len(set(i))}" for r, i in zip(trained, common[0]))
    seen = (
        f"In epoch 1, {shared} of the {len(counts)} training samples were drawn by more than "
        f"one rank ({100 * shared / len(counts):.0f}%; {per_rank}). The training data comes "
        f"from {what}"
    )
    if record.get("sampler") == "DistributedSampler" or "num_replicas" in record:
        sampler = trained[0].samplers.get(record.get("sampler_id") or record.get("id"), record)
        seen += f" (num_replicas={sampler.get('num_replicas')}, rank={sampler.get('rank')})."
    else:
        seen += ", which knows nothing of ranks."
    why = (
        f"Every rank trains on the same data: {world} ranks do the same epoch {world} times, "
        "and the run is no faster than one process (each step averages near-identical gradients)."
    )
    return [Finding(1, _at(record.get("where")), seen, why)]


def _set_epoch(ranks: list[_Rank], world: int, run_dir: Path) -> list:
    """2: a shuffling DistributedSampler must draw a new order every epoch."""
    pairs = [(r, *map(r.sampler_pass, r.train[:2])) for r in ranks if len(r.train) >= 2]
    pairs = [(r, first, second) for r, first, second in pairs if first and second]
    if not pairs:
        trained = max((len(r.train) for r in ranks), default=0)
        reason = {0: _no_pass(ranks), 1: "only one epoch ran before the script ended"}.get(
            trained, "the training data does not come from a DistributedSampler"
        )
        return [f"New order every epoch (set_epoch): not checked ({reason})."]
    rank, first, second = pairs[0]
    sampler = rank.samplers.get(first["sampler"], {})
    same = [r.rank for r, a, b in pairs if a["indices"] == b["indices"]]
    if not sampler.get("shuffle", True) or len(same) < len(pairs):
        return ["New order every epoch: epochs 1 and 2 drew different orders on every rank."]
    calls = [s for s in rank["set_epoch"] if s["sampler"] == first["sampler"]]
    if calls:
        where = _at(calls[-1]["where"])
        how = f"set_epoch was called with {first['epoch']} in both epochs (at {where})"
    else:
        where, how = _at(sampler.get("where")), "set_epoch was never called"
    seen = (
        f"Rank(s) {', '.join(map(str, same))} drew the same {first['n']} samples in the same "
        f"order in epochs 1 and 2: the sampler's epoch was {first['epoch']} both times; {how}."
    )
    return [Finding(2, where, seen)]


def _replicas(ranks: list[_Rank], world: int, run_dir: Path) -> list:
    """3: after the same optimizer step every rank must hold the same parameters."""
    sums: dict[int, dict[int, str]] = defaultdict(dict)
    for r in ranks:
        for rec in [*r["step"], *r["params"]]:
            if "params" in rec:
                sums[rec["n"]][r.rank] = rec["params"]
    common = sorted(n for n, by_rank in sums.items() if len(by_rank) == len(ranks))
    if world < 2 or not common:
        return ["Identical replicas: not checked (no optimizer step on every rank)."]
    ddp = _ddp_at(ranks)
    differ = [n for n in common if len(set(sums[n].values())) > 1]
    if not differ:
        wrapped = f"DDP wraps the model at {ddp}" if ddp else "no DDP on any rank"
        return [
            f"Identical replicas: every rank held the same parameters after optimizer steps "
            f"{', '.join(map(str, common))} ({wrapped})."
        ]
    n = differ[0]
    checksums = ", ".join(f"rank {r}: {c}" for r, c in sorted(sums[n].items()))
    made = (o["where"] for o in [*ranks[0]["optimizer"], *ranks[0]["step"]] if o.get("where"))
    seen = f"After optimizer step {n} the ranks' parameters differ (sha256 prefixes {checksums}); "
    if ddp:
        seen += "DistributedDataParallel was constructed, yet the copies drifted apart."
    else:
        seen += "no DistributedDataParallel was constructed on any rank."
    return [Finding(3, ddp or _at(next(made, None)), seen)]


def _steps(ranks: list[_Rank], world: int, run_dir: Path) -> list:
    """4: every rank must take the same number of optimizer steps in an epoch."""
    epochs = max((len(r.train) for r in ranks), default=0)
    for k in range(1, epochs + 1):
        mine = [(r, r.train[k - 1]) for r in ranks if len(r.train) >= k]
        done = {r.rank: p["steps"] for r, p in mine if r.epoch_done(k)}
        if not done:
            continue
        shortest = min(done.values())
        behind = {r.rank: p for r, p in mine if not r.epoch_done(k) and p["batches"] > shortest}
        if len(set(done.values())) > 1 or behind:
            parts = [f"rank {r} ended it after {n} optimizer steps" for r, n in done.items()]
            parts += [
                f"rank {r} had drawn {p['batches']} batches"
                + (f" of the {p['expected']} its loader holds" if p.get("expected") else "")
                + " and was still in it"
                for r, p in sorted(behind.items())
            ]
            rank = next(r for r, _ in mine if r.rank == min(done))
            record, what = rank.source(rank.train[k - 1])
            seen = f"Epoch {k}: {'; '.join(parts)}. The training data comes from {what}."
            return [Finding(4, _at(record.get("where")), seen)]
    if epochs == 0:
        return [f"Steps per epoch: not checked ({_no_pass(ranks)})."]
    return ["Steps per epoch: every rank that ended an epoch took the same number of steps."]


def _evaluation(ranks: list[_Rank], world: int, run_dir: Path) -> list:
    """5: over all ranks, evaluation must visit every sample of its set exactly once."""
    loaders = list(dict.fromkeys(p["obj"] for p in ranks[0].eval_passes))
    if not loaders:
        return [
            "Evaluation: no evaluation pass ran before the check ended the script (a "
            "DataLoader iterated under torch.no_grad() or model.eval() without optimizer "
            "steps): how it shards and counts samples was not checked."
        ]
    out = []
    for lid in loaders:
        passes = [next((p for p in r.eval_passes if p["obj"] == lid), None) for r in ranks]
        done = [(r, p) for r, p in zip(ranks, passes) if p is not None and p["exhausted"]]
        if done:  # ranks that do not evaluate (evaluation on rank 0 only) add nothing to count
            out += _eval_coverage([r for r, _ in done], [p for _, p in done], world)
        else:
            out.append(f"Evaluation loader {lid}: no rank finished a pass; not checked.")
    return out


def _eval_coverage(ranks: list[_Rank], passes: list[dict], world: int) -> list:
    common = _common(ranks, passes)
    where = _at(ranks[0].source(passes[0])[0].get("where"))
    if common is None:
        return [f"Evaluation at {where}: no sample indices seen; not checked."]
    indices, size = common
    counts = Counter(i for idx in indices for i in idx)
    drawn = sum(counts.values())
    twice = {i: c for i, c in counts.items() if c > 1}
    missing = (size - len(counts)) if size is not None else 0
    calls = [c for c in ranks[0]["collective"] if c["pass"] == passes[0]["pass"]]
    if calls:
        reduced = f"Results are then combined ({calls[0]['op']} at {_at(calls[0]['where'])})."
    else:
        reduced = (
            "No collective followed the evaluation before training went on, so each rank's "
            "result covers its own samples only (what the script prints is not observed)."
        )
    if not twice and missing <= 0:
        return [
            f"Evaluation at {where}: {len(ranks)} of {world} ranks evaluated {drawn} samples, "
            f"each of the {len(counts)} once. {reduced}"
        ]
    of = f" of a {size}-sample set" if size is not None else ""
    if twice and all(c == len(ranks) for c in counts.values()):
        seen = (
            f"Every rank evaluated all {len(counts)} samples{of}: each counted {len(ranks)} times."
        )
    else:
        parts = (
            [f"{len(twice)} sample(s) evaluated twice or more (e.g. index {min(twice)})"]
            if twice
            else []
        )
        parts += [f"{missing} never evaluated"] if missing > 0 else []
        seen = f"The {len(ranks)} ranks evaluated {drawn} samples{of}: {', '.join(parts)}."
    why = (
        "A sample evaluated on several ranks is counted several times once the results are "
        "reduced (a padded DistributedSampler repeats samples to make shards equal), and a "
        "skipped one not at all: the metric is not the set's, and it changes with the world "
        f"size. {reduced}"
    )
    return [Finding(5, where, seen + f" Loader created at {where}.", why)]


def _saves(ranks: list[_Rank], world: int, run_dir: Path) -> list:
    """6: a file path written with torch.save by more than one rank."""
    saves = [(s["path"], r.rank, _at(s["where"])) for r in ranks for s in r["save"] if s["path"]]
    writers = {path: {r for p, r, _ in saves if p == path} for path, _, _ in saves}
    where = {path: at for path, _, at in reversed(saves)}  # each path's first torch.save
    if not writers:
        return ["Checkpoint writes: no torch.save before the check ended the script."]
    shared = {p: w for p, w in writers.items() if len(w) > 1}
    if not shared:
        return [f"Checkpoint writes: {len(writers)} file(s), each written by one rank."]
    path, ranks_writing = next(iter(shared.items()))
    seen = (
        f"Ranks {', '.join(map(str, sorted(ranks_writing)))} all wrote "
        f"{Path(path).name if '/run/' in path else path} (torch.save at {where[path]})"
        + (f", and {len(shared) - 1} other file(s) likewise." if len(shared) > 1 else ".")
    )
    return [Finding(6, where[path], seen)]


def _reads(ranks: list[_Rank], world: int, run_dir: Path) -> list:
    """14: a torch.load of a file another rank writes with torch.save, with no collective between
    them: both at the same point of the same sequence of collectives (the records' ``met``)."""
    saves = [(r.rank, s) for r in ranks for s in r["save"] if s["path"] and s.get("met")]
    loads = [(r.rank, x) for r in ranks for x in r["load"] if x["path"] and x.get("met")]
    shared = [
        (w, ld) for w in saves for ld in loads if w[1]["path"] == ld[1]["path"] and w[0] != ld[0]
    ]
    if not shared:
        return ["Reads of files another rank writes: none before the check ended the script."]
    race = next(((w, ld) for w, ld in shared if w[1]["met"] == ld[1]["met"]), None)
    if race is None:
        reads = len({(rank, x["t"]) for _, (rank, x) in shared})
        return [f"Reads of files another rank writes: {reads}, each after a collective that "
                "follows the write."]  # fmt: skip
    (writer, save), (reader, load) = race
    calls = save["met"][0]
    seen = (
        f"Rank {reader} read {Path(load['path']).name} (torch.load at {_at(load['where'])}) "
        f"and rank {writer} wrote it (torch.save at {_at(save['where'])}), both after the same "
        f"{calls} collective(s) and before the next: nothing made the read wait for the write."
    )
    return [Finding(14, _at(load["where"]), seen)]


def _devices(ranks: list[_Rank], world: int, run_dir: Path) -> list:
    """8: on GPUs each process must use the GPU of its local rank."""
    chosen = [(r, d) for r in ranks for d in r["device"]]
    if not chosen:
        return ["GPU per process: not checked (no CUDA device was chosen in this run)."]
    wrong = [(r, d) for r, d in chosen if d["index"] != r.local_rank and d["index"] == r.rank]
    if not wrong:
        return ["GPU per process: every CUDA device chosen was the local rank's."]
    r, d = wrong[0]
    seen = (
        f"Rank {r.rank} (local rank {r.local_rank}) chose cuda:{d['index']} with {d['call']}: "
        "the global rank."
    )
    return [Finding(8, _at(d.get("where")), seen)]


def _rendezvous(ranks: list[_Rank], world: int, run_dir: Path) -> list:
    """7: init_method / MASTER_ADDR on loopback; rank or world size not torchrun's."""
    found = {(f.where, f.seen): f for r in ranks for f in _rendezvous_findings(r, run_dir)}
    if found:
        return list(found.values())
    if not any(r["init"] for r in ranks):
        return ["Rendezvous: init_process_group was not called; not checked."]
    return [
        "Rendezvous: init_process_group takes its address, rank and world size from "
        "torchrun's environment (env://) on every rank."
    ]


def _rendezvous_findings(rank: _Rank, run_dir: Path):
    """7 on one rank: its init_process_group calls, its writes of os.environ."""
    for init in rank["init"]:
        where, env, method = _at(init["where"]), init["env"], init.get("init_method")
        host = urlparse(method).hostname if str(method).startswith("tcp://") else None
        if host and is_loopback(host):
            seen = f"init_method={method!r}: {host} is this machine, on every machine."
            why = (
                "It runs while every process is on one host. On two nodes, node 1 connects to "
                "itself, never meets node 0, and waits until the rendezvous times out."
            )
            yield Finding(7, where, seen, why)
        literal = _literal_args(run_dir, init["where"])
        for key in ("rank", "world_size"):
            value, env_value = init.get(key), env.get(key.upper())
            if value is not None and str(value) != env_value:
                seen = (
                    f"init_process_group({key}={value}) on the process torchrun started with "
                    f"{key.upper()}={env_value}; the check stopped it there (it would hang)."
                )
                why = f"Processes that disagree with torchrun about the {key.replace('_', ' ')} never form one group."
                yield Finding(7, where, seen, why)
            elif value is not None and key in literal:
                seen = (
                    f"{key}={literal[key]} is written into the script; it equals torchrun's "
                    f"{key.upper()} in this check only because the check runs {env.get('WORLD_SIZE')} processes."
                )
                why = "With another number of nodes or processes per node the group never forms."
                yield Finding(7, where, seen, why)
    for s in rank["setenv"]:
        key, value, where = s["key"], s["value"], _at(s["where"])
        if key == "MASTER_ADDR" and is_loopback(value):
            seen = f"The script sets os.environ['MASTER_ADDR'] = {value!r}, replacing torchrun's."
            why = (
                f"{value} is this machine on every machine: node 1 looks for the rendezvous on "
                "itself and never meets node 0."
            )
            yield Finding(7, where, seen, why)
        elif key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
            seen = f"The script sets os.environ[{key!r}] = {value!r}, replacing torchrun's value."
            why = "torchrun numbers the processes; a number set by the script is right for one layout only."
            yield Finding(7, where, seen, why)


def _literal_args(run_dir: Path, where: dict | None) -> dict[str, object]:
    """``rank``/``world_size`` given as literals in the init_process_group call at ``where``."""
    try:
        tree = ast.parse("\n".join(_lines(run_dir, where["file"])))
    except (SyntaxError, TypeError):
        return {}
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and node.lineno <= where["line"] <= (node.end_lineno or node.lineno)
            and ast.unparse(node.func).rpartition(".")[2] == "init_process_group"
        ):
            given = dict(zip(("", "", "", "world_size", "rank"), node.args))
            given.update({kw.arg: kw.value for kw in node.keywords})
            return {
                k: v.value
                for k, v in given.items()
                if k in ("rank", "world_size") and isinstance(v, ast.Constant) and v.value != -1
            }
    return {}


def _stall(ranks: list[_Rank], hung: RunHung | None) -> list:
    """9: the run stopped moving with ranks waiting in collectives."""
    if hung is not None and hung.stacks is not None:
        states, what = hung.stacks.ranks, hung.stacks.verdict.message
    else:
        blocked = [(r, b) for r in ranks for b in r["blocked"]]
        if not blocked:
            return ["Hangs: no rank was left waiting in a collective."]
        states = [
            RankState(r.rank, 0, "", 0, "running", 0.0, b["steps"], True, frames, 0.0)
            for r, b in blocked
            for frames in [tuple(Frame(*f) for f in b["stack"])]
        ]
        stopped = sorted({r.rank for r in ranks} - {s.rank for s in states})
        what = (
            f"Rank(s) {', '.join(map(str, stopped))} stopped where the check asked; "
            + "; ".join(s.line() for s in states)
            + ", and could not get there."
        )
    waiting = [s for s in states if s.state == "running" and s.waits_in]
    first = (waiting or states)[0].mine
    return [Finding(9, first.at if first is not None else NOWHERE, what)]


def _collectives(ranks: list[_Rank], world: int, run_dir: Path) -> list:
    """9: every rank must call the same collectives (its own and DDP's) in the same order."""
    seqs = {r.rank: r["collectives"][-1]["calls"] for r in ranks if r["collectives"]}
    if world < 2 or len(seqs) < 2:
        return ["Order of collectives: not checked (fewer than two ranks recorded theirs)."]
    n = min(len(s) for s in seqs.values())
    first = next((i for i in range(n) if len({tuple(s[i][:2]) for s in seqs.values()}) > 1), n)
    calls = {rank: tuple(s[first][:2]) for rank, s in seqs.items() if len(s) > first}
    if first == n:  # the same calls as far as every rank got: do some ranks call more?
        ends = {r.rank: (r["end"][-1]["reason"] if r["end"] else "") for r in ranks}
        same_stop = len(set(ends.values())) == 1 and "optimizer step" in next(iter(ends.values()))
        if not (same_stop and calls):
            return [
                f"Order of collectives: every rank called the same {n} collectives in the same "
                "order (its own and DDP's: the parameter broadcast, buffer broadcasts, gradient "
                "all-reduces)."
            ]
        calls = {rank: calls.get(rank, ("no collective", None)) for rank in seqs}
    used = Counter(tuple(c[:2]) for s in seqs.values() for c in {tuple(x[:2]) for x in s})
    odd_rank = min(calls, key=lambda r: (used[calls[r]], r))  # the call fewest ranks ever make
    parts = [
        f"rank {rank} called {op}" + (f" at {at} ({_line_text(run_dir, at)})" if at else "")
        for rank, (op, at) in sorted(calls.items())
    ]
    seen = (
        f"The ranks' collective #{first + 1} differs: {'; '.join(parts)}. From there on their "
        "collectives pair up with the wrong partners."
    )
    return [Finding(9, calls[odd_rank][1] or NOWHERE, seen)]


# os.environ["MASTER_ADDR"] = ..., os.environ.setdefault("MASTER_PORT", ...), os.putenv(...)
_SETS_RENDEZVOUS = re.compile(
    r"""^[^#]*(environ\[|putenv\(|setdefault\()\s*['"]MASTER_(ADDR|PORT)['"]\s*(\]\s*=[^=]|,)"""
)


def _spawn(ranks: list[_Rank], world: int, run_dir: Path) -> list:
    """10: torch.multiprocessing.spawn under torchrun: every rank starts ranks of its own."""
    spawns = [s for r in ranks for s in r["spawn"]]
    if not spawns:
        return ["Own ranks: the script does not call torch.multiprocessing.spawn."]
    s, where = spawns[0], _at(spawns[0]["where"])
    file = s["where"]["file"] if s["where"] else ""
    sets = [
        f"{file}:{i}"
        for i, line in enumerate(_lines(run_dir, file), 1)
        if _SETS_RENDEZVOUS.search(line)
    ]
    seen = (
        f"Every rank called {s['call']} at {where}"
        + (f"; the script sets the rendezvous itself at {', '.join(sets)}" if sets else "")
        + ". The check stopped it there: under torchrun it would start a second job per rank."
    )
    return [Finding(10, where, seen)]


def _parse_args(argv: list[str]):
    """(Script, check_script's keyword arguments) from the command line's words."""
    parser = argparse.ArgumentParser(
        prog="ddpnb check-script",
        description="Run a DDP script briefly on simulated nodes and name its classic mistakes. "
        "Exit status: 0 no mistake found, 1 mistakes found, 2 the script could not run.",
    )
    parser.add_argument("--nnodes", type=int, default=2, help="simulated nodes (default 2)")
    parser.add_argument("--nproc-per-node", type=int, default=1, help="processes per node")
    script_options(parser)
    parser.add_argument("--run-dir", help="keep the check's run and records here")
    parser.add_argument("script", help="the torchrun script")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the script's own arguments")
    opts = parser.parse_args(argv)
    kwargs = {k: getattr(opts, k) for k in ("nnodes", "nproc_per_node", "run_dir")}
    return Script(opts.script, opts.args, opts.file, opts.max_copy_mb), kwargs


def main_check_script(argv: list[str]) -> int:
    """``ddpnb check-script [OPTIONS] SCRIPT [ARGS...]``: words after SCRIPT are the script's."""
    try:
        script, kwargs = _parse_args(argv)
        report = check_script(script, **kwargs)
    except DdpnbError as e:
        print(f"ddpnb check-script: {e}", file=sys.stderr)
        return 2
    print(report)
    return report.exit_code
