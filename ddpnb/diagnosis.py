"""From a run's files and its agents' exit codes to a typed error: which node, which rank, why."""

from __future__ import annotations

import dataclasses
import re
import signal
import time
from collections.abc import Sequence
from pathlib import Path

from .errors import NodeLost, RendezvousTimeout, RunFailed, RunStalled, WorkerFailed
from .hang import Frame, RankState, read_ranks
from .metrics import load_metrics, read_json, read_progress
from .topology import Topology
from .watch import HOOKS_DIR, helpers_from  # the worker's machinery is not the user's line

SECONDARY_ERRORS = (  # messages of ranks that failed only because a peer died first
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out waiting",  # gloo: a peer did not answer within timeout_seconds
    "this node is lost",  # the worker of a killed agent stopping itself
)
GRACE_SECONDS = 30  # seconds past its own limits before a silent run is called stuck
READ_BYTES = 1 << 20  # of a worker's log, its last MiB is read: a GB log is diagnosed in ms


@dataclasses.dataclass(frozen=True)
class Known:
    """An error DDP users meet, found by its own words in a worker's output."""

    cause: str  # its name, e.g. "collective_mismatch" (WorkerFailed.cause)
    pattern: re.Pattern
    means: str
    fix: str


def _known(cause: str, pattern: str, means: str, fix: str) -> Known:
    return Known(cause, re.compile(pattern), means, fix)


# The errors DDP users report most, in the order they are looked for (first match wins).
KNOWN = (
    _known(
        "collective_mismatch",
        r"collective mismatch|Received data size doesn't match expected size",
        "the ranks called different collectives, or the same one with tensors of different "
        "sizes: a rank had more batches than another (uneven inputs), or a collective runs "
        "on some ranks only",
        "give every rank the same number of steps (DistributedSampler, drop_last=True, or "
        "torch.distributed.algorithms.Join) and call every collective on every rank, in the "
        "same order",
    ),
    _known(
        "unused_parameters",
        r"Expected to have finished reduction in the prior iteration",
        "some parameters got no gradient in a step (the loss does not use them: an unused "
        "head or branch), so DDP's all-reduce of the previous step never finished",
        "use every parameter in the loss, or freeze the unused ones (requires_grad_(False)) "
        "before wrapping; DDP(model, find_unused_parameters=True) also works, at the cost "
        "of a walk over the autograd graph every step, and can hide a real bug",
    ),
    _known(
        "no_process_group",
        r"Default process group (has not been|is not) initialized",
        "DDP(model), a collective, dist.get_rank() or DistributedSampler() ran before "
        "dist.init_process_group: they all need the default process group",
        "call dist.init_process_group(backend) first (under torchrun, env:// needs no other "
        "argument), then wrap the model in DDP",
    ),
    _known(
        "ready_twice",
        r"Expected to mark a variable ready only once",
        "a parameter's gradient hook fired twice in one backward: reentrant activation "
        "checkpointing (torch.utils.checkpoint with use_reentrant=True) of a layer used in two "
        "segments, or a module used twice in one forward",
        "torch.utils.checkpoint.checkpoint(..., use_reentrant=False); or DDP(model, "
        "static_graph=True) when the model's graph is the same every step",
    ),
    _known(
        "shared_memory",
        r"Bus error|No space left on device|unable to (write to|allocate shared memory)",
        "shared memory (/dev/shm) is full: DataLoader workers pass batches through it (a "
        "container's default is 64 MB)",
        "a larger /dev/shm (docker run --shm-size=2g; Kubernetes: an emptyDir of medium "
        "Memory on /dev/shm), or DataLoader(num_workers=0)",
    ),
    _known(
        "out_of_memory",
        r"out of memory|OutOfMemoryError|DefaultCPUAllocator: can't allocate|bad_alloc",
        "a rank ran out of memory",
        "a smaller batch_size per rank (the global batch is batch_size x world_size), fewer "
        "processes per node, or gradient accumulation",
    ),
    _known(
        "nccl_timeout",
        r"Watchdog caught collective operation timeout",
        "a NCCL collective did not complete within the process group's timeout: the ranks "
        "called different collectives, or a rank stopped",
        "call every collective on every rank in the same order; ddpnb's stacks and NCCL's "
        "flight recorder (TORCH_NCCL_TRACE_BUFFER_SIZE) show where each rank was",
    ),
    _known(
        "nccl",
        r"NCCL error|nccl(UnhandledCuda|System|Internal|Remote|InvalidUsage|InvalidArgument)",
        "NCCL failed",
        "NCCL_DEBUG=INFO shows the transport and interface NCCL chose; NCCL_SOCKET_IFNAME "
        "names the interface every node can reach",
    ),
    _known(
        "cuda",
        r"CUDA error|CUDA kernel errors|invalid device ordinal",
        "a CUDA error",
        "CUDA_LAUNCH_BLOCKING=1 makes CUDA report it at the line that caused it",
    ),
)
_RANK_PREFIX = re.compile(r"^\[(default)?(rank)?\d+\]:?\s?")
_CPP_PREFIX = re.compile(r"^\s*\[(enforce fail at )?[^\]\s]*\.(cc|cpp|h|hpp):\d+\]\s*")


