"""DDP is data parallelism, not a different algorithm: 1 and 2 processes agree."""

import pytest
from conftest import tiny_config

import ddpnb

pytestmark = pytest.mark.slow

# Float32 sums in a different order (one batch of 16 vs two of 8, then an all-reduce)
# differ by ~1e-7 relative per step; over 32 SGD steps that stays well under 1e-4.
# A real difference (padding, a missing all-reduce, per-rank batch statistics) is >1e-2.
RTOL = 1e-4


def test_one_and_two_processes_give_the_same_curve(tiny_data, tmp_path):
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
