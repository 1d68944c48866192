"""Watch a DDP script from inside its workers, changing neither the script nor what it computes.

Each worker's records go to ``$DDPNB_OBSERVE/rank-<RANK>.jsonl`` (JSON lines), for scriptcheck."""

from __future__ import annotations

import atexit
import contextlib
import functools
import hashlib
import inspect
import itertools
import json
import os
import sys
import threading
import time
import traceback
import zlib
from pathlib import Path

try:  # in a worker, ddpnb's hooks are top-level modules side by side (RUN_DIR/.ddpnb/)
    from ddpnb_watch import main_stack, user_file
except ImportError:  # imported from the package (ddpnb.scriptcheck reads the names below)
    from .watch import main_stack, user_file

DIR_ENV = "DDPNB_OBSERVE"  # the folder for the records; unset: nothing is observed
STEPS_ENV = "DDPNB_OBSERVE_STEPS"  # optimizer steps into the second epoch before stopping
SECONDS_ENV = "DDPNB_OBSERVE_SECONDS"  # seconds of training (from the first step) at most
TIMEOUT_ENV = "DDPNB_OBSERVE_TIMEOUT"  # seconds a worker may live at most
STOP_FILE = "stop.json"
GRACE_SECONDS = 8.0  # after a stop is requested, a rank still running is ended
EPOCH_WAIT_SECONDS = 3.0  # how long a rank that ended an epoch waits for the others to end it
MAX_INDICES = 200_000  # indices kept per pass (beyond that, only counted)
MAX_PARAM_NAMES = 20_000  # parameter names kept per DDP (the reducer's indices beyond: unnamed)
CHECKSUM_STEPS = (1, 2)
ENV_KEYS = ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK")
COLLECTIVES = ("all_reduce", "reduce", "all_gather", "all_gather_object", "gather", "gather_object")
# Every collective the ranks must call in the same order (point-to-point send/recv excepted).
ORDERED = COLLECTIVES + tuple(
    "barrier broadcast broadcast_object_list scatter scatter_object_list reduce_scatter "
    "reduce_scatter_tensor all_gather_into_tensor all_to_all all_to_all_single "
    "monitored_barrier".split()
)
MAX_SEQUENCE = 20_000  # collectives kept per rank, in order
DDP_INIT = "DDP's parameter broadcast (wrapping the model)"
DDP_BUFFERS = "DDP's buffer broadcast (forward)"
DDP_GRADIENTS = "DDP's gradient all-reduce (backward)"

active = None  # the _Observer of this process, once the sitecustomize activated it


def activate(folder: str) -> None:
    """Observe this worker (the sitecustomize checked that it is one)."""
    global active
    active = _Observer(folder)
    threading.Thread(target=active.watch, name="ddpnb-observe", daemon=True).start()
    atexit.register(active.finish, "exit")
    sys.excepthook = active.excepthook

    @_patch(type(os.environ), "__setitem__")
    def __setitem__(original, self, key, value):
        """Record the script's writes of MASTER_ADDR, RANK and the like to os.environ."""
        original(self, key, value)
        where = active.where() if self is os.environ and key in ENV_KEYS else None
        if where is not None:
            active.write({"kind": "setenv", "key": key, "value": value, "where": where})


def install(torch) -> None:
    """Hook torch once the script imported it (the sitecustomize calls this in the main thread)."""
    if active is None:
        return
    active.torch = torch
    hooks = (_hook_start, _hook_ddp, _hook_loader, _hook_sampler, _hook_steps, _hook_collectives)
    for hook in (*hooks, _hook_devices):
        try:
            hook(active, torch)
        except Exception as e:  # an older or newer torch: observe what can be observed
            active.write({"kind": "observe_error", "hook": hook.__name__, "error": repr(e)})


