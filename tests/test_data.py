import json
import os
import shutil
import subprocess
import sys

import pytest
from PIL import Image

import ddpnb
from ddpnb.constants import dataset_fingerprint
from ddpnb.data import require_valid_dataset
from ddpnb.errors import DatasetError


def test_prepare_digits_writes_a_stratified_imagefolder(digits_data):
    s = ddpnb.inspect_dataset(digits_data, show=False)
    assert s.ok, s.problems
    assert s.classes == [str(c) for c in range(10)]
    assert s.split_size("train") + s.split_size("val") == 1797
    assert s.split_size("val") == 360  # 20 %
    for c in s.classes:  # stratified: every class keeps about the same share
        share = s.counts["val"][c] / (s.counts["val"][c] + s.counts["train"][c])
        assert 0.17 < share < 0.23
    assert s.image_sizes == {"16x16": 1797}
    manifest = json.loads((digits_data / "manifest.json").read_text())
    assert manifest["fingerprint"] == dataset_fingerprint(digits_data) == s.fingerprint
    assert manifest["source"] == "digits"


def test_prepare_is_deterministic_and_idempotent(tmp_path, digits_data):
    a = ddpnb.prepare_digits(tmp_path / "a", image_size=16)
    assert dataset_fingerprint(a) == dataset_fingerprint(digits_data)
    mtime = (a / "manifest.json").stat().st_mtime_ns
    ddpnb.prepare_digits(tmp_path / "a", image_size=16)  # same call: nothing happens
    assert (a / "manifest.json").stat().st_mtime_ns == mtime


def test_other_arguments_need_overwrite(tmp_path):
    root = ddpnb.prepare_digits(tmp_path / "d", image_size=8)
    with pytest.raises(DatasetError, match="overwrite=True"):
        ddpnb.prepare_digits(root, image_size=8, seed=1)
    ddpnb.prepare_digits(root, image_size=8, seed=1, overwrite=True)
    assert json.loads((root / "manifest.json").read_text())["params"]["seed"] == 1
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folders left


def test_a_half_written_tree_is_not_taken_as_finished(tmp_path):
    root = tmp_path / "d"
    (root / "train" / "0").mkdir(parents=True)  # what an interrupted writer could leave
    with pytest.raises(DatasetError, match="not a finished"):
        ddpnb.prepare_digits(root, image_size=8)
    ddpnb.prepare_digits(root, image_size=8, overwrite=True)
    assert ddpnb.inspect_dataset(root, show=False).ok


def test_interrupted_prepare_leaves_no_finished_tree(tmp_path):
    # Kill a real prepare mid-way: the target must not exist (only a temp folder may).
    code = (
        "import ddpnb, os, signal\n"
        "from PIL import Image\n"
        "orig = Image.Image.save\n"
        "n = [0]\n"
        "def save(self, *a, **k):\n"
        "    n[0] += 1\n"
        "    if n[0] == 500: os.kill(os.getpid(), signal.SIGKILL)\n"
        "    return orig(self, *a, **k)\n"
        "Image.Image.save = save\n"
        f"ddpnb.prepare_digits({str(tmp_path / 'd')!r}, image_size=8)\n"
    )
    subprocess.run([sys.executable, "-c", code], check=False)
    assert not (tmp_path / "d").exists()
    ddpnb.prepare_digits(tmp_path / "d", image_size=8)
    assert ddpnb.inspect_dataset(tmp_path / "d", show=False).split_size("train") == 1437


def test_every_problem_is_reported_at_once(data_copy, capsys):
    (data_copy / "val" / "3").rename(data_copy / "val3-moved")  # class missing from val
    corrupt = data_copy / "train" / "1" / "corrupt.png"
    corrupt.write_bytes(b"\x89PNG\r\n\x1a\nnot really")
    (data_copy / "train" / "2" / "notes.txt").write_text("hello")
    for f in (data_copy / "train" / "5").iterdir():
        f.unlink()  # empty class
    s = ddpnb.inspect_dataset(data_copy)
    text = "\n".join(s.problems)
    assert str(corrupt) in text
    assert "missing from val: ['3']" in text
    assert "notes.txt" in text and "non-image" in text
    assert "empty class" in text and os.path.join("train", "5") in text
    assert not s.ok and len(s.problems) == 4
    assert "PROBLEMS (4)" in capsys.readouterr().out
    with pytest.raises(DatasetError) as e:
        require_valid_dataset(data_copy)
    assert str(corrupt) in str(e.value)


def test_missing_split_and_missing_root(tmp_path, data_copy):
    shutil.rmtree(data_copy / "val")
    s = ddpnb.inspect_dataset(data_copy, show=False)
    assert any("missing split" in p and "val" in p for p in s.problems)
    with pytest.raises(DatasetError, match="does not exist"):
        ddpnb.inspect_dataset(tmp_path / "nope")


def test_fingerprint_sees_content_and_names(data_copy):
    before = dataset_fingerprint(data_copy)
    img = next((data_copy / "train" / "0").iterdir())
    Image.new("L", (16, 16), 255).save(img)
    changed = dataset_fingerprint(data_copy)
    assert changed != before
    img.rename(img.with_name("renamed.png"))
    assert dataset_fingerprint(data_copy) not in (before, changed)
    (data_copy / "manifest.json").write_text("{}")  # outside train/ and val/: not hashed
    assert dataset_fingerprint(data_copy) == dataset_fingerprint(data_copy)


def test_cli_check_exits_1_naming_corrupt_png_and_missing_class(data_copy):
    shutil.rmtree(data_copy / "val" / "7")
    bad = data_copy / "train" / "4" / "broken.png"
    bad.write_bytes(b"\x89PNG garbage")
    r = subprocess.run(
        [sys.executable, "-m", "ddpnb", "check", str(data_copy)], capture_output=True, text=True
    )
    assert r.returncode == 1
    assert str(bad) in r.stdout and "missing from val: ['7']" in r.stdout


def test_cli_prep_and_check_ok(tmp_path):
    out = tmp_path / "d"
    r = subprocess.run(
        [sys.executable, "-m", "ddpnb", "prep", "--out", str(out), "--image-size", "8"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    assert "no problems found" in r.stdout
    r = subprocess.run(
        [sys.executable, "-m", "ddpnb", "check", str(out)], capture_output=True, text=True
    )
    assert r.returncode == 0 and "1437" in r.stdout
