"""The progress displays against a finished run directory (no browser: see the brief)."""

import subprocess

import pytest
from test_plot import _fake_run

import ddpnb
from ddpnb.errors import RunHung
from ddpnb.hang import Verdict
from ddpnb.job import Job
from ddpnb.progress import WAITING_COLORS, TextProgress, WidgetProgress, is_jupyter_server
from ddpnb.scheduler import Processes
from ddpnb.topology import Topology


class Ended(Processes):
    """Nodes that ran here and ended (``procs`` set by the test)."""

    def start(self, plan, run_dir):
        raise AssertionError("an ended run is not started")


def _job(run_dir, nnodes=4, config=True):
    nodes = Ended()
    nodes.procs = {n: subprocess.Popen(["true"]) for n in range(nnodes)}
    for p in nodes.procs.values():
        p.wait()
    (run_dir / "progress.json").write_text(
        '{"phase": "done", "epoch": 4, "epochs": 4, "step": 9, "steps": 9, "time": 0}'
    )
    return Job(
        run_dir,
        None,
        ddpnb.TrainConfig(epochs=4) if config else None,
        Topology(nnodes, 1, "127.0.0.1", 1234, rdzv_timeout=5),
        nodes,
        progress="widgets",
    )


def test_widget_panel_has_a_row_per_node_full_bars_and_a_plot(tmp_path):
    job = _job(_fake_run(tmp_path / "r", 4))
    panel = WidgetProgress(job)
    panel.close(job)
    assert len(panel.node_rows) == 4
    assert all(">done<" in row.value for row in panel.node_rows)
    assert "master" in panel.node_rows[0].value
    assert panel.epoch_bar.value == panel.epoch_bar.max == 4
    assert panel.step_bar.value == panel.step_bar.max == 9
    assert panel.plot.value[:4] == b"\x89PNG" and panel.plot_updates >= 1
    assert "finished" in panel.status.value


def test_text_progress_is_a_line_per_epoch(tmp_path, capsys):
    job = _job(_fake_run(tmp_path / "r", 2), nnodes=2)
    text = TextProgress(job)
    text.update()
    text.update()
    text.close(job)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 1 + 4 + 1
    assert "hosts the rendezvous" in lines[0] and lines[1].startswith("epoch 1/4")
    assert "finished" in lines[-1]


HANG = "No rank has made progress for 8 s: rank 0 waits in barrier at train.py:9; ..."


def test_the_hang_that_stopped_the_run_is_said_once_by_its_error(tmp_path, capsys):
    """The RunHung raised says the verdict (and e.stacks shows it): the displays do not repeat it."""
    job = _job(_fake_run(tmp_path / "r", 2), nnodes=2)
    job.waiting = Verdict("hang", HANG, 8.0, "different")
    job.error = RunHung(f"The run hangs. {HANG}")
    text, panel = TextProgress(job), WidgetProgress(job)
    text.close(job)
    panel.close(job)
    out = capsys.readouterr().out
    assert "No rank has made progress" not in out and "run FAILED" in out and "(RunHung)" in out
    box = panel.waiting.value
    assert "No rank has made progress" not in box
    assert "<b>The run hangs</b>: stopped (on_hang='stop'); the RunHung error" in box, box


def test_ranks_that_wait_are_shown_waiting_once(tmp_path, capsys):
    job = _job(_fake_run(tmp_path / "r", 2), nnodes=2)
    job.waiting = Verdict("waiting", "rank 0 waits in barrier at train.py:9 for 6 s.", 6.0)
    text, panel = TextProgress(job), WidgetProgress(job)
    text.update()
    text.update()
    assert capsys.readouterr().out.count("ddpnb: waiting: rank 0 waits in barrier") == 1
    assert f"solid {WAITING_COLORS['waiting']}" in panel.waiting.value
    assert "<b>Waiting</b>: rank 0 waits in barrier at train.py:9 for 6 s." in panel.waiting.value


def test_every_node_shows_the_runs_one_count_of_optimizer_steps(tmp_path):
    """Snapshots of ranks in lockstep are taken at different moments (114 and 105 steps): one
    count, the run's, on every node's row."""
    from ddpnb.hang import RankState

    job = _job(_fake_run(tmp_path / "r", 2), nnodes=2)
    about = dict(host="h", pid=1, state="running", still=1.0, process_group=True, frames=())
    job._ranks = [RankState(r, r, steps=n, age=0.5, **about) for r, n in ((0, 114), (1, 105))]
    panel = WidgetProgress(job)
    panel.update()
    assert all("114 optimizer steps" in row.value for row in panel.node_rows)


@pytest.mark.parametrize(
    "cmdline, server",
    [
        ("/venv/bin/python -m jupyter lab --ip=127.0.0.1", True),
        ("/venv/bin/python /venv/bin/jupyter-lab --no-browser", True),
        ("/venv/bin/python -X frozen_modules=off -m jupyterlab", True),
        ("/opt/conda/bin/python /opt/conda/bin/jupyterhub-singleuser", True),
        ("python -m notebook", True),
        ("/venv/bin/python /venv/bin/jupyter-nbconvert --execute nb.ipynb", False),
        ("/venv/bin/python /venv/bin/jupyter-execute nb.ipynb", False),
        ("/venv/bin/python /venv/bin/papermill nb.ipynb out.ipynb", False),
        ("python -m pytest -q /home/jupyter/ddpnb/tests", False),
        ("/home/jupyter/venv/bin/python -m ddpnb.demo", False),
    ],
)
def test_widgets_only_under_a_jupyter_server(cmdline, server):
    assert is_jupyter_server(cmdline.split()) is server
