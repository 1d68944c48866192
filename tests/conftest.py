"""Shared fixtures: datasets are built once per session; trainings run real torchrun."""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

import ddpnb

# Tiny but real: 10 classes of the bundled digits. 37 val images is divisible by
# neither 2 nor 3, so padded validation shards would show up in the counts.
TRAIN_PER_CLASS = 12
VAL_COUNTS = [4, 4, 4, 4, 4, 4, 4, 3, 3, 3]
TINY = dict(image_size=16, epochs=2, batch_size=8, lr=0.05, timeout_seconds=30)


def pytest_configure(config):
    """Ctrl-C means KeyboardInterrupt here and in every process the tests start.

    A shell starts a background job (``make test &``) with SIGINT ignored, and every child
    inherits that, so the interrupt tests would see no interrupt at all. A handler, unlike
    SIG_IGN, is not inherited: the launchers the tests start get Python's default again.
    """
    signal.signal(signal.SIGINT, signal.default_int_handler)


SLOW_TEST_SECONDS = 30  # a test over this says why in its docstring (tests/README: the budget)


def pytest_terminal_summary(terminalreporter):
    """After ``--durations``: seconds per test file (setup, call and teardown), largest first,
    so the suite's growth shows where it happens."""
    per_file: dict[str, float] = {}
    cpu: dict[str, float] = {}
    for reports in terminalreporter.stats.values():
        for report in reports:
            if isinstance(report, pytest.TestReport):
                name = report.nodeid.split("::")[0]
                per_file[name] = per_file.get(name, 0.0) + report.duration
                cpu[name] = cpu.get(name, 0.0) + dict(report.user_properties).get("cpu_s", 0)
    if not per_file:
        return
    total = sum(per_file.values())
    workers = getattr(terminalreporter.config.option, "numprocesses", None) or 1
    terminalreporter.write_sep(
        "=",
        f"seconds per test file ({total / 60:.1f} min of tests in {workers} worker(s); "
        f"CPU: {sum(cpu.values()) / 60:.1f} min of the processes the tests waited for)",
    )
    for name, seconds in sorted(per_file.items(), key=lambda item: -item[1]):
        share = 100 * seconds / total
        terminalreporter.write_line(f"{seconds:8.1f}s {share:5.1f}%  CPU {cpu[name]:7.1f}s  {name}")
    unexplained = [
        (r.duration, r.nodeid)
        for r in terminalreporter.stats.get("passed", [])
        if r.when == "call" and r.duration > SLOW_TEST_SECONDS
        if not dict(r.user_properties).get("says_why")
    ]
    if unexplained:
        terminalreporter.write_sep(
            "=", f"over {SLOW_TEST_SECONDS} s without a docstring saying why"
        )
        for seconds, nodeid in sorted(unexplained, reverse=True):
            terminalreporter.write_line(f"{seconds:8.1f}s  {nodeid}")


def _cpu_seconds() -> float:
    """CPU time of this process and of its children that have been waited for (torchrun and
    its workers; not what sshd or slurmd started)."""
    mine, children = (
        resource.getrusage(resource.RUSAGE_SELF),
        resource.getrusage(resource.RUSAGE_CHILDREN),
    )
    return mine.ru_utime + mine.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item):
    item.stash[_CPU_AT_START] = _cpu_seconds()
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    if call.when == "teardown":  # the suite is CPU-bound on 2 cores: its work, per test
        cpu = _cpu_seconds() - item.stash[_CPU_AT_START]
        outcome.get_result().user_properties.append(("cpu_s", round(cpu, 2)))


_CPU_AT_START = pytest.StashKey[float]()


# pytest-xdist (make test: -n 2): the tests of one group run in one worker, one after another.
# A test file is a group (its module fixtures, e.g. the executed notebooks, are made once),
# with two exceptions: the files that start SSH hosts share one, as their subnets, interface
# names and /run/sshd are only unique per process; and notebook 06 (about 250 s) is a group
# of its own, beside the other notebooks (each worker runs notebook 01 for its data). Groups
# start largest first (seconds of the last full run), so no long one is left to run alone.
GROUPS = {"tests/test_ssh.py": "ssh", "tests/test_network.py": "ssh"}
LARGEST_FIRST = [
    "ssh",
    "tests/test_notebooks.py",
    "tests/test_slurm.py",
    "notebook 06",
    "tests/test_scriptcheck.py",
    "tests/test_wheelhouse.py",
    "tests/test_fault.py",
    "tests/test_launch.py",
    "tests/browser/test_jupyterlab.py",
    "tests/test_gpu.py",
    "tests/test_hang.py",
    "tests/test_sweep.py",
    "tests/test_worker.py",
    "tests/test_lifetime.py",
    "tests/test_script.py",
    "tests/test_netns.py",
]