def read_end(path: Path, limit: int = READ_BYTES) -> str:
    """The last ``limit`` bytes of a file as text ("" when it cannot be read); binary is kept."""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            f.seek(max(0, f.tell() - limit))
            return f.read().decode(errors="replace").replace("\0", "")
    except OSError:
        return ""


def first_error(text: str) -> tuple[str, Known | None]:
    """The output's first line that names its error, in its own words, and what it is."""
    lines = [_RANK_PREFIX.sub("", line) for line in text.splitlines()]
    for known in KNOWN:
        if hit := next((ln for ln in lines if known.pattern.search(ln)), None):
            hit = _CPP_PREFIX.sub("", hit.split("what():", 1)[-1])
            if "<=" in hit or " vs " in hit:  # gloo's enforce: its condition, then its words
                hit = hit[known.pattern.search(hit).start() :]
            return hit.strip(), known
    for i, line in enumerate(lines):
        if line.startswith("terminate called after throwing"):
            what = next((ln for ln in lines[i + 1 : i + 3] if "what():" in ln), line)
            return _CPP_PREFIX.sub("", what.split("what():", 1)[-1]).strip(), None
        if line.startswith(("terminate called", "Fatal Python error:")):
            return line.strip(), None
    return "", None


def tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a text file ("" when it cannot be read)."""
    return "\n".join(read_end(Path(path), 64 * 1024).splitlines()[-lines:])


def log_tail(run_dir: Path, node: int, lines: int = 20) -> str:
    """The last ``lines`` lines of a node's log in ``run_dir/logs``."""
    return tail(Path(run_dir) / "logs" / f"node-{node}.log", lines)


def read_error_file(path: Path) -> dict | None:
    """torchrun's ``error.json`` (written by ``@record``) as its message and traceback."""
    msg = read_json(path).get("message")
    if isinstance(msg, str):
        msg = {"message": msg}
    if not isinstance(msg, dict):
        return None
    traceback = msg.get("extraInfo", {}).get("py_callstack", "")
    text = str(msg.get("message", "")).strip()
    known = first_error(text)[1]
    return {"message": (text.splitlines() or [""])[0], "traceback": traceback, "known": known}


_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)$', re.M)


def script_line(traceback: str, run_dir: Path) -> str:
    """`` at train.py:12 in step`` for the traceback's innermost frame of the script's files."""
    frames = [m for m in _FRAME.finditer(traceback) if "site-packages" not in m.group(1)]
    folder = str(Path(run_dir).resolve()) + "/"
    mine = [m for m in frames if _mine(m[1], folder) and int(m[2]) < helpers_from(m[1])] or frames
    if not mine:
        return ""
    path, line, func = mine[-1].groups()
    name = path[len(folder) :] if path.startswith(folder) else Path(path).name
    return f" at {name}:{line} in {func}"


# torchrun's failure summary, per failed worker: "rank : 1 (local_rank: 1)", "exitcode : 1 ...".
_SUMMARY = re.compile(
    r"^\s*rank\s*:\s*(\d+) \(local_rank:\s*(\d+)\).*\n\s*exitcode\s*:\s*(-?\d+)", re.M
)


def failed_ranks(run_dir: Path, node: int, lines: int = 400) -> list[dict]:
    """Each failed worker in a node's torchrun summary: rank, local_rank, exit_code."""
    return [
        {"rank": int(m[1]), "local_rank": int(m[2]), "exit_code": int(m[3])}
        for m in _SUMMARY.finditer(log_tail(run_dir, node, lines))
    ]


_NOT_FATAL = ("Exception ignored in", "Exception in thread")


