"""Launch over SSH: ddpnb's ``launch(hosts=...)`` against torchrun started by hand.

Two SSH hosts on this machine (network namespaces with real sshd, as in
tests/test_ssh.py; needs root and openssh-server). Each repeat measures, side by side,
the seconds from the start of the launch to the first optimizer step (the worker's
``first_step_time`` in progress.json):

- by hand: one ``ssh host torchrun ...`` per host, started at once, as a user pastes
  ``node_commands`` into one terminal per host (no preflight, nothing copied);
- ddpnb: ``ddpnb.launch(cfg, run_dir, hosts=[...])`` with its preflight of every host.

The ratio ddpnb / by hand is printed (median [min-max]; target <= 1.3). No time is asserted.

    python bench/ssh_launch.py [--repeats 3]
"""

from __future__ import annotations

import argparse
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from sshhosts import IFNAME, ssh_hosts  # noqa: E402

import ddpnb  # noqa: E402
from ddpnb.metrics import read_progress  # noqa: E402


def first_step(run_dir: Path, start: float, procs=(), limit: float = 120) -> float:
    """Seconds from ``start`` to the first optimizer step the run reports."""
    deadline = time.time() + limit
    while time.time() < deadline:
        t = read_progress(run_dir).get("first_step_time")
        if t:
            return t - start
        if any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError(f"a node failed; see {run_dir}")
        time.sleep(0.02)
    raise TimeoutError(f"no first step in {run_dir} within {limit} s")


def by_hand(hosts, cfg, run_dir: Path, port: int) -> float:
    ddpnb.write_worker(cfg, run_dir)  # the user copied these beforehand
    lines = ddpnb.node_commands(cfg, run_dir, hosts=hosts.addrs, master_port=port)
    # By hand the user names the interface: the hosts' name resolves to loopback here.
    env = {"GLOO_SOCKET_IFNAME": IFNAME, "OMP_NUM_THREADS": "1"}
    start = time.time()
    procs = []
    for name, line in zip(hosts.names, lines):
        argv = shlex.split(line)
        remote = shlex.join(
            [
                "env",
                *(f"{k}={v}" for k, v in env.items()),
                sys.executable,
                "-m",
                "torch.distributed.run",
                *argv[1:],
            ]
        )
        procs.append(
            subprocess.Popen(
                ["ssh", "-F", str(hosts.ssh_config), "-T", name, remote],
                stdin=subprocess.PIPE,  # closed below: the session ends, and so does the node
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        )
    try:
        return first_step(run_dir, start, procs)
    finally:
        for p in procs:
            p.stdin.close()
            p.kill()
            p.wait()
        # Plain torchrun does not notice its SSH session ending: end what it started on
        # the hosts (by PID, in the hosts' namespaces) before the next measurement.
        for pids in hosts.leftovers().values():
            for pid in pids:
                try:
                    os.kill(pid, 9)
                except OSError:
                    pass
        while hosts.leftovers():
            time.sleep(0.1)


def with_ddpnb(hosts, cfg, run_dir: Path) -> float:
    start = time.time()
    job = ddpnb.launch(
        cfg,
        run_dir,
        hosts=hosts.names,
        ssh_config=hosts.ssh_config,
        progress="none",
        wait=False,
    )
    try:
        return first_step(run_dir, start, job.scheduler.procs.values())
    finally:
        job.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    data = ddpnb.prepare_digits(
        Path(tempfile.mkdtemp(prefix="ddpnb-bench-")) / "digits", image_size=16
    )
    cfg = ddpnb.TrainConfig(data_dir=str(data), image_size=16, epochs=50, batch_size=16, threads=1)
    ratios, hand, ours = [], [], []
    with (
        tempfile.TemporaryDirectory() as tmp,
        ssh_hosts(Path(tmp) / "ssh", os.getpid() % 1000) as hosts,
    ):
        for i in range(args.repeats):
            h = by_hand(hosts, cfg, Path(tmp) / f"hand-{i}", 29700 + i)
            d = with_ddpnb(hosts, cfg, Path(tmp) / f"ddpnb-{i}")
            hand.append(h)
            ours.append(d)
            ratios.append(d / h)
            print(f"repeat {i}: by hand {h:.2f} s, ddpnb {d:.2f} s, ratio {d / h:.2f}", flush=True)
    print(
        f"by hand to first step: {statistics.median(hand):.2f} s [{min(hand):.2f}-{max(hand):.2f}]"
    )
    print(
        f"ddpnb launch(hosts=) to first step: {statistics.median(ours):.2f} s [{min(ours):.2f}-{max(ours):.2f}]"
    )
    print(
        f"ratio ddpnb / by hand: {statistics.median(ratios):.2f} [{min(ratios):.2f}-{max(ratios):.2f}]"
        " (target <= 1.3)"
    )


if __name__ == "__main__":
    main()
