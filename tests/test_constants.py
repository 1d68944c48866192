"""What the package and the worker share exists once (ddpnb.constants); import stays light."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import ddpnb
from ddpnb import constants, worker
from ddpnb.script import Script
from ddpnb.source import WORKER_PATH


def test_the_worker_holds_no_copy_of_the_shared_code():
    # One copy of each: the worker imports ddpnb_constants.py, written beside it.
    for name in ["dataset_files", "dataset_fingerprint", "threads_for_host"]:
        assert getattr(worker.constants, name) is getattr(constants, name)
        assert f"def {name}(" not in WORKER_PATH.read_text(), name
    for name in ["IMAGE_EXTENSIONS", "IMAGENET_MEAN", "RESUMABLE_KEYS"]:
        assert f"{name} =" not in WORKER_PATH.read_text(), name
    payload = Script.worker(ddpnb.TrainConfig()).payload()
    assert payload["ddpnb_constants.py"] == Path(constants.__file__).read_bytes()


def test_import_ddpnb_does_not_import_torch_or_matplotlib():
    code = (
        "import sys, ddpnb; ddpnb.TrainConfig; ddpnb.inspect_dataset;"
        "heavy = [m for m in ('torch', 'torchvision', 'matplotlib') if m in sys.modules];"
        "print(','.join(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ""


def test_public_names_are_all_lazy_or_eager():
    import ddpnb

    # Lazy: the plots (matplotlib), the SSH and Slurm backends and the check; the rest plain.
    assert set(ddpnb._LAZY.values()) == {"plot", "remote", "slurm", "scriptcheck", "cluster"}
    eager = set(ddpnb.__all__) - set(ddpnb._LAZY)
    assert all(name in vars(ddpnb) for name in eager)
    assert all(callable(getattr(ddpnb, name)) for name in ddpnb.__all__)
    assert ddpnb.__all__ == sorted(ddpnb.__all__)


def test_import_ddpnb_loads_no_backend_but_the_simulated_nodes():
    code = "import sys, ddpnb; print(sorted(m for m in sys.modules if m.startswith('ddpnb.')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = set(ast.literal_eval(out.stdout))
    assert {"ddpnb.launch", "ddpnb.local", "ddpnb.pipeline"} <= loaded
    assert not loaded & {"ddpnb.remote", "ddpnb.ssh", "ddpnb.network", "ddpnb.slurm"}, loaded
    # `make demo` runs `python -m ddpnb.demo`: a module imported before it runs is warned about.
    assert "ddpnb.demo" not in loaded
    demo = [sys.executable, "-m", "ddpnb.demo", "--help"]
    assert subprocess.run(demo, capture_output=True, text=True, check=True).stderr == ""


def test_the_launch_function_survives_importing_its_module():
    code = "import ddpnb, ddpnb.launch; assert callable(ddpnb.launch), ddpnb.launch"
    subprocess.run([sys.executable, "-c", code], check=True)