def stderr_traceback(path: Path) -> dict | None:
    """A worker's error in its ``stderr.log`` (for scripts without ``@record``): its last Python
    traceback headed by the exception's first line, else an abort's own first error line."""
    text = read_end(path)
    lines = [_RANK_PREFIX.sub("", line) for line in text.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call")]
    # Python goes on past an exception in a thread or an atexit callback: the process's own
    # is the last traceback not headed "Exception ignored in ..." or "Exception in thread ...".
    others = [i for i, line in enumerate(lines) if line.startswith(_NOT_FATAL)]
    start = ([i for i in starts if i - 1 not in others] or starts or [None])[-1]
    said, known = first_error(text)
    if start is not None:
        block = lines[start : min([i for i in others if i > start], default=len(lines))]
        # The exception's first line: the first one after the frames not indented.
        said = next((ln for ln in block[1:] if ln.strip() and not ln[0].isspace()), said)
        if not said.rstrip().endswith((".", "?", "!", ":")) and ". " in said:
            said = said[: said.rindex(". ") + 1]  # torch wraps long messages mid-sentence
        return {"message": said.strip(), "traceback": "\n".join(block), "known": known}
    if not said:
        return None
    return {"message": said, "traceback": "", "known": known, "stack": fault_stack(lines)}


_FAULT_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+) in (\S+)')


def fault_stack(lines: list[str]) -> list[tuple[str, int, str]]:
    """The main thread's frames (outermost first) in faulthandler's dump, when one was printed:
    the thread whose outermost frame runs a module (the script)."""
    blocks, current = [], None
    for line in lines:
        if re.match(r"^(Current thread|Thread) 0x", line):
            current = []
            blocks.append(current)
        elif current is not None and (m := _FAULT_FRAME.match(line)):
            current.append((m[1], int(m[2]), m[3]))
    main = [b[::-1] for b in blocks if b and b[-1][2] == "<module>"]
    return main[0] if main else []


def positions(run_dir: Path, found: list) -> str:
    """``rank 0 in all_reduce at x.py:21 (...); rank 1 ...``: each failed rank's last line."""
    return "; ".join(
        f"rank {s.rank} in {s.waits_in or 'its script'} at {s.where()}"
        for s in rank_states(run_dir, found)
    )


def rank_states(run_dir: Path, found: list) -> list[RankState]:
    """Each failed rank (``found``: :func:`worker_errors`) where its traceback or faulthandler's
    dump left it, by rank; ranks whose frames show none of the script's lines are left out."""
    folder = str(Path(run_dir).resolve()) + "/"
    out = []
    for _, _node, rank, info in sorted(found, key=lambda e: e[2]):
        stack = info.get("stack") or [
            (m[1], int(m[2]), m[3]) for m in _FRAME.finditer(info["traceback"])
        ]
        frames = tuple(
            Frame(p[len(folder) :] if p.startswith(folder) else p, n, fn, _source(p, n), mine)
            for p, n, fn in stack
            for mine in [_mine(p, folder) and n < helpers_from(p)]
        )
        state = RankState(rank, 0, "", 0, "running", 0.0, 0, True, frames, 0.0)
        if state.mine is not None:
            out.append(state)
    return out


def _mine(path: str, folder: str) -> bool:
    """A file of the user's, in the run directory: not torch's, nor ddpnb's hooks (.ddpnb/)."""
    ours = path.startswith(folder + HOOKS_DIR + "/")  # the watch's and the check's wrappers
    return path.startswith(folder) and "site-packages" not in path and not ours


def _source(path: str, line: int) -> str:
    try:
        return Path(path).read_text(errors="replace").splitlines()[line - 1].strip()[:120]
    except (OSError, IndexError):
        return ""


def worker_errors(
    run_dir: Path, nodes: Sequence[int], nproc_per_node: int, since: float = 0.0
) -> list:
    """Failed workers' errors, root cause first: ((secondary, mtime), node, global_rank, info);
    files older than ``since`` are an earlier launch's."""
    errors = []
    for node in nodes:
        summary = {r["local_rank"]: r["rank"] for r in failed_ranks(run_dir, node)}
        for folder in (Path(run_dir) / "logs" / f"node-{node}").glob("*/attempt_*/*"):
            if not folder.name.isdigit():
                continue
            path, info = folder / "error.json", read_error_file(folder / "error.json")
            if info is None:
                path, info = folder / "stderr.log", stderr_traceback(folder / "stderr.log")
            if info is None or path.stat().st_mtime < since - 1:
                continue
            local = int(folder.name)
            rank = summary.get(local, node * nproc_per_node + local)
            info["path"], known = path, info.get("known")
            secondary = known is None and any(w in info["message"] for w in SECONDARY_ERRORS)
            errors.append(((secondary, path.stat().st_mtime), node, rank, info))
    return sorted(errors, key=lambda e: e[0])


