"""Every notebook runs headless under papermill, and produces what it promises."""

import io
import json
import os
import re
import tokenize
from pathlib import Path

import nbformat
import pytest

import ddpnb
from ddpnb import pitfalls, tables
from ddpnb.demo import NOTEBOOKS, ipc_kernel_manager, notebook_parameters
from ddpnb.source import worker_source

ALL = sorted(p.name for p in NOTEBOOKS.glob("*.ipynb"))
MAX_CELL_LINES = 8  # statements per code cell: they call the package; the prose teaches


def statements(source: str) -> int:
    """Python's logical lines of a cell: a call spelled out one argument per line is one."""
    code = "\n".join(ln for ln in source.splitlines() if not ln.lstrip().startswith(("%", "!")))
    tokens = tokenize.generate_tokens(io.StringIO(code + "\n").readline)
    return sum(1 for t in tokens if t.type == tokenize.NEWLINE)


FIRST = "01_dataset_prep.ipynb"  # writes the dataset every other notebook reads
NO_DATA = {"09_your_own_script.ipynb", "10_appendix_blog_typos.ipynb"}  # need no dataset
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
    # What the learner will be able to do, first; what to keep, last (the guide: the schedule).
    assert "**Objectives.** After this notebook you can" in nb.cells[0].source
    assert nb.cells[-1].cell_type == "markdown" and nb.cells[-1].source.startswith("## Key points")


