"""The GPU path in one command: does ddpnb's worker train on CUDA, and how fast is it?

Run where a GPU is lent (``make gpu-check``; on a machine with torch but without this
project's venv, or without network, ``python3 bench/gpu_check.py`` from the repo root:
nothing needs installing, the repo is put on ``sys.path``)::

    python3 bench/gpu_check.py [--quick] [--record] [--only a|ab|d]

Sized for under 5 minutes on one H200 with 16 cores, no network (about 3, by estimate:
it has never run on a GPU yet), and step (d) under 2 more. Four steps:

a. Correctness. ``ddpnb.launch`` of the real worker, 1 node x every GPU, backend
   ``auto`` (nccl), bf16 autocast, on (1) a generated ImageFolder of JPEGs with
   channels_last and two DataLoader workers, and (2) the digits (``prepare_digits``) at
   32 px. Asserted: every validation image counted
   exactly once, finite losses, nccl on cuda, a checkpoint written, and a resume with
   one more epoch that continues from it (one new epoch, each epoch recorded once,
   the earlier epochs unchanged).
b. Speed. The worker at resnet50, 224 px, bf16, channels_last, per-GPU batch 256,
   through the worker's DataLoader (synthetic JPEGs, decoded every epoch by the
   config's ``num_workers``, ``augment="none"``):
   images/s per GPU (the ranks' own ``images_per_second``, first epoch skipped) and
   achieved TFLOP/s against the chip's bf16 dense peak; then ``bench/gpu.py``'s bare
   loop with the same settings, in its own process, and worker / bare loop (target
   >= 0.95). The bare loop also runs without cudnn.benchmark, which the worker does
   not set today, so the share of any gap that this setting explains is printed.
c. Scaling, with more than one GPU: per-GPU images/s at all GPUs over one GPU, at
   the same per-GPU batch (target >= 0.90).
d. A hang on NCCL (``bench/nccl_hang.py``, the hang watch on). One rank reads its flight
   recorder the watch's way (``ddpnb.watch.nccl_collectives``): a completed all_reduce
   reads as completed, one held behind a GPU sleep as pending, and a read with the ring
   full is timed (asserted). With 2 GPUs or more, two 2-rank runs: rank 0 alone calls
   ``dist.barrier()``, and rank 0 trains one step more than rank 1; for each, whether
   and how many seconds after the mistake the flight recorder's path
   (``ddpnb.hang.nccl_waits``, limit 10 s) names the hang, whether the Python-stack path
   does, and what NCCL did with the lone barrier (paired with rank 1's next all-reduce,
   or hung). With one GPU it says the 2-rank runs need 2 GPUs and were not run.

One summary line per figure (``gpu-check:``). No time is asserted; ``--record`` appends
a dated section with the summary lines to ``bench/results.md``.

Exit codes: 0 every step-(a) and step-(d) assertion held (the figures are printed, not
judged); 1 an assertion failed or a run failed; 77 no CUDA device, nothing was checked
(77 is the usual "skipped" code, so a caller can tell "passed" from "not run").

``--allow-cpu`` (hidden) runs the same code on the CPU with gloo at tiny sizes (step a: the
JPEG folder's config), so the script is known to work before a GPU is ever lent; its
figures mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

import ddpnb  # noqa: E402

EXIT_OK, EXIT_FAILED, EXIT_NO_CUDA = 0, 1, 77
NO_CUDA_MESSAGE = "no CUDA device: nothing to check; run this where a GPU is lent"
H200_BF16_DENSE_TFLOPS = 989.0
TARGET_VS_BARE = 0.95
TARGET_SCALING = 0.90
# Per class: 7 or 6 validation images, 67 in all: a prime, so padded shards at any
# GPU count would show up in the counts.
VAL_COUNTS = [7] * 7 + [6] * 3


class CheckFailed(AssertionError):
    """A step-(a) assertion that did not hold (raised, never stripped by ``python -O``)."""


def check(ok: bool, message: str) -> None:
    if not ok:
        raise CheckFailed(message)


def say(line: str) -> None:
    print(line, flush=True)


# -- data -----------------------------------------------------------------------------


def make_jpeg_folder(
    root: Path,
    *,
    size: int,
    train_per_class: int,
    val_counts: list[int],
    distinct_per_class: int = 8,
    seed: int = 0,
) -> Path:
    """A 10-class ImageFolder of colour JPEGs, each class its own hue and pattern.

    ``distinct_per_class`` images are encoded per class and their bytes written again
    for the others, so thousands of 224 px files take seconds; decoding costs the same.

    Example
    -------
    >>> root = make_jpeg_folder(Path("/tmp/j"), size=64, train_per_class=24, val_counts=VAL_COUNTS)  # doctest: +SKIP
    """
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / size
    for c in range(len(val_counts)):
        hue = np.array([np.cos(c), np.cos(c + 2.1), np.cos(c + 4.2)], dtype=np.float32)
        encoded = []
        for _ in range(distinct_per_class):
            wave = np.sin((xx * (c + 1) + yy * (10 - c)) * 2 * np.pi + rng.uniform(0, 6.3))
            img = 128 + 60 * wave[..., None] * hue + rng.normal(0, 20, (size, size, 3))
            buf = io.BytesIO()
            Image.fromarray(img.clip(0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
            encoded.append(buf.getvalue())
        for split, count in (("train", train_per_class), ("val", val_counts[c])):
            d = root / split / f"class{c}"
            d.mkdir(parents=True, exist_ok=True)
            for i in range(count):
                (d / f"{i:05d}.jpg").write_bytes(encoded[i % len(encoded)])
    ddpnb.inspect_dataset(root, show=False)  # the manifest, once
    return root


# -- step a: the worker launches, trains, checkpoints and resumes ---------------------


def read_run(run_dir: Path) -> tuple[list[dict], dict[int, list[dict]], dict]:
    m = ddpnb.load_metrics(run_dir)
    return m.epochs, m.ranks, m.effective


def check_epochs(run_dir: Path, epochs: int, nproc: int, n_val: int, cuda: bool) -> list[dict]:
    """Assert what one finished run wrote; return its metrics rows."""
    rows, ranks, effective = read_run(run_dir)
    recorded = [r["epoch"] for r in rows]
    check(
        recorded == list(range(1, epochs + 1)),
        f"{run_dir}: epochs recorded {recorded}, expected 1..{epochs} once each",
    )
    for r in rows:
        check(
            r["val_samples"] == n_val,
            f"{run_dir} epoch {r['epoch']}: val_samples {r['val_samples']}, expected {n_val}",
        )
        for key in ("train_loss", "val_loss"):
            check(math.isfinite(r[key]), f"{run_dir} epoch {r['epoch']}: {key} is {r[key]}")
        check(r["world_size"] == nproc, f"{run_dir}: world_size {r['world_size']} != {nproc}")
    check(sorted(ranks) == list(range(nproc)), f"{run_dir}: rank files {sorted(ranks)}")
    last = [recs[-1] for recs in ranks.values()]
    per_rank = sum(rec["val_samples"] for rec in last)
    check(per_rank == n_val, f"{run_dir}: per-rank val_samples add up to {per_rank}, not {n_val}")
    check(len({rec["param_checksum"] for rec in last}) == 1, f"{run_dir}: ranks' models differ")
    check((run_dir / "checkpoints" / "last.pt").is_file(), f"{run_dir}: no checkpoints/last.pt")
    # backend "auto": nccl on CUDA (torchrun sets RANK, so one process joins a group too)
    backend, device = effective.get("backend"), str(effective.get("device", ""))
    expected = ("nccl", "cuda") if cuda else ("gloo", "cpu")
    check(backend == expected[0], f"{run_dir}: backend {backend!r}, expected {expected[0]}")
    check(device.startswith(expected[1]), f"{run_dir}: device {device!r}, expected {expected[1]}")
    return rows


def launch_and_resume(
    cfg: ddpnb.TrainConfig, run_dir: Path, nproc: int, n_val: int, cuda: bool
) -> str:
    """Launch ``cfg``, check it, resume it for one more epoch, check again; one summary."""
    t0 = time.perf_counter()
    ddpnb.launch(cfg, run_dir, nnodes=1, nproc_per_node=nproc, progress="none")
    first = check_epochs(run_dir, cfg.epochs, nproc, n_val, cuda)
    mtime = (run_dir / "checkpoints" / "last.pt").stat().st_mtime_ns
    more = cfg.replace(epochs=cfg.epochs + 1)
    ddpnb.launch(more, run_dir, nnodes=1, nproc_per_node=nproc, progress="none", resume=True)
    rows = check_epochs(run_dir, more.epochs, nproc, n_val, cuda)
    check(rows[: cfg.epochs] == first, f"{run_dir}: the resumed run rewrote earlier epochs")
    log = (run_dir / "logs" / "node-0.log").read_text(errors="replace")
    # (Rows equal to the first launch's, timings included, already rule out a fresh start.)
    check("resum" in log.lower(), f"{run_dir}: node-0.log does not mention the resume")
    check(
        (run_dir / "checkpoints" / "last.pt").stat().st_mtime_ns != mtime,
        f"{run_dir}: the resumed run did not write a new checkpoint",
    )
    _, _, eff = read_run(run_dir)
    return (
        f"{eff.get('backend')} {nproc}x{cfg.model} {cfg.image_size}px "
        f"amp={cfg.amp} channels_last={cfg.channels_last} on {eff.get('device')}: "
        f"val_samples {rows[-1]['val_samples']}/{n_val} every epoch, losses finite, "
        f"checkpoint written, resumed {cfg.epochs}->{more.epochs} "
        f"(val_acc {rows[-1]['val_acc']:.3f}, {time.perf_counter() - t0:.0f} s)"
    )


def correctness_configs(
    work: Path, *, cuda: bool, quick: bool
) -> list[tuple[str, ddpnb.TrainConfig, int]]:
    """(name, config, number of val images) for step (a): JPEGs (channels_last) and digits."""
    jpeg_size = 64 if cuda and not quick else 16
    jpegs = make_jpeg_folder(
        work / "jpegs", size=jpeg_size, train_per_class=24, val_counts=VAL_COUNTS
    )
    digits = ddpnb.prepare_digits(work / "digits", image_size=32 if cuda else 16)
    n_digits_val = ddpnb.inspect_dataset(digits, show=False).split_size("val")
    common = dict(
        model="resnet18",
        epochs=1,
        amp=True,
        backend="auto",
        lr=0.05,
        timeout_seconds=120,
        max_steps_per_epoch=None if cuda else 3,
    )
    return [
        (
            "jpeg-folder",
            ddpnb.TrainConfig(
                data_dir=str(jpegs),
                image_size=jpeg_size,
                batch_size=16,
                channels_last=True,
                num_workers=2,
                **common,
            ),
            sum(VAL_COUNTS),
        ),
        (
            "digits",
            ddpnb.TrainConfig(
                data_dir=str(digits),
                image_size=32 if cuda else 16,
                batch_size=64 if cuda else 16,
                **common,
            ),
            n_digits_val,
        ),
    ]


# -- step b and c: the worker's speed against the bare loop ---------------------------


def speed_sizes(cuda: bool, quick: bool) -> dict:
    if not cuda:  # --allow-cpu: the same code at toy sizes; the figures mean nothing
        return dict(model="resnet18", image_size=32, batch=8, steps=3, epochs=2)
    if quick:
        return dict(model="resnet50", image_size=224, batch=256, steps=8, epochs=2)
    return dict(model="resnet50", image_size=224, batch=256, steps=20, epochs=3)


def worker_speed(data: Path, work: Path, nproc: int, sizes: dict, cuda: bool) -> dict:
    """Run the worker at ``nproc`` GPUs; its per-GPU images/s (first epoch skipped)."""
    cfg = ddpnb.TrainConfig(
        data_dir=str(data),
        model=sizes["model"],
        image_size=sizes["image_size"],
        batch_size=sizes["batch"],
        epochs=sizes["epochs"],
        max_steps_per_epoch=sizes["steps"],
        amp=True,
        channels_last=True,
        augment="none",  # the bare loop has none: the ratio measures what the worker adds
        backend="auto",
        lr_schedule="constant",
        checkpoint_every=1000,  # one checkpoint, after the last epoch
        timeout_seconds=600,
    )
    run_dir = work / f"speed-{nproc}"
    t0 = time.perf_counter()
    ddpnb.launch(cfg, run_dir, nnodes=1, nproc_per_node=nproc, progress="none", overwrite=True)
    rows, ranks, _ = read_run(run_dir)
    per_rank = [
        statistics.median(rec["images_per_second"] for rec in recs[1:]) for recs in ranks.values()
    ]
    steps = [rec["train_samples"] // sizes["batch"] for rec in ranks[0][1:]]
    return {
        "nproc": nproc,
        "images_per_second_per_gpu": statistics.mean(per_rank),
        "slowest_rank": min(per_rank),
        "steps_timed": sum(steps),
        # On CUDA this also holds the stream syncs that pageable host copies cause.
        "data_wait_share": statistics.mean(
            rec.get("data_wait_seconds", math.nan) / rec["train_seconds"] for rec in ranks[0][1:]
        ),
        "wall_seconds": time.perf_counter() - t0,
    }


def bare_speed(
    sizes: dict, num_classes: int, cudnn_benchmark: bool, cuda: bool, peak: float
) -> dict:
    """bench/gpu.py's loop with the worker's settings, in a fresh process (its own GPU memory)."""
    cmd = [
        sys.executable,
        str(HERE / "gpu.py"),
        f"--model={sizes['model']}",
        f"--batch={sizes['batch']}",
        f"--image-size={sizes['image_size']}",
        f"--num-classes={num_classes}",
        f"--steps={sizes['steps'] * (sizes['epochs'] - 1)}",  # as many steps as the worker timed
        f"--warmup={max(2, sizes['steps'] // 2)}",
        f"--peak-tflops={peak}",
        f"--device={'cuda' if cuda else 'cpu'}",
    ]
    if not cudnn_benchmark:
        cmd.append("--no-cudnn-benchmark")
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if out.returncode:
        raise RuntimeError(f"bench/gpu.py failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads([ln for ln in out.stdout.splitlines() if ln.startswith("{")][-1])


# -- step d: a hang on NCCL, named by the flight recorder ---------------------------------

HANG_SCRIPT = HERE / "nccl_hang.py"
HANG_LIMIT = 10.0  # seconds a collective stays pending before the recorder's path calls it a wait
HANG_PG_TIMEOUT = 60  # the scripts' process-group timeout: NCCL's watchdog ends what is missed
HANG_START_SECONDS = 90.0  # a 2-rank run that has not reached its mistake by then is stopped
HANG_RUN_SECONDS = 25.0  # and one that has, this long after the mistake, named or not
HANG_GRACE = 6.0  # once the recorder named it, how long the stack path may still name it
HANG_MODES = {
    "barrier": ("lone barrier", "d lone barrier"),
    "uneven": ("extra step", "d uneven steps"),
}


def read_events(run_dir: Path) -> list[dict]:
    """What the ranks of nccl_hang.py noted (events-<rank>.jsonl), in time order."""
    out = []
    for path in sorted(run_dir.glob("events-*.jsonl")):
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return sorted(out, key=lambda e: e["time"])


def nccl_summaries(run_dir: Path) -> dict[int, dict | None]:
    """Each rank's latest snapshot's ``"nccl"`` (``ddpnb.watch.nccl_collectives``)."""
    from ddpnb.hang import WATCH_DIR
    from ddpnb.metrics import read_json

    records = [read_json(p) for p in (run_dir / WATCH_DIR).glob("rank-*.json")]
    return {r["rank"]: r.get("nccl") for r in records if r}


def launch_hang_script(work: Path, mode: str, backend: str, nproc: int, wait: bool):
    script = ddpnb.Script(str(HANG_SCRIPT), args=[mode, backend, str(HANG_PG_TIMEOUT)])
    return ddpnb.launch(
        script,
        work / f"hang-{mode}",
        nnodes=1,
        nproc_per_node=nproc,
        wait=wait,
        overwrite=True,
        progress="none",
        hang_timeout=HANG_LIMIT,
        on_hang="wait",  # ddpnb's verdict is read, the run kept, until both paths had their say
        env={"DDPNB_WATCH_INTERVAL": "0.5"},
    )


def hang_run(work: Path, mode: str, backend: str) -> dict:
    """Run nccl_hang.py ``mode`` on 2 ranks; when the recorder, and the stack path, named it."""
    from ddpnb.errors import RunFailed
    from ddpnb.hang import nccl_waits

    t0 = time.time()
    job = launch_hang_script(work, mode, backend, 2, wait=False)
    seen: dict = {"recorder": None, "stack": None, "ended": None, "ended_at": None, "last": None}
    seen["stop_at"] = t0 + HANG_START_SECONDS
    mistake = HANG_MODES[mode][0]
    try:
        while time.time() < seen["stop_at"]:
            if start := next((e for e in read_events(job.run_dir) if e["what"] == mistake), None):
                seen["stop_at"] = start["time"] + HANG_RUN_SECONDS
            try:
                job.wait(timeout=0.5)
                seen["ended"], seen["ended_at"] = "the run finished (exit 0)", time.time()
                break
            except TimeoutError:
                pass
            except RunFailed as e:  # NCCL's watchdog, or a crash
                seen["ended"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                seen["ended_at"] = time.time()
                break
            now = time.time()
            if seen["stack"] is None and job.waiting is not None and job.waiting.kind == "hang":
                seen["stack"] = (now, job.waiting.cause)
            summaries = nccl_summaries(job.run_dir)
            seen["last"] = waits = nccl_waits(summaries, HANG_LIMIT)
            if seen["recorder"] is None and waits.waiting and not waits.free:
                seen["recorder"] = (now, waits, summaries)
            named = seen["recorder"]
            if named and (seen["stack"] or now - named[0] > HANG_GRACE):
                break
    finally:
        with contextlib.suppress(Exception):
            job.stop()
    return {**seen, "t0": t0, "events": read_events(job.run_dir)}


def hang_lines(mode: str, run: dict) -> list[str]:
    """The summary lines of one 2-rank hang run: named by whom, when, and what NCCL did."""
    mistake, name = HANG_MODES[mode]
    events = run["events"]
    start = next((e["time"] for e in events if e["what"] == mistake), None)
    if start is None:
        return [f"{name}: the run never reached its mistake ({run['ended'] or 'no events'})"]
    lines = []
    if run["recorder"]:
        t, w, _ = run["recorder"]
        where = "in different collectives" if w.apart else "in the same collective"
        lines.append(
            f"{name}: named by the flight recorder {t - start:.1f} s after the mistake "
            f"(limit {HANG_LIMIT:g} s): ranks {list(w.waiting)} wait {where}; "
            + "; ".join(f"rank {r}: {at}" for r, at in w.at.items())
            + (f"; no summary from ranks {list(w.unknown)}" if w.unknown else "")
        )
    else:
        w = run["last"]
        view = "; ".join(f"rank {r}: {at}" for r, at in w.at.items()) if w else "no snapshot"
        until = run["ended_at"] or run["stop_at"]
        lines.append(
            f"{name}: NOT named by the flight recorder "
            f"{'before the run ended' if run['ended_at'] else 'before it was stopped'}, "
            f"{until - start:.0f} s after the mistake; its last view: {view or 'no NCCL summary'}"
        )
    stack = run["stack"]
    said = f"named it ({stack[1]}) {stack[0] - start:.1f} s after the mistake" if stack else ""
    said = said or "did not name it"
    lines.append(f"{name}: the Python-stack path (ddpnb's verdict today) {said}")
    lines.append(f"{name}: what the ranks did: {what_happened(events, start)}")
    if mode == "barrier":
        lines.append(f"{name}: what NCCL did with it: {barrier_pairing(events, run['recorder'])}")
    if run["ended"]:
        lines[-1] += f"; the run ended by itself: {run['ended']}"
    return lines


def barrier_pairing(events: list[dict], recorder: tuple | None) -> str:
    """Whether NCCL paired rank 0's lone barrier with rank 1's next collective, or it hung."""
    if any(e["what"] == "lone barrier returned" for e in events):
        return (
            "the barrier returned: NCCL paired it with one of rank 1's collectives and the "
            "run went on with wrong partners (see where it hung above)"
        )
    summaries = recorder[2] if recorder else {}
    oldest = {r: ((s or {}).get("pending") or [None])[0] for r, s in summaries.items()}
    p0, p1 = oldest.get(0), oldest.get(1)
    if p0 and p1 and (p0["pg"], p0["seq"]) == (p1["pg"], p1["seq"]):
        return (
            f"paired: rank 0's {p0['op']} #{p0['seq']} ({elements(p0['size'])}) met rank 1's "
            f"{p1['op'].strip()} #{p1['seq']} ({elements(p1['size'])}), and neither completed"
        )
    if p0 and p1:
        return f"not paired by number: rank 0 waits at #{p0['seq']}, rank 1 at #{p1['seq']}"
    return "the barrier never returned (the recorder did not show both ranks waiting)"


def elements(n: int) -> str:
    return f"{n} element{'' if n == 1 else 's'}"


def what_happened(events: list[dict], start: float) -> str:
    """Each rank's steps and last note; whether rank 0's lone barrier ever returned."""
    parts = []
    back = [e for e in events if e["what"] == "lone barrier returned"]
    if any(e["what"] == "lone barrier" for e in events):
        returned = f"returned after {back[0]['time'] - start:.2f} s" if back else "never returned"
        parts.append(f"rank 0's lone barrier {returned}")
    for r in (0, 1):
        mine = [e for e in events if e["rank"] == r]
        steps = sum(e["what"] == "step" for e in mine)
        last = mine[-1]["what"] if mine else "nothing"
        parts.append(f"rank {r} {steps} steps, last noted '{last}'")
    return "; ".join(parts)


def single_line(work: Path, backend: str) -> str:
    """The recorder read on one rank: a completed all_reduce, a pending one, the read's cost."""
    run = launch_hang_script(work, "single", backend, 1, wait=True)
    (s,) = [e for e in read_events(run.run_dir) if e["what"] == "single"]
    return single_summary(s)


