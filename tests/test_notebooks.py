"""Every notebook runs headless under papermill, and produces what it promises."""

import json
from pathlib import Path

import nbformat
import pytest

from ddpnb.demo import NOTEBOOKS, notebook_parameters

ALL = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))


@pytest.mark.parametrize("name", ALL)
def test_committed_without_outputs_and_with_parameters(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert all(not c.outputs and c.execution_count is None for c in code)
    first = code[0]
    assert "parameters" in first.metadata.get("tags", [])
    assert nb.metadata["kernelspec"]["name"] == "python3"


@pytest.fixture(scope="module")
def executed(tmp_path_factory, digits_data):
    """Run the notebooks in order, as make demo does, with tiny training."""
    import papermill

    out = tmp_path_factory.mktemp("nb")
    data = out / "digits"
    params = notebook_parameters(out, data, quick=True)
    failures = {}
    for name, p in params.items():
        try:
            papermill.execute_notebook(
                str(NOTEBOOKS / name),
                str(out / name),
                parameters=p,
                kernel_name="python3",
                execution_timeout=300,
                cwd=str(out),
                progress_bar=False,
            )
        except Exception as e:  # keep going: later notebooks report on their own
            failures[name] = e
    return out, failures


def _summary(out: Path, stem: str) -> dict:
    return json.loads((out / f"{stem}_summary.json").read_text())


@pytest.mark.slow
def test_01_dataset_prep(executed):
    out, failures = executed
    assert "01_dataset_prep.ipynb" not in failures, failures.get("01_dataset_prep.ipynb")
    s = _summary(out, "01")
    assert (s["train"], s["val"], len(s["classes"])) == (1437, 360, 10)
    assert len(s["fingerprint"]) == 64
    for png in ("01_class_counts.png", "01_samples.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"


@pytest.mark.slow
def test_02_baseline(executed):
    out, failures = executed
    assert "02_single_node_baseline.ipynb" not in failures, failures.get(
        "02_single_node_baseline.ipynb"
    )
    s = _summary(out, "02")
    assert s["epochs"] == 1 and s["images_per_second"] > 0 and 0 <= s["val_acc"] <= 1
    rows = [json.loads(x) for x in (out / "baseline" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["world_size"] == 1 and rows[0]["val_samples"] == 360
    assert (out / "02_baseline_curves.png").exists()


@pytest.mark.slow
def test_03_multi_node(executed):
    out, failures = executed
    assert "03_multi_node_ddp.ipynb" not in failures, failures.get("03_multi_node_ddp.ipynb")
    s = _summary(out, "03")
    assert s["world_size"] == 2 and s["baseline_val_acc"] is not None
    rows = [json.loads(x) for x in (out / "ddp" / "metrics.jsonl").read_text().splitlines()]
    assert rows[0]["world_size"] == 2 and rows[0]["val_samples"] == 360
    assert (out / "03_ddp_vs_baseline.png").exists()
    text = (out / "03_multi_node_ddp.ipynb").read_text()
    assert "srun torchrun" in text and "--node_rank=1" in text


@pytest.mark.slow
def test_04_fault_tolerance(executed):
    out, failures = executed
    assert "04_fault_tolerance.ipynb" not in failures, failures.get("04_fault_tolerance.ipynb")
    s = _summary(out, "04")
    assert s["epochs"] == [1, 2, 3] and s["restart_counts"] == [0, 1, 1]
    assert abs(s["fault_val_acc"] - s["uninterrupted_val_acc"]) <= 0.01
    rows = [json.loads(x) for x in (out / "fault" / "metrics.jsonl").read_text().splitlines()]
    assert [r["epoch"] for r in rows] == [1, 2, 3, 4]  # then resumed for one more epoch
    assert (out / "04_fault_curves.png").read_bytes()[:4] == b"\x89PNG"
    text = (out / "04_fault_tolerance.ipynb").read_text()
    assert "DDPNB_FAULT: kill at epoch 2 step 1" in text and "resumed from" in text
