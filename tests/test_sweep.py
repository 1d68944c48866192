"""ddpnb sweep: a notebook over a grid with papermill, gathered in one table.

Real papermill, real kernels, real torchrun runs of notebook 02 on the tiny dataset (one
epoch of two steps, 16 px). One sweep through the CLI (batch sizes 8 and 16 train, 0 fails)
is shared by the tests that read it.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest

import ddpnb
from ddpnb import cli
from ddpnb.agent import descendants
from ddpnb.demo import NOTEBOOKS
from ddpnb.errors import ConfigError
from ddpnb.scheduler import alive
from ddpnb.sweep import parse_axis, point_names, resolve_type

NB02 = NOTEBOOKS / "02_single_node_baseline.ipynb"
SMALL = {"data_dir": "tiny", "epochs": 1, "max_steps_per_epoch": 2, "image_size": 16}
SMALL_ARGS = [a for name, value in SMALL.items() for a in ("-p", name, str(value))]
FAILS = "ConfigError: batch_size must be an integer >= 1, got 0."  # TrainConfig's message


def _sweep_cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "ddpnb", "sweep", *argv],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=400,
    )


def _rows(out: Path) -> dict[str, dict]:
    with open(out / "summary.csv", newline="") as f:
        return {row["point"]: row for row in csv.DictReader(f)}


def _folder_with_data(root: Path, tiny_data: Path) -> Path:
    """A folder to run sweeps in, holding the tiny dataset as ``tiny`` (a relative data_dir
    there means that folder: the notebooks run in the sweep's current folder)."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "tiny").symlink_to(tiny_data)
    return root


@pytest.fixture(scope="module")
def swept(tiny_data, tmp_path_factory):
    """One sweep through the CLI: batch sizes 8 and 16 train, 0 fails. (folder, result)."""
    where = _folder_with_data(tmp_path_factory.mktemp("sweep"), tiny_data)
    r = _sweep_cli(str(NB02), "--out", "out", *SMALL_ARGS, "-g", "batch_size", "8,16,0", cwd=where)
    return where, r


# -- reading the command line --------------------------------------------------------------


def test_values_are_read_as_papermill_reads_them():
    from papermill.cli import _resolve_type

    texts = ["32", "-3", "0.1", "1e-3", "True", "False", "None", "none", "resnet18", "", "inf"]
    got, expected = [resolve_type(t) for t in texts], [_resolve_type(t) for t in texts]
    assert got == expected and [type(v) for v in got] == [type(v) for v in expected]
    assert parse_axis("lr", "0.1, 0.2,None") == [0.1, 0.2, None]


def test_point_names_are_readable_safe_and_distinct():
    assert point_names([{"batch_size": 32, "lr": 0.1}], "nb") == ["batch_size=32,lr=0.1"]
    assert point_names([{}], "02_single_node_baseline") == ["02_single_node_baseline"]
    names = point_names([{"data_dir": "a/b"}, {"data_dir": "a_b"}, {"m": "x" * 300}], "nb")
    assert names[0] != names[1] and all("/" not in n and len(n) <= 100 for n in names)


# -- one sweep, end to end -----------------------------------------------------------------


@pytest.mark.slow
def test_each_point_runs_into_its_notebook_and_folder_and_the_table_gathers_them(swept):
    where, r = swept
    out = where / "out"
    assert r.returncode == 1, r.stderr  # batch_size=0 failed
    rows = _rows(out)
    assert list(rows) == ["batch_size=8", "batch_size=16", "batch_size=0"]
    for size in ("8", "16"):
        point, row = f"batch_size={size}", rows[f"batch_size={size}"]
        assert row["status"] == "done" and row["batch_size"] == size and row["error"] == ""
        assert 0 <= float(row["val_acc"]) <= 1 and float(row["val_loss"]) > 0
        assert float(row["images_per_second"]) > 0 and row["world_size"] == "1"
        assert float(row["wall_s"]) > 0 and row["notebook"] == f"{point}.ipynb"
        # The notebook's run_dir was pointed inside the point's folder.
        run = out / point / "baseline"
        assert row["run_dir"] == str(run) and (run / "metrics.jsonl").is_file()
        assert ddpnb.load_metrics(run).config["batch_size"] == int(size)
        nb = nbformat.read(out / f"{point}.ipynb", as_version=4)
        assert nb.metadata.papermill.parameters == {
            **SMALL,
            "batch_size": int(size),
            "run_dir": str(run),
        }
    assert (out / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # The terminal shows the same table, and where the files are.
    assert "batch_size=16" in r.stdout and "curves: out/curves.png" in r.stdout


@pytest.mark.slow
def test_a_failing_point_fails_alone_with_its_error(swept):
    where, r = swept
    row = _rows(where / "out")["batch_size=0"]
    assert (row["status"], row["error"], row["val_acc"]) == ("failed", FAILS, "")
    assert (where / "out" / "batch_size=0.ipynb").is_file()  # shows the traceback
    assert f"batch_size=0: {FAILS}" in r.stdout


@pytest.mark.slow
def test_changed_settings_or_foreign_files_are_refused_before_anything_runs(
    swept, monkeypatch, capsys
):
    where, _ = swept
    monkeypatch.chdir(where)
    before = (where / "out" / "summary.csv").stat().st_mtime_ns
    argv = ["sweep", str(NB02), "--out", "out", *SMALL_ARGS, "-g", "batch_size", "8,16,0"]
    assert cli.main([*argv, "-p", "lr", "0.2"]) == 2
    assert "lr unset then, 0.2 now" in capsys.readouterr().err
    (where / "mine").mkdir()
    (where / "mine" / "batch_size=8.ipynb").write_text("{}")  # not a sweep's
    assert cli.main([*argv[:2], "--out", "mine", *argv[4:]]) == 2
    assert "was not written by a sweep" in capsys.readouterr().err
    assert (where / "mine" / "batch_size=8.ipynb").read_text() == "{}"
    assert (where / "out" / "summary.csv").stat().st_mtime_ns == before


@pytest.mark.slow
def test_a_rerun_skips_done_points_retries_failed_ones_and_overwrite_redoes(swept):
    """About 70 s: three more sweeps of notebook 02 (the rerun, the refused and the retried
    point, the overwrite), each point a kernel of its own."""
    where, _ = swept
    out = where / "out"
    done = [out / "batch_size=8.ipynb", out / "batch_size=16/baseline/metrics.jsonl"]
    failed = out / "batch_size=0.ipynb"
    kept = {p: p.stat().st_mtime_ns for p in done}
    failed_before = failed.stat().st_mtime_ns
    r = _sweep_cli(str(NB02), "--out", "out", *SMALL_ARGS, "-g", "batch_size", "8,16,0", cwd=where)
    assert r.returncode == 1, r.stderr
    statuses = {p: row["status"] for p, row in _rows(out).items()}
    assert statuses == {
        "batch_size=8": "skipped",
        "batch_size=16": "skipped",
        "batch_size=0": "failed",
    }
    assert {p: p.stat().st_mtime_ns for p in done} == kept
    assert failed.stat().st_mtime_ns > failed_before  # run again
    assert float(_rows(out)["batch_size=8"]["val_acc"]) >= 0  # metrics of a skipped point
    # Other settings: a failed point is retried with them (a corrected data_dir, say); a done
    # point is refused before anything runs.
    other = {**SMALL, "max_steps_per_epoch": 3}
    failed_before = failed.stat().st_mtime_ns
    with pytest.raises(ConfigError, match="batch_size=8 .* was run with other settings"):
        ddpnb.sweep(NB02, out, {"batch_size": [8, 0]}, other, cwd=where)
    assert failed.stat().st_mtime_ns == failed_before  # refused: nothing ran
    result = ddpnb.sweep(NB02, out, {"batch_size": [0]}, other, cwd=where)
    assert [row["status"] for row in result] == ["failed"]  # ran again: batch_size 0 fails
    assert failed.stat().st_mtime_ns > failed_before
    # overwrite=True redoes a done point (the Python API; one point, to keep the test short).
    result = ddpnb.sweep(NB02, out, {"batch_size": [8]}, SMALL, overwrite=True, cwd=where)
    assert result.ok and [row["status"] for row in result] == ["done"]
    assert (out / "batch_size=8.ipynb").stat().st_mtime_ns > kept[done[0]]
    assert "<td>batch_size=8</td>" in result._repr_html_()
    assert result.figure == out / "curves.png" and "batch_size=8" in str(result)


# -- bad arguments ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, says",
    [
        (["-p", "batchsize", "8"], "no parameter 'batchsize'. Its parameters cell names: data_dir"),
        (["-g", "batch_size", ""], "-g batch_size '' has no values"),
        (["-g", "batch_size", "8,,16"], "has an empty value"),
        (
            ["-p", "lr", "0.1", "-g", "lr", "0.1,0.2"],
            "both as a fixed parameter (-p) and as a grid",
        ),
        (["-g", "lr", "0.1", "-g", "lr", "0.2"], "-g lr is given twice"),
        (["-p", "run_dir", "runs/x", "-g", "lr", "0.1,0.2"], "would both write run_dir='runs/x'"),
        (["--notebook-is", "missing.ipynb"], "missing.ipynb does not exist"),
    ],
)
def test_bad_arguments_exit_2_before_anything_runs(argv, says, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    notebook = str(NB02)
    if argv[0] == "--notebook-is":
        notebook, argv = argv[1], []
    assert cli.main(["sweep", notebook, "--out", "out", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ddpnb sweep: error: ") and says in err, err
    assert not (tmp_path / "out").exists()


def test_the_python_api_refuses_what_the_command_line_refuses(tmp_path):
    with pytest.raises(ConfigError, match="grid axis 'lr' has no values"):
        ddpnb.sweep(NB02, tmp_path / "out", {"lr": []})
    with pytest.raises(ConfigError, match="must be a list of values"):
        ddpnb.sweep(NB02, tmp_path / "out", {"batch_size": "8,16"})
    assert not (tmp_path / "out").exists()


# -- Ctrl-C ----------------------------------------------------------------------------------


def _start(where: Path, *argv: str) -> subprocess.Popen:
    """``ddpnb sweep`` in its own session, as a terminal would run it."""
    return subprocess.Popen(
        [sys.executable, "-m", "ddpnb", "sweep", *argv],
        cwd=where,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def _wait_for(path: Path, proc: subprocess.Popen, limit: float = 180) -> None:
    deadline = time.monotonic() + limit
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} never appeared"
        time.sleep(0.1)


def _group_members(pgid: int) -> list[int]:
    """Processes whose process group is ``pgid`` (Linux /proc)."""
    members = []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[2]) == pgid:
                    members.append(int(entry))
        except (OSError, ValueError, IndexError):
            continue
    return members


def _gone_within(pids: list[int], seconds: float) -> list[int]:
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return [p for p in pids if alive(p)]


def _cmdlines(pids: list[int]) -> str:
    text = []
    for pid in pids:
        try:
            text.append(Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " "))
        except OSError:
            pass
    return "\n".join(text)


@pytest.mark.slow
def test_ctrl_c_stops_the_running_point_and_keeps_the_rest(tiny_data, tmp_path):
    where = _folder_with_data(tmp_path, tiny_data)
    out = where / "out"
    long = [*SMALL_ARGS, "-p", "epochs", "1000", "-p", "max_steps_per_epoch", "None"]
    proc = _start(where, str(NB02), "--out", "out", *long, "-g", "batch_size", "0,8")
    try:
        _wait_for(out / "batch_size=8" / "baseline" / "progress.json", proc)  # training
        pids = descendants(proc.pid)  # the kernel, the torchrun agent, its worker
        assert "ipykernel" in _cmdlines(pids) and "train_ddp.py" in _cmdlines(pids)
        finished = (out / "batch_size=0.ipynb").stat().st_mtime_ns
        start = time.monotonic()
        os.kill(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - start
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130 and "the running point was stopped" in err, err
    assert took < 20, took
    assert not _gone_within(pids, 10), _cmdlines(pids)
    assert _group_members(proc.pid) == []
    rows = _rows(out)  # the table as it stood: the finished point kept, this one interrupted
    assert [rows[p]["status"] for p in rows] == ["failed", "interrupted"]
    assert (out / "batch_size=0.ipynb").stat().st_mtime_ns == finished


@pytest.mark.slow
def test_a_kernel_that_ignores_ctrl_c_is_killed_and_its_run_ends_with_it(tiny_data, tmp_path):
    """A second Ctrl-C kills the kernel at once; ddpnb's lifeline then ends its torchrun."""
    where = _folder_with_data(tmp_path, tiny_data)
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {
        "name": "python3",
        "display_name": "Python 3",
        "language": "python",
    }
    params = nbformat.v4.new_code_cell('data_dir = "tiny"\nrun_dir = "runs/stubborn"')
    params.metadata["tags"] = ["parameters"]
    launch = (
        "import time, ddpnb\n"
        "cfg = ddpnb.TrainConfig(data_dir=data_dir, image_size=16, epochs=1000, batch_size=8)\n"
        'job = ddpnb.launch(cfg, run_dir, nnodes=1, wait=False, progress="none")\n'
        "while True:\n"
        "    try:\n"
        "        time.sleep(0.5)\n"
        "    except KeyboardInterrupt:\n"
        "        pass  # stubborn: only a kill ends this kernel"
    )
    nb.cells = [params, nbformat.v4.new_code_cell(launch)]
    nbformat.write(nb, where / "stubborn.ipynb")
    proc = _start(where, "stubborn.ipynb", "--out", "out")
    try:
        _wait_for(where / "out" / "stubborn" / "stubborn" / "progress.json", proc)
        pids = descendants(proc.pid)
        assert "train_ddp.py" in _cmdlines(pids)
        os.kill(proc.pid, signal.SIGINT)
        time.sleep(1)  # the kernel was interrupted, and ignores it
        assert proc.poll() is None
        os.kill(proc.pid, signal.SIGINT)  # the second Ctrl-C: kill the kernel
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert not _gone_within(pids, 15), _cmdlines(pids)  # the lifeline: within 10 s
    record = json.loads((where / "out" / ".ddpnb" / "stubborn.json").read_text())
    assert record["status"] == "interrupted"
