"""The ``ddpnb`` command line: prep, check, train, plot, commands, slurm."""

from __future__ import annotations

import argparse
import dataclasses
import json
import signal
import sys
import typing
from pathlib import Path
from typing import Any

from .errors import ConfigError, DdpnbError

# Options of ``ddpnb train`` that configure the launch, not the training. A TrainConfig
# field must never take one of these names (see _config_options).
LAUNCH_OPTIONS = (
    "config",
    "run_dir",
    "nnodes",
    "nproc_per_node",
    "master_addr",
    "master_port",
    "max_restarts",
    "resume",
    "overwrite",
)
# TrainConfig fields whose option is not simply ``--field-name``.
FIELD_FLAGS = {"data_dir": ("--data", "--data-dir")}
FIELD_HELP = {"data_dir": "ImageFolder with train/ and val/ (required unless --config)."}
_FIELD_DEST = "field:"  # namespace prefix of the TrainConfig options
STOP_SIGNALS = ("SIGTERM", "SIGHUP")


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

    _train_parser(sub)

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

    _submit_parser(sub)
    attach = sub.add_parser("attach", help="follow a submitted Slurm job again (Ctrl-C cancels it)")
    attach.add_argument("run_dir")

    slurm = sub.add_parser("slurm", help="write an sbatch script")
    slurm.add_argument("--run-dir", required=True)
    slurm.add_argument("--nnodes", type=int, default=2)
    slurm.add_argument("--nproc-per-node", type=int, default=1)
    slurm.add_argument("--master-port", type=int, default=29500)
    slurm.add_argument("--gpus-per-node", type=int, default=0)
    slurm.add_argument("--out", default="train.sbatch")
    return p


def _train_parser(sub) -> argparse.ArgumentParser:
    train = sub.add_parser(
        "train",
        help="train with DDP (one torchrun per node)",
        description="Train with DDP, one torchrun per node. Every training option is a "
        "TrainConfig field; only the options given override its defaults (or --config).",
    )
    launch = train.add_argument_group("launch")
    launch.add_argument(
        "--config",
        metavar="FILE",
        help="start from a saved config.json (e.g. RUN_DIR/config.json); options override it",
    )
    launch.add_argument("--run-dir", required=True)
    launch.add_argument("--nnodes", type=int, help="simulated nodes on this machine (default 1)")
    launch.add_argument("--nproc-per-node", type=int, default=1)
    launch.add_argument(
        "--master-addr", help="default: 127.0.0.1, or with --hosts the first host's address"
    )
    launch.add_argument("--master-port", type=int)
    launch.add_argument("--max-restarts", type=int, default=0)
    launch.add_argument("--resume", action="store_true")
    launch.add_argument("--overwrite", action="store_true")
    hosts = train.add_argument_group("real hosts over SSH (one node per host)")
    hosts.add_argument(
        "--hosts",
        metavar="A,B[,C]",
        type=lambda text: [h for h in text.split(",") if h],
        help="e.g. gpu1,alice@gpu2,10.0.0.3:2222; the first is node 0",
    )
    hosts.add_argument("--ssh-config", metavar="FILE", help="an OpenSSH client config (ssh -F)")
    hosts.add_argument(
        "--ssh-option",
        action="append",
        default=[],
        metavar="ARG",
        help="one extra ssh argument, verbatim (repeat: --ssh-option=-o --ssh-option=Port=2222)",
    )
    hosts.add_argument("--python", help="the hosts' interpreter (default: this one's path)")
    hosts.add_argument("--remote-run-dir", help="the run directory on hosts without a shared one")
    _config_options(train.add_argument_group("training (TrainConfig fields)"))
    return train


def _submit_parser(sub) -> argparse.ArgumentParser:
    submit = sub.add_parser(
        "submit",
        help="train as a Slurm batch job (sbatch), followed until it ends",
        description="Submit a run with sbatch: one torchrun per node (srun), the c10d "
        "rendezvous on the first node. RUN_DIR must be on a filesystem every node shares. "
        "Ctrl-C cancels the job (scancel); --detach leaves it running (ddpnb attach RUN_DIR).",
    )
    job = submit.add_argument_group("Slurm job")
    job.add_argument("--config", metavar="FILE", help="start from a saved config.json")
    job.add_argument("--run-dir", required=True, help="on a filesystem every node shares")
    job.add_argument("--nnodes", type=int, required=True)
    job.add_argument("--nproc-per-node", type=int, default=1, help="usually one per GPU")
    job.add_argument("--gpus-per-node", type=int)
    job.add_argument("--partition", help="default: the cluster's default partition")
    job.add_argument("--time", default="01:00:00", help="the time limit (sbatch --time)")
    job.add_argument("--account")
    job.add_argument(
        "--sbatch-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="one extra sbatch argument, verbatim (repeat: --sbatch-arg=--requeue)",
    )
    job.add_argument("--python", help="the nodes' interpreter (default: this one's path)")
    job.add_argument("--max-restarts", type=int, default=0)
    job.add_argument("--resume", action="store_true")
    job.add_argument("--overwrite", action="store_true")
    job.add_argument("--detach", action="store_true", help="return once submitted")
    _config_options(submit.add_argument_group("training (TrainConfig fields)"))
    return submit