def single_summary(s: dict) -> str:
    """Check what nccl_hang.py's ``single`` read (CheckFailed if wrong); its summary line."""
    done, pending, after = s["completed"], s["pending"], s["after"]
    check(isinstance(done, dict) and "error" not in done, f"the recorder read failed: {done}")
    check(not done["pending"], f"a completed all_reduce read as pending: {done['pending']}")
    check(
        all(e == c for e, c in done["groups"].values()) and done["groups"],
        f"enqueued and completed differ after a synchronize: {done['groups']}",
    )
    newest = s["newest"] or {}
    check(
        newest == {"profiling_name": "nccl:all_reduce", "state": "completed"},
        f"the ring's newest entry: {newest}",
    )
    held = (pending.get("pending") or [{}])[0]
    check(
        (held.get("op"), held.get("size")) == ("nccl:all_reduce", 1000),
        f"an all_reduce behind a GPU sleep did not read as pending: {pending}",
    )
    check(not after["pending"], f"still pending after a synchronize: {after['pending']}")
    return (
        f"d flight recorder read, world size 1: ok: a completed all_reduce reads as completed "
        f"(newest entry {newest['profiling_name']} {newest['state']}, nothing pending, "
        f"group 0 at #{done['groups'].get('0')}); one behind a GPU sleep reads as pending "
        f"({held['op']} #{held['seq']}, {held['size']} elements, {held['state']}, "
        f"{held['for'] * 1e3:.0f} ms); a read with {s['ring']} collectives in the ring takes "
        f"{s['read_ms']:.2f} ms (median of 20)"
    )


