"""Where this rank is: a thread in the worker writes its main thread's stack every few seconds.

To ``$DDPNB_WATCH/rank-<RANK>.json``, readable while gloo or NCCL wait (they release the GIL)."""

from __future__ import annotations

import atexit
import contextlib
import functools
import json
import linecache
import math
import os
import socket
import sys
import threading
import time

DIR_ENV = "DDPNB_WATCH"  # the folder for the snapshots; unset: nothing is watched
INTERVAL_ENV = "DDPNB_WATCH_INTERVAL"  # seconds between snapshots
MAX_FRAMES = 60  # innermost frames kept
BUSY = 0.05  # share of a core the main thread used since the last snapshot: it computes
NCCL_PENDING = 8  # NCCL collectives not completed kept in a snapshot, oldest first
HOOKS_DIR = ".ddpnb"  # the run directory's folder of ddpnb's hooks (this file among them)
RUN_DIR = os.path.realpath(os.getcwd()) + os.sep  # the user's files: the working dir at start
# A line of a user's file that opens its machinery (ddpnb's worker has one): code defined below
# it is the script's helpers, not the line of its own that a rank stands at.
PART2_BANNER = "# Part 2: the machinery"

active = None  # the _Watch of this process, once the sitecustomize activated it


def activate(folder: str) -> None:
    """Watch this worker (the sitecustomize checked that it is one)."""
    global active
    os.makedirs(folder, exist_ok=True)
    active = _Watch(folder, float(os.environ.get(INTERVAL_ENV) or 2.0))
    threading.Thread(target=active.run, name="ddpnb-watch", daemon=True).start()
    atexit.register(active.end)


def install(torch) -> None:
    """Count optimizer steps (called in the main thread right after ``import torch``)."""
    if active is not None:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(active.stepped)


@functools.cache
def user_file(filename: str) -> str | None:
    """The file's path in the run directory when it is the user's (not ddpnb's), else None."""
    path = os.path.realpath(filename)
    ours = path.startswith(RUN_DIR + HOOKS_DIR + os.sep)
    ours = ours or os.path.basename(path) == "ddpnb_reporting.py"
    ok = path.startswith(RUN_DIR) and not ours and not filename.startswith("<")
    return path[len(RUN_DIR) :] if ok and "site-packages" not in path else None


@functools.cache
def helpers_from(filename: str) -> float:
    """The line of ``filename``'s PART2_BANNER (code defined below it is not the user's line);
    infinity when it has none."""
    lines = linecache.getlines(filename)
    return next((i for i, text in enumerate(lines, 1) if text.startswith(PART2_BANNER)), math.inf)


def main_stack() -> list[list]:
    """The main thread's frames, outermost first: [file, line, function, source, mine]."""
    frame = sys._current_frames().get(threading.main_thread().ident)
    out = []
    while frame is not None and len(out) < MAX_FRAMES:
        code = frame.f_code
        name = user_file(code.co_filename)
        text = linecache.getline(code.co_filename, frame.f_lineno).strip()[:120]
        mine = bool(name) and code.co_firstlineno < helpers_from(code.co_filename)
        out.append([name or code.co_filename, frame.f_lineno, code.co_name, text, mine])
        frame = frame.f_back
    return out[::-1]


def main_cpu_clock():
    """A function giving the main thread's CPU seconds (Linux), else the process's."""
    try:
        clock = time.pthread_getcpuclockid(threading.main_thread().ident)
        time.clock_gettime(clock)
        return lambda: time.clock_gettime(clock)
    except (AttributeError, OSError):  # macOS, Windows: the process's (every thread's) time
        return time.process_time


