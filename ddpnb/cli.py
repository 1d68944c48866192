"""The ``ddpnb`` command line: prep, check, train, plot, commands, slurm, sweep."""

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

# The commands with a description of their own: (``ddpnb -h``'s line, ``ddpnb CMD -h``'s text).
COMMANDS = {
    "train": (
        "train with DDP (one torchrun per node)",
        "Train with DDP, one torchrun per node. Every training option is a TrainConfig field; "
        "only the options given override its defaults (or --config).",
    ),
    "run": (
        "run your own torchrun script with DDP (simulated nodes, --hosts, or --slurm)",
        "Run any torchrun script, torchrun's way: options first, then the script; everything "
        "after the script goes to it unchanged. Simulated nodes on this machine by default, "
        "real hosts with --hosts, a Slurm batch job with --slurm. The run directory is the "
        "script's working directory on every node.",
    ),
    "check-hosts": (
        "prove real hosts can run a job: logins, torch, the network (exit 1 on problems)",
        "Ask every host (login, interpreter, torch) and prove the network: node 0's address "
        "and port from every host, every pair on the ports the collectives use, each host's "
        "interface toward node 0. Starts no training. Exit 0: ready; 1: problems, each named "
        "with its fix; 2: bad arguments.",
    ),
    "submit": (
        "train as a Slurm batch job (sbatch), followed until it ends",
        "Submit a run with sbatch: one torchrun per node (srun), the c10d rendezvous on the "
        "first node. RUN_DIR must be on a filesystem every node shares. Ctrl-C cancels the "
        "job (scancel); --detach leaves it running (ddpnb attach RUN_DIR).",
    ),
    "sweep": (
        "run a notebook with papermill over a grid of parameters; one table of the results",
        "Run NOTEBOOK with papermill once per point of the grid (the product of the -g axes) "
        "into DIR/<point>.ipynb, each point's runs in DIR/<point>/; DIR/summary.csv gets one "
        "row per point (parameters, status, wall time, final metrics) and DIR/curves.png every "
        "point's curves. The notebooks run in the current folder, so relative paths mean what "
        "they mean here. Running it again skips the points already done (--overwrite redoes "
        "them) and retries the failed ones. Exit 0: every point done; 1: a point failed; 2: bad "
        "arguments (nothing ran); 130: Ctrl-C (the running point stopped, the rest kept).",
    ),
}


def _command(sub, name: str, **kwargs: Any) -> argparse.ArgumentParser:
    """The subcommand ``name``, with its texts from COMMANDS."""
    help_, description = COMMANDS[name]
    return sub.add_parser(name, help=help_, description=description, **kwargs)


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
    _run_parser(sub)
    sub.add_parser(  # listed here; parsed by ddpnb.scriptcheck (see main)
        "check-script",
        help="run your DDP script briefly and name its classic mistakes with their line "
        "(exit 0 clean, 1 mistakes, 2 could not run); ddpnb check-script --help",
    )

    stacks = sub.add_parser(
        "stacks",
        help="where every rank of a running job is: its script line and the collective it waits in",
        description="Show each rank's current Python stack (the script's frames, torch's folded) "
        "and whether the run hangs. Read from the snapshots every worker writes every 2 s. "
        "Exit 0; 2 when the run has ended, the folder holds no run, or a host stopped reporting.",
    )
    stacks.add_argument("run_dir")

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
    _check_hosts_parser(sub)
    _sweep_parser(sub)
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
    train = _command(sub, "train")
    launch = train.add_argument_group("launch")
    launch.add_argument(
        "--config",
        metavar="FILE",
        help="start from a saved config.json (e.g. RUN_DIR/config.json); options override it",
    )
    launch.add_argument("--run-dir", required=True)
    launch_options(train)
    _config_options(train.add_argument_group("training (TrainConfig fields)"))
    return train


# -- launch() and submit_slurm() keywords as options: declared once, in their signatures ----

