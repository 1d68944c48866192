"""ddpnb's benchmark suite (``make bench``): ratios measured side by side in one run.

Every figure compares two things measured on this machine in this run, so machine noise
cancels; each is the median of ``--repeats`` runs, printed with its spread. The results
table goes to ``bench/results.md`` (and is printed). Nothing here asserts a time.

    python bench/run.py [--repeats 3] [--quick] [--suite]

``--suite`` also times ``make test`` and ``make demo`` (several minutes each).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

import ddpnb  # noqa: E402
from ddpnb.constants import free_port  # noqa: E402
from ddpnb.metrics import read_progress  # noqa: E402
from ddpnb.script import Script  # noqa: E402
from ddpnb.source import WORKER_PATH  # noqa: E402

REFERENCE = HERE / "reference_ddp.py"
# bench/run.py rewrites only what lies between these two lines of bench/results.md; the
# sections written by hand or by other benchmarks (gpu_check.py --record) are kept.
BEGIN = "<!-- bench/run.py writes from here -->"
END = "<!-- bench/run.py writes up to here -->"
# The 2-core ceiling measured when the issue was written: one process, no DDP, both
# cores, in-memory batches, resnet18 at 32 px, batch 64. This run measures its own.
CEILING_REFERENCE_IPS = 590
TARGETS = {
    "ceiling": 0.75,
    "overhead": 0.97,
    "nodes": 0.95,
    "ddp_vs_one": 0.97,
    "latency": 1.2,
}


def median_spread(values: list[float]) -> tuple[float, float, float]:
    return statistics.median(values), min(values), max(values)


def torchrun(script_args: list[str], nproc: int, threads: int | None, nnodes: int = 1) -> dict:
    """Run the reference loop under torchrun (one agent per node); return its JSON line."""
    env = dict(os.environ, BENCH_T0=repr(time.time()))
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    else:  # torchrun's own default, which a user who copies a tutorial gets
        env.pop("OMP_NUM_THREADS", None)
    port = free_port()
    procs = []
    for node in range(nnodes):
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nnodes}",
            f"--node_rank={node}",
            f"--nproc_per_node={nproc}",
            "--master_addr=127.0.0.1",
            f"--master_port={port}",
            str(REFERENCE),
            *script_args,
        ]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, text=True))
    outs = [p.communicate()[0] for p in procs]
    if any(p.returncode for p in procs):
        raise RuntimeError(f"reference run failed: {outs}")
    line = [ln for out in outs for ln in out.splitlines() if ln.startswith("{")][-1]
    return json.loads(line)


def reference_single(steps: int, batch: int, threads: int = 0) -> dict:
    """The ceiling: the reference loop as one plain process on every core (or ``threads``)."""
    env = dict(os.environ, BENCH_T0=repr(time.time()))
    env.pop("OMP_NUM_THREADS", None)
    out = subprocess.run(
        [sys.executable, str(REFERENCE), "--steps", str(steps), "--batch-size", str(batch)]
        + ["--threads", str(threads)],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def per_load_worker(folder: Path) -> Path:
    """The worker without make_data's faster path: each image decoded and transformed as
    it loads, as ImageFolder's transforms do (the line that takes the path, deleted)."""
    text = WORKER_PATH.read_text()
    lines = [ln for ln in text.splitlines(True) if "= decoded_in_memory(train_set, val_set" in ln]
    assert len(lines) == 1, lines
    path = folder / "train_ddp_per_load.py"
    path.write_text(text.replace(lines[0], ""))
    return path


def ddpnb_run(
    data: Path, nnodes: int, nproc: int, epochs: int, worker=None, launch=None, **cfg
) -> dict:
    """Train with ddpnb.launch; return steady images/s (epochs after the first) and latency.

    ``worker``: another version of the worker script to run instead of ddpnb's own;
    ``launch``: more keywords of ddpnb.launch (``hang_timeout=None``: the watch off).
    """
    run_dir = Path(tempfile.mkdtemp(prefix="ddpnb-bench-"))
    # Full batches only (1437 train images: 22 steps of 64), like the reference loop: a
    # short last batch pays a whole step's all-reduce and optimizer update for few images.
    config = ddpnb.TrainConfig(
        data_dir=str(data), image_size=32, epochs=epochs, max_steps_per_epoch=22, **cfg
    )
    t0 = time.time()
    what = Script.worker(config, worker) if worker else config
    job = ddpnb.launch(
        what,
        run_dir,
        nnodes=nnodes,
        nproc_per_node=nproc,
        progress="none",
        overwrite=True,
        **(launch or {}),
    )
    rows = job.metrics.epochs
    ranks = job.metrics.ranks
    steady = rows[1:] or rows
    comm = [r["comm_seconds"] for recs in ranks.values() for r in recs[1:]]
    total = [
        r["compute_seconds"] + r["comm_seconds"] + r["data_wait_seconds"]
        for recs in ranks.values()
        for r in recs[1:]
    ]
    first_step = read_progress(run_dir)["first_step_time"] - t0
    shutil.rmtree(run_dir)
    return {
        "images_per_second": statistics.median(r["images_per_second"] for r in steady),
        "first_step_seconds": first_step,
        "comm_share": sum(comm) / max(sum(total), 1e-9),
        "val_acc": rows[-1]["val_acc"],
    }


