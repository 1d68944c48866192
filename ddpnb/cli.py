"""The ``ddpnb`` command line: prep, check, train, run, check-hosts, submit, sweep and more."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import signal
import sys
import typing
from pathlib import Path
from typing import Any

from .cluster import format_node_commands, node_commands
from .config import TrainConfig
from .data import inspect_dataset, prepare_digits
from .errors import ConfigError, DdpnbError, HostError
from .hang import stacks
from .launch import launch
from .remote import check_hosts
from .script import Script, script_options
from .slurm import attach, slurm_script, submit_slurm
from .sweep import parse_axis, resolve_type, sweep

_FIELD_DEST = "field:"  # namespace prefix of the TrainConfig options
# Options whose flags are not --name-with-dashes (repeatable ones are singular).
FLAGS = {
    "data_dir": ("--data", "--data-dir"),
    "ssh_options": ("--ssh-option",),
    "sbatch_args": ("--sbatch-arg",),
}

# Each command's line in ``ddpnb -h``; some have a longer description for ``ddpnb CMD -h``.
COMMANDS = {
    "prep": "write the bundled digits as an ImageFolder",
    "check": "check an ImageFolder (exit 1 when it has problems)",
    "train": "train with DDP (one torchrun per node)",
    "run": "run your own torchrun script with DDP (simulated nodes, --hosts, or --slurm)",
    "check-script": "run your DDP script briefly and name its classic mistakes with their line "
    "(exit 0 clean, 1 mistakes, 2 could not run); ddpnb check-script --help",
    "stacks": "where every rank of a running job is: its script line and the collective it "
    "waits in",
    "plot": "plot loss/accuracy curves of run directories",
    "commands": "print the torchrun command for each host",
    "submit": "train as a Slurm batch job (sbatch), followed until it ends",
    "check-hosts": "prove real hosts can run a job: logins, torch, the network (exit 1 on "
    "problems)",
    "sweep": "run a notebook with papermill over a grid of parameters; one table of the results",
    "attach": "follow a submitted Slurm job again (Ctrl-C cancels it)",
    "slurm": "write an sbatch script",
}
DESCRIPTIONS = {
    "train": "Train with DDP, one torchrun per node. Every training option is a TrainConfig "
    "field; only the options given override its defaults (or --config).",
    "run": "Options first, then the script; every word after the script goes to it unchanged. "
    "Simulated nodes on this machine by default, real hosts with --hosts, a Slurm batch job "
    "with --slurm. The run directory is the script's working directory on every node.",
    "check-hosts": "Ask every host (login, interpreter, torch) and prove the network: node 0's "
    "address and port from every host, every pair on the collectives' ports, each host's "
    "interface toward node 0. Starts no training. Exit 0: ready; 1: problems, each named with "
    "its fix; 2: bad arguments.",
    "submit": "Submit a run with sbatch: one torchrun per node (srun), the c10d rendezvous on the "
    "first node. RUN_DIR must be on a filesystem every node shares. Ctrl-C cancels the job "
    "(scancel); --detach leaves it running (ddpnb attach RUN_DIR).",
    "sweep": "Run NOTEBOOK once per point of the grid (the product of the -g axes) into "
    "DIR/<point>.ipynb, in the current folder; DIR/summary.csv gets a row per point (parameters, "
    "status, wall time, final metrics), DIR/curves.png their curves. Running it again skips "
    "the points done (--overwrite redoes them). Exit 0: every point done; 1: a point failed; "
    "2: bad arguments (nothing ran); 130: Ctrl-C (the running point stopped).",
    "stacks": "Show each rank's current Python stack (the script's frames, torch's folded) and "
    "whether the run hangs, from the snapshots every worker writes every 2 s. Exit 0; 2 when "
    "the run has ended, the folder holds no run, or a host stopped reporting.",
}

# TrainConfig fields' help; each option's kind and default come from the dataclass.
FIELD_HELP = {
    "data_dir": "ImageFolder with train/ and val/ (required unless --config).",
    "model_kwargs": "Keyword arguments for torchvision.models.get_model, a JSON object.",
    "weights": "'none' (random init), DEFAULT (torchvision download), or a state-dict path.",
    "batch_size": "Per process: the global batch is batch_size * world_size.",
    "amp": "bf16 autocast, applied on CUDA only.",
    "timeout_seconds": "Seconds a collective may wait before the run fails instead of hanging.",
    "max_steps_per_epoch": "Limit steps per epoch (smoke tests); 'none' runs whole epochs.",
    "threads": "Intra-op threads per process on CPU; 0 splits the host's cores over them.",
    "comm_hook": "How DDP averages gradients: shm (through shared memory, gloo on one host), "
    "none (plain all-reduce), bf16/fp16 (compressed); auto: shm when it can, else none.",
}


def _seconds_or_off(text: str) -> float | None:
    if text.lower() == "off":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of seconds, or 'off', not {text!r}") from None


# The keywords of launch(), submit_slurm() and check_hosts() as name: (kind, help); each command
# picks its options from this table by name. Passed only if given: the defaults stay theirs.
N = {"type": int, "metavar": "N"}
TEXT: dict[str, Any] = {}
SWITCH = {"action": "store_true"}
REPEAT = {"action": "append", "metavar": "ARG"}
SECONDS = {"type": _seconds_or_off, "metavar": "SECONDS"}
HOST_LIST = {"type": lambda t: [h.strip() for h in t.split(",") if h.strip()], "metavar": "A,B"}
OPTIONS = {
    "nnodes": (N, "nodes: simulated on this machine (default 2; `train`: 1), or one per --hosts"),
    "nproc_per_node": (N, "processes (workers) per node (default: 1)"),
    "master_addr": (TEXT, "node 0's address (default 127.0.0.1, or with --hosts the first host's)"),
    "master_port": (N, "node 0's rendezvous port (default: a free one)"),
    "max_restarts": (N, "torchrun restarts of a failed node's workers (default: 0)"),
    "rdzv_timeout": (N, "seconds the nodes have to join (default: 60, or 300 for a Slurm job)"),
    "resume": (SWITCH, "continue the run in --run-dir from its checkpoint"),
    "overwrite": (SWITCH, "replace the run in --run-dir"),
    "env": (REPEAT, "KEY=VALUE added to every node's environment (repeat)"),
    "hang_timeout": (
        SECONDS,
        "seconds without progress, ranks waiting in collectives, before the run is called hung "
        "(default: 60; off: the watch is off)",
    ),
    "on_hang": (
        {"choices": ("stop", "wait")},
        "stop: end a hung run naming every rank's line (default); wait: show it and keep waiting",
    ),
    "hosts": (HOST_LIST, "A,B[,C]: real hosts over SSH, one node each, the first is node 0"),
    "ssh_config": (TEXT, "an OpenSSH client config (ssh -F)"),
    "ssh_options": (REPEAT, "one extra ssh argument, verbatim (repeat: --ssh-option=-o ...)"),
    "python": (TEXT, "the hosts' interpreter (default: this one's path)"),
    "remote_run_dir": (TEXT, "the run directory on hosts that do not share this one"),
    "partition": (TEXT, "the partition (default: the cluster's default)"),
    "time": (TEXT, "the time limit (sbatch --time; default: 01:00:00)"),
    "account": (TEXT, "the account to charge"),
    "gpus_per_node": (N, "GPUs per node (sbatch --gpus-per-node)"),
    "sbatch_args": (REPEAT, "one extra sbatch argument, verbatim (repeat: --sbatch-arg=--requeue)"),
}
HOSTS = ["hosts", "ssh_config", "ssh_options", "python", "remote_run_dir"]
SLURM = ["partition", "time", "account", "gpus_per_node", "sbatch_args"]
LAUNCH = [name for name in OPTIONS if name not in HOSTS + SLURM]
SUBMIT = ["nproc_per_node", *SLURM, "python", "max_restarts", "resume", "overwrite"]
CHECK_HOSTS = "ssh_config ssh_options python nproc_per_node master_addr master_port".split()


def _flags(name: str) -> tuple[str, ...]:
    return FLAGS.get(name, ("--" + name.replace("_", "-"),))


def _options(group, names: list[str], **override: tuple) -> None:
    for name in names:
        kind, help_ = (OPTIONS | override)[name]
        group.add_argument(*_flags(name), dest=name, default=argparse.SUPPRESS, help=help_, **kind)


def _given(args: argparse.Namespace, names: list[str]) -> dict[str, Any]:
    return {name: getattr(args, name) for name in names if hasattr(args, name)}


def launch_options(parser: argparse.ArgumentParser) -> None:
    """launch()'s keywords as options: the launch, and real hosts over SSH."""
    _options(parser.add_argument_group("launch (torchrun's names)"), LAUNCH)
    _options(parser.add_argument_group("real hosts over SSH (one node per host)"), HOSTS)