def _submit(args: argparse.Namespace) -> int:
    from .slurm import submit_slurm

    config = train_config(args)
    with _StopSignals():  # SIGTERM/SIGHUP cancel the job as Ctrl-C does
        job = submit_slurm(
            config,
            args.run_dir,
            nnodes=args.nnodes,
            nproc_per_node=args.nproc_per_node,
            gpus_per_node=args.gpus_per_node,
            partition=args.partition,
            time=args.time,
            account=args.account,
            sbatch_args=args.sbatch_arg,
            python=args.python,
            max_restarts=args.max_restarts,
            resume=args.resume,
            overwrite=args.overwrite,
            wait=not args.detach,
            progress="text",
        )
    if args.detach:
        print(
            f"submitted Slurm job {job.job_id}; follow it with: ddpnb attach {job.run_dir} "
            f"(or squeue -j {job.job_id}); cancel it with: scancel {job.job_id}"
        )
    else:
        print(f"metrics: {job.run_dir / 'metrics.jsonl'}")
    return 0


def _attach(args: argparse.Namespace) -> int:
    from .slurm import attach

    with _StopSignals():
        job = attach(args.run_dir, progress="text")
    print(f"metrics: {job.run_dir / 'metrics.jsonl'}")
    return 0


# -- TrainConfig fields as options -----------------------------------------------------


def _field_flags(name: str) -> tuple[str, ...]:
    return FIELD_FLAGS.get(name, ("--" + name.replace("_", "-"),))


def _field_comments() -> dict[str, str]:
    """The ``#:`` comment above each TrainConfig field, by field name."""
    import inspect

    from .config import TrainConfig

    try:
        lines = inspect.getsource(TrainConfig).splitlines()
    except (OSError, TypeError):
        return {}
    out, pending = {}, []
    for line in lines:
        text = line.strip()
        if text.startswith("#:"):
            pending.append(text[2:].strip())
            continue
        name = text.split(":", 1)[0]
        if ":" in text and name.isidentifier() and pending:
            out[name] = " ".join(pending)
        if text and not text.startswith("#"):
            pending = []
    return out


def _optional(tp: Any) -> tuple[Any, bool]:
    """(X, True) for ``X | None``; (tp, False) otherwise."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is not typing.Literal and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        if len(rest) == 1:
            return rest[0], True
    return tp, False


def _default_text(f: dataclasses.Field) -> str:
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if not isinstance(value, dict):
            return f"default: {value!r} on this host"
    else:
        value = f.default
    return f"default: {json.dumps(value) if isinstance(value, dict) else repr(value)}"


def _config_options(group) -> None:
    """One option per TrainConfig field, its kind read from the field's type."""
    from .config import TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    comments = _field_comments()
    for f in dataclasses.fields(TrainConfig):
        if f.name in LAUNCH_OPTIONS:
            raise AssertionError(
                f"TrainConfig field {f.name!r} collides with the launch option --{f.name}; "
                "give it another flag in ddpnb.cli.FIELD_FLAGS."
            )
        tp, optional = _optional(hints[f.name])
        kw: dict[str, Any] = {"dest": _FIELD_DEST + f.name, "default": argparse.SUPPRESS}
        help_ = FIELD_HELP.get(f.name) or comments.get(f.name, "")
        if typing.get_origin(tp) is typing.Literal:
            # Shown as choices; checked by TrainConfig, so the message is the Python API's.
            kw["metavar"] = "{" + ",".join(map(str, typing.get_args(tp))) + "}"
        elif tp is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif tp is dict:
            kw["metavar"] = "JSON"
            help_ = (help_ + " A JSON object.").strip()
        else:
            kw["metavar"] = tp.__name__.upper()
        if optional:
            help_ = (help_ + " 'none' for None.").strip()
        help_ = f"{help_} ({_default_text(f)})".strip()
        kw["help"] = help_.replace("%", "%%")
        group.add_argument(*_field_flags(f.name), **kw)