class _Pass:
    """One pass over a DataLoader or a DistributedSampler: what it drew and what it fed."""

    ids = itertools.count(1)
    KEYS = "source obj grad training expected n batches batch_sizes steps exhausted".split()

    def __init__(self, source: str, obj: str, grad: bool, training) -> None:
        self.id = next(_Pass.ids)
        self.source, self.obj, self.grad, self.training = source, obj, grad, training
        self.expected: int | None = None  # len(loader): the batches it holds
        self.subsets: list = []  # the index lists of the Subsets around the loader's dataset
        self.indices: list[int] = []
        self.n = self.batches = self.steps = 0
        self.batch_sizes: list[int] = []  # the smallest and largest batch
        self.exhausted = self.written = False  # written: its record is on disk

    def add(self, idx) -> None:
        batch = idx if isinstance(idx, list) else [idx]
        self.batches += 1
        self.n += len(batch)
        lo, hi = self.batch_sizes or (len(batch), len(batch))
        self.batch_sizes = [min(lo, len(batch)), max(hi, len(batch))]
        if len(self.indices) < MAX_INDICES:
            self.indices.extend(int(i) for i in batch if isinstance(i, int))

    def record(self) -> dict:
        # The indices as the loader's dataset numbers them, then as each Subset inside does.
        levels = [self.indices]
        for chosen in self.subsets:
            try:
                levels.append([int(chosen[i]) for i in levels[-1]])
            except (IndexError, TypeError):
                break
        indices = levels if self.source == "loader" else None
        fields = {k: getattr(self, k) for k in self.KEYS}
        return {"kind": "pass", "pass": self.id, **fields, "indices": indices}


def _read(path: Path, parse):
    try:
        with open(path) as f:
            return parse(f.read())
    except (OSError, ValueError):
        return None


