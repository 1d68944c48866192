"""Your own script: ddpnb's launch to the first optimizer step, against a bare torchrun.

The same script (bench/first_step.py) on two simulated nodes, measured side by side in
one run, alternating: the seconds from the start of the launch to the script's first
optimizer step (the time it writes, read afterwards):

- bare: two ``torchrun`` agents (static rendezvous, node 0 on 127.0.0.1), as a user starts
  them by hand, with the same thread budget ddpnb sets;
- ddpnb: ``ddpnb.launch(Script(...), run_dir, nnodes=2)``: checks, the run directory,
  the reporting file, the agents with their lifeline.

The ratio ddpnb / bare is printed (median [min-max]; target <= 1.1). No time is asserted.

    python bench/script_launch.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import ddpnb  # noqa: E402
from ddpnb.constants import free_port  # noqa: E402

SCRIPT = Path(__file__).with_name("first_step.py")


def _wait_for(path: Path, procs: list, limit: float = 120.0) -> float:
    deadline = time.time() + limit
    while not path.exists() or not path.read_text():
        if any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError(f"a node failed before {path} was written")
        if time.time() > deadline:
            raise TimeoutError(f"no first step within {limit} s")
        time.sleep(0.01)
    return float(path.read_text())


def bare(folder: Path) -> float:
    """Two torchrun agents started at once; seconds to the first optimizer step."""
    out = folder / "first-step.txt"
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1")
    start = time.time()
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nnodes=2",
                f"--node_rank={n}",
                "--nproc_per_node=1",
                "--master_addr=127.0.0.1",
                f"--master_port={port}",
                str(SCRIPT),
                str(out),
            ],
            cwd=folder,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        for n in range(2)
    ]
    first = _wait_for(out, procs)
    for p in procs:
        p.wait(timeout=60)
    return first - start


def with_ddpnb(folder: Path) -> float:
    run_dir = folder / "run"
    start = time.time()
    job = ddpnb.launch(
        ddpnb.Script(SCRIPT, args=["first-step.txt"]), run_dir, nnodes=2, progress="none"
    )
    return float((job.run_dir / "first-step.txt").read_text()) - start


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args(argv)
    seconds: dict[str, list[float]] = {"bare": [], "ddpnb": []}
    ratios = []
    for i in range(args.repeats + 1):  # the first pair warms the file cache, and is dropped
        with tempfile.TemporaryDirectory() as tmp:
            a, b = Path(tmp, "a"), Path(tmp, "b")
            a.mkdir(), b.mkdir()
            pair = (bare(a), with_ddpnb(b)) if i % 2 else tuple(reversed((with_ddpnb(b), bare(a))))
        if i == 0:
            continue
        seconds["bare"].append(pair[0])
        seconds["ddpnb"].append(pair[1])
        ratios.append(pair[1] / pair[0])
        print(f"repeat {i}: bare {pair[0]:.2f} s, ddpnb {pair[1]:.2f} s", flush=True)
    for name, values in seconds.items():
        print(f"{name:>5}: median {statistics.median(values):.2f} s "
              f"[{min(values):.2f}-{max(values):.2f}]")  # fmt: skip
    print(
        f"launch to first step, ddpnb / bare torchrun: median {statistics.median(ratios):.3f} "
        f"[{min(ratios):.3f}-{max(ratios):.3f}] (target <= 1.1)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
