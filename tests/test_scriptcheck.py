"""ddpnb.check_script: each classic mistake named with its line; correct scripts come out clean.

Real torchrun processes on two simulated nodes (gloo). tests/scripts/good.py is the
corrected twin of every mistake script: each is good.py with one edit, marked ``# MISTAKE``
(tests/mistakes.py), written out once per session. Every scenario runs once per session; several tests assert on its report.
Every script asks for 100 epochs: the check must stop it within seconds.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from conftest import tiny_config
from mistakes import EDITS, write_mistakes

import ddpnb
from ddpnb.constants import free_port
from ddpnb.script import Script
from ddpnb.scriptcheck import _parse_args, check_script, load_records, main_check_script

pytestmark = pytest.mark.slow

SCRIPTS = Path(__file__).with_name("scripts")
EPOCHS = "100"
# How a run the check stopped ended: never its 100 epochs, nor a timeout (no timed assertion:
# the ranks' own records say who ended the run).
STOPPED_BY_THE_CHECK = (
    "stopped after optimizer step",
    "stopped at the end of epoch",
    "the check's watchdog",
    "the check's hang watch",
    "ended after a peer stopped",
)


def stopped_by_the_check(report) -> bool:
    return any(words in report.ended for words in STOPPED_BY_THE_CHECK)


HANGS = Path(__file__).with_name("hangs")

# script -> (the mistake's number, the line the finding must name, what it must have measured)
MISTAKES = {
    "no_sampler": (1, "train_loader = DataLoader(", "49 of the 49 training samples"),
    "no_set_epoch": (2, "sampler = DistributedSampler(", "same 25 samples in the same order"),
    "no_ddp": (3, "optimizer = torch.optim.SGD(", "parameters differ"),
    "unequal_steps": (4, "train_loader = DataLoader(", "after 3 optimizer steps"),
    "padded_val": (5, "val_loader = DataLoader(", "16 samples of a 15-sample set"),
    "every_rank_saves": (6, "torch.save(", "model.pt"),
    "loopback_init": (7, "dist.init_process_group(", "127.0.0.1"),
    "fixed_world_size": (7, "dist.init_process_group(", "world_size=2 is written"),
    "loopback_master_addr": (7, 'os.environ["MASTER_ADDR"]', "'localhost'"),
    # a hang: the hang watch names each rank's line; the collectives' order, before any hang
    "rank0_barrier": (9, "dist.barrier()  # MISTAKE", "rank 0 waits in barrier at"),
    # a race: found from where each rank was in its collectives, not from how the race went
    "unordered_read": (14, "torch.load(", "nothing made the read wait for the write"),
    "ddp_eval_rank0": (9, "total += float(F.mse_loss(model(x)", "DDP's buffer broadcast (forward)"),
}

_reports: dict = {}
_folder: list[Path] = []


def script_path(name: str) -> Path:
    """tests/scripts/<name>.py, or the mistake <name> written out from its twin."""
    if name not in EDITS:
        return SCRIPTS / f"{name}.py"
    if not _folder:
        _folder.append(write_mistakes(Path(tempfile.mkdtemp(prefix="ddpnb-mistakes-"))))
    return _folder[0] / f"{name}.py"


def checked(name: str):
    """The report of tests/scripts/<name>.py, checked once per session."""
    if name not in _reports:
        port = [str(free_port())] if name == "loopback_init" else []
        _reports[name] = check_script(Script(script_path(name), args=[EPOCHS, *port]))
    return _reports[name]


def line_of(name: str, snippet: str) -> int:
    lines = script_path(name).read_text().splitlines()
    return next(i for i, line in enumerate(lines, 1) if snippet in line)


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def assert_nothing_left(report) -> None:
    assert len(report.pids) >= 2, report.pids  # agents and workers were seen
    assert [p for p in report.pids if alive(p)] == []


@pytest.mark.parametrize("name", sorted(MISTAKES))
def test_mistake_is_found_with_its_line_and_evidence(name):
    """Each classic mistake's script: the check names exactly it, at its line, with what it
    measured. Up to 35 s for those that must run until a collective times out or hangs."""
    number, line, measured = MISTAKES[name]
    report = checked(name)
    assert report.error is None, str(report)
    assert [f.number for f in report.findings] == [number], str(report)
    finding = report.findings[0]
    assert finding.where == f"{name}.py:{line_of(name, line)}", str(report)
    assert measured in finding.seen, finding.seen
    assert finding.why and finding.fix
    assert (report.exit_code, report.ok) == (1, False)
    assert f"Mistake {number}" in str(report) and finding.where in report._repr_html_()
    assert stopped_by_the_check(report) or report.error is None and "run stopped" in str(report)
    assert_nothing_left(report)


@pytest.mark.parametrize("name", ["good", "rank0_eval", "bn_rank0_eval"])
def test_correct_script_is_clean_and_stopped_early(name):
    report = checked(name)
    assert report.ok and report.exit_code == 0, str(report)
    assert "stopped after optimizer step" in report.ended  # not 100 epochs
    assert "no mistake found" in str(report) and "<table" in report._repr_html_()
    assert_nothing_left(report)


def test_facts_and_what_was_checked():
    report = checked("good")
    facts = report.facts
    assert facts["world size"].startswith("2 ")
    assert (facts["batch size per rank"], facts["global batch size"][:2]) == ("8", "16")
    assert facts["steps per epoch"] == "rank 0: 4, rank 1: 4"  # 25 samples a rank, batches of 8
    assert facts["DistributedDataParallel"] == f"good.py:{line_of('good', 'model = DDP(')}"
    notes = " ".join(report.checked)
    assert "each of the 15 once" in notes and "all_reduce at good.py" in notes
    assert "1 of 2 ranks evaluated 15 samples" in " ".join(checked("rank0_eval").checked)


def test_tutorial_worker_is_clean(tiny_data, tmp_path):
    """ddpnb's own worker passes its own check (no false finding). About 33 s: the check runs
    it on two simulated nodes into its second epoch (torchvision's model), as any script."""
    src = tmp_path / "src"
    worker = ddpnb.write_worker(tiny_config(tiny_data, epochs=100), src)
    script = Script(worker, args=["--config", "config.json"], files=[src / "config.json"])
    report = check_script(script)
    assert report.ok, str(report)
    assert "stopped after optimizer step" in report.ended
    assert any("epochs 1 and 2 drew different orders" in n for n in report.checked)
    assert_nothing_left(report)


def test_script_raising_before_training_exits_2_with_its_traceback(tmp_path, capsys):
    code = main_check_script(["--run-dir", str(tmp_path), str(SCRIPTS / "raises.py")])
    out = capsys.readouterr().out
    assert code == 2, out
    assert "could not run" in out and "FileNotFoundError: data/train.csv" in out
    assert 'raises.py", line 7, in load_data' in out  # the script's own traceback
    records = load_records(tmp_path / "observe")
    pids = [r["pid"] for rank in records.values() for r in rank if r["kind"] == "start"]
    assert len(pids) == 2 and not [p for p in pids if alive(p)]


def test_a_hang_is_named_with_every_ranks_line():
    """9 from the hang watch: rank 0 in its barrier, rank 1 in DDP's all-reduce, both lines."""
    report = checked("rank0_barrier")
    seen = report.findings[0].seen
    assert "rank 1 waits in DDP's gradient all-reduce inside backward at rank0_barrier.py:" in seen
    assert "stopped by the check's hang watch" in report.ended


def test_evaluation_through_ddp_on_one_rank_is_named_before_it_hangs():
    """9 from the order of collectives: rank 0's extra buffer broadcast, at its evaluation line."""
    seen = checked("ddp_eval_rank0").findings[0].seen
    train = line_of("ddp_eval_rank0", "F.mse_loss(model(x).squeeze(1), y).backward()")
    assert "rank 0 called DDP's buffer broadcast (forward) at ddp_eval_rank0.py:" in seen
    assert f"rank 1 called DDP's buffer broadcast (forward) at ddp_eval_rank0.py:{train}" in seen
    assert "stopped after optimizer step" in checked("ddp_eval_rank0").ended  # no hang needed


def test_mp_spawn_under_torchrun_is_named_with_the_lines_that_set_the_rendezvous():
    report = check_script(Script(HANGS / "spawns.py"))
    assert [f.number for f in report.findings] == [10], str(report)
    finding = report.findings[0]
    text = (HANGS / "spawns.py").read_text().splitlines()
    spawn = next(i for i, line in enumerate(text, 1) if "mp.spawn(" in line)
    addr = next(i for i, line in enumerate(text, 1) if '"MASTER_ADDR"' in line)
    assert finding.where == f"spawns.py:{spawn}"
    assert f"spawns.py:{addr}, spawns.py:{addr + 1}" in finding.seen
    assert "Drop mp.spawn" in finding.fix and report.exit_code == 1
    assert_nothing_left(report)


def test_a_script_with_no_optimizer_step_cannot_be_called_clean(tmp_path):
    """No process group, or no optimizer step: 'could not check' (exit 2), never clean."""
    (tmp_path / "nogroup.py").write_text("import torch\nprint(torch.ones(2).sum())\n")
    report = check_script(Script(tmp_path / "nogroup.py"))
    assert (report.exit_code, report.ok) == (2, False), str(report)
    assert "could not check: no process group was formed" in report.summary()
    assert report.error is None and report.findings == []


def test_global_rank_device_is_seen_before_cuda_fails_here():
    """8 on a machine without CUDA: set_device(RANK) is recorded, then fails (exit 2)."""
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("CUDA is present: test_gpu_device_per_local_rank covers mistake 8")
    report = checked("global_rank_device")
    assert report.exit_code == 2 and "NVIDIA" in report.error
    assert [f.number for f in report.findings] == [8]
    where = line_of("global_rank_device", "torch.cuda.set_device(")
    assert report.findings[0].where == f"global_rank_device.py:{where}"
    assert "chose cuda:1" in report.findings[0].seen
    assert_nothing_left(report)


@pytest.mark.gpu
def test_gpu_device_per_local_rank():
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device: the GPU of the global rank is mistake 8")
    wrong, right = checked("global_rank_device"), checked("local_rank_device")
    assert 8 in [f.number for f in wrong.findings], str(wrong)
    assert right.ok, str(right)


def test_cli_options_come_before_the_script_and_the_rest_goes_to_it():
    script, kwargs = _parse_args(
        ["--nnodes", "3", "--file", "a.py", "train.py", "--epochs", "3", "--nnodes", "5"]
    )
    assert (script.path, script.args, script.files) == (
        "train.py",
        ("--epochs", "3", "--nnodes", "5"),
        ("a.py",),
    )
    assert kwargs == {"nnodes": 3, "nproc_per_node": 1, "run_dir": None}


def _line(path: Path, snippet: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if snippet in line)


def test_unused_parameters_are_mistake_11_with_their_names():
    """DDP's 'Expected to have finished reduction' is a finding, not 'could not run'."""
    script = HANGS / "unused_head.py"
    report = check_script(Script(script))
    assert (report.exit_code, report.error) == (1, None), str(report)
    assert [f.number for f in report.findings] == [11], str(report)  # not 3: 11 explains it
    finding = report.findings[0]
    assert finding.where == f"unused_head.py:{_line(script, 'model = DDP(')}"
    assert "head_b.weight, head_b.bias" in finding.seen, finding.seen
    assert f"unused_head.py:{_line(script, 'out_a, _ = model(')}" in finding.seen  # raised there
    assert "find_unused_parameters=True" in finding.fix and "requires_grad_(False)" in finding.fix
    assert any(n.startswith("The run stopped:") for n in report.checked)
    assert_nothing_left(report)


def test_ddp_before_init_process_group_is_mistake_12_at_its_line():
    """'Default process group has not been initialized': 12 at the DDP(...) line that raised."""
    script = HANGS / "ddp_before_init.py"
    report = check_script(Script(script))
    assert (report.exit_code, report.error) == (1, None), str(report)
    assert [f.number for f in report.findings] == [12], str(report)
    finding = report.findings[0]
    assert finding.where == f"ddp_before_init.py:{_line(script, 'model = DDP(')}"
    assert "Default process group has not been initialized" in finding.seen, finding.seen
    assert "init_process_group(backend) first" in finding.fix and "env://" in finding.fix
    assert any(n.startswith("The run stopped:") for n in report.checked)
    assert_nothing_left(report)


def test_a_layer_in_two_reentrant_checkpoints_is_mistake_13_by_name():
    """'Expected to mark a variable ready only once': 13 with the parameter's name, at DDP(...)."""
    script = HANGS / "reentrant_checkpoint.py"
    report = check_script(Script(script))
    assert (report.exit_code, report.error) == (1, None), str(report)
    assert [f.number for f in report.findings] == [13], str(report)
    finding = report.findings[0]
    assert finding.where == f"reentrant_checkpoint.py:{_line(script, 'model = DDP(')}"
    assert "parameter layer." in finding.seen and "checkpoint" in finding.seen, finding.seen
    assert f"reentrant_checkpoint.py:{_line(script, 'loss.backward()')}" in finding.seen
    assert "use_reentrant=False" in finding.fix and "static_graph=True" in finding.fix
    assert_nothing_left(report)


def test_uneven_inputs_abort_is_mistake_9_with_each_ranks_line(capsys):
    """gloo's 'Received data size doesn't match': 9 with both ranks' lines, from the CLI."""
    script = HANGS / "uneven_abort.py"
    code = main_check_script([str(script)])
    out = capsys.readouterr().out
    assert code == 1, out
    assert "Mistake 9:" in out and "could not run" not in out
    reduce, backward = _line(script, "dist.all_reduce(total)"), _line(script, "loss.backward()")
    assert f"[uneven_abort.py:{reduce}]" in out
    seen = " ".join(out.split())  # the report wraps its lines
    assert f"rank 0 in all_reduce at uneven_abort.py:{reduce}" in seen
    assert (
        f"rank 1 in DDP's gradient all-reduce inside backward at uneven_abort.py:{backward}" in seen
    )
    assert "uneven inputs" in seen and "torch.distributed.algorithms.Join" in seen


def test_a_script_that_cannot_start_still_exits_2(tmp_path):
    (tmp_path / "imports.py").write_text("import torch\nimport not_a_module_of_ddpnb\n")
    report = check_script(Script(tmp_path / "imports.py"))
    assert report.exit_code == 2 and report.findings == [], str(report)
    assert "No module named 'not_a_module_of_ddpnb'" in report.error


def test_the_report_in_a_notebook_sets_the_verdict_apart_and_gives_prose_its_width():
    """No process: the HTML a notebook shows. Clean is green, mistakes red; the table's
    columns have widths (JupyterLab squeezed "why it matters" to a few words)."""
    from ddpnb.scriptcheck import Finding, ScriptReport

    clean = ScriptReport("a.py", "2 nodes x 1", [], {}, [], "ended", seconds=9)
    assert "background:#2e7d32'>a.py on 2 nodes x 1: no mistake found" in clean._repr_html_()
    finding = Finding(6, "a.py:9", "both ranks saved it", "a torn file", "if rank == 0: save")
    found = ScriptReport("a.py", "2 nodes x 1", [finding], {}, [], "ended", seconds=9)
    page = found._repr_html_()
    assert "background:#c62828'>a.py on 2 nodes x 1: 1 mistake(s) found" in page
    assert "table-layout:fixed" in page and page.count("<col style='width:") == 6
    assert "white-space:pre-wrap" in page and "mistake 6</small>" in page


def test_a_read_is_ordered_after_a_write_only_by_a_collective_between_them():
    """Mistake 14 from the records alone: the same point in the same collectives is a race;
    a read after one more collective, or a rank reading its own file, is not."""
    from ddpnb.scriptcheck import _Rank, _reads

    def rank(n: int, *io: tuple[str, list[int]]) -> _Rank:
        start = {"kind": "start", "rank": n, "env": {"LOCAL_RANK": "0"}}
        where = {"file": "train.py", "line": 10 + n, "func": "main"}
        files = [{"kind": k, "path": "/r/ckpt.pt", "where": where, "met": m, "t": i}
                 for i, (k, m) in enumerate(io)]  # fmt: skip
        return _Rank([start, *files])

    race = _reads([rank(0, ("save", [18, 7])), rank(1, ("load", [18, 7]))], 2, Path("."))
    assert [(f.number, f.where) for f in race] == [(14, "train.py:11")], race
    assert "after the same 18 collective(s)" in race[0].seen
    waited = _reads([rank(0, ("save", [18, 7])), rank(1, ("load", [19, 9]))], 2, Path("."))
    assert waited == ["Reads of files another rank writes: 1, each after a collective that "
                      "follows the write."]  # fmt: skip
    own = _reads([rank(0, ("save", [18, 7]), ("load", [18, 7])), rank(1)], 2, Path("."))
    assert own == ["Reads of files another rank writes: none before the check ended the script."]