def _group(nodeid: str) -> str:
    path, _, name = nodeid.partition("::")
    if path == "tests/test_notebooks.py" and "06" in name:
        return "notebook 06"
    return GROUPS.get(path, path)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """xdist's scope scheduling with :func:`_group` as the scopes. Not the ``xdist_group``
    mark: under pytest 9.2 it silently groups nothing (pytest-dev/pytest-xdist#1386)."""
    from xdist.scheduler import LoadScopeScheduling

    class ByGroup(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return ByGroup(config, log)


def pytest_collection_modifyitems(items):
    order = {name: i for i, name in enumerate(LARGEST_FIRST)}
    items.sort(key=lambda item: order.get(_group(item.nodeid), len(order)))  # stable sort
    for item in items:
        doc = (getattr(item, "function", None) and item.function.__doc__) or ""
        item.user_properties.append(("says_why", bool(doc.strip())))


def make_imagefolder(
    root: Path, train_per_class: int, val_counts: list[int], size: int = 16
) -> Path:
    """A small ImageFolder of real digits images."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    images = (digits.images * (255 / 16)).astype(np.uint8)
    for c in range(10):
        idx = np.flatnonzero(digits.target == c)
        for split, chosen in (
            ("train", idx[:train_per_class]),
            ("val", idx[train_per_class : train_per_class + val_counts[c]]),
        ):
            d = root / split / str(c)
            d.mkdir(parents=True, exist_ok=True)
            for i in chosen:
                Image.fromarray(images[i]).resize((size, size)).save(d / f"{i:04d}.png")
    return root


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> Path:
    root = make_imagefolder(tmp_path_factory.mktemp("data") / "tiny", TRAIN_PER_CLASS, VAL_COUNTS)
    ddpnb.inspect_dataset(root, show=False)  # writes the manifest once
    return root


@pytest.fixture(scope="session")
def digits_data(tmp_path_factory) -> Path:
    return ddpnb.prepare_digits(tmp_path_factory.mktemp("digits") / "digits", image_size=16)


@pytest.fixture()
def data_copy(tiny_data, tmp_path) -> Path:
    """A private copy of the tiny dataset that a test may damage."""
    return Path(shutil.copytree(tiny_data, tmp_path / "data"))


@contextlib.contextmanager
def tmpfs(path: Path, options: str):
    """A small real filesystem mounted at ``path`` for the block (root only; CI is root)."""
    if os.geteuid() != 0:
        pytest.fail("needs root to mount a tmpfs (CI runs as root)")
    subprocess.run(["mount", "-t", "tmpfs", "-o", options, "ddpnb-test", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


def tiny_config(data_dir, **changes) -> ddpnb.TrainConfig:
    return ddpnb.TrainConfig(data_dir=str(data_dir), **{**TINY, **changes})


_runs: dict = {}


@pytest.fixture(scope="session")
def layout_run(tiny_data, tmp_path_factory):
    """Run (and cache) a tiny training for a layout 'NODESxPROCS'."""

    def run(layout: str):
        if layout not in _runs:
            nnodes, nproc = map(int, layout.split("x"))
            run_dir = tmp_path_factory.mktemp(f"run-{layout}")
            job = ddpnb.launch(
                tiny_config(tiny_data),
                run_dir,
                nnodes=nnodes,
                nproc_per_node=nproc,
                progress="none",
            )
            _runs[layout] = job
        return _runs[layout]

    return run


def wait_for_hang(job, limit: float) -> None:
    """Follow ``job`` (launched with on_hang="wait") until its hang watch names a hang.

    Returns as soon as it does, so no test waits out a fixed time; fails after ``limit``
    seconds, or when the run ends instead.
    """
    import time

    deadline = time.monotonic() + limit
    while job.waiting is None or job.waiting.kind != "hang":
        assert time.monotonic() < deadline, f"no hang named within {limit} s: {job.waiting}"
        try:
            job.wait(timeout=1)
        except TimeoutError:
            continue
        raise AssertionError("the run ended instead of hanging")
