"""What the hang watch costs a healthy run: with and without, side by side (issue 35).

Two figures, both from this run on this machine:

1. ddpnb's worker on 1 node x 2 processes, the watch on (``hang_timeout=60``, the
   default) and off (``hang_timeout=None``), launched alternately ``--pairs`` times:
   the ratio of steady images/s, median [min-max]. Machine noise is a few percent per
   run, so this shows the cost is within noise, not its exact size.
2. The cost itself: one snapshot (the main thread's stack, JSON, an atomic replace)
   timed in a worker-like process, times one snapshot every 2 s, as a share of one core.

    python bench/hang_watch.py [--pairs 4] [--epochs 3]

Nothing here asserts a time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from run import ddpnb_run  # noqa: E402

import ddpnb  # noqa: E402


def snapshot_seconds(n: int = 2000) -> float:
    """Seconds one snapshot takes, with a main thread 30 frames deep (as in a training step)."""
    from ddpnb import watch

    folder = tempfile.mkdtemp(prefix="ddpnb-watch-bench-")
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"})
    w = watch._Watch(folder, 2.0)

    def deep(k: int) -> float:
        if k:
            return deep(k - 1)
        t = time.perf_counter()
        for _ in range(n):
            w.write("running")
        return (time.perf_counter() - t) / n

    return deep(30)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--epochs", type=int, default=3, help="per run; the first is warm-up")
    args = p.parse_args(argv)
    data = Path(tempfile.mkdtemp(prefix="ddpnb-bench-data-")) / "digits"
    ddpnb.prepare_digits(data, image_size=32)
    ratios = []
    for i in range(args.pairs):
        order = [60.0, None] if i % 2 == 0 else [None, 60.0]
        ips = {}
        for timeout in order:
            run = ddpnb_run(
                data, 1, 2, args.epochs, launch={"hang_timeout": timeout}, batch_size=32
            )
            ips[timeout] = run["images_per_second"]
            print(
                f"  pair {i + 1}, watch {'on' if timeout else 'off'}: {ips[timeout]:.1f} images/s"
            )
        ratios.append(ips[60.0] / ips[None])
    one = snapshot_seconds()
    print(
        f"ddpnb 1x2 with the hang watch / without, {args.pairs} alternating pairs: "
        f"{statistics.median(ratios):.3f} [{min(ratios):.3f}-{max(ratios):.3f}]"
    )
    print(f"one snapshot: {one * 1e6:.0f} us; one every 2 s per rank = {one / 2.0:.5%} of a core")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
