import json

from matplotlib.figure import Figure

import ddpnb


def _fake_run(path, world_size, restart_at=None):
    path.mkdir()
    (path / "ranks").mkdir()
    with open(path / "metrics.jsonl", "w") as f:
        for e in range(1, 5):
            restarts = int(restart_at is not None and e >= restart_at)
            f.write(
                json.dumps(
                    {
                        "epoch": e,
                        "world_size": world_size,
                        "train_loss": 2 / e,
                        "train_acc": 0.2 * e,
                        "val_loss": 2.2 / e,
                        "val_acc": 0.21 * e,
                        "train_samples": 100,
                        "val_samples": 37,
                        "epoch_seconds": 1.0,
                        "images_per_second": 100.0 * world_size,
                        "restart_count": restarts,
                    }
                )
                + "\n"
            )
        f.write('{"epoch": 5, "trunc')  # a write in progress is skipped
    for r in range(world_size):
        with open(path / "ranks" / f"rank-{r}.jsonl", "w") as f:
            f.write(json.dumps({"epoch": 4, "global_rank": r, "images_per_second": 100.0}) + "\n")
    return path


def test_load_metrics_skips_a_torn_line(tmp_path):
    m = ddpnb.load_metrics(_fake_run(tmp_path / "a", 2))
    assert m.series("epoch") == [1, 2, 3, 4] and sorted(m.ranks) == [0, 1]
    assert m.final["val_acc"] == 0.84


def test_plot_curves_overlays_runs_and_marks_restarts(tmp_path):
    a = _fake_run(tmp_path / "a", 1)
    b = _fake_run(tmp_path / "b", 2, restart_at=3)
    fig = ddpnb.plot_curves([a, b], labels=["one", "two"])
    assert isinstance(fig, Figure)
    loss_ax, acc_ax = fig.axes
    labels = [line.get_label() for line in acc_ax.get_lines()]
    assert labels == ["one train", "one val", "two train", "two val", "two: restart"]
    resumed = acc_ax.get_lines()[-1]
    assert list(resumed.get_xdata()) == [3]
    assert list(loss_ax.get_lines()[1].get_ydata()) == [2.2 / e for e in range(1, 5)]
    # One legend, the figure's, below the plots: none inside an axis, over the curves.
    assert loss_ax.get_legend() is None and acc_ax.get_legend() is None
    assert [t.get_text() for t in fig.legends[0].get_texts()] == labels
    fig.savefig(tmp_path / "c.png")
    legend, axes = fig.legends[0].get_window_extent(), [ax.get_window_extent() for ax in fig.axes]
    assert all(legend.y1 <= box.y0 for box in axes)  # drawn: under both plots


def test_plot_throughput_bars(tmp_path):
    fig = ddpnb.plot_throughput([_fake_run(tmp_path / "a", 1), _fake_run(tmp_path / "b", 2)])
    heights = [p.get_height() for p in fig.axes[0].patches]
    assert heights == [100.0, 100.0, 100.0, 100.0, 200.0]


def test_cli_plot(tmp_path):
    import subprocess
    import sys

    a = _fake_run(tmp_path / "a", 1)
    out = tmp_path / "c.png"
    subprocess.run([sys.executable, "-m", "ddpnb", "plot", str(a), "--out", str(out)], check=True)
    assert out.read_bytes()[:4] == b"\x89PNG"