# The options' help; kind and default come from the function's signature.
LAUNCH_HELP = {
    "nnodes": "nodes: simulated on this machine (default 2; `train`: 1), or one per --hosts",
    "nproc_per_node": "processes (workers) per node",
    "master_addr": "node 0's address (default 127.0.0.1, or with --hosts the first host's)",
    "master_port": "node 0's rendezvous port (default: a free one)",
    "max_restarts": "torchrun restarts of a failed node's workers",
    "rdzv_timeout": "seconds the nodes have to join (default: 60, or 300 for a Slurm job)",
    "resume": "continue the run in --run-dir from its checkpoint",
    "overwrite": "replace the run in --run-dir",
    "env": "KEY=VALUE added to every node's environment (repeat)",
    "hang_timeout": "seconds without progress, ranks waiting in collectives, before the run is "
    "called hung (default: 60; off: the watch is off)",
    "on_hang": "stop: end a hung run naming every rank's line (default); wait: show it and "
    "keep waiting",
}
HOSTS_HELP = {
    "hosts": "A,B[,C]: real hosts over SSH, one node each, the first is node 0",
    "ssh_config": "an OpenSSH client config (ssh -F)",
    "ssh_options": "one extra ssh argument, verbatim (repeat: --ssh-option=-o --ssh-option=Port=2222)",
    "python": "the hosts' interpreter (default: this one's path)",
    "remote_run_dir": "the run directory on hosts that do not share this one",
}
SLURM_HELP = {
    "partition": "the partition (default: the cluster's default)",
    "time": "the time limit (sbatch --time)",
    "account": "the account to charge",
    "gpus_per_node": "GPUs per node (sbatch --gpus-per-node)",
    "sbatch_args": "one extra sbatch argument, verbatim (repeat: --sbatch-arg=--requeue)",
}
# ``ddpnb submit``: the worker as a Slurm job (submit_slurm's keywords).
SUBMIT_HELP = {
    "nproc_per_node": "processes per node, usually one per GPU",
    **SLURM_HELP,
    "python": "the nodes' interpreter (default: this one's path)",
    "max_restarts": LAUNCH_HELP["max_restarts"],
    "resume": LAUNCH_HELP["resume"],
    "overwrite": LAUNCH_HELP["overwrite"],
}
# ``ddpnb check-hosts`` (check_hosts' keywords).
CHECK_HOSTS_HELP = {
    "ssh_config": HOSTS_HELP["ssh_config"],
    "ssh_options": HOSTS_HELP["ssh_options"],
    "python": HOSTS_HELP["python"],
    "nproc_per_node": LAUNCH_HELP["nproc_per_node"],
    "master_addr": LAUNCH_HELP["master_addr"],
    "master_port": "node 0's rendezvous port to prove",
}
# Options whose flag is not simply --name-with-dashes (repeatable ones are singular).
FLAGS = {"ssh_options": "--ssh-option", "sbatch_args": "--sbatch-arg", "time": "--time"}
# Options left unset unless given: the backend that runs picks the default (Slurm's is longer).
BACKEND_DEFAULTS = ("rdzv_timeout",)


def _options(group, fn, helps: dict[str, str]) -> None:
    """One option per keyword of ``fn`` named in ``helps`` (see _option)."""
    for name, help_ in helps.items():
        _option(group, fn, name, help_)


def _keywords(args: argparse.Namespace, names) -> dict[str, Any]:
    """Those options as keyword arguments: each option's dest is its keyword's name."""
    return {name: getattr(args, name) for name in names}


def _option(group, fn, name: str, help_: str) -> None:
    """One option for keyword ``name`` of ``fn``: its kind and default read from the signature."""
    import inspect

    param = inspect.signature(fn).parameters[name]
    flag = FLAGS.get(name, "--" + name.replace("_", "-"))
    default = None if name in BACKEND_DEFAULTS else param.default
    kw: dict[str, Any] = {"dest": name, "help": help_}
    annotation = str(param.annotation)
    if isinstance(default, bool):
        kw["action"] = "store_true"
    elif name in ("ssh_options", "sbatch_args", "env"):
        kw.update(action="append", default=[], metavar="ARG")
    elif name == "hosts":
        kw.update(type=lambda text: [h for h in text.split(",") if h], metavar="A,B")
    elif name == "hang_timeout":
        kw.update(type=_seconds_or_off, default=default, metavar="SECONDS")
    elif name == "on_hang":
        kw.update(choices=("stop", "wait"), default=default)
    elif annotation.startswith("int"):
        kw.update(type=int, default=default, metavar="N")
    else:
        kw.update(default=default, metavar=name.upper().split("_")[-1])
    if default not in (None, False, (), inspect.Parameter.empty) and "default" not in help_:
        kw["help"] = f"{help_} (default: {default})"
    group.add_argument(flag, **kw)


def _seconds_or_off(text: str) -> float | None:
    if text.lower() == "off":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of seconds, or 'off', not {text!r}") from None


def launch_options(parser: argparse.ArgumentParser) -> None:
    """launch()'s keywords as options: the launch, and real hosts over SSH."""
    from .launch import launch

    _options(parser.add_argument_group("launch (torchrun's names)"), launch, LAUNCH_HELP)
    _options(
        parser.add_argument_group("real hosts over SSH (one node per host)"), launch, HOSTS_HELP
    )


