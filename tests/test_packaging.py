import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parent.parent
# conda and PyPI spell a few packages differently
CONDA_NAMES = {"pytorch": "torch"}


def _name(spec: str) -> str:
    return re.split(r"[<>=!~ \[]", spec.strip(), maxsplit=1)[0].lower()


def test_environment_yml_names_the_same_packages_as_pyproject():
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pypi = {_name(d) for d in deps}
    import yaml

    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    conda = {
        CONDA_NAMES.get(_name(d), _name(d))
        for d in env["dependencies"]
        if isinstance(d, str) and _name(d) not in ("python", "pip")
    }
    assert conda == pypi
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict))
    assert pip == ["-e ."] and env["name"] == "ddpnb"


def _bounds(spec: str) -> dict[str, tuple[int, ...]]:
    return {op: tuple(map(int, v.split("."))) for op, v in re.findall(r"(>=|<)([\d.]+)", spec)}


def test_environment_yml_takes_a_current_torch_from_conda_forge():
    import yaml

    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    # The pytorch channel's last build is 2.5: listed, conda would prefer its old torch.
    assert env["channels"][0] == "conda-forge" and "pytorch" not in env["channels"]
    conda = {_name(d): d for d in env["dependencies"] if isinstance(d, str)}
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pypi = {_name(d): d for d in deps}
    torch = _bounds(conda["pytorch"])
    assert torch[">="] >= (2, 6), "a lower bound at or below 2.5 lets conda pick an old build"
    assert torch["<"] == _bounds(pypi["torch"])["<"]  # the same newest torch as pip installs
    assert _bounds(conda["torchvision"])["<"] == _bounds(pypi["torchvision"])["<"]


def test_console_script_and_module_entry_points():
    r = subprocess.run([sys.executable, "-m", "ddpnb", "--help"], capture_output=True, text=True)
    assert r.returncode == 0 and "prep" in r.stdout and "train" in r.stdout
    exe = Path(sys.executable).with_name("ddpnb")
    r = subprocess.run([str(exe), "--help"], capture_output=True, text=True)
    assert r.returncode == 0


def test_public_api_is_small_and_declared():
    import ddpnb

    # Three ways to run (simulated nodes, SSH hosts, Slurm) any script, the check of a
    # script, a sweep of a notebook (papermill), and the few names around them.
    assert len(ddpnb.__all__) <= 22
    assert all(hasattr(ddpnb, n) for n in ddpnb.__all__)


def test_no_import_cycles_in_the_package():
    import ast

    graph = {}
    for f in (Path(__file__).parents[1] / "ddpnb").glob("*.py"):
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module:
                deps.add(node.module.split(".")[0])
        graph[f.stem] = deps

    def reach(start, seen):
        for dep in graph.get(start, ()):
            assert dep != seen[0], f"import cycle: {' -> '.join([*seen, dep])}"
            if dep not in seen:
                reach(dep, [*seen, dep])

    for module in graph:
        reach(module, [module])


def test_the_pipeline_sits_below_its_schedulers():
    """pipeline.py, job.py and what they import reach no scheduler, only the seam they all
    share (scheduler.py): a new scheduler is one module."""
    import ast

    graph = {}
    for f in (Path(__file__).parents[1] / "ddpnb").glob("*.py"):
        deps = {
            node.module.split(".")[0]
            for node in ast.walk(ast.parse(f.read_text()))
            if isinstance(node, ast.ImportFrom) and node.level == 1 and node.module
        }
        graph[f.stem] = deps
    reached, todo = set(), ["pipeline"]
    while todo:
        for dep in graph[todo.pop()] - reached:
            reached.add(dep)
            todo.append(dep)
    assert {"job", "scheduler"} <= reached, reached
    assert not reached & {"local", "remote", "slurm", "launch"}, reached
    for scheduler in ("local", "remote", "slurm"):
        assert "scheduler" in graph[scheduler]


def test_the_scheduler_seam_is_abstract_and_its_state_is_each_instances():
    """The seam is the three methods every scheduler must write; no class holds a list, dict
    or set that its instances would share (``procs`` once was one dict for every run)."""
    from ddpnb.local import Local
    from ddpnb.remote import Hosts
    from ddpnb.scheduler import Processes, Scheduler
    from ddpnb.slurm import Slurm
    from ddpnb.topology import Topology

    assert Scheduler.__abstractmethods__ == {"start", "poll", "stop"}
    with pytest.raises(TypeError, match="abstract"):
        Processes()
    for cls in (Scheduler, Processes, Local, Hosts, Slurm):
        state = {k: v for k, v in vars(cls).items() if not k.startswith("__")}
        shared = [k for k, v in state.items() if isinstance(v, (dict, list, set))]
        assert not shared, (cls.__name__, shared)
    first, second = (Local(Topology(2, 1, None, None, 60, 0)) for _ in range(2))
    assert first.procs == {} and first.procs is not second.procs
