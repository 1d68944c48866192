"""An offline room: ``make wheelhouse``, then ``make setup`` from that folder alone.

On a copy of the repository's tracked files (what a fresh clone holds), ``make wheelhouse``
downloads the wheels once for the module (about 3 GB on Linux x86_64: torch brings its CUDA
libraries). A clean venv is then set up as the README's "An offline room" says, with pip
told to use no index, no configuration file and no setting of this machine, only
``PIP_FIND_LINKS=<wheelhouse>``; where a network namespace can be made (root), ``make setup``
runs in one without any network at all. Everything is deleted afterwards (about 9 GB).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
NEEDS_GB = 10  # the wheelhouse (3 GB) and the venv installed from it (6.2 GB), and a little spare
MAKE_VARS = ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")  # make test's own, not for the make below


@dataclass
class Room:
    base: Path
    clone: Path
    wheelhouse: Path


def _make(clone: Path, *args: str, env: dict[str, str], timeout: float = 120):
    return subprocess.run(
        ["make", "--no-print-directory", "-C", str(clone), *args],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout,
    )  # fmt: skip


def _copy_tracked(dest: Path) -> None:
    """The repository's tracked files as they are now (uncommitted edits included)."""
    out = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z"], capture_output=True, check=True
    )
    for name in filter(None, out.stdout.decode().split("\0")):
        src = REPO / name
        if src.is_file():  # a tracked file deleted in the work tree is gone from a commit too
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name, follow_symlinks=False)


@pytest.fixture(scope="module")
def room(tmp_path_factory) -> Iterator[Room]:
    base = tmp_path_factory.mktemp("offline-room")
    free_gb = shutil.disk_usage(base).free / 2**30
    assert free_gb > NEEDS_GB, f"{base} has {free_gb:.1f} GB free; this test needs {NEEDS_GB}"
    clone = base / "clone"
    try:  # removed however the module ends: about 9 GB
        _copy_tracked(clone)
        env = {k: v for k, v in os.environ.items() if k not in MAKE_VARS}  # the organiser's pip
        t0 = time.monotonic()
        r = _make(clone, "wheelhouse", env=env, timeout=1200)
        assert r.returncode == 0, r.stdout[-4000:]
        print(f"\nmake wheelhouse: {time.monotonic() - t0:.0f} s")
        yield Room(base, clone, clone / "wheelhouse")
    finally:
        shutil.rmtree(base, ignore_errors=True)


def _wheels(wheelhouse: Path) -> dict[str, list]:
    have: dict[str, list] = {}
    for p in wheelhouse.glob("*.whl"):
        name, version, *_ = parse_wheel_filename(p.name)
        have.setdefault(name, []).append(version)
    return have


def test_the_wheelhouse_holds_wheels_only_pip_and_the_build_backend_among_them(room):
    others = sorted(p.name for p in room.wheelhouse.iterdir() if p.suffix != ".whl")
    assert others == [".complete"], f"not wheels (offline they would need a build): {others}"
    have = _wheels(room.wheelhouse)
    build = tomllib.loads((REPO / "pyproject.toml").read_text())["build-system"]["requires"]
    for spec in ["pip", *build]:  # make setup's `pip install --upgrade pip`, the editable build
        req = Requirement(spec)
        versions = have.get(canonicalize_name(req.name), [])
        assert any(req.specifier.contains(v) for v in versions), (spec, versions)
    r = subprocess.run(["git", "-C", str(REPO), "check-ignore", "-q", "wheelhouse/x.whl"])
    assert r.returncode == 0, "wheelhouse/ is not git-ignored"


def test_a_second_make_wheelhouse_has_nothing_to_do(room):
    env = {k: v for k, v in os.environ.items() if k not in MAKE_VARS}
    r = _make(room.clone, "-q", "wheelhouse", env=env)
    assert r.returncode == 0, f"make wheelhouse would run again:\n{r.stdout}"
    r = _make(room.clone, "-q", "-W", "pyproject.toml", "wheelhouse", env=env)
    assert r.returncode == 1, "a changed pyproject.toml should download again"


def _can_cut_the_network() -> bool:
    if not shutil.which("unshare"):
        return False
    return subprocess.run(["unshare", "--net", "true"], capture_output=True).returncode == 0


def test_a_clean_venv_is_set_up_from_the_wheelhouse_alone(room):
    """About 130 s: pip installs every wheel a room needs (torch with its CUDA libraries, 6 GB
    unpacked) into a clean venv, with no index and no network: only a real install proves
    that the wheelhouse is complete."""
    venv = room.base / "venv"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in (*MAKE_VARS, "PYTHONPATH") and not k.startswith("PIP_")  # only the venv's
    }
    env |= {
        "PIP_CONFIG_FILE": os.devnull,  # no pip.conf at all: no index, constraints, find-links
        "PIP_NO_INDEX": "1",
        "PIP_FIND_LINKS": str(room.wheelhouse),
        "PIP_CACHE_DIR": str(room.base / "pip-cache"),  # a laptop's empty cache
    }
    cmd = ["make", "--no-print-directory", "-C", str(room.clone), f"VENV={venv}", "setup"]
    offline = _can_cut_the_network()
    if offline:
        cmd = ["unshare", "--net", *cmd]
    t0 = time.monotonic()
    r = subprocess.run(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=1200
    )
    install_s = time.monotonic() - t0
    assert r.returncode == 0, r.stdout[-4000:]
    print(f"\noffline make setup: {install_s:.0f} s (without any network: {offline})")
    assert (venv / ".installed").exists(), r.stdout[-4000:]
    py = str(venv / "bin" / "python")
    code = (
        "import ddpnb, torch, torchvision, jupyterlab, papermill, ipywidgets, pytest, pip;"
        "print(ddpnb.__file__); print(pip.__version__)"
    )
    r = subprocess.run([py, "-c", code], capture_output=True, text=True, env=env, cwd=room.base)
    assert r.returncode == 0, r.stderr[-3000:]
    where, pip_version = r.stdout.split()
    assert Path(where).is_relative_to(room.clone)  # the editable install of the clone
    # `pip install --upgrade pip` took the wheelhouse's pip, not quietly nothing
    assert pip_version in {str(v) for v in _wheels(room.wheelhouse)["pip"]}, pip_version
