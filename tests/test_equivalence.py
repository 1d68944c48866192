"""DDP is data parallelism, not a different algorithm: 1 and 2 processes agree."""

import pytest
from conftest import TINY, tiny_config

import ddpnb

pytestmark = pytest.mark.slow

# Float32 sums in a different order (one batch of 16 vs two of 8, then an all-reduce)
# differ by ~1e-7 relative per step; over 32 SGD steps that stays well under 1e-4.
# A real difference (padding, a missing all-reduce, per-rank batch statistics) is >1e-2.
RTOL = 1e-4
TINY_EPOCHS = TINY["epochs"]


def test_one_and_two_processes_give_the_same_curve(tiny_data, tmp_path):
    """About 60 s under two workers: two trainings, compared epoch by epoch."""
    # SqueezeNet without dropout has no BatchNorm and no randomness of its own, and with
    # augment="none" the only difference left is how the global batch is split.
    common = dict(
        model="squeezenet1_1",
        model_kwargs={"dropout": 0.0},
        augment="none",
        lr=0.02,
        image_size=32,
        epochs=4,
    )
    one = ddpnb.launch(
        tiny_config(tiny_data, batch_size=16, **common),
        tmp_path / "one",
        nnodes=1,
        progress="none",
    )
    two = ddpnb.launch(
        tiny_config(tiny_data, batch_size=8, **common),
        tmp_path / "two",
        nnodes=1,
        nproc_per_node=2,
        progress="none",
    )
    a, b = one.metrics.epochs, two.metrics.epochs
    assert [e["world_size"] for e in b] == [2] * 4
    for ea, eb in zip(a, b):
        for key in ("train_loss", "val_loss"):
            assert eb[key] == pytest.approx(ea[key], rel=RTOL), (key, ea[key], eb[key])
        assert eb["val_acc"] == pytest.approx(ea["val_acc"], abs=1 / 37 + 1e-9)
    # The curve must move, or agreement would prove nothing.
    assert a[-1]["train_loss"] < a[0]["train_loss"] - 0.02


def test_shared_memory_average_is_bit_identical_to_gloo(layout_run, tiny_data, tmp_path):
    """About 30 s: a gloo run to compare with the session's shared-memory 1x2 run, bit for bit."""
    # At two ranks both paths compute a/2 + b/2 per element: the weights must be equal to
    # the bit, not just close, or the shared-memory path would change training.
    shm = layout_run("1x2")  # comm_hook="auto" takes shared memory on one host
    assert "averaged through shared memory" in (shm.run_dir / "logs" / "node-0.log").read_text()
    gloo = ddpnb.launch(
        tiny_config(tiny_data, comm_hook="none"),
        tmp_path / "gloo",
        nnodes=1,
        nproc_per_node=2,
        progress="none",
    )
    assert "averaged through gloo all-reduce" in (gloo.run_dir / "logs" / "node-0.log").read_text()
    for rank in (0, 1):
        a = [r["param_checksum"] for r in shm.metrics.ranks[rank]]
        b = [r["param_checksum"] for r in gloo.metrics.ranks[rank]]
        assert a == b and len(a) == TINY_EPOCHS
    for ea, eb in zip(shm.metrics.epochs, gloo.metrics.epochs):
        assert (ea["train_loss"], ea["val_loss"]) == (eb["train_loss"], eb["val_loss"])
