"""The pitfall switches (notebook 06) at world size 2: each mistake shows in the records."""

import logging
import math
import os
import subprocess
import sys

import pytest
from conftest import TRAIN_PER_CLASS, VAL_COUNTS, tiny_config

import ddpnb
from ddpnb.data import inspect_dataset, subset_dataset
from ddpnb.errors import ConfigError

TRAIN_SIZE = 10 * TRAIN_PER_CLASS
VAL_SIZE = sum(VAL_COUNTS)  # 37: odd, so padded shards must repeat an image


def test_switches_default_to_correct_and_are_listed():
    assert ddpnb.TrainConfig().pitfalls_off == []
    cfg = ddpnb.TrainConfig(set_epoch=False, thread_budget=False)
    assert cfg.pitfalls_off == ["set_epoch", "thread_budget"]


def test_thread_budget_off_with_fixed_threads_is_rejected():
    with pytest.raises(ConfigError, match="threads=0"):
        ddpnb.TrainConfig(thread_budget=False, threads=2)


def test_subset_keeps_classes_balanced(tiny_data, tmp_path):
    root = subset_dataset(tiny_data, tmp_path / "sub", train=30, val=11)
    s = inspect_dataset(root, show=False)
    assert s.ok and s.split_size("train") == 30 and s.split_size("val") == 11
    assert set(s.counts["train"].values()) == {3}
    assert sorted(s.counts["val"].values()) == [1] * 9 + [2]
    assert subset_dataset(tiny_data, root, train=30, val=11) == root  # same call: kept
    with pytest.raises(ddpnb.DdpnbError, match="between 10"):
        subset_dataset(tiny_data, tmp_path / "bad", train=5, val=11)


_runs: dict = {}


@pytest.fixture(scope="module")
def pitfall_run(tiny_data, tmp_path_factory):
    """Run (and cache) a tiny 2-node training with one pitfall switch off."""

    def run(switch: str, **extra):
        if switch not in _runs:
            cfg = tiny_config(tiny_data, **{switch: False}, **extra)
            _runs[switch] = ddpnb.launch(
                cfg, tmp_path_factory.mktemp(f"pitfall-{switch}"), nnodes=2, progress="none"
            )
        return _runs[switch]

    return run


def _epoch(job, epoch: int) -> list[dict]:
    return [records[epoch - 1] for records in job.metrics.ranks.values()]


@pytest.mark.slow
def test_without_sampler_every_rank_trains_on_the_whole_split(layout_run, pitfall_run):
    base, bad = layout_run("2x1"), pitfall_run("distributed_sampler")
    for epoch in (1, 2):
        assert [r["train_samples"] for r in _epoch(base, epoch)] == [TRAIN_SIZE // 2] * 2
        assert [r["train_samples"] for r in _epoch(bad, epoch)] == [TRAIN_SIZE] * 2
        # The same order on both ranks: they do the same work twice.
        assert len({r["order_hash"] for r in _epoch(bad, epoch)}) == 1
        assert len({r["order_hash"] for r in _epoch(base, epoch)}) == 2
    assert bad.metrics.final["train_samples"] == 2 * TRAIN_SIZE
    log = bad.log_paths[0].read_text()
    assert "pitfall switch distributed_sampler is OFF" in log


@pytest.mark.slow
def test_without_set_epoch_every_epoch_repeats_the_order(layout_run, pitfall_run):
    base = layout_run("2x1")
    bad = pitfall_run("set_epoch", max_steps_per_epoch=1)
    for rank in (0, 1):
        hashes = [r["order_hash"] for r in bad.metrics.ranks[rank]]
        assert hashes[0] == hashes[1]
        assert len({r["order_hash"] for r in base.metrics.ranks[rank]}) == 2


@pytest.mark.slow
def test_padded_validation_counts_an_image_twice(layout_run, pitfall_run):
    base = layout_run("2x1")
    bad = pitfall_run("exact_validation", max_steps_per_epoch=1)
    padded = math.ceil(VAL_SIZE / 2)
    assert [r["val_samples"] for r in _epoch(bad, 1)] == [padded, padded]
    assert bad.metrics.final["val_samples"] == 2 * padded == VAL_SIZE + 1
    assert sorted(r["val_samples"] for r in _epoch(base, 1)) == [VAL_SIZE // 2, padded]
    assert base.metrics.final["val_samples"] == VAL_SIZE


@pytest.mark.slow
def test_mean_of_rank_means_is_reported_next_to_the_exact_value(layout_run, pitfall_run):
    bad = pitfall_run("reduce_sums", max_steps_per_epoch=1)
    final, ranks = bad.metrics.final, _epoch(bad, 2)
    for key in ("val_loss", "val_acc"):
        means = [r[key] for r in ranks]
        counts = [r["val_samples"] for r in ranks]
        assert final[key] == pytest.approx(sum(means) / 2, rel=1e-9)
        weighted = sum(m * n for m, n in zip(means, counts)) / sum(counts)
        assert final[f"{key}_exact"] == pytest.approx(weighted, rel=1e-9)
    # Shards of 19 and 18 images: the unweighted mean is off (loss never ties exactly).
    assert final["val_loss"] != pytest.approx(final["val_loss_exact"], rel=1e-12, abs=0)
    base = layout_run("2x1").metrics.final
    assert base["val_acc"] == base["val_acc_exact"] and base["val_loss"] == base["val_loss_exact"]


def _torch_default_threads() -> int:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    out = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.get_num_threads())"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    return int(out.stdout)


@pytest.mark.slow
def test_thread_budget_off_uses_torch_default_threads(layout_run, pitfall_run, caplog):
    with caplog.at_level(logging.WARNING, logger="ddpnb"):
        bad = pitfall_run("thread_budget", max_steps_per_epoch=2, epochs=1)
    assert "PITFALL SWITCH OFF: thread_budget=False" in caplog.text
    budget = max(1, (os.cpu_count() or 1) // 2)
    assert [r["threads"] for r in _epoch(layout_run("2x1"), 1)] == [budget] * 2
    assert [r["threads"] for r in _epoch(bad, 1)] == [_torch_default_threads()] * 2


@pytest.mark.slow
def test_every_rank_holds_identical_parameters(layout_run, pitfall_run):
    for job in (layout_run("2x1"), pitfall_run("distributed_sampler")):
        sums = [{r["param_checksum"] for r in _epoch(job, e)} for e in (1, 2)]
        assert all(len(s) == 1 for s in sums)  # one checksum per epoch: the copies agree
        assert sums[0] != sums[1]  # and they did train
