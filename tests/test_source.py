"""worker_source prints the worker exactly as it stands, and Part 1 stays the DDP story."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ddpnb.source import PART2_BANNER, WORKER_PATH, worker_part1_names, worker_source

TEXT = WORKER_PATH.read_text()
LINES = TEXT.splitlines()
PART1_START = next(i for i, ln in enumerate(LINES) if ln.startswith("# Part 1: DDP"))
PART2_START = next(i for i, ln in enumerate(LINES) if ln.startswith(PART2_BANNER))
PART1 = "\n".join(LINES[PART1_START:PART2_START])
STEPS = [
    "main",
    "who_am_i",
    "join_process_group",
    "make_data",
    "wrap_model",
    "train_one_epoch",
    "validate",
    "reduce_epoch_metrics",
    "save_checkpoint",
]


def test_a_function_is_an_exact_slice_of_the_worker():
    src = worker_source("train_one_epoch")
    assert "loss.backward()" in src and "optimizer.step()" in src
    assert src.startswith("def train_one_epoch(") and src.endswith("return sums\n")
    start = TEXT.index(src)
    assert start > 0 and TEXT[start - 1] == "\n"  # whole lines, from the def on
    assert TEXT.count(src) == 1


def test_decorators_come_along_and_names_join_with_a_blank_line():
    assert worker_source("main").startswith("@record")
    assert worker_source("Rank").startswith("@dataclasses.dataclass")
    both = worker_source("wrap_model", "train_one_epoch")
    assert both == worker_source("wrap_model") + "\n" + worker_source("train_one_epoch")


def test_an_unknown_name_is_named_with_the_choices():
    with pytest.raises(ValueError, match="no_such_step") as info:
        worker_source("main", "no_such_step")
    assert "train_one_epoch" in str(info.value)
    with pytest.raises(ValueError, match="make_data"):
        worker_source()


def test_part1_is_short_and_starts_right_after_the_imports():
    assert PART1_START < PART2_START
    assert PART2_START - PART1_START <= 250, PART2_START - PART1_START  # issue 26
    assert worker_source("main").count("\n") <= 70
    # Nothing but imports between the docstring and Part 1.
    head = LINES[TEXT[: TEXT.index('"""', 3) + 3].count("\n") + 1 : PART1_START]
    imports = ("import ", "from ", "#", "try:", "except ImportError:")
    assert all(ln.strip().startswith(imports) or not ln.strip() for ln in head)


def test_part1_names_every_step_in_order_of_definition():
    names = worker_part1_names()
    assert names[0] == "main"
    assert set(STEPS) <= set(names), set(STEPS) - set(names)
    assert "Monitor" not in names and "SharedMemoryAllReduce" not in names


def test_the_training_step_is_the_tutorial_step():
    src = worker_source("train_one_epoch")
    assert src.count("\n") <= 22
    assert src.count("report.") == 1  # one reporting call per step; no timing, no monitor
    assert "perf_counter" not in src and "monitor" not in src


def test_part1_tells_every_ddp_idea_and_none_of_the_machinery():
    for idea in [
        "DistributedSampler(",
        "sampler=train_sampler",
        "set_epoch(epoch)",
        "DDP(",
        "dist.init_process_group",
        "dist.all_gather_object",
        "dist.all_reduce(totals)",
        "dist.broadcast",
        "dist.barrier()",
        "dist.destroy_process_group()",
        "loss.backward()",
        "model.module",
        "DataLoader(train_set, sampler=train_sampler",  # the data runs through what is shown
        "register_comm_hook",  # the gradients' route, visible where DDP is made
        "torch.set_num_threads",
    ]:
        assert idea in PART1, idea
    for machinery in [
        "SharedMemoryAllReduce",
        "DDPNB_FAULT",
        "progress.json",
        "SIGKILL",
        "getppid",
        "first_step_time",
        "atomic_write_bytes",
        "json.dumps",
        "MISTAKE",
        'cfg["distributed_sampler"]',
        'cfg["reduce_sums"]',
        "mean_of_means",
    ]:
        assert machinery not in PART1, machinery
    assert "cfg.get(" not in TEXT  # config.json holds every field


def test_every_name_the_notebooks_print_exists():
    asked = set()
    for nb in sorted(Path(__file__).parents[1].glob("notebooks/*.ipynb")):
        for cell in json.loads(nb.read_text())["cells"]:
            for call in re.findall(r"worker_source\(([^)]*)\)", "".join(cell["source"])):
                asked |= set(re.findall(r"\"(\w+)\"", call))
    for name in asked:
        assert worker_source(name)


def test_import_does_not_import_torch():
    code = "import sys, ddpnb.source; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
