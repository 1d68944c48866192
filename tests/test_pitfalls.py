"""Notebook 06's pitfalls, variants of the worker at world size 2: each shows in the records."""

import json
import math
import os
import subprocess
import sys
import time

import pytest
from conftest import TRAIN_PER_CLASS, VAL_COUNTS, tiny_config

import ddpnb
from ddpnb import pitfalls
from ddpnb.data import inspect_dataset, subset_dataset
from ddpnb.errors import ConfigError, RunHung
from ddpnb.source import WORKER_PATH

TRAIN_SIZE = 10 * TRAIN_PER_CLASS
VAL_SIZE = sum(VAL_COUNTS)  # 37: odd, so padded shards must repeat an image


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


_runs: dict = {}


@pytest.fixture(scope="module")
def pitfall_run(tiny_data, tmp_path_factory):
    """Run (and cache) a tiny 2-node training of one pitfall's variant of the worker."""

    def run(name: str, env=None, **changes):
        if name not in _runs:
            folder = tmp_path_factory.mktemp(f"pitfall-{name}")
            script = pitfalls.script(tiny_config(tiny_data, **changes), name, folder)
            _runs[name] = ddpnb.launch(
                script, folder / "run", nnodes=2, env=env or {}, progress="none"
            )
        return _runs[name]

    return run


def _epoch(job, epoch: int) -> list[dict]:
    return [records[epoch - 1] for records in job.metrics.ranks.values()]


@pytest.mark.slow
def test_without_sampler_every_rank_trains_on_the_whole_split(layout_run, pitfall_run):
    base, bad = layout_run("2x1"), pitfall_run("no_sampler")
    for epoch in (1, 2):
        assert [r["train_samples"] for r in _epoch(base, epoch)] == [TRAIN_SIZE // 2] * 2
        assert [r["train_samples"] for r in _epoch(bad, epoch)] == [TRAIN_SIZE] * 2
        assert len({r["order_hash"] for r in _epoch(base, epoch)}) == 2  # two shards
    assert bad.metrics.final["train_samples"] == 2 * TRAIN_SIZE
    assert "MISTAKE: no sampler" in (bad.run_dir / "train_ddp.py").read_text()


@pytest.mark.slow
def test_without_set_epoch_every_epoch_repeats_the_order(layout_run, pitfall_run):
    base = layout_run("2x1")
    bad = pitfall_run("no_set_epoch", max_steps_per_epoch=1)
    for rank in (0, 1):
        hashes = [r["order_hash"] for r in bad.metrics.ranks[rank]]
        assert hashes[0] == hashes[1]
        assert len({r["order_hash"] for r in base.metrics.ranks[rank]}) == 2


@pytest.mark.slow
def test_padded_validation_counts_an_image_twice(layout_run, pitfall_run):
    base = layout_run("2x1")
    bad = pitfall_run("padded_validation", max_steps_per_epoch=1)
    padded = math.ceil(VAL_SIZE / 2)
    assert [r["val_samples"] for r in _epoch(bad, 1)] == [padded, padded]
    assert bad.metrics.final["val_samples"] == 2 * padded == VAL_SIZE + 1
    assert sorted(r["val_samples"] for r in _epoch(base, 1)) == [VAL_SIZE // 2, padded]
    assert base.metrics.final["val_samples"] == VAL_SIZE


@pytest.mark.slow
def test_mean_of_rank_means_differs_from_the_exact_value(layout_run, pitfall_run):
    base, bad = layout_run("2x1"), pitfall_run("mean_of_means")
    final, ranks = bad.metrics.final, _epoch(bad, 2)
    for key in ("val_loss", "val_acc"):
        means = [r[key] for r in ranks]
        counts = [r["val_samples"] for r in ranks]
        assert final[key] == pytest.approx(sum(means) / 2, rel=1e-9)
        weighted = sum(m * n for m, n in zip(means, counts)) / sum(counts)
        assert base.metrics.final[key] == pytest.approx(weighted, rel=1e-9)
    # The same training (the same parameters after every epoch), reported differently:
    # shards of 19 and 18 images make the unweighted mean wrong (loss never ties exactly).
    for epoch in (1, 2):
        assert _epoch(bad, epoch)[0]["param_checksum"] == _epoch(base, epoch)[0]["param_checksum"]
    assert final["val_loss"] != pytest.approx(base.metrics.final["val_loss"], rel=1e-12, abs=0)
    assert final["val_samples"] == 1  # the counts are lost on the way


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
def test_without_a_thread_budget_every_process_takes_torch_default(layout_run, pitfall_run):
    # Plain torchrun with one process per node leaves OMP_NUM_THREADS unset, so torch
    # takes every core in each process; ddpnb's launcher sets it, the notebook unsets it.
    cores = {"OMP_NUM_THREADS": str(_torch_default_threads())}
    bad = pitfall_run("no_thread_budget", env=cores, max_steps_per_epoch=2, epochs=1)
    budget = max(1, (os.cpu_count() or 1) // 2)
    assert [r["threads"] for r in _epoch(layout_run("2x1"), 1)] == [budget] * 2
    assert [r["threads"] for r in _epoch(bad, 1)] == [_torch_default_threads()] * 2


@pytest.mark.slow
def test_a_barrier_on_rank_0_only_hangs_and_the_watch_stops_it(tiny_data, tmp_path):
    script = pitfalls.script(tiny_config(tiny_data), "barrier_on_rank0", tmp_path)
    job = ddpnb.launch(
        script, tmp_path / "run", nnodes=2, progress="none", hang_timeout=8, wait=False
    )
    try:
        with pytest.raises(RunHung) as caught:
            job.wait(timeout=120)
        deadline = time.monotonic() + 10
        while job.pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert job.pids() == []  # every process of the run has ended
    finally:
        job.stop()
    lines = pitfalls.variant("barrier_on_rank0").splitlines()
    line = next(i for i, text in enumerate(lines, 1) if "dist.barrier()  # nobody" in text)
    message = str(caught.value)
    assert f"rank 0 waits in barrier at train_ddp.py:{line} (dist.barrier()" in message
    assert "rank 1 waits in" in message and "different collectives" in message
    # Rank 1's line is its training step's, not the worker's shared-memory helper (Part 2).
    step = next(i for i, text in enumerate(lines, 1) if text.strip().startswith("loss.backward()"))
    assert f"at train_ddp.py:{step} (loss.backward()" in message
    assert "self.flag" not in message and "the script's helpers (hook, allreduce, agree)" in message
    assert "barrier" in str(caught.value.stacks)
    assert len(job.metrics.epochs) == 1  # the first epoch ended; the second never did


@pytest.mark.slow
def test_every_rank_holds_identical_parameters(layout_run, pitfall_run):
    for job in (layout_run("2x1"), pitfall_run("no_sampler")):
        sums = [{r["param_checksum"] for r in _epoch(job, e)} for e in (1, 2)]
        assert all(len(s) == 1 for s in sums)  # one checksum per epoch: the copies agree
        assert sums[0] != sums[1]  # and they did train