def step_d(work: Path, ngpu: int, cuda: bool, lines: list[str]) -> None:
    """Step (d); each line is appended to ``lines`` as it is made."""

    def emit(line: str) -> None:
        lines.append(line)
        say(f"gpu-check: {line}")

    if cuda:
        emit(single_line(work, "nccl"))
    else:
        emit("d flight recorder read: not run (--allow-cpu: NCCL's recorder needs a GPU)")
    if ngpu < 2:
        emit(
            f"d 2-rank hang (lone barrier, uneven steps): not run: it needs 2 GPUs, "
            f"this machine has {ngpu}"
        )
        return
    for mode in HANG_MODES:
        for line in hang_lines(mode, hang_run(work, mode, "nccl" if cuda else "gloo")):
            emit(line)


# -- the run ----------------------------------------------------------------------------


def machine_line(cuda: bool, ngpu: int) -> str:
    import torch

    if cuda:
        # Asked in a child process: this one plays the notebook kernel and must not
        # initialise CUDA (step a checks that it did not).
        name = subprocess.run(
            [sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0))"],
            capture_output=True,
            text=True,
            timeout=120,
        ).stdout.strip()
        gpu = f"{ngpu} x {name or 'CUDA device'}"
    else:
        gpu = "no GPU (--allow-cpu: the figures mean nothing)"
    return (
        f"{gpu}, {os.cpu_count()} cores ({platform.machine()}), torch {torch.__version__}, "
        f"python {platform.python_version()}"
    )