class _Observer:
    """This worker's records, its passes, and the stop (at the step a stop file names, status 0)."""

    def __init__(self, folder: str) -> None:
        self.folder, self.rank, self.pid = Path(folder), int(os.environ["RANK"]), os.getpid()
        self.t0 = time.monotonic()
        self.lock = threading.RLock()
        self.file = open(self.folder / f"rank-{self.rank}.jsonl", "a", buffering=1)
        self.ids = {"L": itertools.count(1), "S": itertools.count(1)}
        self.open_passes: dict[str, _Pass] = {}
        self.current: _Pass | None = None  # the pass whose batches the next step trains on
        self.fetching: _Pass | None = None  # a loader pass drawing indices right now
        self.train_passes: list[int] = []  # the id of each epoch's training pass
        self.first_step = self.stop_at = self.stop_seen = None  # when; the stop; when seen
        self.steps = self.in_collective = 0  # in_collective: all_gather_object's inner calls
        self.backward_syncs = 0  # DDP forwards whose backward will all-reduce gradients
        self.finished = False
        self.ddp_modules: list = []
        self.sequence: list[list] = []  # [collective, "file:line", steps] in the order called
        # Collectives so far (init_process_group too) and a crc of their names: see met().
        self.calls = self.ops = 0
        self.previous_excepthook = sys.excepthook
        self.torch = None
        self.steps_into_second = int(os.environ.get(STEPS_ENV, "2"))
        self.train_seconds = float(os.environ.get(SECONDS_ENV, "20"))
        self.timeout = float(os.environ.get(TIMEOUT_ENV, "60"))
        env = {k: os.environ.get(k) for k in ("LOCAL_RANK", "WORLD_SIZE", "GROUP_RANK")}
        self.write({"kind": "start", "rank": self.rank, "pid": self.pid, "env": env})

    def write(self, record: dict) -> None:
        if os.getpid() != self.pid or self.finished:
            return  # a forked child (DataLoader worker) shares the hooks, not the file
        record["t"] = round(time.monotonic() - self.t0, 3)
        line = json.dumps(record, default=str)
        with self.lock:
            self.file.write(line + "\n")

    def where(self) -> dict | None:
        """The innermost frame of the user's code (the run directory's files)."""
        for frame, line in traceback.walk_stack(sys._getframe(1)):
            name = user_file(frame.f_code.co_filename)
            if name is not None:
                return {"file": name, "line": line, "func": frame.f_code.co_name}
        return None

    def made(self, kind: str, obj, names: str, **fields) -> None:
        """The record of a DataLoader or DistributedSampler: its id, line, attributes ``names``."""
        fields = {**{k: getattr(obj, k) for k in names.split()}, **fields}
        prefix = "L" if kind == "loader" else "S"
        self.write({"kind": kind, "id": self.id_of(obj, prefix), "where": self.where(), **fields})

    def id_of(self, obj, prefix: str) -> str:
        """A DataLoader's id ("L1", "L2", ...) or a DistributedSampler's ("S1", ...)."""
        if "_ddpnb_id" not in obj.__dict__:
            obj.__dict__["_ddpnb_id"] = f"{prefix}{next(self.ids[prefix])}"
        return obj.__dict__["_ddpnb_id"]

    def open_pass(self, source: str, obj_id: str) -> _Pass:
        with self.lock:
            self.pass_ended(self.open_passes.pop(obj_id, None))
            training = bool(self.ddp_modules[-1].training) if self.ddp_modules else None
            p = _Pass(source, obj_id, self.torch.is_grad_enabled(), training)
            self.open_passes[obj_id] = self.current = p
            return p

    def pass_ended(self, p: _Pass | None) -> None:
        """Write a finished pass at once: a rank that then hangs in a collective keeps it."""
        with self.lock:
            if p is not None and not p.written:
                self.write(p.record())
                p.written = True

    def train_pass_ended(self, p: _Pass) -> None:
        """Wait briefly for every rank to end this training epoch too: uneven ones would hang."""
        if p.id not in self.train_passes:
            return
        epoch = self.train_passes.index(p.id) + 1
        mine = self.folder / f"epoch-{epoch}.rank-{self.rank}"
        Path(f"{mine}.tmp").write_text(str(p.steps))
        os.replace(f"{mine}.tmp", mine)
        self.write({"kind": "epoch_end", "epoch": epoch, "steps": p.steps, "pass": p.id})
        world = int(os.environ.get("WORLD_SIZE", "1"))
        counts: dict[int, int] = {}
        deadline = time.monotonic() + EPOCH_WAIT_SECONDS
        while time.monotonic() < deadline:
            read = {r: _read(self.folder / f"epoch-{epoch}.rank-{r}", int) for r in range(world)}
            counts = {r: n for r, n in read.items() if n is not None}
            if len(counts) == world or self.read_stop() is not None:
                break
            time.sleep(0.01)
        if self.read_stop() is None and (len(counts) < world or len(set(counts.values())) > 1):
            self.write({"kind": "epoch_mismatch", "epoch": epoch, "counts": counts})
            self.request_stop(None, f"ranks' epoch {epoch} differ in length")
            self.end(f"stopped at the end of epoch {epoch}: the ranks' epochs differ in length")

    def after_step(self, optimizer) -> None:
        self.steps += 1
        n, p = self.steps, self.current
        record = {"kind": "step", "n": n, "pass": p.id if p else None}
        if p is not None:
            p.steps += 1
            if p.steps == 1:
                self.train_passes.append(p.id)
        if self.first_step is None:
            self.first_step = time.monotonic()
            record["where"] = self.where()
        if n in CHECKSUM_STEPS:
            record["params"] = self.checksum(optimizer)
        self.write(record)
        stop = self.read_stop()
        epoch = len(self.train_passes)
        done = epoch >= 3 or (epoch == 2 and p is not None and p.steps >= self.steps_into_second)
        if stop is None and (done or time.monotonic() - self.first_step > self.train_seconds):
            if done:
                why = f"{self.steps_into_second} step(s) into epoch 2, where the check stops"
            else:
                why = f"after {self.train_seconds:g} s of training, the check's time limit"
            stop = self.request_stop(n + 1, why)
        if stop is not None and (stop.get("step") is None or n >= stop["step"]):
            if n not in CHECKSUM_STEPS:
                self.write({"kind": "params", "n": n, "params": self.checksum(optimizer)})
            self.end(f"stopped after optimizer step {n} ({stop['reason']})")

    def read_stop(self) -> dict | None:
        if self.stop_at is None:
            self.stop_at = _read(self.folder / STOP_FILE, json.loads)
        return self.stop_at

    def request_stop(self, step: int | None, reason: str) -> dict:
        """Ask every rank to stop after optimizer step ``step`` (None: at once); first ask wins."""
        tmp = self.folder / f".stop-{self.rank}.tmp"
        tmp.write_text(json.dumps({"step": step, "reason": reason, "rank": self.rank}))
        with contextlib.suppress(FileExistsError):
            os.link(tmp, self.folder / STOP_FILE)  # atomic, and only once
        tmp.unlink()
        self.stop_at = None
        return self.read_stop()

    def end(self, reason: str) -> None:
        """Write what is pending and leave now, with status 0 (the check ended the script)."""
        self.finish(reason)
        os._exit(0)

    def called(self, collective: str, where: dict | None) -> None:
        """One collective this rank called (or DDP called for it), in order."""
        self.met(collective)
        if len(self.sequence) < MAX_SEQUENCE:
            at = f"{where['file']}:{where['line']}" if where else None
            self.sequence.append([collective, at, self.steps])

    def met(self, call: str) -> None:
        """A call every rank makes (a collective, init_process_group): a file one rank wrote
        before it is there for a rank that reads after it (the file records carry the count)."""
        self.calls += 1
        self.ops = zlib.crc32(call.encode(), self.ops)

    def finish(self, reason: str) -> None:
        with self.lock:
            if self.finished or os.getpid() != self.pid:
                return
            for p in self.open_passes.values():
                self.pass_ended(p)
            full = len(self.sequence) >= MAX_SEQUENCE
            self.write({"kind": "collectives", "calls": self.sequence, "truncated": full})
            self.write({"kind": "end", "reason": reason, "steps": self.steps})
            self.finished = True
            self.file.flush()

    def watch(self) -> None:
        """End this rank when a stop was asked and it did not get there (a blocked collective)."""
        while not self.finished:
            time.sleep(0.2)
            now = time.monotonic()
            if self.stop_seen is None and now - self.t0 > self.timeout:
                self.request_stop(None, f"time bound of {self.timeout:g} s")
            if self.stop_seen is None and (self.folder / STOP_FILE).exists():
                self.stop_seen = now
            if self.stop_seen is not None and now - self.stop_seen > GRACE_SECONDS:
                self.write({"kind": "blocked", "stack": main_stack(), "steps": self.steps})
                self.end("ended by the check's watchdog (another rank had stopped)")

    def excepthook(self, kind, value, tb) -> None:
        if (self.folder / STOP_FILE).exists():
            self.end(f"ended after a peer stopped ({kind.__name__})")  # its peer left
        self.write({"kind": "exception", "type": kind.__name__, "message": str(value)[:2000]})
        self.finish("exception")
        self.previous_excepthook(kind, value, tb)

    def checksum(self, optimizer) -> str:
        params = [p for g in optimizer.param_groups for p in g["params"]]
        digest = hashlib.sha256()
        try:
            for param in params:
                t = param.detach().reshape(-1).cpu().contiguous()
                digest.update(t.view(self.torch.uint8).numpy().tobytes())
        except Exception:  # no numpy, an exotic tensor: sums are still telling
            return "sum:" + repr([float(p.detach().double().sum()) for p in params])
        return digest.hexdigest()[:16]