def matmul_flops(threads: int) -> float:
    """This machine's fp32 matmul FLOP/s on ``threads`` threads (the compute roof)."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    a, b = torch.rand(2048, 2048), torch.rand(2048, 2048)
    for _ in range(3):
        a @ b
    t = time.perf_counter()
    n = 10
    for _ in range(n):
        a @ b
    seconds = time.perf_counter() - t
    torch.set_num_threads(old)
    return 2 * 2048**3 * n / seconds


def train_step_flops(image_size: int = 32, batch: int = 64) -> float:
    """FLOPs of one resnet18 training step (forward + backward), counted by torch."""
    import torchvision
    from torch.utils.flop_counter import FlopCounterMode

    model = torchvision.models.resnet18(num_classes=10)
    x = torch.rand(batch, 3, image_size, image_size)
    with FlopCounterMode(display=False) as counter:
        model(x).sum().backward()
    return counter.get_total_flops()


def timed(cmd: list[str]) -> float:
    t = time.time()
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return time.time() - t


def replace_block(path: Path, table: str) -> str:
    """``path``'s text with this run's table between BEGIN and END (at the top if the
    file has no such block yet); everything else in the file is kept."""
    old = path.read_text() if path.exists() else ""
    block = f"{BEGIN}\n{table}{END}\n"
    if BEGIN in old and END in old:
        before, rest = old.split(BEGIN, 1)
        return before + block + rest.split(END, 1)[1].removeprefix("\n")
    return block + ("\n" + old if old else "")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3, help="per ddpnb run; the first is warm-up")
    p.add_argument("--quick", action="store_true", help="1 repeat, 2 epochs: a smoke test")
    p.add_argument("--suite", action="store_true", help="also time make test and make demo")
    p.add_argument("--out", default=str(HERE / "results.md"))
    args = p.parse_args(argv)
    repeats, epochs = (1, 2) if args.quick else (args.repeats, args.epochs)
    data = Path(tempfile.mkdtemp(prefix="ddpnb-bench-data-")) / "digits"
    ddpnb.prepare_digits(data, image_size=32)
    ddpnb.inspect_dataset(data, show=False)
    steps = 44  # as many timed steps as two ddpnb epochs of 22
    per_load_path = per_load_worker(data.parent)

    samples: dict[str, list[float]] = {}

    def note(key: str, value: float) -> None:
        samples.setdefault(key, []).append(value)
        print(f"  {key}: {value:.3f}", flush=True)

    for i in range(repeats):
        print(f"repeat {i + 1}/{repeats}", flush=True)
        # Each repeat measures both sides of every ratio back to back.
        ceiling = reference_single(steps, 64)["images_per_second"]
        ref2 = torchrun(["--steps", str(steps), "--batch-size", "32"], 2, threads=1)
        ref_nodes_nobudget = torchrun(
            ["--steps", str(steps), "--batch-size", "32"], 1, threads=None, nnodes=2
        )
        bound = torchrun(["--steps", str(steps), "--batch-size", "32", "--independent"], 2, 1)
        core32 = reference_single(steps, 32, threads=1)["images_per_second"]
        core64 = reference_single(steps, 64, threads=1)["images_per_second"]
        one = ddpnb_run(data, 1, 1, epochs, batch_size=64)
        per_load = ddpnb_run(data, 1, 1, epochs, batch_size=64, worker=per_load_path)
        # The default (shared memory here) and gloo's all-reduce, in alternating order.
        hooks = ["auto", "none"] if i % 2 == 0 else ["none", "auto"]
        pair = {h: ddpnb_run(data, 1, 2, epochs, batch_size=32, comm_hook=h) for h in hooks}
        two, gloo = pair["auto"], pair["none"]
        nodes = ddpnb_run(data, 2, 1, epochs, batch_size=32)
        # The hang watch (every worker's stack written every 2 s) on and off, alternately.
        order = [60.0, None] if i % 2 == 0 else [None, 60.0]
        watch = {
            t: ddpnb_run(data, 1, 2, epochs, launch={"hang_timeout": t}, batch_size=32)
            for t in order
        }
        note("ceiling images/s", ceiling)
        note("reference DDP 1x2 images/s", ref2["images_per_second"])
        note("ddpnb 1x2 images/s", two["images_per_second"])
        note("0 ddpnb 1x2 / ceiling", two["images_per_second"] / ceiling)
        note("0 reference DDP 1x2 / ceiling", ref2["images_per_second"] / ceiling)
        note(
            "0 ddpnb 1x2 with gloo's all-reduce (comm_hook='none') / ceiling",
            gloo["images_per_second"] / ceiling,
        )
        note(
            "0 ddpnb 1x2 default (shared memory) / gloo's all-reduce, side by side",
            two["images_per_second"] / gloo["images_per_second"],
        )
        note(
            "0 bound: 2 processes that never exchange gradients (no DDP) / ceiling",
            bound["images_per_second"] / ceiling,
        )
        note("0 why: one core at batch 32 / one core at batch 64 (images/s)", core32 / core64)
        note(
            "1 ddpnb 1x2 / reference DDP 1x2", two["images_per_second"] / ref2["images_per_second"]
        )
        note("2 ddpnb 2x1 / ddpnb 1x2", nodes["images_per_second"] / two["images_per_second"])
        note(
            "2 plain torchrun 2x1 without thread budget / with",
            ref_nodes_nobudget["images_per_second"] / ref2["images_per_second"],
        )
        note(
            "3 ddpnb 1x2 / ddpnb 1x1 (both cores)",
            two["images_per_second"] / one["images_per_second"],
        )
        note(
            "4 ddpnb 1x1 decoded in memory (the default here) / decoded per load",
            one["images_per_second"] / per_load["images_per_second"],
        )
        note(
            "5 launch latency ddpnb / bare torchrun",
            two["first_step_seconds"] / ref2["first_step_seconds"],
        )
        note(
            "6 ddpnb 1x2 with the hang watch / without, side by side",
            watch[60.0]["images_per_second"] / watch[None]["images_per_second"],
        )
        note("ddpnb 1x2 communication share of epoch", two["comm_share"])
        note("ddpnb 1x2 communication share with gloo's all-reduce", gloo["comm_share"])
        note("ddpnb 1x1 images/s", one["images_per_second"])

    shutil.rmtree(data.parent)
    peak = matmul_flops(os.cpu_count() or 1)
    flops_per_image = train_step_flops() / 64
    one_ips = statistics.median(samples["ddpnb 1x1 images/s"])
    ceiling_ips = statistics.median(samples["ceiling images/s"])
    two_ips = statistics.median(samples["ddpnb 1x2 images/s"])
    efficiency = {
        "ceiling loop (1 process)": ceiling_ips * flops_per_image / peak,
        "ddpnb 1x1": one_ips * flops_per_image / peak,
        "ddpnb 1x2": two_ips * flops_per_image / peak,
    }

    print("levers, each alone against the plain DDP loop:", flush=True)
    levers = subprocess.run(
        [sys.executable, str(HERE / "levers.py"), "--repeats", str(repeats)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lever_table = [ln for ln in levers.splitlines() if ln.startswith("|")]

    suite = {}
    if args.suite:
        suite["make test"] = timed(["make", "test"])
        suite["make demo"] = timed(["make", "demo"])

    lines = [
        "# Benchmark results",
        "",
        f"Machine: {os.cpu_count()} cores ({platform.processor() or platform.machine()}), "
        f"torch {torch.__version__}, {time.strftime('%Y-%m-%d')}. resnet18 at 32 px on the "
        f"digits ImageFolder; per-process batch 32 at 2 processes, 64 at 1. Median of "
        f"{repeats} repeat(s) [min-max]. The issue's reference ceiling was "
        f"{CEILING_REFERENCE_IPS} images/s.",
        "",
        "| figure | median [min-max] |",
        "|---|---|",
    ]
    for key, values in samples.items():
        m, lo, hi = median_spread(values)
        lines.append(f"| {key} | {m:.3f} [{lo:.3f}-{hi:.3f}] |")
    lines += [
        "",
        f"Compute efficiency (training FLOP/s over this machine's fp32 matmul "
        f"{peak / 1e9:.0f} GFLOP/s; {flops_per_image / 1e6:.0f} MFLOP per image):",
        "",
    ]
    lines += [f"- {k}: {v:.1%}" for k, v in efficiency.items()]
    lines += ["", "Levers, each measured alone (`bench/levers.py`):", "", *lever_table]
    if suite:
        lines += ["", "Wall times after install:", ""]
        lines += [f"- `{k}`: {v:.0f} s" for k, v in suite.items()]
    table = "\n".join(lines) + "\n"
    print("\n" + table)
    Path(args.out).write_text(replace_block(Path(args.out), table))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