def test_import_has_no_side_effects():
    import subprocess
    import sys

    code = (
        "import os, logging, matplotlib\n"
        "env = dict(os.environ); rc = dict(matplotlib.rcParams)\n"
        "import ddpnb\n"
        "assert dict(os.environ) == env\n"
        "assert dict(matplotlib.rcParams) == rc\n"
        "assert logging.getLogger('ddpnb').handlers == []\n"
        "import torch; assert not torch.cuda.is_initialized()\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_plot_scaling_splits_each_ranks_time(tmp_path):
    runs = []
    for name, ws in (("1x1", 1), ("1x2", 2)):
        run = _fake_run(tmp_path / name, ws)
        with open(run / "ranks" / "rank-0.jsonl", "a") as f:
            split = {"data_wait_seconds": 0.1, "compute_seconds": 2.0, "comm_seconds": 0.5}
            f.write(json.dumps({"epoch": 5, "images_per_second": 50.0, **split}) + "\n")
        runs.append(run)
    fig = ddpnb.plot_scaling(runs, labels=["1x1", "1x2"])
    ips_ax, split_ax = fig.axes
    assert [round(p.get_height()) for p in ips_ax.patches] == [100, 200]
    assert any("200%" in t.get_text() for t in ips_ax.texts)  # efficiency vs the first run
    # three stacked parts for each of the 1 + 2 ranks; rank 0's compute sits on its data wait
    heights = [round(p.get_height(), 2) for p in split_ax.patches]
    assert heights[:3] == [0.1, 2.0, 0.5] and len(heights) == 9
    assert split_ax.patches[1].get_y() == 0.1
    assert {t.get_text() for t in split_ax.get_legend().get_texts()} == {
        "data wait",
        "compute",
        "communication (not overlapped)",
    }


def test_plot_class_counts_bars_are_the_counts(tiny_data):
    from conftest import TRAIN_PER_CLASS, VAL_COUNTS

    summary = ddpnb.inspect_dataset(tiny_data, show=False)
    for data in (tiny_data, summary):  # a folder, or the summary already in hand
        fig = ddpnb.plot.plot_class_counts(data)
        ax = fig.axes[0]
        heights = [p.get_height() for p in ax.patches]
        assert heights == [TRAIN_PER_CLASS] * 10 + VAL_COUNTS
        legend = [t.get_text() for t in ax.get_legend().get_texts()]
        assert legend == [f"train ({10 * TRAIN_PER_CLASS})", f"val ({sum(VAL_COUNTS)})"]
        assert [t.get_text() for t in ax.get_xticklabels()] == [str(c) for c in range(10)]


def test_plot_samples_shows_the_first_images_of_each_class(tiny_data, tmp_path):
    import numpy as np
    from PIL import Image

    fig = ddpnb.plot.plot_samples(tiny_data, per_class=2, max_classes=4)
    assert len(fig.axes) == 2 * 4
    assert [ax.get_title() for ax in fig.axes[:4]] == ["0", "1", "2", "3"]
    first = sorted((tiny_data / "train" / "1").iterdir())[0]
    shown = fig.axes[1].get_images()[0].get_array()  # row 0, class "1"
    assert np.array_equal(np.asarray(shown), np.asarray(Image.open(first)))
    fig.savefig(tmp_path / "s.png")
    assert (tmp_path / "s.png").read_bytes()[:4] == b"\x89PNG"


def test_a_log_loss_axis_labels_one_two_five_of_each_decade():
    from matplotlib.figure import Figure

    from ddpnb.plot import label_log_axis

    ax = Figure().subplots()
    ax.plot([1, 2, 3], [150, 2.1, 1.3])  # epoch 1's spike, then a loss near 2
    ax.set_yscale("log")
    label_log_axis(ax)
    ax.figure.canvas.draw()
    low, high = ax.get_ylim()
    shown = [t.get_text() for t in ax.get_yticklabels() if low <= t.get_position()[1] <= high]
    assert {"2", "5", "10", "20", "50", "100"} <= set(shown), shown  # a tick beside the 2


def test_a_log_loss_axis_within_one_decade_has_several_labels():
    """A loss between 0.07 and 0.18 (notebook 09's): more than the single label 0.1."""
    from matplotlib.figure import Figure

    from ddpnb.plot import label_log_axis

    ax = Figure().subplots()
    ax.plot([1, 2, 3], [0.18, 0.1, 0.07])
    ax.set_yscale("log")
    label_log_axis(ax)
    ax.figure.canvas.draw()
    low, high = ax.get_ylim()
    shown = [t.get_text() for t in ax.get_yticklabels() if low <= t.get_position()[1] <= high]
    assert {"0.07", "0.1", "0.15"} <= set(shown) and len(shown) >= 4, shown  # one above 0.1


def test_the_epoch_axis_has_whole_epochs_only(tmp_path):
    """Two epochs: ticks at 1 and 2, not 1.2, 1.4 ... (nor 0.5 and 2.5)."""
    run = tmp_path / "run"
    run.mkdir()
    rows = [{"epoch": e, "train_loss": 1.0 / e, "val_loss": 1.2 / e, "val_acc": 0.4 * e}
            for e in (1, 2)]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    fig = ddpnb.plot_curves(run)
    fig.canvas.draw()
    for ax in fig.axes:
        ticks = [t for t in ax.get_xticks() if ax.get_xlim()[0] <= t <= ax.get_xlim()[1]]
        assert ticks and all(float(t).is_integer() for t in ticks), ticks
