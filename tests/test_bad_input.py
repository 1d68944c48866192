"""Bad input: each case of the issue's list gets a clear error before any process starts.

Where each case is tested:
missing data dir, corrupt image (before launch)   test_launch.test_bad_dataset_is_refused_before_launch
a split missing, train/val classes differ,
an empty class                                    test_dataset_problems_refused_before_launch (here)
corrupt image found only while loading            test_fault.test_worker_names_a_corrupt_image_found_while_loading
unknown model, weights missing / not a state dict test_launch.test_bad_config_values
nnodes/nproc_per_node/epochs/batch_size < 1 or
not integers, lr <= 0                             test_bad_numbers (here), test_launch.test_bad_launch_arguments,
                                                  test_config.test_bad_values_are_rejected
busy master_port                                  test_launch.test_busy_port_is_refused
node_rank >= nnodes in node_commands              test_cluster.test_node_rank_must_be_below_nnodes
run dir holding a different run's config          test_run_dir_with_another_run (here),
                                                  test_launch.test_finished_run_is_never_overwritten_silently
run dir not writable                              test_launch.test_unwritable_run_dir (a path under a file),
                                                  test_read_only_run_dir (here, a read-only mount)
disk full while writing a checkpoint              test_fault.test_full_disk_keeps_the_previous_checkpoint
"""

from __future__ import annotations

import json
import shutil

import pytest
from conftest import tiny_config, tmpfs

import ddpnb
from ddpnb.errors import ConfigError, DatasetError, RunDirError
from ddpnb.rundir import prepare_run_dir
from ddpnb.script import Script


def _move_val_class(root):
    (root / "val" / "3").rename(root / "val-3")


def _empty_class(root):
    for f in (root / "train" / "5").iterdir():
        f.unlink()


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda root: shutil.rmtree(root / "val"), "missing split: .*val does not exist"),
        (_move_val_class, r"train/val class sets differ: missing from val: \['3'\]"),
        (_empty_class, r"empty class: .*train/5 holds no readable images"),
    ],
)
def test_dataset_problems_refused_before_launch(data_copy, tmp_path, damage, words):
    damage(data_copy)
    with pytest.raises(DatasetError, match=words) as e:
        ddpnb.launch(tiny_config(data_copy), tmp_path / "run", nnodes=1)
    assert "Fix or remove" in str(e.value)  # ... and how to fix it
    assert not (tmp_path / "run").exists()  # nothing started, nothing written


@pytest.mark.parametrize(
    "launch_kwargs, config_changes, words",
    [
        ({"nnodes": "2"}, {}, "nnodes must be an integer >= 1"),
        ({"nproc_per_node": 1.0}, {}, "nproc_per_node must be an integer >= 1"),
        ({"nproc_per_node": -1}, {}, "nproc_per_node must be an integer >= 1"),
        ({}, {"epochs": "3"}, "epochs must be an? int"),
        ({}, {"batch_size": 0}, "batch_size must be an integer >= 1"),
        ({}, {"lr": -0.1}, "lr must be > 0"),
    ],
)
def test_bad_numbers(tiny_data, tmp_path, launch_kwargs, config_changes, words):
    with pytest.raises(ConfigError, match=words):
        config = tiny_config(tiny_data).to_dict() | config_changes
        ddpnb.launch(config, tmp_path / "run", **launch_kwargs)
    assert not (tmp_path / "run").exists()


def _fake_run(run_dir, config):
    run_dir.mkdir()
    config.save(run_dir / "config.json")
    (run_dir / "metrics.jsonl").write_text(json.dumps({"epoch": 1}) + "\n")
    (run_dir / "notes.txt").write_text("mine")  # not a run product: never removed


def test_run_dir_with_another_run(tiny_data, tmp_path):
    run = tmp_path / "run"
    _fake_run(run, tiny_config(tiny_data, lr=0.1))
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    other = tiny_config(tiny_data)
    with pytest.raises(RunDirError, match="already holds a run.*overwrite=True"):
        ddpnb.launch(other, run, nnodes=1)
    with pytest.raises(RunDirError, match="different config.*lr.*overwrite=True"):
        ddpnb.launch(other, run, nnodes=1, resume=True)
    assert {p.name: p.read_bytes() for p in run.iterdir()} == before  # nothing touched
    payload = Script.worker(other).payload()
    prepare_run_dir(run, payload, other, overwrite=True)  # what launch(overwrite=True) does first
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]


@pytest.mark.root
def test_read_only_run_dir(tiny_data, tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    with tmpfs(ro, "ro,size=1m"):
        with pytest.raises(RunDirError, match="not writable.*Read-only file system"):
            ddpnb.launch(tiny_config(tiny_data), ro / "run", nnodes=1)


@pytest.mark.parametrize("broken", ["script", "file"])
def test_a_syntax_error_is_named_before_anything_starts(tmp_path, broken):
    """The script and the .py files shipped with it are compiled first: file, line, text."""
    good = "import torch\nprint(torch.ones(1))\n"
    bad = "import torch\nx = [1,\n     2\nprint(x)\n"
    (tmp_path / "train.py").write_text(bad if broken == "script" else good)
    (tmp_path / "helpers.py").write_text(bad if broken == "file" else good)
    script = ddpnb.Script(tmp_path / "train.py", files=[tmp_path / "helpers.py"])
    name = "train.py" if broken == "script" else "helpers.py"
    with pytest.raises(ConfigError, match=rf"{name}, line 2: SyntaxError: '\[' was never closed"):
        ddpnb.launch(script, tmp_path / "run", nnodes=2, progress="none")
    assert not (tmp_path / "run").exists()  # nothing written, nothing started


def test_train_single_names_its_new_spelling_and_still_checks(tmp_path):
    cfg = ddpnb.TrainConfig(data_dir=str(tmp_path / "no-such-data"))
    with pytest.warns(FutureWarning, match=r"ddpnb\.launch\(cfg, run_dir, nnodes=1\)"):
        with pytest.raises(DatasetError):
            ddpnb.train_single(cfg, tmp_path / "run")
    assert not (tmp_path / "run").exists()
