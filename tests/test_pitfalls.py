"""Notebook 06's pitfalls are small marked edits of the worker. Each one's records at world
size 2 are proven on the notebook's own runs (tests/test_notebooks.py::test_06_pitfalls)."""

import json

import pytest

import ddpnb
from ddpnb import pitfalls
from ddpnb.data import inspect_dataset, subset_dataset
from ddpnb.errors import ConfigError
from ddpnb.source import WORKER_PATH


def test_every_pitfall_is_a_small_marked_edit_of_the_worker():
    worker = WORKER_PATH.read_text().splitlines()
    for name, pitfall in pitfalls.PITFALLS.items():
        text = pitfalls.variant(name)
        compile(text, f"train_ddp_{name}.py", "exec")  # the variant runs
        changed = [ln for ln in pitfalls.edit(name).splitlines() if ln[:1] in "+-"][2:]
        assert 0 < len(changed) <= 4 and len(text.splitlines()) >= len(worker) - 1, name
        assert "MISTAKE" in pitfalls.edit(name) and len(pitfall.harm) > 20
    with pytest.raises(ConfigError, match="no_sampler"):
        pitfalls.variant("no-such-pitfall")


def test_the_retired_switches_are_refused_with_where_they_went(tmp_path):
    with pytest.raises(ConfigError, match="ddpnb.pitfalls"):
        ddpnb.TrainConfig().replace(set_epoch=False)
    # An earlier version's config.json, which holds them, still loads.
    saved = {**ddpnb.TrainConfig().to_dict(), "thread_budget": True, "pipeline": "auto"}
    (tmp_path / "config.json").write_text(json.dumps(saved))
    assert ddpnb.TrainConfig.load(tmp_path / "config.json") == ddpnb.TrainConfig()


def test_subset_keeps_classes_balanced(tiny_data, tmp_path):
    root = subset_dataset(tiny_data, tmp_path / "sub", train=30, val=11)
    s = inspect_dataset(root, show=False)
    assert s.ok and s.split_size("train") == 30 and s.split_size("val") == 11
    assert set(s.counts["train"].values()) == {3}
    assert sorted(s.counts["val"].values()) == [1] * 9 + [2]
    assert subset_dataset(tiny_data, root, train=30, val=11) == root  # same call: kept
    with pytest.raises(ddpnb.DdpnbError, match="between 10"):
        subset_dataset(tiny_data, tmp_path / "bad", train=5, val=11)