def _launch_kwargs(args: argparse.Namespace, default_nnodes: int | None = None) -> dict:
    """The keywords of launch() from a command line made by launch_options()."""
    kwargs = _keywords(args, (*LAUNCH_HELP, *HOSTS_HELP))
    env = {}
    for item in kwargs["env"]:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--env takes KEY=VALUE, got {item!r}.")
        env[key] = value
    kwargs["env"] = env
    for name in BACKEND_DEFAULTS:
        if kwargs[name] is None:
            del kwargs[name]
    if kwargs["nnodes"] is None and not kwargs["hosts"]:
        kwargs["nnodes"] = default_nnodes
    return kwargs


def _run_parser(sub) -> argparse.ArgumentParser:
    from .slurm import submit_slurm

    run = _command(sub, "run", usage="ddpnb run [OPTIONS] SCRIPT [SCRIPT_ARGS...]")
    run.add_argument("--run-dir", help="default: runs/<script name without .py>")
    from .script import script_options

    script_options(run)
    launch_options(run)
    slurm = run.add_argument_group("Slurm (with --slurm: one batch job, sbatch)")
    slurm.add_argument(
        "--slurm", action="store_true", help="submit as a Slurm batch job and follow it"
    )
    _options(slurm, submit_slurm, SLURM_HELP)
    slurm.add_argument("--detach", action="store_true", help="with --slurm: return once submitted")
    run.add_argument("script", metavar="SCRIPT", help="the torchrun script")
    run.add_argument("script_args", nargs=argparse.REMAINDER, metavar="SCRIPT_ARGS")
    return run


def _run_script(args: argparse.Namespace) -> int:
    from .script import Script

    script = Script(args.script, args.script_args, args.file, args.max_copy_mb)
    run_dir = args.run_dir or str(Path("runs") / Path(args.script).stem)
    kwargs = _launch_kwargs(args)
    if args.slurm:
        return _submit_script(script, run_dir, args, kwargs)
    from .launch import launch

    with _StopSignals():  # SIGTERM/SIGHUP stop every process of the run, as Ctrl-C does
        job = launch(script, run_dir, progress="text", **kwargs)
    print(f"run directory: {job.run_dir}")
    return 0


def _submit_script(script, run_dir: str, args: argparse.Namespace, kwargs: dict) -> int:
    local_only = ("hosts", "ssh_config", "remote_run_dir", "master_addr", "master_port")
    given = [n for n in local_only if kwargs[n]] + (["ssh_option"] if kwargs["ssh_options"] else [])
    if given:
        raise ConfigError(
            f"--{given[0].replace('_', '-')} does not apply with --slurm: Slurm picks the nodes "
            "and the first one hosts the rendezvous."
        )
    # launch()'s options that submit_slurm() takes too
    shared = (
        "nproc_per_node",
        "max_restarts",
        "rdzv_timeout",
        "resume",
        "overwrite",
        "env",
        "python",
        "hang_timeout",
        "on_hang",
    )
    keywords = {name: kwargs[name] for name in shared if name in kwargs}  # given, or each default
    keywords |= _keywords(args, SLURM_HELP)
    return _slurm_job(script, run_dir, kwargs["nnodes"] or 2, args.detach, keywords)


def _check_hosts_parser(sub) -> argparse.ArgumentParser:
    from .remote import check_hosts

    check = _command(sub, "check-hosts")
    check.add_argument("--hosts", required=True, type=lambda t: [h for h in t.split(",") if h])
    _options(check, check_hosts, CHECK_HOSTS_HELP)
    check.add_argument(
        "--data", help="also check this dataset (the tutorial worker's) on every host"
    )
    return check


def _check_hosts(args: argparse.Namespace) -> int:
    from .errors import HostError
    from .remote import check_hosts

    config = None
    if args.data:
        from .config import TrainConfig

        config = TrainConfig(data_dir=args.data)
    try:
        rows = check_hosts(config, args.hosts, **_keywords(args, CHECK_HOSTS_HELP))
    except HostError as e:
        print(f"ddpnb check-hosts: {e}", file=sys.stderr)
        return 1
    print(rows)
    text = rows.network.table()
    print(text[text.index("node 0 at") :])  # the interfaces chosen, and why
    return 0


def _submit_parser(sub) -> argparse.ArgumentParser:
    submit = _command(sub, "submit")
    from .slurm import submit_slurm

    job = submit.add_argument_group("Slurm job")
    job.add_argument("--config", metavar="FILE", help="start from a saved config.json")
    job.add_argument("--run-dir", required=True, help="on a filesystem every node shares")
    job.add_argument("--nnodes", type=int, required=True)
    _options(job, submit_slurm, SUBMIT_HELP)
    job.add_argument("--detach", action="store_true", help="return once submitted")
    _config_options(submit.add_argument_group("training (TrainConfig fields)"))
    return submit


def _submit(args: argparse.Namespace) -> int:
    config = train_config(args)
    return _slurm_job(config, args.run_dir, args.nnodes, args.detach, _keywords(args, SUBMIT_HELP))


