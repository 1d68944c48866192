"""The report tables on real tiny runs: their rows and sums match what the runs did."""

import pytest
from conftest import TINY, TRAIN_PER_CLASS, VAL_COUNTS

import ddpnb
from ddpnb import tables

TRAIN_SIZE = 10 * TRAIN_PER_CLASS
VAL_SIZE = sum(VAL_COUNTS)
EPOCHS = TINY["epochs"]

pytestmark = pytest.mark.slow


def test_rank_table_has_a_row_per_rank_and_epoch(layout_run):
    job = layout_run("1x2")
    table = tables.rank_table(job)
    assert len(table) == job.world_size * EPOCHS
    assert [(r["epoch"], r["rank"]) for r in table] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    assert list(table[0]) == ["epoch", "rank", *tables.RANK_KEYS]
    for epoch in (1, 2):
        rows = [r for r in table if r["epoch"] == epoch]
        assert sum(r["val_samples"] for r in rows) == VAL_SIZE  # each image once
        assert sum(r["train_samples"] for r in rows) >= TRAIN_SIZE
        assert all(r["node_rank"] == 0 and r["images_per_second"] > 0 for r in rows)
    assert [r["local_rank"] for r in table[:2]] == [0, 1]
    text = str(table)
    assert text.splitlines()[0].split() == ["epoch", "rank", *tables.RANK_KEYS]
    assert len(text.splitlines()) == 1 + len(table)


def test_rank_table_last_epoch_and_several_runs(layout_run):
    """Up to about 30 s: the first test to ask for the session's 1x1 and 1x2 runs pays for them."""
    one, two = layout_run("1x1"), layout_run("1x2")
    last = tables.rank_table(two, ["val_samples"], last_epoch=True)
    assert [(r["epoch"], r["rank"]) for r in last] == [(EPOCHS, 0), (EPOCHS, 1)]
    assert tables.samples_seen(two)["val"] == VAL_SIZE == sum(r["val_samples"] for r in last)
    assert tables.samples_seen(one) == {"train": TRAIN_SIZE, "val": VAL_SIZE}
    both = tables.rank_table({"one": one, "two": two.run_dir}, ["train_samples"])
    assert [r["run"] for r in both] == ["one"] * EPOCHS + ["two"] * 2 * EPOCHS
    assert list(both[0]) == ["run", "epoch", "rank", "train_samples"]


def test_epoch_and_run_tables(layout_run):
    one, two = layout_run("1x1"), layout_run("1x2")
    epochs = tables.epoch_table(two, ["restart_count", "val_samples"])
    assert [r["epoch"] for r in epochs] == list(range(1, EPOCHS + 1))
    assert all(r["restart_count"] == 0 and r["val_samples"] == VAL_SIZE for r in epochs)
    runs = tables.run_table({"one": one, "two": two})
    assert [(r["run"], r["world_size"]) for r in runs] == [("one", 1), ("two", 2)]
    assert runs[1]["images_per_second"] == two.metrics.final["images_per_second"]


def test_scaling_table_is_what_plot_scaling_draws(layout_run):
    runs = {"1x1": layout_run("1x1"), "1x2": layout_run("1x2")}
    table = tables.scaling_table(runs)
    assert [(r["layout"], r["world_size"]) for r in table] == [("1x1", 1), ("1x2", 2)]
    finals = [job.metrics.final for job in runs.values()]
    assert [r["images/s"] for r in table] == [round(f["images_per_second"]) for f in finals]
    assert table[0]["efficiency"] == 1.0
    assert table[1]["efficiency"] == round(
        finals[1]["images_per_second"] / finals[0]["images_per_second"], 2
    )
    assert 0 < table[1]["communication share"] < 1
    assert table[0]["communication share"] < table[1]["communication share"]
    fig = ddpnb.plot_scaling(list(runs.values()), labels=list(runs))
    ips_ax, split_ax = fig.axes
    assert [p.get_height() for p in ips_ax.patches] == [r["images/s"] for r in table]
    assert len(split_ax.patches) == 3 * (1 + 2)  # data, compute, comm for each rank


def test_same_weights_and_run_figures(layout_run):
    one, two = layout_run("1x1"), layout_run("1x2")
    assert tables.same_weights(two, two.run_dir)
    assert not tables.same_weights(one, two)  # another global batch: other weights
    figures = tables.run_figures(two, prefix="ddp_")
    assert figures["ddp_world_size"] == 2 and figures["ddp_epochs"] == EPOCHS
    assert figures["ddp_val_acc"] == two.metrics.final["val_acc"]
    assert figures["ddp_train_seconds"] == pytest.approx(sum(two.metrics.series("epoch_seconds")))
    assert tables.run_figures(None, prefix="b_") == dict.fromkeys(
        ["b_" + k for k in ("val_acc", "images_per_second", "train_seconds", "epochs")]
        + ["b_world_size"]
    )


def test_node_log_lines(layout_run):
    job = layout_run("1x2")
    head = tables.node_log_lines(job, head=1).splitlines()
    assert head[0] == "--- node 0" and len(head) == 2
    assert head[1].startswith("$ ") and "--node_rank=0" in head[1]  # the agent's command
    chosen = tables.node_log_lines(job, ["attempt 0"], width=20).splitlines()
    assert chosen[0] == "--- node 0" and len(chosen) == 1 + 2  # one line per rank
    assert sorted(chosen[1:]) == ["[rank0] node 0 local", "[rank1] node 0 local"]
