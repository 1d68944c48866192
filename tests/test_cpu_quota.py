"""A CPU limit (a shared JupyterHub's cpu_limit, Docker --cpus) sets the threads a rank gets."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddpnb.constants import cpu_quota, threads_for_host, usable_cpus

V1 = Path("/sys/fs/cgroup/cpu")  # cgroup v1's cpu controller (this machine's, CI's)
V2 = Path("/sys/fs/cgroup")

THREADS = """\
import os
with open(f"threads-{os.environ['RANK']}.txt", "w") as f:
    f.write(os.environ["OMP_NUM_THREADS"])
"""


def _cgroup(name: str, cpus: float) -> tuple[Path, str]:
    """A cgroup allowing ``cpus`` CPUs of time: its folder and the file that takes a PID."""
    if (V1 / "cpu.cfs_quota_us").is_file() and os.access(V1, os.W_OK):
        folder = V1 / name
        folder.mkdir()
        (folder / "cpu.cfs_quota_us").write_text(str(int(cpus * 100000)))
        (folder / "cpu.cfs_period_us").write_text("100000")
        return folder, "cgroup.procs"
    if "cpu" in (V2 / "cgroup.subtree_control").read_text(errors="replace").split():
        folder = V2 / name
        folder.mkdir()
        (folder / "cpu.max").write_text(f"{int(cpus * 100000)} 100000")
        return folder, "cgroup.procs"
    pytest.skip("needs a writable cgroup cpu controller (root; CI has one)")


def test_a_run_in_a_one_cpu_cgroup_gives_its_rank_one_thread(tmp_path):
    """On 2 cores a 1-process run gets 2 threads; under a 1-CPU quota, 1 (the launcher reads
    the quota, which os.cpu_count() and the affinity do not show)."""
    if threads_for_host(1) < 2:
        pytest.skip("needs 2 usable cores to show a 1-CPU limit")
    assert cpu_quota() is None  # the test process itself is not limited
    script = tmp_path / "threads.py"
    script.write_text(THREADS)
    folder, procs = _cgroup(f"ddpnb-test-{os.getpid()}", cpus=1.0)
    try:
        enter = f'echo $$ > "{folder / procs}" && exec "$@"'
        seen = subprocess.run(
            ["sh", "-c", enter, "sh", sys.executable, "-c",
             "from ddpnb.constants import cpu_quota, usable_cpus; print(cpu_quota(), usable_cpus())"],
            capture_output=True, text=True, check=True,
        ).stdout.split()  # fmt: skip
        assert seen == ["1.0", "1"]
        cli = [sys.executable, "-m", "ddpnb", "run", "--nnodes", "1"]
        cli += ["--run-dir", str(tmp_path / "run"), str(script)]
        done = subprocess.run(["sh", "-c", enter, "sh", *cli], capture_output=True, text=True)
        assert done.returncode == 0, done.stdout + done.stderr
    finally:
        folder.rmdir()  # fails while any process of the run is left in it
    assert (tmp_path / "run" / "threads-0.txt").read_text() == "1"
    assert usable_cpus() >= 2  # outside the cgroup: every core again
