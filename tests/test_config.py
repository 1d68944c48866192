import json

import pytest

from ddpnb import TrainConfig
from ddpnb.errors import ConfigError


def test_defaults_match_the_brief():
    cfg = TrainConfig()
    assert (cfg.model, cfg.weights, cfg.image_size, cfg.epochs, cfg.batch_size) == (
        "resnet18",
        None,
        32,
        8,
        64,
    )
    assert (cfg.lr, cfg.momentum, cfg.weight_decay, cfg.seed) == (0.05, 0.9, 5e-4, 0)
    assert cfg.backend == "auto" and cfg.checkpoint_every == 1


def test_json_round_trip(tmp_path):
    cfg = TrainConfig(data_dir="x", epochs=3, model_kwargs={"dropout": 0.0}, weights="DEFAULT")
    path = cfg.save(tmp_path / "config.json")
    assert json.loads(path.read_text())["epochs"] == 3
    assert TrainConfig.load(path) == cfg


def test_unknown_keys_are_rejected_with_the_valid_list():
    with pytest.raises(ConfigError) as e:
        TrainConfig.from_dict({"epochz": 3})
    assert "epochz" in str(e.value) and "epochs" in str(e.value)


@pytest.mark.parametrize(
    "changes, words",
    [
        ({"epochs": 0}, "epochs"),
        ({"epochs": 2.5}, "epochs"),
        ({"batch_size": "64"}, "batch_size"),
        ({"batch_size": True}, "batch_size"),
        ({"lr": 0}, "lr"),
        ({"lr": -1.0}, "lr"),
        ({"backend": "mpi"}, "backend"),
        ({"augment": "flip"}, "augment"),
        ({"weights": 3}, "weights"),
        ({"image_size": 0}, "image_size"),
        ({"comm_hook": "nccl"}, "comm_hook"),
        ({"comm_hook": "shm", "backend": "nccl"}, "comm_hook='shm' averages CPU tensors"),
    ],
)
def test_bad_values_are_rejected(changes, words):
    with pytest.raises(ConfigError, match=words):
        TrainConfig(**changes)


def test_type_errors_name_the_type_with_its_article():
    with pytest.raises(ConfigError, match="epochs must be an int, got '2'"):
        TrainConfig(epochs="2")


def test_int_is_accepted_for_float_fields():
    assert TrainConfig(lr=1).lr == 1


def test_replace_validates():
    with pytest.raises(ConfigError):
        TrainConfig().replace(epochs=-1)