def step_a(work: Path, nproc: int, cuda: bool, quick: bool, lines: list[str]) -> None:
    """Step (a); each summary line is appended to ``lines`` as it is made."""
    configs = correctness_configs(work, cuda=cuda, quick=quick)
    # --allow-cpu: the JPEG folder only (channels_last, loader workers: this script's own
    # path); the digits config differs by its data alone, which every other test trains on.
    for name, cfg, n_val in configs if cuda else configs[:1]:
        summary = launch_and_resume(cfg, work / f"check-{name}", nproc, n_val, cuda)
        lines.append(f"a {name}: ok: {summary}")
        say(f"gpu-check: {lines[-1]}")
    import torch

    check(not torch.cuda.is_initialized(), "launching initialised CUDA in the launching process")
    lines.append("a the launching process never initialised CUDA: ok")
    say(f"gpu-check: {lines[-1]}")


def speed_data(work: Path, nproc: int, sizes: dict) -> Path:
    """JPEGs for ``sizes["steps"]`` full batches on each of ``nproc`` ranks, 100 for val."""
    per_class = math.ceil(sizes["batch"] * sizes["steps"] * nproc / 10)
    t0 = time.perf_counter()
    root = make_jpeg_folder(
        work / f"speed-data-{nproc}",
        size=sizes["image_size"],
        train_per_class=per_class,
        val_counts=[10] * 10,
    )
    say(f"gpu-check: generated {per_class * 10} train JPEGs in {time.perf_counter() - t0:.0f} s")
    return root