def _launch_kwargs(args: argparse.Namespace, default_nnodes: int | None = None) -> dict:
    kwargs = _given(args, LAUNCH + HOSTS)
    if "env" in kwargs:
        pairs = [item.partition("=") for item in kwargs["env"]]
        if bad := [k + sep + v for k, sep, v in pairs if not sep or not k]:
            raise ConfigError(f"--env takes KEY=VALUE, got {bad[0]!r}.")
        kwargs["env"] = {key: value for key, _, value in pairs}
    if default_nnodes and "nnodes" not in kwargs and not kwargs.get("hosts"):
        kwargs["nnodes"] = default_nnodes
    return kwargs


def _command(sub, name: str, handler, **kwargs: Any) -> argparse.ArgumentParser:
    parser = sub.add_parser(name, help=COMMANDS[name], description=DESCRIPTIONS.get(name), **kwargs)
    parser.set_defaults(handler=handler)
    return parser


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("ddpnb", description="Multi-node DDP training, from a notebook.")
    sub = p.add_subparsers(dest="command", required=True)
    prep = _command(sub, "prep", _prep)
    prep.add_argument("--out", required=True, help="dataset folder to create")
    prep.add_argument("--image-size", type=int, default=32)
    prep.add_argument("--val-fraction", type=float, default=0.2)
    prep.add_argument("--seed", type=int, default=0)
    prep.add_argument("--overwrite", action="store_true")
    _command(sub, "check", lambda a: 0 if inspect_dataset(a.dir).ok else 1).add_argument("dir")
    train = _command(sub, "train", _train)
    _job_group(train, "launch", "where the run's files go (config, metrics, checkpoint, logs)")
    launch_options(train)
    _config_options(train)
    _run_parser(_command(sub, "run", _run, usage="ddpnb run [OPTIONS] SCRIPT [SCRIPT_ARGS...]"))
    _command(sub, "check-script", None)  # listed here; parsed by ddpnb.scriptcheck (see main)
    _command(sub, "stacks", lambda a: print(stacks(a.run_dir))).add_argument("run_dir")
    plot = _command(sub, "plot", _plot)
    plot.add_argument("run_dirs", nargs="+")
    plot.add_argument("--out", default="curves.png")
    cmds = _command(sub, "commands", _commands)
    cmds.add_argument(
        "--run-dir", required=True, help="where train_ddp.py and config.json are on the nodes"
    )
    cmds.add_argument("--hosts", required=True, help="the first is the master", **HOST_LIST)
    cmds.add_argument("--nproc-per-node", type=int, default=1)
    cmds.add_argument("--master-port", type=int, default=29500)
    cmds.add_argument("--rendezvous", choices=["static", "c10d"], default="static")
    cmds.add_argument("--node-rank", type=int)
    submit = _command(sub, "submit", _submit)
    job = _job_group(submit, "Slurm job", "on a filesystem every node shares")
    job.add_argument("--nnodes", type=int, required=True)
    _options(job, SUBMIT)
    job.add_argument("--detach", action="store_true", help="return once submitted")
    _config_options(submit)
    check = _command(sub, "check-hosts", _check_hosts)
    check.add_argument("--hosts", required=True, **HOST_LIST)
    _options(
        check, CHECK_HOSTS, master_port=(N, "node 0's rendezvous port to prove (default: 29500)")
    )
    check.add_argument(
        "--data", help="also check this dataset (the tutorial worker's) on each host"
    )
    _sweep_parser(_command(sub, "sweep", _sweep))
    _command(sub, "attach", _attach).add_argument("run_dir")
    slurm = _command(sub, "slurm", _slurm)
    slurm.add_argument("--run-dir", required=True)
    slurm.add_argument("--nnodes", type=int, default=2)
    slurm.add_argument("--nproc-per-node", type=int, default=1)
    slurm.add_argument("--master-port", type=int, default=29500)
    slurm.add_argument("--gpus-per-node", type=int, default=0)
    slurm.add_argument("--out", default="train.sbatch")
    return p


