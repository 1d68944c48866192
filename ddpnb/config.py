"""The one training configuration, its defaults and its validation.

The worker never imports this module (it runs with torch alone): it reads ``config.json``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import types
import typing
from pathlib import Path
from typing import Any, Literal

from .constants import usable_cpus
from .errors import ConfigError

Backend = Literal["auto", "gloo", "nccl"]
Augment = Literal["auto", "digits", "photo", "none"]
CommHook = Literal["auto", "shm", "none", "bf16", "fp16"]
LrSchedule = Literal["cosine", "constant"]
# Fields of earlier versions, dropped when an old config.json loads (its run still resumes).
RETIRED_KEYS = (
    "pipeline distributed_sampler set_epoch exact_validation reduce_sums thread_budget"
).split()


def check_int(name: str, value: object, low: int = 1, high: int | None = None) -> int:
    """``value`` if it is an int in ``low..high``, else a ConfigError naming ``name``."""
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= low
    if ok and (high is None or value <= high):
        return value
    bound = f">= {low}" if high is None else f"in {low}..{high}"
    raise ConfigError(f"{name} must be an integer {bound}, got {value!r}.")


def _default_num_workers() -> int:
    # DataLoader workers compete with compute for the cores: only big hosts get a few.
    cores = usable_cpus()
    return 0 if cores <= 4 else min(4, cores // 4)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """All the worker needs to train, with the defaults; bad values raise :class:`ConfigError`."""

    data_dir: str = "data/digits"
    model: str = "resnet18"
    #: Extra keyword arguments for ``torchvision.models.get_model`` (e.g. ``{"dropout": 0.0}``).
    model_kwargs: dict = dataclasses.field(default_factory=dict)
    #: ``None`` (random init), ``"DEFAULT"`` (torchvision download), or a local state-dict path.
    weights: str | None = None
    image_size: int = 32
    epochs: int = 8
    batch_size: int = 64  #: Per process: the global batch is ``batch_size * world_size``.
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 5e-4
    lr_schedule: LrSchedule = "cosine"
    seed: int = 0
    num_workers: int = dataclasses.field(default_factory=_default_num_workers)
    backend: Backend = "auto"
    amp: bool = True  #: bf16 autocast, applied on CUDA only.
    augment: Augment = "auto"
    checkpoint_every: int = 1
    timeout_seconds: int = 60  #: Seconds a collective may wait before the run fails, not hangs.
    #: Limit steps per epoch (benchmarks, smoke tests); ``None`` runs whole epochs.
    max_steps_per_epoch: int | None = None
    #: Intra-op threads per process on CPU; 0 splits the host's cores over its processes.
    threads: int = 0
    bucket_cap_mb: int = 25
    #: How DDP averages gradients: ``shm`` (shared memory, ranks on one host, gloo), ``none``
    #: (plain all-reduce), ``bf16``/``fp16`` (compressed); ``auto``: ``shm`` if all share /dev/shm.
    comm_hook: CommHook = "auto"
    channels_last: bool = False

    def __post_init__(self) -> None:
        hints = typing.get_type_hints(type(self))
        for name, value in vars(self).items():
            if not _matches(value, hints[name]):
                kind = type(value).__name__
                raise ConfigError(
                    f"{name} must be {_describe(hints[name])}, got {value!r} ({kind})."
                )
        positive = ["image_size", "epochs", "batch_size", "checkpoint_every", "timeout_seconds"]
        for name in [*positive, "bucket_cap_mb"]:
            check_int(name, getattr(self, name))
        if self.max_steps_per_epoch is not None and self.max_steps_per_epoch < 1:
            raise ConfigError("max_steps_per_epoch must be >= 1 or None.")
        if not self.lr > 0:
            raise ConfigError(f"lr must be > 0, got {self.lr!r}.")
        for name in ["momentum", "weight_decay"]:
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0, got {getattr(self, name)!r}.")
        for name in ["num_workers", "threads", "seed"]:
            check_int(name, getattr(self, name), low=0)
        if self.comm_hook == "shm" and self.backend == "nccl":
            raise ConfigError(
                "comm_hook='shm' averages CPU tensors for gloo; NCCL already uses shared "
                "memory between GPUs of one host. Use comm_hook='auto' or 'none' with nccl."
            )
        if not self.model:
            raise ConfigError(
                "model must name a torchvision classification model, e.g. 'resnet18'."
            )

    def to_dict(self) -> dict[str, Any]:
        """Return the config as plain JSON-ready data."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        """Build a config from a dict, rejecting keys that are not fields."""
        valid = [f.name for f in dataclasses.fields(cls)]
        unknown = sorted(set(data) - set(valid))
        if retired := [k for k in unknown if k in RETIRED_KEYS]:
            raise ConfigError(
                f"{', '.join(retired)}: no longer a config field. Every run reads its "
                "images through a DataLoader (the worker keeps small datasets decoded in "
                "memory by itself), and the pitfall switches became variants of the worker "
                "script: ddpnb.pitfalls.script(config, name, folder)."
            )
        if unknown:
            raise ConfigError(
                f"Unknown config key(s) {unknown}. Valid keys are: {', '.join(valid)}."
            )
        return cls(**data)

    def replace(self, **changes: Any) -> TrainConfig:
        """Return a copy with some fields changed (validated like a new config)."""
        return self.from_dict({**self.to_dict(), **changes})

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"

    def save(self, path: str | os.PathLike) -> Path:
        """Write the config as JSON to ``path`` and return the path."""
        path = Path(path)
        path.write_text(self.to_json())
        return path

    @classmethod
    def load(cls, path: str | os.PathLike) -> TrainConfig:
        """Read a config written by :meth:`save`."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ConfigError(f"Cannot read config {path}: {e}") from e
        return cls.from_dict({k: v for k, v in data.items() if k not in RETIRED_KEYS})


def _matches(value: Any, tp: Any) -> bool:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return value in typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, arg) for arg in typing.get_args(tp))
    if tp is type(None):
        return value is None
    if tp is float:
        # An int is a fine float (lr=1), a bool is not.
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is dict:
        return isinstance(value, dict) and all(isinstance(k, str) for k in value)
    return isinstance(value, tp)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "None"
    name = tp.__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"
