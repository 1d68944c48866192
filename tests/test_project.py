"""Your own project, not only your own file: folders and relative paths travel as they are.

tests/project/ is a small project: ``train.py`` imports ``mypkg/model.py``, reads
``config/small.json`` (its argument) and ``data/tiny/train.txt`` by a relative path, and
writes ``out/model.pt``; ``tools/unsharded.py`` is a script in a subfolder with a module
beside it. Paths given relative keep their place relative to the current folder, so every
test runs from the project's folder. The SSH hosts without the shared filesystem run it in
test_ssh.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import ddpnb
from ddpnb.errors import ConfigError

PROJECT = Path(__file__).with_name("project")
FILES = ["mypkg", "config/", "./data/tiny/train.txt"]
LANDED = ["train.py", "mypkg/__init__.py", "mypkg/model.py", "config/small.json"]
LANDED += ["data/tiny/train.txt"]


@pytest.fixture
def project(monkeypatch):
    monkeypatch.chdir(PROJECT)
    return PROJECT


def test_relative_paths_keep_their_place_absolute_ones_land_at_the_top(project):
    script = ddpnb.Script("tools/unsharded.py", files=[*FILES, PROJECT / "train.py"])
    script.check()
    assert script.name == "tools/unsharded.py"
    assert script.command("/r") == ["/r/tools/unsharded.py"]
    names = set(script.payload())
    assert {"tools/unsharded.py", *LANDED, "ddpnb_reporting.py"} == names
    assert not any("__pycache__" in n for n in names)


@pytest.mark.slow
def test_a_project_with_folders_trains_on_simulated_nodes(project, tmp_path):
    """About 40 s: a two-node launch of the project's own script, its folders copied in."""
    script = ddpnb.Script("train.py", args=["config/small.json"], files=FILES)
    job = ddpnb.launch(script, tmp_path / "run", nnodes=2, progress="none")
    run = job.run_dir
    assert all((run / name).is_file() for name in LANDED), sorted(map(str, run.rglob("*")))
    assert not (run / "model.py").exists() and not (run / "train.txt").exists()  # not flattened
    assert (run / "out" / "model.pt").is_file()  # written by rank 0 in its working directory
    assert job.node_status() == {0: "done", 1: "done"}
    assert "rank 1 epoch 2 loss" in (run / "logs" / "node-1.log").read_text()
    # overwrite replaces the copied files; what the script or the user wrote there stays
    (run / "data" / "tiny" / "mine.txt").write_text("mine")
    job = ddpnb.launch(script, run, nnodes=2, progress="none", overwrite=True)
    assert (run / "data" / "tiny" / "mine.txt").read_text() == "mine"
    assert all((run / name).is_file() for name in LANDED)
    assert (run / "out" / "model.pt").is_file()


@pytest.mark.slow
def test_a_script_in_a_subfolder_imports_beside_it_and_the_check_names_its_line(project, tmp_path):
    # The module it imports from beside it is given, as every file the script needs is.
    script = ddpnb.Script("tools/unsharded.py", files=["data/tiny", "tools/common.py"])
    report = ddpnb.check_script(script, run_dir=tmp_path / "check")
    assert (tmp_path / "check" / "run" / "tools" / "common.py").is_file()  # beside the script
    assert report.script == "tools/unsharded.py"
    found = {f.number: f for f in report.findings}
    assert 1 in found, report  # every rank trains on all the data
    assert found[1].where.startswith("tools/unsharded.py:"), found[1].where
    assert "DataLoader(" in found[1].source


def test_too_large_climbing_and_missing_paths_are_refused_before_anything_starts(project, tmp_path):
    run = tmp_path / "run"
    too_large = ddpnb.Script("train.py", ["config/small.json"], ["data"], max_copy_mb=0.002)
    with pytest.raises(ConfigError, match=r"more than max_copy_mb=0.002.*largest: data \("):
        ddpnb.launch(too_large, run)
    with pytest.raises(ConfigError, match=r"\.\./own/datautils\.py: not inside the current folder"):
        ddpnb.launch(ddpnb.Script("train.py", files=["../own/datautils.py"]), run)
    with pytest.raises(ConfigError, match="absolute path"):
        ddpnb.Script("../own/linear.py")
    with pytest.raises(ConfigError, match="no_such_folder: no such file or folder"):
        ddpnb.launch(ddpnb.Script("train.py", files=["no_such_folder"]), run)
    assert not run.exists()