def _patch(owner, name: str):
    """Decorator: ``owner.name(...)`` becomes ``hook(original, ...)`` (once per process)."""

    def decorate(hook):
        original = getattr(owner, name)
        if not getattr(original, "_ddpnb", False):
            wrapper = functools.wraps(original)(lambda *a, **kw: hook(original, *a, **kw))
            wrapper._ddpnb = True
            setattr(owner, name, wrapper)
        return hook

    return decorate


def _len(obj) -> int | None:
    try:
        return len(obj)
    except Exception:
        return None


def _hook_start(obs: _Observer, torch) -> None:
    """How the ranks start: init_process_group's arguments, and mp.spawn under torchrun."""
    import torch.distributed.distributed_c10d as c10d
    import torch.multiprocessing as mp

    signature = inspect.signature(c10d.init_process_group)

    @_patch(c10d, "init_process_group")
    def init_process_group(original, *args, **kwargs):
        try:
            bound = signature.bind_partial(*args, **kwargs).arguments
        except TypeError:
            bound = {}
        given = {k: bound.get(k) for k in ("rank", "world_size") if bound.get(k) not in (None, -1)}
        env = {k: os.environ.get(k) for k in ENV_KEYS}
        fields = {"backend": str(bound.get("backend")), "init_method": bound.get("init_method")}
        fields.update(store=bound.get("store") is not None, rank=None, world_size=None, env=env)
        obs.write({"kind": "init", "where": obs.where(), **fields, **given})
        if any(str(v) != env[k.upper()] for k, v in given.items()):
            # Ranks that disagree with torchrun's never meet: stop instead of hanging.
            obs.request_stop(None, "rank or world_size differs from torchrun's")
            obs.end("stopped at init_process_group: rank or world_size is not torchrun's")
        try:
            return original(*args, **kwargs)
        finally:
            obs.met("init_process_group")

    torch.distributed.init_process_group = c10d.init_process_group

    def spawn(original, *args, **kwargs):  # under torchrun every rank would start ranks of its own
        call = f"torch.multiprocessing.{original.__name__}"
        obs.write({"kind": "spawn", "call": call, "where": obs.where()})
        obs.request_stop(None, "the script calls torch.multiprocessing.spawn under torchrun")
        obs.end(f"stopped at {call}: the script starts ranks of its own")

    for name in ("spawn", "start_processes"):
        _patch(mp, name)(spawn)


