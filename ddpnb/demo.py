"""The main job (``make demo``): run the notebooks in order with papermill.

``python -m ddpnb.demo --out runs/demo [--quick]``: executed notebooks and the figures they show
(``03_figure1.png``, ...) go to ``--out``; the summary at the end is read from their run dirs.
"""

from __future__ import annotations

import argparse
import base64
import time
from pathlib import Path

from .sweep import ipc_kernel_manager

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"


def notebook_parameters(out: Path, data_dir: Path, quick: bool) -> dict[str, dict]:
    """papermill parameters per notebook; ``quick`` shrinks training for smoke runs."""
    small = {"epochs": 1, "max_steps_per_epoch": 3} if quick else {}
    base = str(out / "baseline")
    data = {"data_dir": str(data_dir)}
    live = {**data, "progress": "text"}  # the panel as lines: no widgets under papermill
    return {
        "01_dataset_prep.ipynb": data,
        "02_single_node_baseline.ipynb": {**data, "run_dir": base, **small},
        "03_multi_node_ddp.ipynb": {**live, "baseline_dir": base, "run_dir": str(out / "ddp")}
        | small,
        "04_fault_tolerance.ipynb": {**live, "run_dir": str(out / "fault")}
        | ({"epochs": 3, "kill_at_epoch": 2, "max_steps_per_epoch": 3} if quick else {}),
        "05_scaling.ipynb": {**live, "run_root": str(out / "scaling"), **small},
        # Whole epochs even when quick: the lessons compare epoch times and orders.
        "06_pitfalls.ipynb": {**live, "run_root": str(out / "pitfalls")}
        | ({"train_images": 200, "val_images": 41} if quick else {}),
        # hosts stays empty: the notebook explains and shows the commands, starting nothing
        # (tests/test_ssh.py runs it against two SSH hosts).
        "07_real_machines.ipynb": {
            **live,
            "run_dir": str(out / "real"),
            "simulated_dir": str(out / "ddp"),
        },
        # Prints the sbatch script and how to submit it (tests/test_slurm.py submits it to a
        # throwaway Slurm); use_slurm=None would submit wherever a Slurm controller answers.
        "08_slurm.ipynb": {**live, "run_dir": str(out / "slurm"), "use_slurm": False, **small},
        # Your own script: written by the notebook, launched on two simulated nodes.
        "09_your_own_script.ipynb": {"run_dir": str(out / "own")}
        | ({"script_args": ["5"]} if quick else {}),
        # The appendix: the blog example's two Python typos, and their fixes.
        "10_appendix_blog_typos.ipynb": {},
    }


def run(out: Path, data_dir: Path, quick: bool = False, timeout: int = 900) -> None:
    """Execute every notebook into ``out`` and save the figures each shows."""
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
        save_figures(out / name, out)
        print(f"   done in {time.time() - t:.0f} s -> {out / name}", flush=True)


def save_figures(notebook: Path, folder: Path) -> None:
    """Write every image an executed notebook shows to ``folder/<NN>_figure<i>.png``."""
    import nbformat

    nb = nbformat.read(notebook, as_version=4)
    images = [
        o["data"]["image/png"]
        for c in nb.cells
        for o in c.get("outputs", [])  # code cells only have outputs
        if "image/png" in o.get("data", {})
    ]
    for i, data in enumerate(images, 1):
        (folder / f"{notebook.name[:2]}_figure{i}.png").write_bytes(base64.b64decode(data))


def summary_lines(out: Path) -> list[str]:
    """The key figures, read from the run directories the notebooks wrote under ``out``."""
    from .metrics import load_metrics
    from .tables import same_weights, scaling_table

    def final(name: str) -> dict | None:
        run = out / name
        return load_metrics(run).final if (run / "metrics.jsonl").is_file() else None

    lines = []
    for name, label in (("baseline", "baseline (1 process): "), ("ddp", "DDP (world size {}):  ")):
        if r := final(name):
            who = label.format(r["world_size"])
            lines.append(f"{who} val_acc {r['val_acc']:.4f}  {r['images_per_second']:.0f} img/s")
    if final("fault") and final("fault_uninterrupted"):
        clean = load_metrics(out / "fault_uninterrupted").epochs
        drill = load_metrics(out / "fault").epochs[: len(clean)]  # before the extra epoch
        restarts = max(r.get("restart_count", 0) for r in drill)
        lines.append(
            f"failure drill: val_acc {drill[-1]['val_acc']:.4f} after {restarts} restart(s), "
            f"{clean[-1]['val_acc']:.4f} uninterrupted"
        )
    scaling = out / "scaling"
    layouts = [p.name for p in sorted(scaling.glob("*x*")) if "-" not in p.name]
    layouts = [name for name in layouts if final(f"scaling/{name}") is not None]
    for row in scaling_table({name: scaling / name for name in layouts}) if layouts else []:
        lines.append(
            f"scaling {row['layout']}:  {row['images/s']} img/s, efficiency "
            f"{row['efficiency']:.2f}, communication share {row['communication share']:.2f}"
        )
    for gloo in sorted(scaling.glob("*-gloo")):
        shm = gloo.name.removesuffix("-gloo")
        if (s := final(f"scaling/{shm}")) and (g := final(f"scaling/{gloo.name}")):
            lines.append(
                f"{shm} gradients through shared memory {s['images_per_second']:.0f} img/s, "
                f"through gloo {g['images_per_second']:.0f} img/s, "
                f"identical weights {same_weights(scaling / shm, gloo)}"
            )
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/demo")
    p.add_argument("--data", default="data/digits")
    p.add_argument("--quick", action="store_true", help="tiny training, for smoke tests")
    args = p.parse_args(argv)
    out, data = Path(args.out).resolve(), Path(args.data).resolve()
    t = time.time()
    run(out, data, args.quick)
    print(f"\nddpnb demo finished in {time.time() - t:.0f} s; outputs in {out}")
    for line in summary_lines(out):
        print("  " + line)
    print("  figures: " + ", ".join(sorted(p.name for p in out.glob("*_figure*.png"))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