def resume_hint(run_dir: Path) -> str:
    """How to continue, when the run has a checkpoint to continue from."""
    last = Path(run_dir) / "checkpoints" / "last.pt"
    if not last.exists():
        return ""
    done = len(load_metrics(run_dir).epochs)
    return (
        f" The checkpoint {last} holds the finished epochs ({done} recorded): relaunch "
        "with resume=True to continue from it."
    )


def _rendezvous_timeout(t: Topology, nodes: Sequence[int], how: str, end: str = "", **kw):
    """A RendezvousTimeout: ``how`` the rendezvous failed, and the nodes this launch lacks."""
    text = f"The rendezvous at {t.master_addr}:{t.master_port} {how}: not all {t.nnodes} nodes "
    text += "joined."
    if missing := [n for n in range(t.nnodes) if n not in nodes]:
        text += f" Nodes {missing} are not started by this launch: run their commands "
        text += "(ddpnb.node_commands) on their hosts."
    text += " Check that every node can reach master_addr:master_port and uses the same nnodes."
    return RendezvousTimeout(text + end, **kw)


def check_stalled(
    run_dir: Path,
    topology: Topology,
    local_nodes: Sequence[int],
    started_at: float,
    timeout_seconds: int,
    now: float | None = None,
) -> RunFailed | None:
    """RendezvousTimeout if the nodes never all joined; RunStalled if progress stopped."""
    progress = read_progress(run_dir)
    now = time.time() if now is None else now
    if not progress or progress.get("time", 0) < started_at:
        limit = topology.rdzv_timeout + GRACE_SECONDS
        if now - started_at <= limit:
            return None
        how = f"did not complete within {limit} s"
        return _rendezvous_timeout(topology, local_nodes, how, log_tail=log_tail(run_dir, 0))
    quiet = now - progress.get("time", now)
    limit = timeout_seconds + GRACE_SECONDS
    if progress.get("phase") == "done" or quiet <= limit:
        return None
    return RunStalled(
        f"Rank 0 has reported no progress for {quiet:.0f} s (limit: timeout_seconds + "
        f"{GRACE_SECONDS} = {limit} s): a node or rank stopped answering. See the node logs "
        f"in {Path(run_dir) / 'logs'}.{resume_hint(run_dir)}",
        log_tail=log_tail(run_dir, 0),
    )


def lost_node(
    run_dir: Path,
    topology: Topology,
    local_nodes: Sequence[int],
    failed: dict[int, int],
    errors: list,
    started_at: float,
) -> NodeLost | None:
    """A NodeLost when no worker failed on its own: a peer vanished under them."""
    if any(not secondary for (secondary, _), *_ in errors):
        return None
    if read_progress(run_dir).get("time", 0) < started_at:
        return None  # the nodes never all joined: a rendezvous problem, not a lost node
    killed = sorted(n for n, rc in failed.items() if rc < 0)  # agent ended by a signal
    unwatched = [n for n in range(topology.nnodes) if n not in local_nodes]
    suspects = killed or (unwatched if errors else [])
    if not suspects:
        return None
    if killed:
        sig = signal.Signals(-failed[killed[0]]).name
        what = f"Node {killed[0]} was lost: its torchrun agent was killed ({sig})"
    else:
        what = "A node or rank stopped answering (crashed, killed, or the network was cut)"
        if unwatched:
            what += f"; nodes {unwatched} run elsewhere: check them first"
    if errors:
        _, node, rank, info = errors[0]
        what += f". Worker global rank {rank} on node {node} saw: {info['message'].rstrip('.')}"
    return NodeLost(
        f"{what}. The other nodes were stopped.{resume_hint(run_dir)}",
        node_rank=suspects[0] if len(suspects) == 1 else None,
        log_tail=log_tail(run_dir, min(failed), 20),
    )


def died_after_end(
    run_dir: Path, topology: Topology, nodes: Sequence[int], since: float
) -> str | None:
    """A warning when every rank's script ended cleanly (the watch's record at exit) and the
    ranks that failed died of a signal afterwards, as the interpreter finalised; "" when not;
    None when those ranks did, and the others have not yet written their record at exit."""
    ranks = {r.rank: r for r in read_ranks(run_dir, since)}
    done = lambda rank: rank in ranks and ranks[rank].state == "ended" and ranks[rank].clean
    died = [(n, r) for n in nodes for r in failed_ranks(run_dir, n)]
    if not died or any(r["exit_code"] >= 0 or not done(r["rank"]) for _, r in died):
        return ""
    if not all(done(rank) for rank in range(topology.world_size)):
        return None  # the others may be exiting too (the launcher waits a few seconds)
    said = worker_errors(run_dir, nodes, topology.nproc_per_node, since)
    said = {rank: info["message"] for _, _, rank, info in said}
    parts = []
    for node, r in died:
        words = f" ({said[r['rank']]})" if said.get(r["rank"]) else ""
        parts.append(
            f"worker global rank {r['rank']} on node {node} was killed by "
            f"{_signal(r['exit_code'])}{words}"
        )
    return (
        f"The run finished: every rank's script ended, then {'; '.join(parts)} as its "
        "interpreter exited. Nothing of the run's output is lost. An abort at exit after "
        "destroy_process_group is a known teardown race of the process group's threads "
        "(gloo: 'terminate called without an active exception'), not a failure of the training."
    )