def _reducer_names(ddp) -> list[str] | None:
    """The names of the parameters DDP's reducer holds, in its order: the indices in its
    "Parameter indices which did not receive grad" are positions in this list. As torch's
    DDP._build_params_for_reducer: named_modules, then each module's own parameters that
    require grad and are not in parameters_to_ignore, the first of shared ones kept."""
    try:
        ignore, seen, names = getattr(ddp, "parameters_to_ignore", ()), set(), []
        for module_name, module in ddp.module.named_modules():
            for name, p in module.named_parameters(recurse=False):
                if p.requires_grad and f"{module_name}.{name}" not in ignore and id(p) not in seen:
                    seen.add(id(p))
                    names.append(f"{module_name}.{name}".lstrip("."))
        return names[:MAX_PARAM_NAMES]
    except Exception:  # a DDP of another torch: the finding then gives indices only
        return None


def _hook_ddp(obs: _Observer, torch) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    @_patch(DDP, "__init__")
    def __init__(original, self, module, *args, **kwargs):
        obs.called(DDP_INIT, obs.where())
        original(self, module, *args, **kwargs)
        obs.ddp_modules.append(self)
        ids = getattr(self, "device_ids", None)
        params = _reducer_names(self)
        obs.write({"kind": "ddp", "where": obs.where(), "device_ids": ids, "params": params})
        for i in ids or ():
            obs.write({"kind": "device", "call": "DDP(device_ids=...)", "index": int(i)})

    @_patch(DDP, "forward")
    def forward(original, self, *args, **kwargs):
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            obs.backward_syncs += 1  # the next backward all-reduces this forward's gradients
        return original(self, *args, **kwargs)

    @_patch(DDP, "_sync_buffers")
    def _sync_buffers(original, *args, **kwargs):
        obs.called(DDP_BUFFERS, obs.where())
        return original(*args, **kwargs)

    @_patch(torch.autograd, "backward")
    def backward(original, *args, **kwargs):
        if obs.backward_syncs:
            obs.backward_syncs = 0
            obs.called(DDP_GRADIENTS, obs.where())
        return original(*args, **kwargs)