def _job_group(parser: argparse.ArgumentParser, title: str, run_dir_help: str):
    """``--config`` and ``--run-dir``: where ``train`` and ``submit`` start."""
    group = parser.add_argument_group(title)
    config_help = "start from a saved config.json (e.g. RUN_DIR/config.json); options override it"
    group.add_argument("--config", metavar="FILE", help=config_help)
    group.add_argument("--run-dir", required=True, help=run_dir_help)
    return group


def _run_parser(run: argparse.ArgumentParser) -> None:
    run.add_argument("--run-dir", help="default: runs/<script name without .py>")
    script_options(run)
    launch_options(run)
    slurm = run.add_argument_group("Slurm (with --slurm: one batch job, sbatch)")
    slurm.add_argument("--slurm", action="store_true", help="submit as a Slurm job, follow it")
    _options(slurm, SLURM)
    slurm.add_argument("--detach", action="store_true", help="with --slurm: return once submitted")
    run.add_argument("script", metavar="SCRIPT", help="the torchrun script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, metavar="SCRIPT_ARGS")


def _sweep_parser(p: argparse.ArgumentParser) -> None:
    p.usage = "ddpnb sweep NOTEBOOK --out DIR [-p NAME VALUE]... [-g NAME V1,V2]..."
    p.add_argument("notebook", metavar="NOTEBOOK", help="the notebook (.ipynb) to run")
    p.add_argument("--out", required=True, metavar="DIR", help="where everything goes")
    pairs = {"nargs": 2, "action": "append", "default": []}
    value = "a parameter for every point, read as papermill reads it (True, 3, 0.1, text); repeat"
    p.add_argument("-p", "--parameters", metavar=("NAME", "VALUE"), help=value, **pairs)
    axis = "a grid axis: comma-separated values, each read as -p reads one; repeat for more axes"
    p.add_argument("-g", "--grid", metavar=("NAME", "V1,V2"), help=axis, **pairs)
    p.add_argument("--overwrite", action="store_true", help="redo the points already done")
    seconds = "seconds each cell may run, or 'off' (default: 3600)"
    p.add_argument("--timeout", default=3600.0, help=seconds, **SECONDS)
    p.add_argument("--kernel", help="the Jupyter kernel (default: the notebook's own)")


def _optional(tp: Any) -> tuple[Any, bool]:
    """(X, True) for ``X | None``; (tp, False) otherwise."""
    args = typing.get_args(tp)
    return (args[0], True) if type(None) in args else (tp, False)


def _config_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("training (TrainConfig fields)")
    hints = typing.get_type_hints(TrainConfig)
    for f in dataclasses.fields(TrainConfig):
        tp, _ = _optional(hints[f.name])
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        help_ = f"{FIELD_HELP.get(f.name, '')} (default: {default!r})".lstrip()
        kw: dict[str, Any] = {"dest": _FIELD_DEST + f.name, "default": argparse.SUPPRESS}
        if tp is bool:
            kw["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(tp) is typing.Literal:  # not choices: TrainConfig's message
            kw["metavar"] = "{" + ",".join(typing.get_args(tp)) + "}"
        else:
            kw["metavar"] = "JSON" if tp is dict else tp.__name__.upper()
        group.add_argument(*_flags(f.name), help=help_, **kw)


def _convert(name: str, tp: Any, raw: Any) -> Any:
    """A command-line string as the field's type; unparsed, left for TrainConfig to reject."""
    tp, optional = _optional(tp)
    if optional and raw.strip().lower() == "none":
        return None
    if tp is dict:
        try:
            return json.loads(raw)
        except json.JSONDecodeError as e:
            raise ConfigError(
                f"{_flags(name)[0]} must be a JSON object such as '{{\"dropout\": 0.0}}'; "
                f"{raw!r} is not valid JSON ({e})."
            ) from None
    if tp in (int, float):
        with contextlib.suppress(ValueError):
            return tp(raw)
    return raw  # text, a bool flag's value, or what TrainConfig rejects


def train_config(args: argparse.Namespace) -> TrainConfig:
    """The TrainConfig of a ``ddpnb train`` line: ``--config`` (or defaults), then the options."""
    hints = typing.get_type_hints(TrainConfig)
    given = {k[len(_FIELD_DEST) :]: v for k, v in vars(args).items() if k.startswith(_FIELD_DEST)}
    changes = {k: _convert(k, hints[k], v) for k, v in given.items()}
    if getattr(args, "config", None):
        return TrainConfig.load(args.config).replace(**changes)
    if "data_dir" not in changes:
        raise ConfigError("--data is required (the ImageFolder with train/ and val/), or --config.")
    return TrainConfig(**changes)


class StoppedBySignal(KeyboardInterrupt):
    """SIGTERM or SIGHUP reached ``ddpnb``: it takes the Ctrl-C path."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum, self.name = signum, signal.Signals(signum).name


class _StopSignals:
    """Turn SIGTERM/SIGHUP into StoppedBySignal (once; a repeat must not cut the stop short)."""

    def _handle(self, signum, frame) -> None:
        if self.received is None:
            self.received = signum
            raise StoppedBySignal(signum)

    def __enter__(self) -> _StopSignals:
        self.received: int | None = None
        self.previous: dict[int, Any] = {}
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) is not signal.SIG_IGN:  # nohup: SIGHUP stays ignored
                with contextlib.suppress(ValueError):  # not the main thread: leave them alone
                    self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if self.received is not None and exc is not None and not isinstance(exc, StoppedBySignal):
            raise StoppedBySignal(self.received) from exc  # e.g. a write to a closed terminal


# Each command returns its exit status (None: 0); those that start processes stop them on a signal.


def _train(args: argparse.Namespace) -> None:
    config = train_config(args)
    with _StopSignals():
        job = launch(config, args.run_dir, progress="text", **_launch_kwargs(args, 1))
    print(f"metrics: {job.run_dir / 'metrics.jsonl'}")


def _run(args: argparse.Namespace) -> None:
    script = Script(args.script, args.script_args, args.file, args.max_copy_mb)
    run_dir = args.run_dir or str(Path("runs") / Path(args.script).stem)
    kwargs = _launch_kwargs(args)
    if args.slurm:
        local = "hosts ssh_config remote_run_dir master_addr master_port ssh_options".split()
        if given := [name for name in local if name in kwargs]:
            raise ConfigError(
                f"{_flags(given[0])[0]} does not apply with --slurm: Slurm picks the nodes "
                "and the first one hosts the rendezvous."
            )
        nnodes = kwargs.pop("nnodes", None) or 2
        return _slurm_job(script, run_dir, nnodes, args.detach, kwargs | _given(args, SLURM))
    with _StopSignals():
        job = launch(script, run_dir, progress="text", **kwargs)
    print(f"run directory: {job.run_dir}")


def _submit(args: argparse.Namespace) -> None:
    _slurm_job(train_config(args), args.run_dir, args.nnodes, args.detach, _given(args, SUBMIT))


def _slurm_job(what, run_dir: str, nnodes: int, detach: bool, keywords: dict) -> None:
    """``submit`` and ``run --slurm``: submit_slurm(), followed as text unless detached."""
    with _StopSignals():  # Ctrl-C, SIGTERM and SIGHUP cancel the job
        job = submit_slurm(what, run_dir, nnodes, wait=not detach, progress="text", **keywords)
    if detach:
        job_id = job.scheduler.job_id
        print(
            f"submitted Slurm job {job_id}; follow it with: ddpnb attach {job.run_dir} "
            f"(or squeue -j {job_id}); cancel it with: scancel {job_id}"
        )
    else:
        print(f"run directory: {job.run_dir}")


def _attach(args: argparse.Namespace) -> None:
    with _StopSignals():
        job = attach(args.run_dir, progress="text")
    print(f"metrics: {job.run_dir / 'metrics.jsonl'}")


def _check_hosts(args: argparse.Namespace) -> int | None:
    config = TrainConfig(data_dir=args.data) if args.data else None
    try:
        rows = check_hosts(config, args.hosts, **_given(args, CHECK_HOSTS))
    except HostError as e:
        print(f"ddpnb check-hosts: {e}", file=sys.stderr)
        return 1
    print(rows)
    text = rows.network.table()
    print(text[text.index("node 0 at") :])  # the interfaces chosen, and why


def _sweep(args: argparse.Namespace) -> int:
    parameters = {name: resolve_type(value) for name, value in args.parameters}
    grid: dict[str, list] = {}
    for name, text in args.grid:
        if name in grid:
            raise ConfigError(
                f"-g {name} is given twice: give all its values in one -g {name} V1,V2,..."
            )
        grid[name] = parse_axis(name, text)
    options = {"overwrite": args.overwrite, "timeout": args.timeout, "kernel_name": args.kernel}
    with _StopSignals():
        result = sweep(args.notebook, args.out, grid, parameters, **options)
    print(result)
    return 0 if result.ok else 1


def _prep(args: argparse.Namespace) -> None:
    root = prepare_digits(args.out, args.image_size, args.val_fraction, args.seed, args.overwrite)
    inspect_dataset(root)


def _plot(args: argparse.Namespace) -> None:
    from .plot import plot_curves

    plot_curves(args.run_dirs).savefig(args.out, dpi=110)
    print(f"wrote {args.out}")


def _commands(args: argparse.Namespace) -> None:
    nodes = (args.hosts, args.nproc_per_node, args.master_port)
    options = {"rendezvous": args.rendezvous, "node_rank": args.node_rank}
    lines = node_commands(_run_config(args.run_dir), args.run_dir, *nodes, **options)
    shown = args.hosts if args.node_rank is None else [args.hosts[args.node_rank]]
    print(format_node_commands(shown, lines))


def _slurm(args: argparse.Namespace) -> None:
    nodes = (args.nnodes, args.nproc_per_node, args.master_port)
    config = _run_config(args.run_dir)
    slurm_script(config, args.run_dir, *nodes, gpus_per_node=args.gpus_per_node, path=args.out)
    print(f"wrote {args.out}; submit with: sbatch {args.out}")


def _run_config(run_dir: str) -> TrainConfig:
    path = Path(run_dir) / "config.json"
    return TrainConfig.load(path) if path.exists() else TrainConfig()


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``ddpnb`` console script and ``python -m ddpnb``."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["check-script"]:  # its own parser: every word after the script is the script's
        from .scriptcheck import main_check_script

        try:
            return main_check_script(argv[1:])
        except KeyboardInterrupt:
            _say("ddpnb: interrupted; every process of the check was stopped.")
            return 130
    args = _parser().parse_args(argv)
    try:
        return args.handler(args) or 0
    except DdpnbError as e:
        print(f"ddpnb {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM/SIGHUP as StoppedBySignal
        signum = e.signum if isinstance(e, StoppedBySignal) else None
        how = f"stopped by {e.name}" if signum else "interrupted"
        if args.command == "sweep":
            _say(
                f"ddpnb sweep: {how}; the running point was stopped (its kernel shut down, ending "
                f"its runs), the finished points and {Path(args.out) / 'summary.csv'} are kept. "
                "Run the same command again to do the rest."
            )
        else:
            _say(f"ddpnb: {how}; every process of the run was stopped; resume with --resume.")
        return 128 + signum if signum else 130


def _say(message: str) -> None:
    with contextlib.suppress(OSError):  # SIGHUP: the terminal may be gone
        print(message, file=sys.stderr)
