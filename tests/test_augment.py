"""augment="auto" is safe on data it does not know: photo crops only for colour photos."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from conftest import tiny_config
from PIL import Image

import ddpnb
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
    assert effective["augment_reason"].startswith("auto -> none: grayscale 16x16")
    assert effective["world_size"] == 2 and effective["threads"] >= 1
    assert effective["backend"] == "gloo"
    assert effective["lr"] == cfg.lr  # the config itself is in there too
