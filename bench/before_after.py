"""Before and after: this tree's ddpnb against an earlier commit's, launched alternately.

    python bench/before_after.py REV [--repeats 3]

Checks REV out into a temporary git worktree, then for each layout (one process on every
core; one node x 2 processes) trains the same short run with the earlier ddpnb and with
this one in turn, alternating which goes first, so that both sides see the same machine
noise and drift. Prints each layout's
after/before ratio of training images/s: the median of the paired ratios, with their
spread. Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYOUTS = {"1 process on every core": 1, "1 node x 2 processes": 2}
# One training, run inside a tree (its ddpnb is the one imported): resnet18 at 32 px, a
# global batch of 64, 22 steps per epoch; epochs 2 and 3 are timed.
RUN = """
import statistics, sys, tempfile
import ddpnb
data, nproc = sys.argv[1], int(sys.argv[2])
cfg = ddpnb.TrainConfig(data_dir=data, image_size=32, epochs=3, max_steps_per_epoch=22,
                        batch_size=64 // nproc)
job = ddpnb.launch(cfg, tempfile.mkdtemp(prefix="ddpnb-ba-"), nnodes=1,
                   nproc_per_node=nproc, progress="none", overwrite=True)
print(statistics.median(r["images_per_second"] for r in job.metrics.epochs[1:]))
print(job.run_dir)
"""


def images_per_second(tree: Path, data: Path, nproc: int) -> float:
    """One training with ``tree``'s ddpnb; its run directory is removed afterwards."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    out = subprocess.run(
        [sys.executable, "-c", RUN, str(data), str(nproc)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.splitlines()
    shutil.rmtree(out[-1], ignore_errors=True)
    return float(out[-2])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("rev", help="the earlier commit (anything git rev-parse accepts)")
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="ddpnb-before-after-"))
    before = work / "before"
    subprocess.run(
        ["git", "-C", str(ROOT), "worktree", "add", "--detach", str(before), args.rev],
        check=True,
        capture_output=True,
    )
    try:
        sys.path.insert(0, str(ROOT))
        import ddpnb

        data = ddpnb.prepare_digits(work / "digits", image_size=32)
        for layout, nproc in LAYOUTS.items():
            ratios, pairs = [], []
            for i in range(args.repeats):  # alternate which runs first: the machine drifts
                if i % 2:
                    new = images_per_second(ROOT, data, nproc)
                    old = images_per_second(before, data, nproc)
                else:
                    old = images_per_second(before, data, nproc)
                    new = images_per_second(ROOT, data, nproc)
                pairs.append(f"{old:.0f} -> {new:.0f}")
                ratios.append(new / old)
                print(f"  {layout}: {pairs[-1]} images/s", flush=True)
            print(
                f"{layout}: after/before {statistics.median(ratios):.3f} "
                f"[{min(ratios):.3f}-{max(ratios):.3f}] ({', '.join(pairs)})",
                flush=True,
            )
    finally:
        subprocess.run(
            ["git", "-C", str(ROOT), "worktree", "remove", "--force", str(before)], check=False
        )
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