def steps_b_c(
    work: Path, ngpu: int, cuda: bool, quick: bool, peak: float, lines: list[str]
) -> None:
    """Steps (b) and (c); each figure's line is appended to ``lines`` as it is measured."""
    sizes = speed_sizes(cuda, quick)

    def emit(line: str) -> None:
        lines.append(line)
        say(f"gpu-check: {line}")

    setting = (
        f"{sizes['model']} {sizes['image_size']}px bf16={cuda} channels_last "
        f"batch {sizes['batch']}/GPU"
    )
    one = worker_speed(speed_data(work, 1, sizes), work, 1, sizes, cuda)
    bare = bare_speed(sizes, 10, True, cuda, peak)
    bare_plain = bare_speed(sizes, 10, False, cuda, peak)
    flops = bare["flops_per_image"]
    ips = one["images_per_second_per_gpu"]
    tflops = ips * flops / 1e12
    emit(
        f"b worker 1 GPU, {setting}, DataLoader: {ips:.0f} images/s, "
        f"{tflops:.1f} TFLOP/s = {tflops / peak:.1%} of {peak:.0f} bf16 dense "
        f"({flops / 1e9:.1f} GFLOP per training image; {one['steps_timed']} steps timed, "
        f"data wait {one['data_wait_share']:.0%} of train time)"
    )
    emit(
        f"b bare loop (bench/gpu.py), same settings: {bare['images_per_second']:.0f} images/s, "
        f"{bare['achieved_tflops']:.1f} TFLOP/s = {bare['share_of_peak']:.1%} of peak"
    )
    emit(
        f"b worker / bare loop: {ips / bare['images_per_second']:.3f} (target >= {TARGET_VS_BARE})"
    )
    sets_it = "cudnn.benchmark" in (ROOT / "ddpnb" / "worker.py").read_text()
    emit(
        f"b bare loop without cudnn.benchmark / with: "
        f"{bare_plain['images_per_second'] / bare['images_per_second']:.3f} "
        f"(the worker {'sets' if sets_it else 'does not set'} it)"
    )
    if ngpu > 1:
        # At many GPUs each rank's shard is smaller: fewer steps per epoch are timed;
        # the first epoch is skipped either way.
        sizes_c = {
            **sizes,
            "steps": sizes["steps"] if ngpu <= 2 else max(8, sizes["steps"] * 2 // ngpu),
        }
        many = worker_speed(speed_data(work, ngpu, sizes_c), work, ngpu, sizes_c, cuda)
        eff = many["images_per_second_per_gpu"] / ips
        emit(
            f"c scaling 1 -> {ngpu} GPUs at batch {sizes['batch']}/GPU: {eff:.3f} "
            f"(target >= {TARGET_SCALING}; {many['images_per_second_per_gpu']:.0f} vs {ips:.0f} "
            f"images/s per GPU, slowest rank {many['slowest_rank']:.0f}, "
            f"{many['steps_timed']} steps timed per rank)"
        )
    else:
        emit("c scaling: not measured (one GPU)")


def record(lines: list[str], machine: str, quick: bool, path: Path = HERE / "results.md") -> Path:
    """Append a dated section holding the summary lines to ``path`` (bench/results.md)."""
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    text = [
        "",
        f"## GPU check ({'--quick, ' if quick else ''}`bench/gpu_check.py`), {stamp}",
        "",
        f"Machine: {machine}.",
        "",
        *[f"- {line}" for line in lines],
        "",
    ]
    with open(path, "a") as f:
        f.write("\n".join(text))
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smaller sizes (about half the time)")
    p.add_argument("--record", action="store_true", help="append the figures to bench/results.md")
    p.add_argument(
        "--only", choices=["a", "ab", "d"], help="run step a alone, a and b, or d (the hang) alone"
    )
    p.add_argument("--peak-tflops", type=float, default=H200_BF16_DENSE_TFLOPS)
    p.add_argument("--work", type=Path, help="keep the runs here (default: a temporary folder)")
    p.add_argument("--allow-cpu", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import torch  # is_available/device_count read the driver and leave CUDA uninitialised

    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        say(f"gpu-check: {NO_CUDA_MESSAGE}")
        return EXIT_NO_CUDA
    ngpu = torch.cuda.device_count() if cuda else 2
    machine = machine_line(cuda, ngpu)
    say(f"gpu-check: {machine}")
    work = args.work or Path(tempfile.mkdtemp(prefix="ddpnb-gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    lines: list[str] = []
    code = EXIT_OK
    try:
        if args.only != "d":
            step_a(work, ngpu, cuda, args.quick, lines)
        if args.only in (None, "ab"):
            ngpu_c = 1 if args.only == "ab" else ngpu
            steps_b_c(work, ngpu_c, cuda, args.quick, args.peak_tflops, lines)
        if args.only in (None, "d"):
            step_d(work, ngpu, cuda, lines)
    except Exception as e:  # a failed check or run: say which, keep what was measured
        lines.append(f"FAILED: {type(e).__name__}: {e}".splitlines()[0])
        say(f"gpu-check: FAILED: {type(e).__name__}: {e}")
        code = EXIT_FAILED
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    lines.append(f"total {time.perf_counter() - t0:.0f} s")
    say(f"gpu-check: {lines[-1]}; exit {code}")
    if args.record:
        if cuda:
            say(f"gpu-check: recorded in {record(lines, machine, args.quick)}")
        else:
            say("gpu-check: --record ignored: CPU figures are not GPU results")
    return code


if __name__ == "__main__":
    sys.exit(main())
