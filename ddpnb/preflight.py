"""Every check made before a process starts or anything is written: config, data, model, ports."""

from __future__ import annotations

import functools
import importlib.util
import re
import socket
import sys
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .config import TrainConfig, check_int
from .data import require_valid_dataset
from .errors import ConfigError, PortInUseError


def check_progress(progress: str) -> str:
    if progress not in ("auto", "widgets", "text", "none"):
        raise ConfigError("progress must be 'auto', 'widgets', 'text' or 'none'.")
    return progress


def check_run(config: TrainConfig, world_size: int, here: bool = True) -> TrainConfig:
    """Check the worker's dataset and model; return the config with data_dir absolute.

    ``here=False`` (real hosts): a data_dir not here must be absolute (the hosts check it).
    """
    data_dir = Path(config.data_dir)
    if here or data_dir.exists():
        data_dir = data_dir.resolve()
        train_size = require_valid_dataset(data_dir).split_size("train")
        shard = -(-train_size // world_size)
        if config.batch_size > shard:
            raise ConfigError(
                f"batch_size={config.batch_size} per process is larger than each rank's shard of "
                f"the train split ({train_size} images / world size {world_size} = {shard}). Use "
                f"batch_size <= {shard}, or fewer processes."
            )
    elif not data_dir.is_absolute():
        raise ConfigError(
            f"data_dir {config.data_dir!r} is not on this machine, so it must be an absolute "
            "path: the same path on every host (where the preflight checks it)."
        )
    check_model(config)
    return config.replace(data_dir=str(data_dir))


def as_config(config: TrainConfig | Mapping[str, Any]) -> TrainConfig:
    """Accept a TrainConfig or a plain dict of its fields."""
    if isinstance(config, TrainConfig):
        return config
    if isinstance(config, Mapping):
        return TrainConfig.from_dict(dict(config))
    raise ConfigError(f"config must be a TrainConfig or a dict, got {type(config).__name__}.")


@functools.cache  # torchvision's files do not change under a running kernel
def _registered_here(model: str) -> bool:
    """Whether torchvision's classification models register ``model``, read from their
    source (``@register_model()``, other decorators, then ``def <name>(``) without importing
    torchvision, which costs the launcher seconds of CPU. False means "not seen":
    list_models then decides."""
    spec = importlib.util.find_spec("torchvision")
    for folder in (spec and spec.submodule_search_locations) or []:
        for source in (Path(folder) / "models").glob("*.py"):
            if re.search(
                rf"^@register_model\(.*\n(@.*\n)*def {re.escape(model)}\(", source.read_text(), re.M
            ):
                return True
    return False


def check_model(config: TrainConfig) -> None:
    """Raise ConfigError for an unknown model name or unusable weights."""
    if config.weights is None and _registered_here(config.model):
        return
    import torch
    import torchvision

    known = torchvision.models.list_models(module=torchvision.models)
    if config.model not in known:
        close = [m for m in known if m.startswith(config.model[:4])][:8]
        raise ConfigError(
            f"Unknown model {config.model!r}. Use a torchvision classification model name"
            + (f", e.g. {', '.join(close)}" if close else ", e.g. resnet18 or resnet50")
            + " (see torchvision.models.list_models())."
        )
    if config.weights == "DEFAULT":  # in torch's cache, or its server answers
        weights = torchvision.models.get_model_weights(config.model).DEFAULT
        cached = Path(torch.hub.get_dir()) / "checkpoints" / Path(weights.url).name
        host = re.sub(r"^https?://([^/]+)/.*$", r"\1", weights.url)
        try:
            if not cached.exists():
                socket.create_connection((host, 443), timeout=3).close()
        except OSError as e:
            raise ConfigError(
                f"weights='DEFAULT' needs to download {weights.url}, but no network is "
                f"available ({e}). Pass weights=None to train from scratch, or the path of a local "
                f"state-dict file (or place the file at {cached})."
            ) from None
    elif config.weights is not None:
        path = Path(config.weights)
        if not path.is_file():
            raise ConfigError(
                f"weights file {config.weights!r} does not exist. Pass the path of a saved state "
                "dict (torch.save(model.state_dict(), path)), weights='DEFAULT', or weights=None."
            )
        from .worker import read_state_dict

        try:
            read_state_dict(str(path))
        except ValueError as e:
            raise ConfigError(f"{e} Save it with torch.save(model.state_dict(), path).") from None


def check_port_free(host: str, port: int) -> None:
    """Raise PortInUseError if ``port`` cannot be bound on ``host``."""
    check_int("master_port", port, low=1, high=65535)
    with socket.socket() as s:
        # SO_REUSEADDR as the TCPStore sets it: a port in TIME_WAIT is not busy.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise PortInUseError(
                f"master_port {port} on {host} is already in use ({e.strerror}). Pass another "
                "port, or master_port=None to pick a free one."
            ) from None


def warn_if_cuda_initialised() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        warnings.warn(
            "This kernel has initialised CUDA. ddpnb's workers are separate processes and are "
            "not affected, but the kernel holds GPU memory they may need: restart the kernel "
            "and avoid touching CUDA in it before launching.",
            stacklevel=3,
        )