def _sentence(text: str) -> str:
    text = text.strip()
    return text if text.endswith((".", "?", "!")) else text + "."


def _signal(code: int) -> str:
    return signal.Signals(-code).name if -code in set(signal.Signals) else f"signal {-code}"


def _meaning(known: Known | None, run_dir: Path, errors: list) -> str:
    """What a known error means, where each rank was (a mismatch), and the fix."""
    if known is None:
        return ""
    where = positions(run_dir, errors) if known.cause == "collective_mismatch" else ""
    where = f" Where the ranks were: {where}." if where else ""
    unused = re.search(
        r"^Parameter(s| indices) which did not receive grad[^\n]*", errors[0][3]["traceback"], re.M
    )
    where += f" {_sentence(unused[0])}" if unused else ""
    return f"{where} This means {known.means}. Fix: {known.fix}."


def diagnose_failure(
    run_dir: Path,
    topology: Topology,
    local_nodes: Sequence[int],
    failed: dict[int, int],
    started_at: float,
) -> RunFailed:
    """The typed error, root cause first, for agents that exited non-zero (``failed``: node->rc)."""
    errors = worker_errors(run_dir, local_nodes, topology.nproc_per_node, started_at)
    if lost := lost_node(run_dir, topology, local_nodes, failed, errors, started_at):
        return lost
    node = min(failed)
    killed = [(n, r["rank"], r["exit_code"]) for n in local_nodes for r in failed_ranks(run_dir, n)]
    killed = [k for k in killed if k[2] < 0]  # a worker killed by a signal
    killed_first = killed and (not errors or errors[0][0][0])  # nothing but secondary errors
    if killed_first:
        node, rank, code = killed[0]
        how = f"was killed by {_signal(code)} (exit code {code}); the other ranks failed because "
        how += "it was gone."
        traceback = ""
    elif errors:
        _, node, rank, info = errors[0]
        summary = failed_ranks(run_dir, node, 200)
        code = next((r["exit_code"] for r in summary if r["rank"] == rank), None)
        traceback, line = info["traceback"], script_line(info["traceback"], run_dir)
        how = f"failed (exit code {code}){line}: {_sentence(info['message'])}"
        if code is not None and code < 0:
            how = f"was killed by {_signal(code)} (exit code {code}): {_sentence(info['message'])}"
        how += _meaning(info.get("known"), run_dir, errors)
    if killed or errors:
        known = errors[0][3].get("known") if errors and not killed_first else None
        return WorkerFailed(
            f"Worker global rank {rank} on node {node} {how} The other nodes were stopped.",
            node_rank=node,
            global_rank=rank,
            exit_code=code,
            traceback=traceback,
            log_tail=log_tail(run_dir, node) if killed_first else tail(errors[0][3]["path"]),
            cause=known.cause if known else None,
        )
    text = log_tail(run_dir, node, 200)
    joined = re.search(r"Timed out after \d+ seconds waiting for clients\. (\d+)/(\d+)", text)
    if joined or "RendezvousTimeoutError" in text:
        counted = f" ({joined.group(1)} of {joined.group(2)} nodes joined)" if joined else ""
        how = f"timed out after {topology.rdzv_timeout} s{counted}"
        kw = {"node_rank": node, "exit_code": failed[node], "log_tail": log_tail(run_dir, node, 5)}
        return _rendezvous_timeout(
            topology, local_nodes, how, " The other nodes were stopped.", **kw
        )
    first = next(iter(failed_ranks(run_dir, node, 200)), {})
    rank, exit_code = first.get("rank"), first.get("exit_code", failed[node])
    return WorkerFailed(
        f"Node {node}'s torchrun exited with code {failed[node]}"
        + (f" (worker global rank {rank}, exit code {exit_code})" if rank is not None else "")
        + ". The other nodes were stopped.",
        node_rank=node,
        global_rank=rank,
        exit_code=exit_code,
        log_tail=log_tail(run_dir, node, 40),
    )
