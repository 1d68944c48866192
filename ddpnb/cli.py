"""The ``ddpnb`` command line: prep, check, train, plot, commands, slurm."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .errors import DdpnbError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ddpnb", description="Multi-node DDP training, from a notebook."
    )
    sub = p.add_subparsers(dest="command", required=True)

    prep = sub.add_parser("prep", help="write the bundled digits as an ImageFolder")
    prep.add_argument("--out", required=True, help="dataset folder to create")
    prep.add_argument("--image-size", type=int, default=32)
    prep.add_argument("--val-fraction", type=float, default=0.2)
    prep.add_argument("--seed", type=int, default=0)
    prep.add_argument("--overwrite", action="store_true")

    check = sub.add_parser("check", help="check an ImageFolder (exit 1 when it has problems)")
    check.add_argument("dir")

    train = sub.add_parser("train", help="train with DDP (one torchrun per node)")
    train.add_argument("--data", required=True, help="ImageFolder with train/ and val/")
    train.add_argument("--run-dir", required=True)
    train.add_argument("--epochs", type=int)
    train.add_argument("--batch-size", type=int, help="per process")
    train.add_argument("--lr", type=float)
    train.add_argument("--model")
    train.add_argument("--image-size", type=int)
    train.add_argument("--seed", type=int)
    train.add_argument("--weights", help="DEFAULT, or the path of a state-dict file")
    train.add_argument("--nnodes", type=int, default=1)
    train.add_argument("--nproc-per-node", type=int, default=1)
    train.add_argument("--master-addr", default="127.0.0.1")
    train.add_argument("--master-port", type=int)
    train.add_argument("--max-restarts", type=int, default=0)
    train.add_argument("--resume", action="store_true")
    train.add_argument("--overwrite", action="store_true")

    plot = sub.add_parser("plot", help="plot loss/accuracy curves of run directories")
    plot.add_argument("run_dirs", nargs="+")
    plot.add_argument("--out", default="curves.png")

    cmds = sub.add_parser("commands", help="print the torchrun command for each host")
    cmds.add_argument(
        "--run-dir", required=True, help="where train_ddp.py and config.json are on the nodes"
    )
    cmds.add_argument("--hosts", required=True, help="comma-separated; the first is the master")
    cmds.add_argument("--nproc-per-node", type=int, default=1)
    cmds.add_argument("--master-port", type=int, default=29500)
    cmds.add_argument("--rendezvous", choices=["static", "c10d"], default="static")
    cmds.add_argument("--node-rank", type=int)

    slurm = sub.add_parser("slurm", help="write an sbatch script")
    slurm.add_argument("--run-dir", required=True)
    slurm.add_argument("--nnodes", type=int, default=2)
    slurm.add_argument("--nproc-per-node", type=int, default=1)
    slurm.add_argument("--master-port", type=int, default=29500)
    slurm.add_argument("--gpus-per-node", type=int, default=0)
    slurm.add_argument("--out", default="train.sbatch")
    return p


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ddpnb`` console script and ``python -m ddpnb``."""
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except DdpnbError as e:
        print(f"ddpnb {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("ddpnb: interrupted; every process of the run was stopped.", file=sys.stderr)
        return 130


def _run(args: argparse.Namespace) -> int:
    if args.command == "prep":
        from .data import inspect_dataset, prepare_digits

        root = prepare_digits(
            args.out, args.image_size, args.val_fraction, args.seed, args.overwrite
        )
        inspect_dataset(root)
        return 0
    if args.command == "check":
        from .data import inspect_dataset

        return 0 if inspect_dataset(args.dir).ok else 1
    if args.command == "train":
        from .config import TrainConfig
        from .launch import launch

        fields = ("epochs", "batch_size", "lr", "model", "image_size", "seed", "weights")
        given = {k: getattr(args, k) for k in fields if getattr(args, k) is not None}
        config = TrainConfig(data_dir=args.data, **given)
        job = launch(
            config,
            args.run_dir,
            nnodes=args.nnodes,
            nproc_per_node=args.nproc_per_node,
            master_addr=args.master_addr,
            master_port=args.master_port,
            max_restarts=args.max_restarts,
            resume=args.resume,
            overwrite=args.overwrite,
            progress="text",
        )
        print(f"metrics: {job.run_dir / 'metrics.jsonl'}")
        return 0
    if args.command == "plot":
        from .plot import plot_curves

        plot_curves(args.run_dirs).savefig(args.out, dpi=110)
        print(f"wrote {args.out}")
        return 0
    if args.command == "commands":
        from .cluster import format_node_commands, node_commands

        hosts = [h.strip() for h in args.hosts.split(",") if h.strip()]
        config = _run_config(args.run_dir)
        lines = node_commands(
            config,
            args.run_dir,
            hosts,
            args.nproc_per_node,
            args.master_port,
            rendezvous=args.rendezvous,
            node_rank=args.node_rank,
        )
        shown = hosts if args.node_rank is None else [hosts[args.node_rank]]
        print(format_node_commands(shown, lines))
        return 0
    if args.command == "slurm":
        from .cluster import slurm_script

        slurm_script(
            _run_config(args.run_dir),
            args.run_dir,
            args.nnodes,
            args.nproc_per_node,
            args.master_port,
            gpus_per_node=args.gpus_per_node,
            path=args.out,
        )
        print(f"wrote {args.out}; submit with: sbatch {args.out}")
        return 0
    raise AssertionError(args.command)


def _run_config(run_dir: str):
    from .config import TrainConfig

    path = Path(run_dir) / "config.json"
    return TrainConfig.load(path) if path.exists() else TrainConfig()
