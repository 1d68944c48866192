"""Every notebook runs headless under papermill, and produces what it promises."""

import json
import re
from pathlib import Path

import nbformat
import pytest

import ddpnb
from ddpnb.demo import NOTEBOOKS, ipc_kernel_manager, notebook_parameters
from ddpnb.source import worker_source

ALL = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
MAX_CELL_LINES = 8  # code cells call the package; the prose teaches
FIRST = "01_dataset_prep.ipynb"  # writes the dataset every other notebook reads
NEEDS = {  # the baseline; the simulated run notebook 07 compares with
    "03_multi_node_ddp.ipynb": ["02_single_node_baseline.ipynb"],
    "07_real_machines.ipynb": ["03_multi_node_ddp.ipynb"],
}
DRAWS = re.compile(r"\b(plot_\w+|draw\w*)\(")  # a cell that calls one of these promises a figure


@pytest.mark.parametrize("name", ALL)
def test_committed_without_outputs_and_with_parameters(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    raw = json.loads((NOTEBOOKS / name).read_text())
    ids = [c.get("id") for c in raw["cells"]]  # nbformat 4.5 wants one per cell
    assert all(ids) and len(set(ids)) == len(ids)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code)
    first = code[0]
    assert "parameters" in first.metadata.get("tags", [])
    assert nb.metadata["kernelspec"]["name"] == "python3"