def _convert(name: str, tp: Any, raw: Any) -> Any:
    """A command-line string as the field's type; left as is when it does not parse,
    so that TrainConfig rejects it with the same message as the Python API."""
    tp, optional = _optional(tp)
    if not isinstance(raw, str):
        return raw  # bool flags
    if optional and raw.strip().lower() == "none":
        return None
    if tp is dict:
        try:
            return json.loads(raw)
        except json.JSONDecodeError as e:
            flag = _field_flags(name)[0]
            raise ConfigError(
                f"{flag} must be a JSON object such as '{{\"dropout\": 0.0}}'; "
                f"{raw!r} is not valid JSON ({e})."
            ) from None
    if tp in (int, float):
        try:
            return tp(raw)
        except ValueError:
            return raw
    return raw


def train_config(args: argparse.Namespace):
    """The TrainConfig of a ``ddpnb train`` command line: ``--config`` (or the defaults),
    then the options given. Raises ConfigError exactly as ``TrainConfig(...)`` does."""
    from .config import TrainConfig

    hints = typing.get_type_hints(TrainConfig)
    given = {k[len(_FIELD_DEST) :]: v for k, v in vars(args).items() if k.startswith(_FIELD_DEST)}
    changes = {k: _convert(k, hints[k], v) for k, v in given.items()}
    if getattr(args, "config", None):
        return TrainConfig.load(args.config).replace(**changes)
    if "data_dir" not in changes:
        raise ConfigError("--data is required (the ImageFolder with train/ and val/), or --config.")
    return TrainConfig(**changes)


# -- stopping on SIGTERM / SIGHUP -------------------------------------------------------


class StoppedBySignal(KeyboardInterrupt):
    """SIGTERM or SIGHUP reached ``ddpnb train``: it takes the Ctrl-C path."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum
        self.name = signal.Signals(signum).name


class _StopSignals:
    """Turn SIGTERM/SIGHUP into StoppedBySignal (once; a repeat must not cut the stop short)."""

    def __init__(self) -> None:
        self.received: int | None = None
        self.previous: dict[int, Any] = {}

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
            raise StoppedBySignal(signum)

    def __enter__(self) -> _StopSignals:
        for name in STOP_SIGNALS:
            sig = getattr(signal, name, None)
            if sig is None:
                continue
            if signal.getsignal(sig) is signal.SIG_IGN:
                continue  # e.g. nohup: an ignored SIGHUP stays ignored
            try:
                self.previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave the signals alone
                break
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if self.received is not None and exc is not None and not isinstance(exc, StoppedBySignal):
            raise StoppedBySignal(self.received) from exc  # e.g. a write to a closed terminal


def _train(args: argparse.Namespace) -> int:
    from .launch import launch

    config = train_config(args)
    # launch() stops every process it started on KeyboardInterrupt (StoppedBySignal is one).
    with _StopSignals():
        job = launch(
            config,
            args.run_dir,
            nnodes=args.nnodes if args.nnodes is not None or args.hosts else 1,
            nproc_per_node=args.nproc_per_node,
            master_addr=args.master_addr,
            master_port=args.master_port,
            max_restarts=args.max_restarts,
            resume=args.resume,
            overwrite=args.overwrite,
            progress="text",
            hosts=args.hosts,
            ssh_config=args.ssh_config,
            ssh_options=args.ssh_option,
            python=args.python,
            remote_run_dir=args.remote_run_dir,
        )
    print(f"metrics: {job.run_dir / 'metrics.jsonl'}")
    return 0


# -- entry point ---------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ddpnb`` console script and ``python -m ddpnb``."""
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except DdpnbError as e:
        print(f"ddpnb {args.command}: error: {e}", file=sys.stderr)
        return 2
    except StoppedBySignal as e:
        _say(
            f"ddpnb: stopped by {e.name}; every process of the run was stopped; "
            "resume with --resume."
        )
        return 128 + e.signum
    except KeyboardInterrupt:
        _say("ddpnb: interrupted; every process of the run was stopped.")
        return 130


def _say(message: str) -> None:
    try:
        print(message, file=sys.stderr)
    except OSError:  # SIGHUP: the terminal may be gone
        pass


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
        return _train(args)
    if args.command == "submit":
        return _submit(args)
    if args.command == "attach":
        return _attach(args)
    if args.command == "plot":
        from .plot import plot_curves

        plot_curves(args.run_dirs).savefig(args.out, dpi=110)
        print(f"wrote {args.out}")
        return 0
    if args.command == "commands":
        return _commands(args)
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


def _commands(args: argparse.Namespace) -> int:
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


def _run_config(run_dir: str):
    from .config import TrainConfig

    path = Path(run_dir) / "config.json"
    return TrainConfig.load(path) if path.exists() else TrainConfig()