@pytest.mark.parametrize("name", ALL)
def test_code_cells_are_short(name):
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    long = {
        i: n
        for i, c in enumerate(nb.cells)
        if c.cell_type == "code" and "parameters" not in c.metadata.get("tags", [])
        if not c.source.startswith("%%writefile")  # a script the reader runs, not kernel code
        if (n := statements(c.source)) > MAX_CELL_LINES
    }
    assert not long, (
        f"{name}: code cells {sorted(long)} have {sorted(long.values())} statements, "
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
    # Pitfall 6's hang is stopped after 8 s without progress, not the workshop's 20 s: the
    # ranks snapshot their stacks every 2 s, so the hang is still seen several times over.
    params["06_pitfalls.ipynb"]["hang_timeout"] = 8
    failures, done = {}, set()

    def run(name: str):
        first = [] if name == FIRST or name in NO_DATA else [FIRST]
        for before in first + NEEDS.get(name, []):
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

    yield run
    for checkpoint in out.rglob("*.pt"):  # about 1.4 GB; the notebooks and logs stay to look at
        checkpoint.unlink()


def _printed(path: Path) -> str:
    """Everything the executed notebook's cells printed."""
    nb = nbformat.read(path, as_version=4)
    return "".join(
        o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
    )


def _images(path: Path) -> int:
    """How many images the executed notebook shows."""
    nb = nbformat.read(path, as_version=4)
    return sum(
        "image/png" in o.get("data", {})
        for c in nb.cells
        if c.cell_type == "code"
        for o in c.get("outputs", [])
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


def _ok(executed, name: str) -> Path:
    """Run the notebook; fail with its error if it raised; the output folder."""
    out, failures = executed(name)
    assert name not in failures, failures.get(name)
    assert not cells_without_figure(out / name)
    return out


@pytest.mark.slow
def test_01_dataset_prep(executed):
    out = _ok(executed, "01_dataset_prep.ipynb")
    s = ddpnb.inspect_dataset(out / "digits", show=False)  # the folder the notebook wrote
    assert (s.split_size("train"), s.split_size("val"), len(s.classes)) == (1437, 360, 10)
    assert len(s.fingerprint) == 64
    printed = _printed(out / "01_dataset_prep.ipynb")
    assert f"fingerprint: sha256:{s.fingerprint}" in printed
    assert "manifest.json agrees: True" in printed
    assert _images(out / "01_dataset_prep.ipynb") == 2  # class counts, samples


@pytest.mark.slow
def test_02_baseline(executed):
    out = _ok(executed, "02_single_node_baseline.ipynb")
    run = ddpnb.load_metrics(out / "baseline")
    assert len(run.epochs) == 1 and run.final["images_per_second"] > 0
    assert 0 <= run.final["val_acc"] <= 1
    assert run.epochs[0]["world_size"] == 1 and run.epochs[0]["val_samples"] == 360
    printed = _printed(out / "02_single_node_baseline.ipynb")
    assert f"final val_acc:     {run.final['val_acc']:.4f}" in printed  # the run's own figures
    assert _images(out / "02_single_node_baseline.ipynb") == 1  # the curves
    for name in ("main", "make_data", "reduce_epoch_metrics"):  # the worker's own text
        assert worker_source(name) in printed


@pytest.mark.slow
def test_03_multi_node(executed):
    """About 50 s: the notebook's two trainings (DDP on 2 nodes, one process back to back for
    the throughput ratio) and its check of the exercise script, each its own torchrun."""
    out = _ok(executed, "03_multi_node_ddp.ipynb")
    run = ddpnb.load_metrics(out / "ddp")
    assert run.final["world_size"] == 2 and sorted(run.ranks) == [0, 1]
    assert run.epochs[0]["world_size"] == 2 and run.epochs[0]["val_samples"] == 360
    printed = _printed(out / "03_multi_node_ddp.ipynb")
    assert "baseline found:" in printed and "baseline, 1 process" in printed  # compared
    assert "throughput ratio DDP / one process, measured back to back:" in printed
    assert _images(out / "03_multi_node_ddp.ipynb") == 2  # curves, throughput
    base, ddp = (json.loads((out / d / "config.json").read_text()) for d in ("baseline", "ddp"))
    assert {k for k in base if base[k] != ddp[k]} == {"batch_size"}  # the baseline's config
    assert worker_source("wrap_model", "train_one_epoch") in printed
    assert worker_source("who_am_i", "join_process_group") in printed  # the group's set-up
    assert worker_source("validate") in printed
    text = (out / "03_multi_node_ddp.ipynb").read_text()
    assert "exec torchrun" in text and "--node_rank=1" in text
    # Node commands one option per line: none wraps mid-token in the output area.
    assert "torchrun \\\n    --nnodes=2 \\\n" in printed and "    --node_rank=1 \\\n" in printed
    assert "    --master_addr=127.0.0.1 \\\n" in printed  # the simulated nodes' own commands


@pytest.mark.slow
def test_04_fault_tolerance(executed):
    """About 65 s: the drill trains twice (uninterrupted, and killed then restarted) and
    resumes once more: the lesson compares those runs' numbers."""
    out = _ok(executed, "04_fault_tolerance.ipynb")
    rows = ddpnb.load_metrics(out / "fault").epochs
    assert [r["epoch"] for r in rows] == [1, 2, 3, 4]  # the drill, then resumed for one more
    assert [r["restart_count"] for r in rows[:3]] == [0, 1, 1]  # killed in epoch 2
    clean = ddpnb.load_metrics(out / "fault_uninterrupted").epochs
    assert [r["epoch"] for r in clean] == [1, 2, 3]
    assert all(r["restart_count"] == 0 for r in clean)
    assert abs(rows[2]["val_acc"] - clean[-1]["val_acc"]) <= 0.01
    assert _images(out / "04_fault_tolerance.ipynb") == 1  # both runs' curves
    text = (out / "04_fault_tolerance.ipynb").read_text()
    assert "DDPNB_FAULT: kill at epoch 2 step 1" in text and "resumed from" in text


@pytest.mark.slow
def test_05_scaling(executed):
    """About 55 s: one training per layout (1x1, 1x2, 2x1, 1x2 over gloo): the scaling table
    needs each."""
    out = _ok(executed, "05_scaling.ipynb")
    layouts = {name: out / "scaling" / name for name in ("1x1", "1x2", "2x1")}
    rows = tables.scaling_table(layouts)
    assert [r["world_size"] for r in rows] == [1, 2, 2]
    assert rows[0]["efficiency"] == 1.0 and all(r["images/s"] > 0 for r in rows)
    assert rows[0]["communication share"] < 0.05  # one process: an all-reduce with itself
    assert all(0 < r["communication share"] < 1 for r in rows[1:])
    for layout in ("1x2", "2x1"):
        ranks = ddpnb.load_metrics(layouts[layout]).ranks
        assert sorted(ranks) == [0, 1] and all(
            recs[-1]["comm_seconds"] > 0 for recs in ranks.values()
        )
    printed = _printed(out / "05_scaling.ipynb")
    assert "communication share" in printed and "identical_weights" in printed
    assert _images(out / "05_scaling.ipynb") == 1  # the scaling plot
    gloo = out / "scaling" / "1x2-gloo"  # the first layout with several processes, over gloo
    assert tables.same_weights(layouts["1x2"], gloo)
    assert ddpnb.load_metrics(gloo).final["images_per_second"] > 0


@pytest.mark.slow
def test_06_pitfalls(executed):
    """About 250 s (more than 120): the notebook runs seven trainings, a hang and six checks
    at world size 2, each its own torchrun. These runs are also the proof of each pitfall's
    records (tests/test_pitfalls.py keeps the edits' shape): no second copy of them runs."""
    out = _ok(executed, "06_pitfalls.ipynb")
    root = out / "pitfalls"
    data = ddpnb.inspect_dataset(root / "data", show=False)
    n_train, n_val = data.split_size("train"), data.split_size("val")
    assert (n_train, n_val) == (200, 41) and n_val % 2 == 1  # no world size 2 divides it
    run = {
        name: ddpnb.load_metrics(root / name)
        for name in (
            "correct",
            "no_sampler",
            "no_set_epoch",
            "padded_validation",
            "mean_of_means",
            "no_thread_budget",
        )
    }
    correct = run["correct"]
    assert sorted(correct.ranks) == [0, 1] and len(correct.epochs) == 2
    for records in correct.ranks.values():
        assert all(r["train_samples"] == n_train // 2 for r in records)
    assert [r["val_samples"] for r in correct.epochs] == [n_val, n_val]  # each image once
    assert all(sum(recs[e]["val_samples"] for recs in correct.ranks.values()) == n_val
               for e in range(2))  # fmt: skip
    # No sampler: every rank trains on the whole split, in the same order.
    ranks = run["no_sampler"].ranks
    assert all(r["train_samples"] == n_train for recs in ranks.values() for r in recs)
    assert "MISTAKE: no sampler" in (root / "no_sampler" / "train_ddp.py").read_text()
    if ranks[0][0].get("order_hash") is not None:
        assert [r["order_hash"] for r in ranks[0]] == [r["order_hash"] for r in ranks[1]]
    # No set_epoch: each rank repeats its first epoch's order; the correct run's changes.
    for rank in (0, 1):
        first, second = (r["order_hash"] for r in run["no_set_epoch"].ranks[rank])
        assert first is not None and first == second
        good = [r["order_hash"] for r in correct.ranks[rank]]
        assert good[0] != good[1]
    assert correct.ranks[0][0]["order_hash"] != correct.ranks[1][0]["order_hash"]  # 2 shards
    # Every rank holds the same parameters after each epoch, and they trained.
    for job in (correct, run["no_sampler"]):
        sums = [{recs[e]["param_checksum"] for recs in job.ranks.values()} for e in (0, 1)]
        assert all(len(s) == 1 for s in sums) and sums[0] != sums[1]
    # Padded validation: each rank counts ceil(41 / 2) = 21, one image twice.
    padded = -(-n_val // 2)
    assert [recs[0]["val_samples"] for recs in run["padded_validation"].ranks.values()] == [
        padded,
        padded,
    ]
    assert run["padded_validation"].final["val_samples"] == 2 * padded == n_val + 1
    assert sorted(recs[0]["val_samples"] for recs in correct.ranks.values()) == [
        n_val // 2,
        padded,
    ]
    # Mean of means: the same training, another validation loss; the exact value weighs
    # each rank's mean by its count (shards of 21 and 20), the counts are lost on the way.
    wrong = run["mean_of_means"]
    for key in ("val_loss", "val_acc"):
        means = [recs[-1][key] for recs in wrong.ranks.values()]
        counts = [recs[-1]["val_samples"] for recs in wrong.ranks.values()]
        assert wrong.final[key] == pytest.approx(sum(means) / len(means), rel=1e-9)
        exact = sum(m * n for m, n in zip(means, counts)) / sum(counts)
        assert correct.final[key] == pytest.approx(exact, rel=1e-9)
    assert wrong.final["val_loss"] != pytest.approx(correct.final["val_loss"], rel=1e-12, abs=0)
    assert wrong.final["val_samples"] == 1
    checksums = [[r["param_checksum"] for r in m.ranks[0]] for m in (wrong, correct)]
    assert checksums[0] == checksums[1]
    # No thread budget: each process runs torch's default, every core.
    default = torch_default_threads()
    assert all(r["threads"] == default for recs in run["no_thread_budget"].ranks.values()
               for r in recs)  # fmt: skip
    budget = max(1, (os.cpu_count() or 1) // 2)  # ddpnb shares the cores out: 2 processes
    assert all(r["threads"] == budget for recs in correct.ranks.values() for r in recs)
    text = (out / "06_pitfalls.ipynb").read_text()
    # ddpnb.check_script names the sampler mistakes in the variants, with their line.
    assert "Ranks train on the same samples" in text and "train_ddp.py:" in text
    assert "Every epoch repeats the same order" in text
    assert "PortInUseError" in text
    # The barrier on rank 0 only: the hang watch stopped it after epoch 1, naming each
    # rank's line, and the check names it as mistake 9.
    assert len(ddpnb.load_metrics(root / "barrier_on_rank0").epochs) == 1
    assert "run FAILED" in text and "(RunHung)" in text
    lines = pitfalls.variant("barrier_on_rank0").splitlines()
    line = next(i for i, t in enumerate(lines, 1) if "dist.barrier()  # nobody" in t)
    assert f"rank 0 waits in barrier at train_ddp.py:{line} (dist.barrier()" in text
    assert "rank 1 waits in" in text and "different collectives" in text
    # Rank 1's line is its training step's, not the worker's shared-memory helper (Part 2).
    assert "self.flag" not in text and "the script's helpers (hook, allreduce, agree)" in text
    assert "Ranks call different collectives" in text
    # Said once (by the RunHung's stacks, not also by the progress), at the training step's line.
    assert text.count("ddpnb: the run hangs") == 0 and "(loss.backward()" in text
    # The check's notes agree with each other: rank 0's pass never ended, both ranks stepped.
    assert "fewer than two ranks took an optimizer step" not in text
    assert "ended a pass of its training data" in text


def torch_default_threads() -> int:
    """torch's intra-op threads in a fresh process with OMP_NUM_THREADS at every core."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, OMP_NUM_THREADS=str(os.cpu_count()))
    code = "import torch; print(torch.get_num_threads())"
    return int(subprocess.check_output([sys.executable, "-c", code], env=env, text=True))


@pytest.mark.slow
def test_07_real_machines_without_hosts(executed):
    out = _ok(executed, "07_real_machines.ipynb")  # 03's simulated curves are shown
    printed = _printed(out / "07_real_machines.ipynb")
    assert "hosts is empty: nothing was started." in printed
    assert not (out / "real").exists()  # no run directory: nothing started
    assert _images(out / "07_real_machines.ipynb") == 1
    # Lines to paste: ssh, the run directory, torchrun; nothing internal, no placeholder.
    assert "# node 1:\nssh -t -- gpu2 'cd " in printed and " --node_rank=1 " in printed
    ssh_lines = [line for line in printed.splitlines() if line.startswith("ssh ")]
    assert len(ssh_lines) == 2 and not [line for line in ssh_lines if "DDPNB_" in line]
    assert "<ddpnb agent>" not in printed


@pytest.mark.slow
def test_09_your_own_script(executed):
    """About 50 s: the notebook launches, checks and reruns the reader's own script; each
    step is its own torchrun."""
    out = _ok(executed, "09_your_own_script.ipynb")  # its curves are shown
    printed = _printed(out / "09_your_own_script.ipynb")
    assert "epoch 3: val_acc" in printed  # the single-process script ran first
    assert '+    dist.init_process_group("gloo")' in printed  # the DDP changes, as a diff
    assert "+    model = DDP(" in printed
    assert "+        sampler.set_epoch(epoch)" in printed  # the one-line fix
    # The check named the missing line before the fix, and came out clean after it.
    checks = [c for c in nbformat.read(out / "09_your_own_script.ipynb", as_version=4).cells
              if "check_script(ddpnb.Script(" in c.source]  # fmt: skip
    first, second = (json.dumps(c.outputs) for c in checks)
    assert "Every epoch repeats the same order" in first and "tabular_ddp.py:" in first
    assert "Every epoch repeats" not in second and "no mistake found" in second.lower()
    run = ddpnb.load_metrics(out / "own")
    assert [r["epoch"] for r in run.epochs] == [1, 2, 3, 4, 5]
    assert all(r["world_size"] == 2 for r in run.epochs) and run.final["val_acc"] > 0.9
    assert (out / "own" / "model.pt").is_file()  # rank 0 wrote it in its working directory
    assert "# node 1:\nssh -t -- gpu2 'cd /shared/runs/own && exec torchrun " in printed
    ssh_lines = [line for line in printed.splitlines() if line.startswith("ssh ")]
    assert len(ssh_lines) == 2 and not [line for line in ssh_lines if "DDPNB_" in line]
    assert "srun" in printed


@pytest.mark.slow
def test_10_appendix_blog_typos(executed):
    out = _ok(executed, "10_appendix_blog_typos.ipynb")
    printed = _printed(out / "10_appendix_blog_typos.ipynb")
    assert "SyntaxError at line 2: invalid character" in printed and "(U+FF08)" in printed
    assert "compiles: model.eval()" in printed  # the fix
    assert "NameError: name 'device' is not defined" in printed
    assert "train() ran on cpu" in printed  # device passed as an argument


# -- the exercises: a script that runs but is not right yet, its check, a hint, a solution --

SOLUTIONS = NOTEBOOKS / "solutions"
EXERCISES = {  # script: (its notebook, the mistakes (check_script's numbers) it is about)
    "join_anywhere.py": ("03_multi_node_ddp.ipynb", {7}),
    "exact_eval.py": ("06_pitfalls.ipynb", {5}),
    "checkpoint_read.py": ("06_pitfalls.ipynb", {14}),
    "digits_ddp.py": ("09_your_own_script.ipynb", {2, 3, 6}),
}
WITH_EXERCISES = sorted({nb for nb, _ in EXERCISES.values()})


def exercise_cells(nb) -> dict[str, int]:
    """The cells tagged ``exercise``: the script each writes, and the cell's index."""
    found = {}
    for i, cell in enumerate(nb.cells):
        if "exercise" in cell.metadata.get("tags", []):
            m = re.match(r"%%writefile (\S+)\n", cell.source)
            assert m, f"an exercise cell writes a script: {cell.source[:60]!r}"
            found[m.group(1)] = i
    return found


def test_every_exercise_has_its_check_hint_and_solution():
    nbs = {name: nbformat.read(NOTEBOOKS / name, as_version=4) for name in ALL}
    where = {script: name for name, nb in nbs.items() for script in exercise_cells(nb)}
    assert where == {script: nb for script, (nb, _) in EXERCISES.items()}
    assert len(where) >= 4 and len(set(where.values())) >= 3
    assert sorted(p.name for p in SOLUTIONS.glob("*.py")) == sorted(EXERCISES)
    for script, name in where.items():
        cells = nbs[name].cells
        i = exercise_cells(nbs[name])[script]
        assert "# TODO" in cells[i].source
        assert cells[i + 1].source.startswith(f'ddpnb.check_script("{script}")')  # the check
        after = cells[i + 2].source  # a hint, then where the solution is
        assert cells[i + 2].cell_type == "markdown" and "Hint" in after
        assert after.index("Hint") < after.index(f"solutions/{script}")
        assert (SOLUTIONS / script).read_text() != cells[i].source.split("\n", 1)[1]
        assert "TODO" not in (SOLUTIONS / script).read_text()  # a solution reads as done


PREDICTIONS = {  # the variable each "predict, then run" exercise asks for: its notebook
    "predicted_first_epoch": "04_fault_tolerance.ipynb",
    "predicted_share": "05_scaling.ipynb",
    "predicted_counted": "06_pitfalls.ipynb",
}


def prediction_cells(nb) -> dict[str, tuple[int, int]]:
    """The cells tagged ``prediction``: the variable each asks for, its index and its check's."""
    found = {}
    for i, cell in enumerate(nb.cells):
        if "prediction" in cell.metadata.get("tags", []):
            name = re.match(r"(\w+) = None  # TODO: your prediction", cell.source)[1]
            checks = [
                j for j, c in enumerate(nb.cells) if j > i and "check_prediction(" in c.source
            ]
            found[name] = (i, checks[0])
    return found


def _solution(cell, name: str) -> str:
    """The expression the solution gives ``name`` (after the hint, in the cell below the check)."""
    assert cell.cell_type == "markdown" and 0 < cell.source.index("Hint") < cell.source.index(
        "Solution"
    )
    return re.search(rf"```python\n{name} = (.+)\n```", cell.source)[1]


def test_every_prediction_has_its_check_hint_and_solution():
    nbs = {name: nbformat.read(NOTEBOOKS / name, as_version=4) for name in ALL}
    where = {var: name for name, nb in nbs.items() for var in prediction_cells(nb)}
    assert where == PREDICTIONS
    # The workshop's exercises: at least 7, in at least 5 notebooks.
    assert len(EXERCISES) + len(PREDICTIONS) >= 7 and len({*WITH_EXERCISES, *where.values()}) >= 5
    for var, name in where.items():
        cells = nbs[name].cells
        i, check = prediction_cells(nbs[name])[var]
        assert cells[i - 1].source.startswith("### Exercise: predict, then run")
        assert var in cells[check].source and _solution(cells[check + 1], var)


@pytest.mark.slow
@pytest.mark.parametrize("name, var", sorted((nb, var) for var, nb in PREDICTIONS.items()))
def test_a_prediction_not_made_is_flagged_and_the_solution_is_what_the_run_measured(
    executed, name, var
):
    """The notebook's name in the test's id: 06's runs with notebook 06's group (one worker
    executes each notebook once)."""
    nb = nbformat.read(_ok(executed, name) / name, as_version=4)
    i, check = prediction_cells(nb)[var]
    shown = "".join(o.get("data", {}).get("text/plain", "") for o in nb.cells[check].outputs)
    measured = re.search(r"predicted None, measured (.+): no prediction yet", shown)
    assert measured, shown
    # The solution's expression with the parameters the notebook ran with (papermill's too).
    given: dict = {}
    for cell in nb.cells:
        if {"parameters", "injected-parameters"} & set(cell.metadata.get("tags", [])):
            exec(cell.source, given)
    assert repr(eval(_solution(nb.cells[check + 1], var), given)) == measured[1]


def _check_outputs(path: Path) -> dict[str, str]:
    """The output of each exercise's check cell in an executed notebook, by script."""
    nb = nbformat.read(path, as_version=4)
    return {s: json.dumps(nb.cells[i + 1].outputs) for s, i in exercise_cells(nb).items()}


def _mistakes(output: str) -> set[int]:
    return {int(n) for n in re.findall(r"mistake (\d+)</small>", output)}


@pytest.mark.slow
@pytest.mark.parametrize("name", WITH_EXERCISES)
def test_exercises_as_written_name_exactly_their_mistakes(executed, name):
    out = _ok(executed, name)  # unsolved, the notebook ran top to bottom
    for script, output in _check_outputs(out / name).items():
        assert _mistakes(output) == EXERCISES[script][1], (script, output[:2000])
        assert f"{script}:" in output  # with their lines


def solved(src: Path, dst: Path) -> Path:
    """The notebook's exercises, solved: its parameters and imports cells, then each exercise's
    own cells (its text, the script, the check, the hint) with the solution in the script's
    cell. What comes between is the notebook's unsolved run's (test_notebooks above runs it
    whole); the exercises depend on none of it, so it does not run twice."""
    nb = nbformat.read(src, as_version=4)
    code = [i for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    keep = code[:2]  # the parameters, then the imports
    for script, i in exercise_cells(nb).items():
        nb.cells[i].source = f"%%writefile {script}\n{(SOLUTIONS / script).read_text()}"
        keep += [i - 1, i, i + 1, i + 2]
    nb.cells = [nb.cells[i] for i in keep]
    nbformat.write(nb, dst)
    return dst


@pytest.mark.slow
@pytest.mark.parametrize("name", WITH_EXERCISES)
def test_the_exercises_run_solved_and_their_checks_are_clean(tmp_path, name):
    """About 35-45 s: the solved exercises run in a kernel, and the check runs once per solution."""
    import papermill

    path = solved(NOTEBOOKS / name, tmp_path / f"solved-{name}")
    papermill.execute_notebook(
        str(path),
        str(path),
        parameters={"progress": "none"} if name != "09_your_own_script.ipynb" else {},
        kernel_name="python3",
        execution_timeout=300,
        cwd=str(tmp_path),
        progress_bar=False,
        kernel_manager_class=ipc_kernel_manager(),
    )
    checks = _check_outputs(path)
    assert sorted(checks) == sorted(s for s, (nb, _) in EXERCISES.items() if nb == name)
    for script, output in checks.items():
        assert "no mistake found" in output and not _mistakes(output), (script, output[:2000])