def _hook_loader(obs: _Observer, torch) -> None:
    """DataLoaders, and each pass: the indices it draws, and its end as its consumer sees it."""
    from torch.utils.data import DataLoader, Subset
    from torch.utils.data import dataloader as dl

    @_patch(DataLoader, "__init__")
    def __init__(original, self, *args, **kwargs):
        original(self, *args, **kwargs)
        dataset, chosen, layers = self.dataset, [], []
        while isinstance(dataset, Subset):  # each level's index list (outside in), size, identity
            digest = hashlib.sha256(",".join(map(str, dataset.indices)).encode()).hexdigest()[:12]
            layers.append({"len": len(dataset.indices), "id": digest})
            chosen.append(dataset.indices)
            dataset = dataset.dataset
        layers.append({"len": _len(dataset), "id": type(dataset).__name__})
        self.__dict__["_ddpnb_subsets"] = chosen
        sampler = getattr(self, "sampler", None)
        obs.made(
            "loader",
            self,
            "batch_size drop_last",
            sampler=type(sampler).__name__,
            sampler_id=getattr(sampler, "__dict__", {}).get("_ddpnb_id"),
            dataset_len=_len(self.dataset),
            iterable=isinstance(self.dataset, torch.utils.data.IterableDataset),
            layers=layers,
        )

    @_patch(DataLoader, "__iter__")
    def __iter__(original, self):
        p = obs.open_pass("loader", obs.id_of(self, "L"))
        p.subsets = self.__dict__.get("_ddpnb_subsets", [])
        p.expected = _len(self)
        obs.fetching = p  # a multi-process iterator draws its first indices in here
        try:
            it = original(self)
        finally:
            obs.fetching = None
        it.__dict__["_ddpnb_pass"] = p
        return it

    @_patch(dl._BaseDataLoaderIter, "_next_index")
    def _next_index(original, self):
        p = self.__dict__.get("_ddpnb_pass") or obs.fetching
        previous, obs.fetching = obs.fetching, p
        try:
            idx = original(self)
        except StopIteration:
            if p is not None:
                p.exhausted = True
            raise
        finally:
            obs.fetching = previous
        if p is not None:
            p.add(idx)
            obs.current = p
        return idx

    @_patch(dl._BaseDataLoaderIter, "__next__")
    def __next__(original, self):
        try:
            return original(self)
        except StopIteration:
            p = self.__dict__.get("_ddpnb_pass")
            if p is not None and p.exhausted:
                obs.pass_ended(p)  # its steps are final: the consumer has seen the end
            if p is not None and p.steps:
                obs.train_pass_ended(p)
            raise


