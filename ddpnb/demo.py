"""The main job (``make demo``): run the notebooks in order with papermill.

Executed notebooks and PNG plots go to ``--out``; a short summary is printed at the end.
``python -m ddpnb.demo --out runs/demo [--quick]``
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def notebook_parameters(out: Path, data_dir: Path, quick: bool) -> dict[str, dict]:
    """papermill parameters per notebook; ``quick`` shrinks training for smoke runs."""
    small = {"epochs": 1, "max_steps_per_epoch": 3} if quick else {}
    base = str(out / "baseline")
    return {
        "01_dataset_prep.ipynb": {"data_dir": str(data_dir), "out_dir": str(out)},
        "02_single_node_baseline.ipynb": {
            "data_dir": str(data_dir),
            "run_dir": base,
            "out_dir": str(out),
            **small,
        },
        "03_multi_node_ddp.ipynb": {
            "data_dir": str(data_dir),
            "baseline_dir": base,
            "run_dir": str(out / "ddp"),
            "out_dir": str(out),
            "progress": "text",
            **small,
        },
        "04_fault_tolerance.ipynb": {
            "data_dir": str(data_dir),
            "run_dir": str(out / "fault"),
            "out_dir": str(out),
            "progress": "text",
            **({"epochs": 3, "kill_at_epoch": 2, "max_steps_per_epoch": 3} if quick else {}),
        },
        "05_scaling.ipynb": {
            "data_dir": str(data_dir),
            "run_root": str(out / "scaling"),
            "out_dir": str(out),
            "progress": "text",
            **small,
        },
        "06_pitfalls.ipynb": {
            "data_dir": str(data_dir),
            "run_root": str(out / "pitfalls"),
            "out_dir": str(out),
            "progress": "text",
            # Whole epochs even when quick: the lessons compare epoch times and orders.
            **({"train_images": 200, "val_images": 41} if quick else {}),
        },
        # hosts stays empty: the notebook explains and shows the commands, starting nothing
        # (tests/test_ssh.py runs it against two SSH hosts).
        "07_real_machines.ipynb": {
            "data_dir": str(data_dir),
            "run_dir": str(out / "real"),
            "simulated_dir": str(out / "ddp"),
            "out_dir": str(out),
            "progress": "text",
        },
        # Prints the sbatch script and how to submit it (tests/test_slurm.py submits it to a
        # throwaway Slurm); use_slurm=None would submit wherever a Slurm controller answers.
        "08_slurm.ipynb": {
            "data_dir": str(data_dir),
            "run_dir": str(out / "slurm"),
            "out_dir": str(out),
            "progress": "text",
            "use_slurm": False,
            **small,
        },
        # Your own script: written by the notebook, launched on two simulated nodes.
        "09_your_own_script.ipynb": {
            "run_dir": str(out / "own"),
            **({"script_args": ["5"]} if quick else {}),
        },
    }


def ipc_kernel_manager():
    """A kernel manager whose kernel talks over local IPC sockets, not loopback TCP.

    With TCP, every kernel prints a warning that its traffic is unencrypted; IPC
    sockets are files only this user can open, so there is nothing to warn about.
    """
    from jupyter_client.manager import AsyncKernelManager

    class IpcKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.transport = "ipc"

    return IpcKernelManager


def run(out: Path, data_dir: Path, quick: bool = False, timeout: int = 900) -> dict:
    """Execute every notebook into ``out`` and return the summaries they wrote."""
    import papermill

    out.mkdir(parents=True, exist_ok=True)
    for name, params in notebook_parameters(out, data_dir, quick).items():
        if not (NOTEBOOKS / name).exists():
            continue
        t = time.time()
        print(f"== {name}", flush=True)
        papermill.execute_notebook(
            str(NOTEBOOKS / name),
            str(out / name),
            parameters=params,
            kernel_name="python3",
            execution_timeout=timeout,
            cwd=str(out),
            progress_bar=False,
            kernel_manager_class=ipc_kernel_manager(),
        )
        print(f"   done in {time.time() - t:.0f} s -> {out / name}", flush=True)
    summaries = {}
    for path in sorted(out.glob("0*_summary.json")):
        summaries[path.stem] = json.loads(path.read_text())
    return summaries


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--data", default="data/digits")
    p.add_argument("--quick", action="store_true", help="tiny training, for smoke tests")
    args = p.parse_args(argv)
    out, data = Path(args.out).resolve(), Path(args.data).resolve()
    t = time.time()
    s = run(out, data, args.quick)
    print(f"\nddpnb demo finished in {time.time() - t:.0f} s; outputs in {out}")
    if "02_summary" in s:
        b = s["02_summary"]
        print(
            f"  baseline (1 process):  val_acc {b['val_acc']:.4f}  {b['images_per_second']:.0f} img/s"
        )
    if "03_summary" in s:
        d = s["03_summary"]
        print(
            f"  DDP (world size {d['world_size']}):   val_acc {d['ddp_val_acc']:.4f}  "
            f"{d['ddp_images_per_second']:.0f} img/s"
        )
    if "04_summary" in s:
        f = s["04_summary"]
        print(
            f"  failure drill ({f['fault']}): val_acc {f['fault_val_acc']:.4f} after a restart, "
            f"{f['uninterrupted_val_acc']:.4f} uninterrupted"
        )
    if "05_summary" in s:
        for row in s["05_summary"]["layouts"]:
            print(
                f"  scaling {row['layout']}:  {row['images/s']} img/s, efficiency "
                f"{row['efficiency']:.2f}, communication share {row['communication share']:.2f}"
            )
        v = s["05_summary"].get("shared_memory_vs_gloo")
        if v:
            print(
                f"  {v['layout']} gradients through shared memory "
                f"{v['shared_memory_images_per_second']} img/s, through gloo "
                f"{v['gloo_images_per_second']} img/s, identical weights {v['identical_weights']}"
            )
    print("  plots: " + ", ".join(sorted(p.name for p in out.glob("*.png"))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
