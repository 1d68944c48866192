"""The worker's own copies of the shared names match ddpnb.constants exactly."""

from __future__ import annotations

import inspect
import subprocess
import sys

from ddpnb import constants, worker

NAMES = ["IMAGE_EXTENSIONS", "IMAGENET_MEAN", "IMAGENET_STD", "PITFALL_SWITCHES", "RESUMABLE_KEYS"]


def test_worker_constants_match_the_package():
    for name in NAMES:
        assert getattr(worker, name) == getattr(constants, name), name


def test_worker_fingerprint_is_the_same_code(tiny_data):
    for name in ["dataset_files", "dataset_fingerprint", "threads_for_host"]:
        assert inspect.getsource(getattr(worker, name)) == inspect.getsource(
            getattr(constants, name)
        ), name
    assert worker.dataset_fingerprint(tiny_data) == constants.dataset_fingerprint(tiny_data)


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

    # Plain imports (stdlib-only modules); only the plots, which need matplotlib, are lazy.
    assert set(ddpnb._LAZY) == {"plot_curves", "plot_scaling", "plot_throughput"}
    eager = set(ddpnb.__all__) - set(ddpnb._LAZY)
    assert all(name in vars(ddpnb) for name in eager)
    assert ddpnb.__all__ == sorted(ddpnb.__all__)


def test_the_launch_function_survives_importing_its_module():
    code = "import ddpnb, ddpnb.launch; assert callable(ddpnb.launch), ddpnb.launch"
    subprocess.run([sys.executable, "-c", code], check=True)
