"""From a run's files and its agents' exit codes to a typed error: which node, which rank, why."""

from __future__ import annotations

import re
import signal
import time
from collections.abc import Sequence
from pathlib import Path

from .errors import NodeLost, RendezvousTimeout, RunFailed, RunStalled, WorkerFailed
from .metrics import load_metrics, read_json, read_progress
from .topology import Topology

SECONDARY_ERRORS = (  # messages of ranks that failed only because a peer died first
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
    "Timed out waiting",  # gloo: a peer did not answer within timeout_seconds
    "this node is lost",  # the worker of a killed agent stopping itself
)
GRACE_SECONDS = 30  # seconds past its own limits before a silent run is called stuck


def tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a text file ("" when it cannot be read)."""
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def log_tail(run_dir: Path, node: int, lines: int = 20) -> str:
    """The last ``lines`` lines of a node's log in ``run_dir/logs``."""
    return tail(Path(run_dir) / "logs" / f"node-{node}.log", lines)


def read_error_file(path: Path) -> dict | None:
    """torchrun's ``error.json`` (written by ``@record``) as its message and traceback."""
    msg = read_json(path).get("message")
    if isinstance(msg, str):
        return {"message": msg, "traceback": ""}
    if not isinstance(msg, dict):
        return None
    traceback = msg.get("extraInfo", {}).get("py_callstack", "")
    return {"message": msg.get("message", "").strip(), "traceback": traceback}


_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (\S+)$', re.M)


def script_line(traceback: str, run_dir: Path) -> str:
    """`` at train.py:12 in step`` for the traceback's innermost frame of the script's files."""
    frames = [m for m in _FRAME.finditer(traceback) if "site-packages" not in m.group(1)]
    folder = str(Path(run_dir).resolve()) + "/"
    mine = [m for m in frames if m.group(1).startswith(folder)] or frames
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


def stderr_traceback(path: Path) -> dict | None:
    """A worker's last traceback in its ``stderr.log`` (for scripts without ``@record``)."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return None
    lines = [re.sub(r"^\[rank\d+\]:\s?", "", line) for line in text.splitlines()]
    starts = [i for i, line in enumerate(lines) if line.startswith("Traceback (most recent call")]
    if not starts:
        return None
    block = lines[starts[-1] :]
    message = next((line for line in reversed(block) if line.strip()), "")
    return {"message": message.strip(), "traceback": "\n".join(block)}


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
            secondary = any(w in info["message"] for w in SECONDARY_ERRORS)
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
    if killed and (not errors or errors[0][0][0]):  # nothing but secondary errors
        node, rank, code = killed[0]
        name = signal.Signals(-code).name if -code in set(signal.Signals) else f"signal {-code}"
        how = f"was killed by {name} (exit code {code}); the other ranks failed because it was gone"
        traceback = ""
    elif errors:
        _, node, rank, info = errors[0]
        summary = failed_ranks(run_dir, node, 200)
        code = next((r["exit_code"] for r in summary if r["rank"] == rank), None)
        traceback, line = info["traceback"], script_line(info["traceback"], run_dir)
        how = f"failed (exit code {code}){line}: {info['message']}"
    if killed or errors:
        return WorkerFailed(
            f"Worker global rank {rank} on node {node} {how}. The other nodes were stopped.",
            node_rank=node,
            global_rank=rank,
            exit_code=code,
            traceback=traceback,
            log_tail=log_tail(run_dir, node),
        )
    tail = log_tail(run_dir, node, 200)
    joined = re.search(r"Timed out after \d+ seconds waiting for clients\. (\d+)/(\d+)", tail)
    if joined or "RendezvousTimeoutError" in tail:
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
