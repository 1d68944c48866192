"""augment="auto" is safe on data it does not know: photo crops only for colour photos."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import tiny_config
from PIL import Image
from torch.utils.data import DataLoader

import ddpnb
from ddpnb import worker
from ddpnb.worker import resolve_augment

AUTO = {"augment": "auto"}


def write_folder(root: Path, size: tuple[int, int], mode: str, per_class: int = 2) -> Path:
    rng = np.random.default_rng(0)
    for split in ("train", "val"):
        for c in ("a", "b"):
            d = root / split / c
            d.mkdir(parents=True)
            for i in range(per_class):
                shape = (size[1], size[0], 3) if mode == "RGB" else (size[1], size[0])
                pixels = rng.integers(0, 256, shape, dtype=np.uint8)
                Image.fromarray(pixels, mode=mode).save(d / f"{i}.png")
    return root


def test_colour_photos_get_photo_augmentation(tmp_path):
    root = write_folder(tmp_path / "photos", (160, 160), "RGB")
    augment, reason = resolve_augment(AUTO, root)
    assert augment == "photo"
    assert reason.startswith("auto -> photo: colour 160x160 images")


@pytest.mark.parametrize(
    "size, mode, kind",
    [((160, 160), "L", "grayscale 160x160"), ((32, 32), "RGB", "colour 32x32")],
)
def test_grayscale_or_small_images_get_none(tmp_path, size, mode, kind):
    # Grayscale images saved as RGB (three equal channels) are grayscale too.
    root = write_folder(tmp_path / "data", size, mode)
    augment, reason = resolve_augment(AUTO, root)
    assert augment == "none"
    assert reason == f"auto -> none: {kind} images, not photo-like; set augment='photo' to opt in"


def test_digits_manifest_and_explicit_choice(tmp_path):
    root = write_folder(tmp_path / "data", (160, 160), "RGB")
    assert resolve_augment({"augment": "none"}, root) == ("none", "none: set in the config")
    (root / "manifest.json").write_text(json.dumps({"source": "digits"}))
    assert resolve_augment(AUTO, root)[0] == "digits"


@pytest.mark.slow
def test_unknown_grayscale_digits_train_without_photo_crops_or_warnings(data_copy, tmp_path):
    # The user's own grayscale digits: no manifest from prepare_digits.
    (data_copy / "manifest.json").unlink(missing_ok=True)
    cfg = tiny_config(data_copy, epochs=1, max_steps_per_epoch=2)
    job = ddpnb.launch(cfg, tmp_path / "run", nnodes=1, nproc_per_node=2, progress="none")
    log = (job.run_dir / "logs" / "node-0.log").read_text()
    line = "augment auto -> none: grayscale 16x16 images, not photo-like; set augment='photo'"
    assert log.count(line) == 1  # rank 0 only
    assert "Warning" not in log  # e.g. DDP's deprecated broadcast_buffers, once per rank
    effective = json.loads((job.run_dir / "effective_config.json").read_text())
    assert job.metrics.effective == effective
    assert effective["augment"] == "none" and effective["augment_requested"] == "auto"
    assert effective["images"] == "decoded in memory"  # make_data's faster path
    assert effective["augment_reason"].startswith("auto -> none: grayscale 16x16")
    assert effective["world_size"] == 2 and effective["threads"] >= 1
    assert effective["backend"] == "gloo"
    assert effective["lr"] == cfg.lr  # the config itself is in there too


# make_data's faster path: small datasets decoded once, transformed a batch at a time.
CFG = {"image_size": 16, "num_workers": 0}


def splits(data: Path, augment: str):
    train, val, _ = worker.image_folders({**CFG, "augment": augment}, worker.who_am_i(), data)
    return (train, val), worker.decoded_in_memory(train, val, CFG, augment)


def test_in_memory_batches_are_the_per_image_transforms_batched(tiny_data):
    (train, val), (dtrain, dval) = splits(tiny_data, "none")
    assert isinstance(dtrain, worker.DecodedImages) and dval.classes == val.classes
    for classic, decoded in ((train, dtrain), (val, dval)):
        for (x, y), (dx, dy) in zip(
            DataLoader(classic, batch_size=8), DataLoader(decoded, batch_size=8)
        ):
            assert torch.equal(x, dx) and torch.equal(y, dy)
    assert len(dtrain) == len(train) and all(dtrain.decoded)  # each decoded once, then kept


def test_in_memory_digits_get_their_own_random_affine_each(tiny_data):
    (train, _), (dtrain, _) = splits(tiny_data, "digits")
    torch.manual_seed(0)
    batch = torch.stack([x for x, _ in dtrain.__getitems__([0] * 8)])
    plain = torch.stack([x for x, _ in splits(tiny_data, "none")[1][0].__getitems__([0])])
    assert batch.shape == (8, 3, 16, 16)
    assert len({x.sum().item() for x in batch}) == 8  # eight different draws of one image
    assert not torch.equal(batch[0], plain[0])
    # The same kind of change as torchvision's RandomAffine on the classic path.
    classic = torch.stack([train[0][0] for _ in range(64)])
    mean = torch.stack([x for x, _ in dtrain.__getitems__([0] * 64)]).mean()
    assert abs(mean - classic.mean()) < 0.1


def test_random_affine_without_randomness_is_the_identity():
    x = torch.rand(4, 3, 16, 16)
    assert torch.equal(worker.random_affine(x, degrees=0, translate=0.0, scale=(1, 1)), x)


def test_photos_and_big_datasets_stay_decoded_per_load(tiny_data, monkeypatch):
    (train, val), decoded = splits(tiny_data, "photo")
    assert decoded == (train, val)  # photo crops are cut from the full-size image
    monkeypatch.setattr(worker, "DECODED_BYTES", 3 * 16 * 16 * (len(train) + len(val)) - 1)
    (train, val), decoded = splits(tiny_data, "none")
    assert decoded == (train, val)


@pytest.mark.slow
def test_each_rank_draws_its_own_augmentation(tiny_data, tmp_path):
    """Rank r's k-th image is not rotated, shifted and scaled as rank 0's k-th image is."""
    cfg = tiny_config(tiny_data, epochs=1, max_steps_per_epoch=2, augment="digits")
    job = ddpnb.launch(cfg, tmp_path / "run", nnodes=1, nproc_per_node=2, progress="none")
    first = {rank: records[0] for rank, records in job.metrics.ranks.items()}
    assert first[0]["rng_checksum"] != first[1]["rng_checksum"]  # two streams
    assert first[0]["param_checksum"] == first[1]["param_checksum"]  # one model
    # The draws themselves: the worker's seeding, then its batched random affine.
    draws = []
    for rank in (0, 1):
        torch.manual_seed(cfg.seed + rank)  # as main() seeds each rank after the model
        draws.append(worker.random_affine(torch.rand(4, 3, 16, 16).fill_(0.5), 10, 0.1, (0.9, 1.1)))
    assert not torch.equal(draws[0], draws[1])