def _hook_sampler(obs: _Observer, torch) -> None:
    from torch.utils.data import DistributedSampler

    @_patch(DistributedSampler, "__init__")
    def __init__(original, self, dataset, *args, **kwargs):
        original(self, dataset, *args, **kwargs)
        names = "num_replicas rank shuffle drop_last"
        obs.made("sampler", self, names, dataset_len=_len(dataset))

    @_patch(DistributedSampler, "__iter__")
    def __iter__(original, self):
        indices = list(original(self))
        obj_id = obs.id_of(self, "S")
        inner = obs.fetching  # drawn by a DataLoader pass, or iterated by the script
        p = None if inner is not None else obs.open_pass("sampler", obj_id)
        obs.write(
            {
                "kind": "sampler_pass",
                "sampler": obj_id,
                "epoch": getattr(self, "epoch", None),
                "loader_pass": inner.id if inner is not None else None,
                "pass": p.id if p is not None else None,
                "indices": [int(i) for i in indices[:MAX_INDICES]],
                "n": len(indices),
            }
        )
        if p is not None:
            p.n, p.exhausted = len(indices), True
        return iter(indices)

    @_patch(DistributedSampler, "set_epoch")
    def set_epoch(original, self, epoch):
        obj_id = self.__dict__.get("_ddpnb_id")
        obs.write({"kind": "set_epoch", "sampler": obj_id, "epoch": epoch, "where": obs.where()})
        return original(self, epoch)


def _hook_steps(obs: _Observer, torch) -> None:
    """Optimizers made, each step, and the files torch.save writes and torch.load reads."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    @_patch(torch.optim.Optimizer, "__init__")
    def __init__(original, self, *args, **kwargs):
        original(self, *args, **kwargs)
        obs.write({"kind": "optimizer", "type": type(self).__name__, "where": obs.where()})

    register_optimizer_step_post_hook(lambda optimizer, args, kwargs: obs.after_step(optimizer))

    def file_io(kind: str, f) -> None:
        """A torch.save or torch.load: its file, its line, and how many collectives came before
        (a rank's read is ordered after another's write only by a collective between them)."""
        path = os.fspath(f) if isinstance(f, (str, os.PathLike)) else getattr(f, "name", None)
        path = os.path.abspath(path) if isinstance(path, str) else None
        obs.write({"kind": kind, "path": path, "where": obs.where(), "met": [obs.calls, obs.ops]})

    @_patch(torch.serialization, "save")
    def save(original, obj, f, *args, **kwargs):
        file_io("save", f)
        return original(obj, f, *args, **kwargs)

    @_patch(torch.serialization, "load")
    def load(original, f, *args, **kwargs):
        file_io("load", f)
        return original(f, *args, **kwargs)

    torch.save, torch.load = torch.serialization.save, torch.serialization.load


def _hook_collectives(obs: _Observer, torch) -> None:
    """The script's own collectives: each call in order, and once per call site and pass."""
    import torch.distributed as dist

    seen: set = set()

    def collective(original, *args, **kwargs):
        name = original.__name__
        if obs.in_collective:  # called by another collective (all_gather_object)
            return original(*args, **kwargs)
        where = obs.where()
        obs.called(name, where)
        key = (name, str(where), obs.current.id if obs.current else None)
        if where is not None and key not in seen and name in COLLECTIVES:
            seen.add(key)
            obs.write({"kind": "collective", "op": name, "where": where, "pass": key[2]})
        obs.in_collective += 1
        try:
            return original(*args, **kwargs)
        finally:
            obs.in_collective -= 1

    for name in ORDERED:
        if hasattr(dist, name):
            _patch(dist, name)(collective)


def _hook_devices(obs: _Observer, torch) -> None:
    """CUDA device choices: the index asked for, beside LOCAL_RANK and RANK."""

    def note(call: str, device) -> None:
        try:
            d = torch.device("cuda", device) if isinstance(device, int) else torch.device(device)
        except Exception:
            return
        if d.type == "cuda" and d.index is not None:
            obs.write({"kind": "device", "call": call, "index": d.index, "where": obs.where()})

    @_patch(torch.cuda, "set_device")
    def set_device(original, device):
        note("torch.cuda.set_device", device)
        return original(device)

    @_patch(torch.nn.Module, "to")
    def to(original, self, *args, **kwargs):
        try:
            note("Module.to", torch._C._nn._parse_to(*args, **kwargs)[0])
        except Exception:  # the original call reports bad arguments itself
            pass
        return original(self, *args, **kwargs)