def _slurm_job(what, run_dir: str, nnodes: int, detach: bool, keywords: dict) -> int:
    """``submit`` and ``run --slurm``: submit_slurm(), followed as text unless detached."""
    from .slurm import submit_slurm

    with _StopSignals():  # SIGTERM/SIGHUP cancel the job as Ctrl-C does
        job = submit_slurm(what, run_dir, nnodes, wait=not detach, progress="text", **keywords)
    if detach:
        print(
            f"submitted Slurm job {job.job_id}; follow it with: ddpnb attach {job.run_dir} "
            f"(or squeue -j {job.job_id}); cancel it with: scancel {job.job_id}"
        )
    else:
        print(f"run directory: {job.run_dir}")
    return 0


def _attach(args: argparse.Namespace) -> int:
    from .slurm import attach

    with _StopSignals():
        job = attach(args.run_dir, progress="text")
    print(f"metrics: {job.run_dir / 'metrics.jsonl'}")
    return 0


# -- sweep: papermill's -p NAME VALUE, and -g NAME V1,V2,... --------------------------------


def _sweep_parser(sub) -> argparse.ArgumentParser:
    sweep = _command(
        sub, "sweep", usage="ddpnb sweep NOTEBOOK --out DIR [-p NAME VALUE]... [-g NAME V1,V2]..."
    )
    sweep.add_argument("notebook", metavar="NOTEBOOK", help="the notebook (.ipynb) to run")
    sweep.add_argument("--out", required=True, metavar="DIR", help="where everything goes")
    sweep.add_argument(
        "-p",
        "--parameters",
        nargs=2,
        action="append",
        default=[],
        metavar=("NAME", "VALUE"),
        help="a parameter for every point, read as papermill reads it (True, False, None, "
        "an int, a float, else text); repeat for more",
    )
    sweep.add_argument(
        "-g",
        "--grid",
        nargs=2,
        action="append",
        default=[],
        metavar=("NAME", "V1,V2"),
        help="a grid axis: comma-separated values, each read as -p reads one; the points are "
        "the product of the axes; repeat for more",
    )
    sweep.add_argument("--overwrite", action="store_true", help="redo the points already done")
    sweep.add_argument(
        "--timeout",
        type=_seconds_or_off,
        default=3600.0,
        metavar="SECONDS",
        help="seconds each cell may run, or 'off' (default: 3600)",
    )
    sweep.add_argument("--kernel", help="the Jupyter kernel (default: the notebook's own)")
    return sweep


def _sweep(args: argparse.Namespace) -> int:
    from .sweep import parse_axis, resolve_type, sweep

    parameters = {name: resolve_type(value) for name, value in args.parameters}
    grid: dict[str, list] = {}
    for name, text in args.grid:
        if name in grid:
            raise ConfigError(
                f"-g {name} is given twice: give all its values in one -g {name} V1,V2,..."
            )
        grid[name] = parse_axis(name, text)
    try:
        with _StopSignals():  # SIGTERM/SIGHUP stop the running point as Ctrl-C does
            result = sweep(
                args.notebook,
                args.out,
                grid,
                parameters,
                overwrite=args.overwrite,
                timeout=args.timeout,
                kernel_name=args.kernel,
            )
    except KeyboardInterrupt as e:
        how = f"stopped by {e.name}" if isinstance(e, StoppedBySignal) else "interrupted"
        _say(
            f"ddpnb sweep: {how}; the running point was stopped (its kernel shut down, which "
            f"ends every ddpnb run it started); the finished points and "
            f"{Path(args.out) / 'summary.csv'} are kept. Run the same command again to do "
            "the rest."
        )
        return 128 + e.signum if isinstance(e, StoppedBySignal) else 130
    print(result)
    return 0 if result.ok else 1


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
        job = launch(config, args.run_dir, progress="text", **_launch_kwargs(args, 1))
    print(f"metrics: {job.run_dir / 'metrics.jsonl'}")
    return 0


# -- entry point ---------------------------------------------------------------------------


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
    if args.command == "run":
        return _run_script(args)
    if args.command == "check-hosts":
        return _check_hosts(args)
    if args.command == "submit":
        return _submit(args)
    if args.command == "attach":
        return _attach(args)
    if args.command == "sweep":
        return _sweep(args)
    if args.command == "stacks":
        from .hang import stacks

        print(stacks(args.run_dir))
        return 0
    if args.command == "plot":
        from .plot import plot_curves

        plot_curves(args.run_dirs).savefig(args.out, dpi=110)
        print(f"wrote {args.out}")
        return 0
    if args.command == "commands":
        return _commands(args)
    if args.command == "slurm":
        from .slurm import slurm_script

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
