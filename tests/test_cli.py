"""The ``ddpnb train`` command line: options from TrainConfig, its errors, and signals."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import signal
import subprocess
import sys
import time
import typing

import pytest

import ddpnb
from ddpnb import cli
from ddpnb.agent import descendants
from ddpnb.config import TrainConfig
from ddpnb.errors import ConfigError
from ddpnb.scheduler import alive


def _train_action(name: str):
    train = cli._parser()._subparsers._group_actions[0].choices["train"]
    for action in train._actions:
        if action.dest == cli._FIELD_DEST + name:
            return action
    return None


def _config(*argv: str) -> TrainConfig:
    args = cli._parser().parse_args(["train", "--run-dir", "r", *argv])
    return cli.train_config(args)


def test_every_config_field_has_an_option():
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        action = _train_action(f.name)
        assert action is not None, f"TrainConfig.{f.name} has no `ddpnb train` option"
        assert action.default is argparse.SUPPRESS, f.name  # only given options override
        if hints[f.name] is bool:
            assert f"--no-{f.name.replace('_', '-')}" in action.option_strings
    for flag in ("--augment", "--num-workers", "--max-steps-per-epoch", "--weights", "--threads"):
        assert flag in " ".join(a for act in _all_actions() for a in act.option_strings)
    assert _train_action("data_dir").option_strings == ["--data", "--data-dir"]
    # A field named like a launch option (--nnodes, --resume, ...) would make _parser() fail:
    # argparse refuses the conflicting option string. train and submit list every field.
    for command in ("train", "submit"):
        text = cli._parser()._subparsers._group_actions[0].choices[command].format_help()
        for f in dataclasses.fields(TrainConfig):
            flag = "--data" if f.name == "data_dir" else "--" + f.name.replace("_", "-")
            assert re.search(re.escape(flag) + r"(?![\w-])", text), (command, flag)


def _all_actions():
    return cli._parser()._subparsers._group_actions[0].choices["train"]._actions


def test_options_become_typed_config_values():
    cfg = _config(
        "--data",
        "d",
        "--epochs",
        "3",
        "--lr",
        "0.1",
        "--no-amp",
        "--augment",
        "none",
        "--max-steps-per-epoch",
        "2",
        "--model-kwargs",
        '{"dropout": 0.0}',
        "--weights",
        "DEFAULT",
    )
    assert cfg == TrainConfig(
        data_dir="d",
        epochs=3,
        lr=0.1,
        amp=False,
        augment="none",
        max_steps_per_epoch=2,
        model_kwargs={"dropout": 0.0},
        weights="DEFAULT",
    )
    assert _config("--data-dir", "d") == TrainConfig(data_dir="d")  # defaults stay TrainConfig's
    assert _config("--data", "d", "--max-steps-per-epoch", "none").max_steps_per_epoch is None


@pytest.mark.parametrize(
    "argv, python_api",
    [
        (["--augment", "bogus"], {"augment": "bogus"}),
        (["--epochs", "abc"], {"epochs": "abc"}),
        (["--epochs", "0"], {"epochs": 0}),
        (["--lr", "-1"], {"lr": -1.0}),
    ],
)
def test_bad_values_give_the_python_api_message(tmp_path, capsys, argv, python_api):
    with pytest.raises(ConfigError) as api:
        TrainConfig(data_dir="d", **python_api)
    run = tmp_path / "r"
    assert cli.main(["train", "--data", "d", "--run-dir", str(run), *argv]) == 2
    err = capsys.readouterr().err
    assert err == f"ddpnb train: error: {api.value}\n"
    assert not run.exists()  # nothing started, nothing written


def test_bad_json_and_missing_data(capsys):
    assert cli.main(["train", "--data", "d", "--run-dir", "r", "--model-kwargs", "{x"]) == 2
    assert "--model-kwargs must be a JSON object" in capsys.readouterr().err
    assert cli.main(["train", "--run-dir", "r"]) == 2
    assert "--data is required" in capsys.readouterr().err


def test_signal_handlers_are_restored_and_ignored_ones_kept():
    before = signal.getsignal(signal.SIGTERM)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    try:
        with cli._StopSignals() as stop:
            assert signal.getsignal(signal.SIGTERM) == stop._handle
            assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN  # nohup stays in force
        assert signal.getsignal(signal.SIGTERM) is before
        with pytest.raises(cli.StoppedBySignal) as e, cli._StopSignals():
            signal.raise_signal(signal.SIGTERM)
        assert (e.value.signum, e.value.name) == (signal.SIGTERM, "SIGTERM")
        assert isinstance(e.value, KeyboardInterrupt)  # the Ctrl-C path: launch stops the job
    finally:
        signal.signal(signal.SIGHUP, signal.SIG_DFL)
    assert signal.getsignal(signal.SIGTERM) is before


def test_config_file_then_overrides(tmp_path):
    saved = TrainConfig(data_dir="d", epochs=7, lr=0.2, augment="none", amp=False)
    path = saved.save(tmp_path / "config.json")
    assert _config("--config", str(path), "--epochs", "3") == saved.replace(epochs=3)
    assert _config("--config", str(path), "--data", "e") == saved.replace(data_dir="e")
    with pytest.raises(ConfigError, match="Cannot read config"):
        _config("--config", str(tmp_path / "missing.json"))


def _wait_for(predicate, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_stops_every_process_and_the_run_resumes(tiny_data, tmp_path, sig):
    """About 40 s each: two nodes train until the signal. SIGINT (Ctrl-C: exit 130, nothing
    left) goes through the same handler and is tested with `ddpnb run`
    (test_script.py::test_cli_interrupt_leaves_nothing)."""
    run = tmp_path / "r"
    argv = [sys.executable, "-m", "ddpnb", "train", "--data", str(tiny_data), "--run-dir", str(run)]
    tiny = ["--image-size", "16", "--batch-size", "8", "--timeout-seconds", "30"]
    cli_proc = subprocess.Popen(
        [*argv, *tiny, "--nnodes", "2", "--epochs", "50"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert _wait_for(lambda: (run / "progress.json").exists(), 90), "the workers never ran"
        pids = descendants(cli_proc.pid)
        assert len(pids) >= 4  # two torchrun agents and their workers
        os.kill(cli_proc.pid, sig)
        out, err = cli_proc.communicate(timeout=30)
    finally:
        if cli_proc.poll() is None:
            os.killpg(cli_proc.pid, signal.SIGKILL)
    assert cli_proc.returncode == 128 + sig, err
    assert f"stopped by {signal.Signals(sig).name}" in err and "--resume" in err
    assert _wait_for(lambda: not any(alive(p) for p in pids), 10), [p for p in pids if alive(p)]
    if sig != signal.SIGTERM:
        return  # resuming is the same for either signal; once is enough for the suite
    # The same command resumes it (epochs may change on resume).
    r = subprocess.run(
        [*argv, *tiny, "--nnodes", "2", "--epochs", "1", "--resume"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert [e["epoch"] for e in ddpnb.load_metrics(run).epochs] == [1]
    assert json.loads((run / "config.json").read_text())["epochs"] == 1
