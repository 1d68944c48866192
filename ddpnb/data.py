"""Dataset preparation and checking: the bundled digits, any ImageFolder, fingerprints."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import shutil
import tempfile
from collections import Counter
from pathlib import Path

from .constants import IMAGE_EXTENSIONS, dataset_files, dataset_fingerprint
from .errors import DatasetError
from .metrics import read_json

SPLITS = ("train", "val")
MANIFEST = "manifest.json"


@dataclasses.dataclass
class DatasetSummary:
    """What :func:`inspect_dataset` found; prints as a readable report."""

    root: str
    classes: list[str]
    counts: dict[str, dict[str, int]]  # split -> class -> images
    image_sizes: dict[str, int]  # "WxH" -> images
    problems: list[str]
    fingerprint: str | None
    source: str | None = None

    @property
    def ok(self) -> bool:
        return not self.problems

    def split_size(self, split: str) -> int:
        return sum(self.counts.get(split, {}).values())

    def __str__(self) -> str:
        lines = [f"Dataset {self.root}" + (f" (source: {self.source})" if self.source else "")]
        lines.append(f"  classes ({len(self.classes)}): {', '.join(self.classes)}")
        rows = [("class", SPLITS)]
        rows += [(c[:12], [self.counts.get(s, {}).get(c, 0) for s in SPLITS]) for c in self.classes]
        rows.append(("total", [self.split_size(s) for s in SPLITS]))
        lines += ["  " + name.ljust(12) + "".join(str(n).rjust(8) for n in ns) for name, ns in rows]
        sizes = ", ".join(f"{k} ({v})" for k, v in sorted(self.image_sizes.items()))
        lines.append(f"  image sizes: {sizes or 'none'}")
        if self.fingerprint:
            lines.append(f"  fingerprint: sha256:{self.fingerprint}")
        problems = [f"  PROBLEMS ({len(self.problems)}):", *(f"    - {p}" for p in self.problems)]
        lines += problems if self.problems else ["  no problems found"]
        return "\n".join(lines)

    def _repr_pretty_(self, p, cycle) -> None:  # IPython display
        p.text(str(self))


def prepare_digits(
    root: str | os.PathLike,
    image_size: int = 32,
    val_fraction: float = 0.2,
    seed: int = 0,
    overwrite: bool = False,
) -> Path:
    """Write scikit-learn's bundled handwritten digits as an ImageFolder tree.

    ``root/train/<0..9>/*.png`` and ``root/val/<0..9>/*.png``, upscaled to ``image_size``, split per
    class (stratified) and deterministically by ``seed``. Needs no network. Calling again with the
    same arguments does nothing; other arguments on a non-empty folder raise :class:`DatasetError`
    unless ``overwrite``.
    """
    if not isinstance(image_size, int) or isinstance(image_size, bool) or image_size < 8:
        raise DatasetError(f"image_size must be an integer >= 8, got {image_size!r}.")
    if not 0 < val_fraction < 1:
        raise DatasetError(f"val_fraction must be between 0 and 1, got {val_fraction!r}.")
    root = Path(root)
    params = {"image_size": image_size, "val_fraction": val_fraction, "seed": seed}
    existing = read_json(root / MANIFEST)
    if existing.get("source") == "digits" and existing.get("params") == params:
        return root  # finished earlier: the manifest is written last
    if root.exists() and any(root.iterdir()) and not overwrite:
        what = "files that are not a finished ddpnb dataset (an interrupted run, or other data)"
        if existing:
            what = f"digits prepared with {existing.get('params')}"
        raise DatasetError(
            f"{root} already holds {what}. Choose another folder, or pass overwrite=True "
            "(CLI: --overwrite) to replace it."
        )

    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    images = (digits.images * (255.0 / 16.0)).clip(0, 255).astype(np.uint8)
    train_idx, val_idx = train_test_split(
        np.arange(len(images)), test_size=val_fraction, stratify=digits.target, random_state=seed
    )
    root.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename at the end: an interrupted call leaves only a
    # temp folder, never a half tree that looks finished.
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}.", dir=root.parent))
    try:
        for split, idx in (("train", train_idx), ("val", val_idx)):
            for i in sorted(idx):
                folder = tmp / split / str(digits.target[i])
                folder.mkdir(parents=True, exist_ok=True)
                img = Image.fromarray(images[i], mode="L")
                img.resize((image_size, image_size), Image.BICUBIC).save(folder / f"{i:04d}.png")
        summary = inspect_dataset(tmp, show=False, write_manifest=False)
        _write_manifest(tmp, summary, source="digits", params=params)
        old = root.with_name(f".{root.name}.old-{os.getpid()}")
        if root.exists():
            os.replace(root, old)
        os.replace(tmp, root)
        shutil.rmtree(old, ignore_errors=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already once renamed
    return root


def _check_class_folder(folder: Path, sizes: Counter[str], problems: list[str]) -> int:
    """Decode every image below ``folder``; count the readable ones, note the problems."""
    from PIL import Image

    n = 0
    for path in sorted(p for p in folder.rglob("*") if not p.is_dir()):  # broken links too
        if not path.name.lower().endswith(IMAGE_EXTENSIONS):
            problems.append(f"non-image file: {path}")
            continue
        try:
            with Image.open(path) as im:
                im.load()  # decodes fully: truncated files fail here
                sizes[f"{im.width}x{im.height}"] += 1
            n += 1
        except Exception as e:
            problems.append(f"unreadable or corrupt image: {path} ({e})")
    return n


def inspect_dataset(
    root: str | os.PathLike, *, show: bool = True, write_manifest: bool = True
) -> DatasetSummary:
    """Check an ImageFolder dataset with ``train/`` and ``val/`` and summarise it.

    Every problem is collected, then the summary is printed (``show``) and, when the folder is
    writable, saved with the fingerprint to ``manifest.json``.
    """
    root = Path(root)
    if not root.is_dir():
        raise DatasetError(
            f"Dataset folder {root} does not exist. Create it with ddpnb.prepare_digits(...) "
            "(CLI: ddpnb prep --out DIR) or point data_dir at an ImageFolder with train/ and val/."
        )
    problems: list[str] = []
    counts: dict[str, dict[str, int]] = {}
    sizes: Counter[str] = Counter()
    class_sets = {}
    for split in SPLITS:
        split_dir = root / split
        if not split_dir.is_dir():
            problems.append(f"missing split: {split_dir} does not exist")
            continue
        classes = sorted(d.name for d in split_dir.iterdir() if d.is_dir())
        class_sets[split] = classes
        if not classes:
            problems.append(f"{split_dir} holds no class folders")
        for f in sorted(p for p in split_dir.iterdir() if p.is_file()):
            problems.append(f"file outside any class folder: {f}")
        counts[split] = {}
        for c in classes:
            n = counts[split][c] = _check_class_folder(split_dir / c, sizes, problems)
            if n == 0:
                problems.append(f"empty class: {split_dir / c} holds no readable images")
    if len(class_sets) == 2 and class_sets["train"] != class_sets["val"]:
        pairs = (("val", "train"), ("train", "val"))
        gaps = [(a, sorted(set(class_sets[b]) - set(class_sets[a]))) for a, b in pairs]
        gaps = "; ".join(f"missing from {a}: {names}" for a, names in gaps if names)
        problems.append(f"train/val class sets differ: {gaps}")
    all_classes = sorted(set().union(*class_sets.values())) if class_sets else []
    fingerprint = dataset_fingerprint(root) if class_sets else None
    existing = read_json(root / MANIFEST)
    summary = DatasetSummary(
        str(root), all_classes, counts, dict(sizes), problems, fingerprint, existing.get("source")
    )
    if write_manifest and fingerprint and os.access(root, os.W_OK):
        if existing.get("fingerprint") != fingerprint or existing.get("problems") != problems:
            _write_manifest(root, summary, existing.get("source"), existing.get("params"))
    if show:
        print(summary)
    return summary


def require_valid_dataset(root: str | os.PathLike) -> DatasetSummary:
    """Inspect quietly and raise :class:`DatasetError` listing every problem."""
    summary = inspect_dataset(root, show=False)
    if summary.problems:
        listed = "\n".join(f"  - {p}" for p in summary.problems)
        raise DatasetError(
            f"The dataset at {root} has {len(summary.problems)} problem(s):\n{listed}\n"
            "Fix or remove the files named above (ddpnb check DIR re-checks), then run again."
        )
    return summary


def _write_manifest(root: Path, summary: DatasetSummary, source, params) -> None:
    data = dataclasses.asdict(summary)
    data.update(root=None, source=source, params=params, files=len(dataset_files(root)))
    tmp = root / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps(data, indent=2) + "\n")
    os.replace(tmp, root / MANIFEST)


def subset_dataset(
    source: str | os.PathLike, root: str | os.PathLike, *, train: int | None, val: int | None
) -> Path:
    """Copy a class-balanced subset of an ImageFolder dataset to ``root`` (``None``: a whole split).

    The source's ``source`` tag is kept (digits stay "digits" for augmentation). Calling again
    with the same arguments does nothing; another subset in ``root`` is replaced.
    """
    source, root = Path(source), Path(root)
    summary = require_valid_dataset(source)
    wanted = {"train": train, "val": val}
    for split, n in wanted.items():
        have = summary.split_size(split)
        if n is not None and not len(summary.classes) <= n <= have:
            raise DatasetError(
                f"{split}={n} must be between {len(summary.classes)} (one image per class) and "
                f"the {have} images of {source}."
            )
    params = {"subset_of": summary.fingerprint, **wanted}
    existing = read_json(root / MANIFEST)
    if existing.get("params") == params:
        return root
    if root.exists() and any(root.iterdir()) and "subset_of" not in (existing.get("params") or {}):
        raise DatasetError(
            f"{root} already holds files that are not a ddpnb subset. Choose another folder."
        )
    shutil.rmtree(root, ignore_errors=True)
    for split, n in wanted.items():
        per_class = [
            sorted(p for p in (source / split / c).rglob("*") if p.is_file())
            for c in summary.classes
        ]
        # Round robin over the classes: the first n images keep the class balance.
        in_turn = itertools.chain.from_iterable(itertools.zip_longest(*per_class))
        for path in [p for p in in_turn if p is not None][:n]:
            target = root / path.relative_to(source)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, target)
    subset = inspect_dataset(root, show=False, write_manifest=False)
    _write_manifest(root, subset, summary.source, params)
    return root
