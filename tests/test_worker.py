"""The worker under real torchrun (gloo, 127.0.0.1) at world sizes 1, 2 and 3."""

import ast
import math
import subprocess
import sys

import pytest
import torch
import torchvision
from conftest import TRAIN_PER_CLASS, VAL_COUNTS, tiny_config

import ddpnb
from ddpnb.script import REPORTING_PATH
from ddpnb.source import WORKER_PATH
from ddpnb.worker import replace_head

pytestmark = pytest.mark.slow
TRAIN_SIZE = 10 * TRAIN_PER_CLASS
VAL_SIZE = sum(VAL_COUNTS)


@pytest.mark.parametrize("layout", ["1x1", "1x2", "2x1", "3x1"])
def test_metrics_and_rank_files(layout_run, layout):
    """Up to about 35 s: the first test to ask for a layout pays for its run (3x1: three agents)."""
    job = layout_run(layout)
    nnodes, nproc = map(int, layout.split("x"))
    world_size = nnodes * nproc
    epochs = job.metrics.epochs
    assert [e["epoch"] for e in epochs] == [1, 2]
    for e in epochs:
        assert e["world_size"] == world_size
        assert e["val_samples"] == VAL_SIZE  # every val image exactly once
        assert e["train_samples"] >= TRAIN_SIZE
        assert e["restart_count"] == 0
        assert all(math.isfinite(e[k]) for k in ("train_loss", "val_loss"))
        assert 0 <= e["val_acc"] <= 1 and e["images_per_second"] > 0
    ranks = job.metrics.ranks
    assert sorted(ranks) == list(range(world_size))
    for epoch in (1, 2):
        recs = [ranks[r][epoch - 1] for r in ranks]
        assert sum(r["val_samples"] for r in recs) == VAL_SIZE
        # DistributedSampler pads train shards to equal size: they cover the split.
        assert (
            sum(r["train_samples"] for r in recs) == math.ceil(TRAIN_SIZE / world_size) * world_size
        )
        assert {r["node_rank"] for r in recs} == set(range(nnodes))
        assert {r["local_rank"] for r in recs} == set(range(nproc))
        for r in recs:
            assert r["data_wait_seconds"] >= 0 and r["compute_seconds"] > 0
        # Parameters and BatchNorm buffers: every rank validates one identical model.
        assert len({r["param_checksum"] for r in recs}) == 1
    assert (job.run_dir / "checkpoints" / "last.pt").exists()
    assert job.metrics.config["data_dir"] == job.config.data_dir


def test_worker_file_is_a_byte_copy_and_stdlib_only(layout_run):
    job = layout_run("1x1")
    assert (job.run_dir / "train_ddp.py").read_bytes() == WORKER_PATH.read_bytes()
    tree = ast.parse((job.run_dir / "train_ddp.py").read_text())
    imported = {
        (node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    }
    # torch, torchvision and the two files written beside it (the package's own modules
    # only when the package imports the worker as ddpnb.worker).
    needs = {"torch", "torchvision", "ddpnb_reporting", "ddpnb_constants", "ddpnb"}
    assert imported - sys.stdlib_module_names - {"__future__"} == needs
    assert (job.run_dir / "ddpnb_reporting.py").read_bytes() == REPORTING_PATH.read_bytes()
    doc = WORKER_PATH.read_text()
    assert "--nnodes 2 --node_rank 0" in doc and "--nnodes 2 --node_rank 1" in doc


def test_plain_python_run_is_world_size_one(tiny_data, tmp_path):
    cfg = tiny_config(tiny_data, epochs=1, max_steps_per_epoch=2)
    ddpnb.write_worker(cfg, tmp_path)
    subprocess.run(
        [sys.executable, str(tmp_path / "train_ddp.py"), "--config", str(tmp_path / "config.json")],
        check=True,
        capture_output=True,
    )
    (row,) = ddpnb.load_metrics(tmp_path).epochs
    assert row["world_size"] == 1 and row["val_samples"] == VAL_SIZE


def test_accuracy_rises_on_digits(digits_data, tmp_path):
    """About 40 s: an accuracy claim needs the real model on the real digits set (1,437
    images, 3 epochs); no smaller run shows learning."""
    cfg = ddpnb.TrainConfig(data_dir=str(digits_data), image_size=16, epochs=3, batch_size=64)
    job = ddpnb.launch(cfg, tmp_path / "run", nnodes=1, progress="none")
    accs = job.metrics.series("val_acc")
    assert accs[-1] > 0.8 and accs[-1] > accs[0]
    assert job.metrics.series("train_loss")[-1] < job.metrics.series("train_loss")[0]


@pytest.mark.parametrize(
    "name, attr",
    [("resnet18", "fc"), ("mobilenet_v3_small", "classifier"), ("squeezenet1_1", "classifier")],
)
def test_head_replacement(name, attr):
    model = replace_head(torchvision.models.get_model(name), 7)
    assert model(torch.zeros(2, 3, 64, 64)).shape == (2, 7)


def test_fused_sgd_takes_the_same_steps_as_the_plain_loop():
    # The worker's default optimizer is the fused kernel (3x faster per step on CPU); it must
    # train exactly like torch.optim.SGD's default implementation, up to float rounding.
    from ddpnb.worker import make_sgd

    cfg = {"lr": 0.05, "momentum": 0.9, "weight_decay": 5e-4}
    torch.manual_seed(0)
    fused_model = torchvision.models.resnet18(num_classes=10)
    plain_model = torchvision.models.resnet18(num_classes=10)
    plain_model.load_state_dict(fused_model.state_dict())
    fused = make_sgd(fused_model.parameters(), cfg)
    plain = torch.optim.SGD(plain_model.parameters(), foreach=False, **cfg)
    assert fused.defaults.get("fused") is True
    x, y = torch.rand(8, 3, 32, 32), torch.randint(0, 10, (8,))
    for _ in range(3):
        for model, opt in ((fused_model, fused), (plain_model, plain)):
            opt.zero_grad()
            torch.nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    for a, b in zip(fused_model.parameters(), plain_model.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