def nccl_collectives(dist) -> dict | None:
    """NCCL's flight recorder in brief; None unless the process group is NCCL's.

    NCCL's collectives are asynchronous: a rank whose partners never come sits where it next
    waits for the GPU (``loss.item()``), spinning, so its stack and CPU time say nothing. The
    recorder (``TORCH_FR_BUFFER_SIZE`` entries) says what it enqueued and what completed:
    ``groups`` {process group id: [last enqueued, last completed] sequence ids}, ``pending``
    the oldest collectives not completed ({pg, seq, p2p, op, size: elements, state, for:
    seconds since enqueued}), ``more`` how many were left off, ``pending_for`` the oldest's
    seconds. Only those not completed are read (``onlyActive``: the ring is not serialised).
    Never raises: ``{"error": ...}`` instead (the recorder off among them).
    """
    try:
        if not (dist and dist.is_available() and dist.is_initialized()):
            return None
        if "nccl" not in str(dist.get_backend()):  # "nccl", or "cpu:gloo,cuda:nccl"
            return None
        names = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")  # torch's order
        if int(next(filter(None, map(os.environ.get, names)), 0)) <= 0:
            return {"error": "the flight recorder is off (TORCH_FR_BUFFER_SIZE unset or 0)"}
        from torch._C._distributed_c10d import _dump_nccl_trace_json

        trace = json.loads(_dump_nccl_trace_json(includeCollectives=True, onlyActive=True))
        now, pending = time.time(), []
        for e in trace.get("entries") or []:  # in the order they were enqueued
            if e.get("state") == "completed" or e.get("retired"):
                continue
            p2p = bool(e.get("is_p2p"))  # send/recv: numbered apart from the collectives
            pending.append(
                {
                    "pg": str(e["pg_id"]),
                    "seq": e["p2p_seq_id"] if p2p else e["collective_seq_id"],
                    "p2p": p2p,
                    "op": e["profiling_name"],
                    "size": sum(math.prod(s) for s in e.get("input_sizes") or []),
                    "state": e["state"],  # "scheduled", or "started" (TORCH_NCCL_ENABLE_TIMING)
                    "for": round(max(0.0, now - e["time_created_ns"] / 1e9), 3),
                }
            )
        status = trace.get("pg_status") or {}
        return {
            "groups": {
                pg: [int(s["last_enqueued_collective"]), int(s["last_completed_collective"])]
                for pg, s in status.items()
            },
            "pending": pending[:NCCL_PENDING],
            "more": max(0, len(pending) - NCCL_PENDING),
            "pending_for": pending[0]["for"] if pending else 0.0,
        }
    except Exception as e:  # the watch must never stop the script
        return {"error": f"{type(e).__name__}: {e}"[:300]}


class _Watch:
    def __init__(self, folder: str, interval: float) -> None:
        self.path = os.path.join(folder, f"rank-{os.environ['RANK']}.json")
        self.interval = interval
        self.pid = os.getpid()
        self.steps = 0
        self.last: tuple | None = None  # (stack, steps) of the previous snapshot
        self.moved_at = self.busy_at = self.cpu_at = time.time()
        self.cpu = main_cpu_clock()
        self.cpu_last = self.cpu()
        self.ended = False
        self.lock = threading.Lock()
        env = lambda name: int(os.environ.get(name) or 0)
        self.about = {
            "rank": env("RANK"),
            "node": env("GROUP_RANK"),
            "world_size": env("WORLD_SIZE") or 1,
            "restart": env("TORCHELASTIC_RESTART_COUNT"),
            "host": socket.gethostname(),
            "pid": self.pid,
        }

    def stepped(self, *args) -> None:
        self.steps += 1

    def run(self) -> None:
        while not self.ended:
            time.sleep(self.interval)
            with contextlib.suppress(Exception):  # a full disk, a torn interpreter at exit
                self.write("running")

    def end(self) -> None:
        """The last record (atexit): its failure is never printed (the worker's last traceback
        in stderr must be the script's own, the one the diagnosis reads)."""
        with contextlib.suppress(Exception):
            self.write("ended", wait=5.0)  # not forever behind a snapshot stuck in NCCL

    def write(self, state: str, wait: float = -1) -> None:
        if os.getpid() != self.pid:
            return  # a forked child (a DataLoader worker) has no watch of its own
        # The thread's and the exit's writes share one temporary file: one at a time.
        if self.lock.acquire(timeout=wait):
            try:
                if not self.ended:
                    self._write(state)
            finally:
                self.lock.release()

    def _write(self, state: str) -> None:
        self.ended = state == "ended"
        now = time.time()
        stack = [] if self.ended else main_stack()
        key = ([f[:3] for f in stack], self.steps)
        if key != self.last:
            self.last, self.moved_at = key, now
        # Waiting is measured: a main thread that used CPU since the last snapshot computes.
        cpu = self.cpu()
        if cpu - self.cpu_last > BUSY * max(now - self.cpu_at, 1e-3):
            self.busy_at = now
        self.cpu_last, self.cpu_at = cpu, now
        dist = getattr(sys.modules.get("torch"), "distributed", None)
        record = {
            **self.about,
            "state": state,
            # At exit: did the script end without an uncaught exception (then any later death,
            # an abort as the interpreter finalises, comes after its work was done)?
            "clean": self.ended and getattr(sys, "last_value", None) is None,
            "time": now,
            "still": round(now - self.moved_at, 3),  # seconds without a step or a new stack
            # seconds without a step, a new stack or the main thread computing
            "idle": round(now - max(self.moved_at, self.busy_at), 3),
            "cpu": round(cpu, 3),  # the main thread's CPU seconds so far
            "steps": self.steps,
            "process_group": bool(dist and dist.is_available() and dist.is_initialized()),
            "interval": self.interval,
            "stack": stack,
            "nccl": nccl_collectives(dist),  # NCCL's own record of its collectives
        }
        tmp = f"{self.path}.{self.pid}.tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, self.path)