@pytest.mark.parametrize("name", ALL)
def test_code_cells_are_short(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    long = {
        i: n
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code" and "parameters" not in c.metadata.get("tags", [])
        if not c.source.startswith("%%writefile")  # a script the reader runs, not kernel code
        if (n := sum(1 for line in c.source.splitlines() if line.strip())) > MAX_CELL_LINES
    }
    assert not long, (
        f"{name}: code cells {sorted(long)} have {sorted(long.values())} non-blank lines, "
        f"more than {MAX_CELL_LINES}: move the logic into ddpnb and let the prose teach"
    )


@pytest.fixture(scope="module")
def executed(tmp_path_factory):
    """Run a notebook (after the ones it needs, once each) as make demo does, tiny.

    ``executed(name)`` returns the output folder and the failures so far, so ``-k``
    on one notebook's test runs only that notebook and the ones before it that it needs.
    """
    import papermill

    out = tmp_path_factory.mktemp("nb")
    params = notebook_parameters(out, out / "digits", quick=True)
    failures, done = {}, set()

    def run(name: str):
        for before in ([FIRST] if name != FIRST else []) + NEEDS.get(name, []):
            run(before)
        if name not in done:
            done.add(name)
            try:
                papermill.execute_notebook(
                    str(NOTEBOOKS / name),
                    str(out / name),
                    parameters=params[name],
                    kernel_name="python3",
                    execution_timeout=300,
                    cwd=str(out),
                    progress_bar=False,
                    kernel_manager_class=ipc_kernel_manager(),
                )
            except Exception as e:  # keep going: later notebooks report on their own
                failures[name] = e
        return out, failures

    return run


def _summary(out: Path, stem: str) -> dict:
    return json.loads((out / f"{stem}_summary.json").read_text())


def _printed(path: Path) -> str:
    """Everything the executed notebook's cells printed."""
    nb = nbformat.read(path, as_version=4)
    return "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )


def cells_without_figure(path: Path) -> list[int]:
    """Code cells of an executed notebook that call a plot function but show no image.

    ddpnb's plot functions return a Figure built without pyplot: a cell shows it only by
    ending with it or by ``display(fig)``; one that just calls the function shows nothing.
    """
    nb = nbformat.read(path, as_version=4)
    return [
        i
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code" and DRAWS.search(c.source)
        if not any("image/png" in o.get("data", {}) for o in c.get("outputs", []))
    ]


@pytest.mark.slow
def test_01_dataset_prep(executed):
    out, failures = executed("01_dataset_prep.ipynb")
    assert "01_dataset_prep.ipynb" not in failures, failures.get("01_dataset_prep.ipynb")
    assert not cells_without_figure(out / "01_dataset_prep.ipynb")
    s = _summary(out, "01")
    assert (s["train"], s["val"], len(s["classes"])) == (1437, 360, 10)
    assert len(s["fingerprint"]) == 64
    for png in ("01_class_counts.png", "01_samples.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_02_baseline(executed):
    out, failures = executed("02_single_node_baseline.ipynb")
    assert "02_single_node_baseline.ipynb" not in failures, failures.get(
        "02_single_node_baseline.ipynb"
    )
    assert not cells_without_figure(out / "02_single_node_baseline.ipynb")
    s = _summary(out, "02")
    assert s["epochs"] == 1 and s["images_per_second"] > 0 and 0 <= s["val_acc"] <= 1
    rows = [json.loads(x) for x in (out / "baseline" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["world_size"] == 1 and rows[0]["val_samples"] == 360
    assert (out / "02_baseline_curves.png").exists()
    printed = _printed(out / "02_single_node_baseline.ipynb")
    for name in ("main", "make_data", "reduce_epoch_metrics"):  # the worker's own text
        assert worker_source(name) in printed


@pytest.mark.slow
def test_03_multi_node(executed):
    out, failures = executed("03_multi_node_ddp.ipynb")
    assert "03_multi_node_ddp.ipynb" not in failures, failures.get("03_multi_node_ddp.ipynb")
    assert not cells_without_figure(out / "03_multi_node_ddp.ipynb")
    s = _summary(out, "03")
    assert s["world_size"] == 2 and s["baseline_val_acc"] is not None
    rows = [json.loads(x) for x in (out / "ddp" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["world_size"] == 2 and rows[0]["val_samples"] == 360
    assert (out / "03_ddp_vs_baseline.png").exists()
    base, ddp = (json.loads((out / d / "config.json").read_text()) for d in ("baseline", "ddp"))
    assert {k for k in base if base[k] != ddp[k]} == {"batch_size"}  # the baseline's config
    printed = _printed(out / "03_multi_node_ddp.ipynb")
    assert worker_source("wrap_model", "train_one_epoch") in printed
    assert worker_source("who_am_i", "join_process_group") in printed  # the group's set-up
    assert worker_source("validate") in printed
    text = (out / "03_multi_node_ddp.ipynb").read_text()
    assert "bash torchrun" in text and "--node_rank=1" in text
    # Node commands one option per line: none wraps mid-token in the output area.
    assert "torchrun \\\n    --nnodes=2 \\\n" in printed and "    --node_rank=1 \\\n" in printed
    assert "    --master_addr=127.0.0.1 \\\n" in printed  # the simulated nodes' own commands


@pytest.mark.slow
def test_04_fault_tolerance(executed):
    out, failures = executed("04_fault_tolerance.ipynb")
    assert "04_fault_tolerance.ipynb" not in failures, failures.get("04_fault_tolerance.ipynb")
    assert not cells_without_figure(out / "04_fault_tolerance.ipynb")
    s = _summary(out, "04")
    assert s["epochs"] == [1, 2, 3] and s["restart_counts"] == [0, 1, 1]
    assert abs(s["fault_val_acc"] - s["uninterrupted_val_acc"]) <= 0.01
    rows = [json.loads(x) for x in (out / "fault" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2, 3, 4]  # then resumed for one more epoch
    assert (out / "04_fault_curves.png").read_bytes()[:4] == b"\x89PNG"
    text = (out / "04_fault_tolerance.ipynb").read_text()
    assert "DDPNB_FAULT: kill at epoch 2 step 1" in text and "resumed from" in text


@pytest.mark.slow
def test_05_scaling(executed):
    out, failures = executed("05_scaling.ipynb")
    assert "05_scaling.ipynb" not in failures, failures.get("05_scaling.ipynb")
    assert not cells_without_figure(out / "05_scaling.ipynb")
    rows = _summary(out, "05")["layouts"]
    assert [r["layout"] for r in rows] == ["1x1", "1x2", "2x1"]
    assert [r["world_size"] for r in rows] == [1, 2, 2]
    assert rows[0]["efficiency"] == 1.0 and all(r["images/s"] > 0 for r in rows)
    assert rows[0]["communication share"] < 0.05  # one process: an all-reduce with itself
    assert all(0 < r["communication share"] < 1 for r in rows[1:])
    for layout in ("1x2", "2x1"):
        ranks = ddpnb.load_metrics(out / "scaling" / layout).ranks
        assert sorted(ranks) == [0, 1] and all(
            recs[-1]["comm_seconds"] > 0 for recs in ranks.values()
        )
    assert (out / "05_scaling.png").exists()
    versus = _summary(out, "05")["shared_memory_vs_gloo"]
    assert versus["layout"] == "1x2" and versus["identical_weights"] is True
    assert versus["gloo_images_per_second"] > 0


@pytest.mark.slow
def test_06_pitfalls(executed):
    out, failures = executed("06_pitfalls.ipynb")
    assert "06_pitfalls.ipynb" not in failures, failures.get("06_pitfalls.ipynb")
    assert not cells_without_figure(out / "06_pitfalls.ipynb")
    s = _summary(out, "06")
    assert s["world_size"] == 2 and s["val_images"] % 2 == 1
    assert s["no_sampler_train_samples_per_rank"] == s["train_images"]
    assert s["no_sampler_slowdown"] > 1.3
    first, second = s["no_set_epoch_order_hashes"]
    assert first == second
    assert s["padded_val_samples"] == s["val_images"] + 1
    assert s["mean_of_means_val_loss"] != s["exact_val_loss"]
    assert s["oversubscribed_threads"] >= 1 and s["oversubscription_slowdown"] > 0
    rows = [
        json.loads(x)
        for x in (out / "pitfalls" / "correct" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [r["val_samples"] for r in rows] == [s["val_images"]] * 2
    for png in ("06_no_sampler.png", "06_oversubscription.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    text = (out / "06_pitfalls.ipynb").read_text()
    # ddpnb.check_script names the two sampler mistakes in the worker with the switch off.
    assert "Ranks train on the same samples" in text and "train_ddp.py:" in text
    assert "Every epoch repeats the same order" in text
    assert "U+FF08" in text and "name 'device' is not defined" in text
    assert "PortInUseError" in text and "PITFALL SWITCH OFF" in text


@pytest.mark.slow
def test_07_real_machines_without_hosts(executed):
    out, failures = executed("07_real_machines.ipynb")
    assert "07_real_machines.ipynb" not in failures, failures.get("07_real_machines.ipynb")
    assert not cells_without_figure(out / "07_real_machines.ipynb")  # 03's simulated curves
    s = _summary(out, "07")
    assert s["hosts"] == [] and s["world_size"] == 0
    printed = _printed(out / "07_real_machines.ipynb")
    assert "hosts is empty: nothing was started." in printed
    assert "-- gpu2  # runs, on that host:" in printed and "--node_rank=1 \\\n" in printed


@pytest.mark.slow
def test_09_your_own_script(executed):
    out, failures = executed("09_your_own_script.ipynb")
    assert "09_your_own_script.ipynb" not in failures, failures.get("09_your_own_script.ipynb")
    assert not cells_without_figure(out / "09_your_own_script.ipynb")  # its curves are shown
    printed = _printed(out / "09_your_own_script.ipynb")
    assert "epoch 3: val_acc" in printed  # the single-process script ran first
    assert '+    dist.init_process_group("gloo")' in printed  # the DDP changes, as a diff
    assert "+    model = DDP(" in printed
    assert "+        sampler.set_epoch(epoch)" in printed  # the one-line fix
    # The check named the missing line before the fix, and came out clean after it.
    checks = [c for c in nbformat.read(out / "09_your_own_script.ipynb", as_version=4).cells
              if "check_script(" in c.source]  # fmt: skip
    first, second = (json.dumps(c.outputs) for c in checks)
    assert "Every epoch repeats the same order" in first and "tabular_ddp.py:" in first
    assert "Every epoch repeats" not in second and "no mistake found" in second.lower()
    run = ddpnb.load_metrics(out / "own")
    assert [r["epoch"] for r in run.epochs] == [1, 2, 3, 4, 5]
    assert all(r["world_size"] == 2 for r in run.epochs) and run.final["val_acc"] > 0.9
    assert (out / "own" / "model.pt").is_file()  # rank 0 wrote it in its working directory
    assert "-- gpu2  # runs, on that host:" in printed and "srun" in printed
