"""What a run executes: a torchrun script, its arguments, and the files it needs beside it.

Any script that runs under ``torchrun`` runs under ddpnb. The run directory is its
working directory on every node: the script, its ``files`` and ddpnb's reporting file
(``ddpnb_reporting.py``, optional to use) are copied there. ddpnb's own worker is one
such script: :func:`worker_script` is ``train_ddp.py --config config.json``.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from .errors import ConfigError

REPORTING_NAME = "ddpnb_reporting.py"
MESHCHECK_NAME = "ddpnb_meshcheck.py"  # the network check a Slurm job runs first
REPORTING_PATH = Path(__file__).with_name("reporting.py")
CONSTANTS_NAME = "ddpnb_constants.py"  # what ddpnb's worker shares with the package


@dataclasses.dataclass(frozen=True)
class Script:
    """A torchrun script, the arguments after it, and the files it needs beside it.

    ``files`` (modules the script imports, small configs) are copied into the run
    directory with the script, under their own names. Pass a ``Script`` wherever a
    :class:`~ddpnb.TrainConfig` goes: ``launch``, ``submit_slurm``, ``check_script``.

    Example
    -------
    >>> s = Script("multinode.py", args=["50", "10", "--batch_size", "32"], files=["datautils.py"])
    >>> s.name
    'multinode.py'
    """

    path: str | os.PathLike
    args: Sequence[str] = ()
    files: Sequence[str | os.PathLike] = ()
    # ddpnb's worker: the name it takes in the run directory and the files ddpnb writes
    # for it (config.json). Not for users' scripts.
    rename: str | None = dataclasses.field(default=None, repr=False)
    generated: Mapping[str, bytes] = dataclasses.field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.path, (str, os.PathLike)) or not str(self.path):
            raise ConfigError(f"Script path must be a file path, got {self.path!r}.")
        for field in ("args", "files"):
            value = getattr(self, field)
            if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
                raise ConfigError(
                    f"Script {field} must be a list, e.g. {field}=['a', 'b'], got {value!r}."
                )
            object.__setattr__(self, field, tuple(value))
        bad = [a for a in self.args if not isinstance(a, str)]
        if bad:
            raise ConfigError(f"Script args must be strings (as on a command line): {bad!r}.")

    @property
    def name(self) -> str:
        """The script's file name in the run directory."""
        return self.rename or Path(self.path).name

    def check(self) -> None:
        """Raise ConfigError unless the script and every file exist and their names differ."""
        paths = [Path(self.path), *map(Path, self.files)]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise ConfigError(
                f"{', '.join(missing)}: no such file. Pass the path of the script "
                "(and of each file it needs) as it is on this machine."
            )
        names = [self.name, *(p.name for p in paths[1:]), *self.generated]
        names += [REPORTING_NAME, MESHCHECK_NAME]
        for path in paths:
            if path.suffix == ".py":
                _compile(path)
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:
            raise ConfigError(
                f"Two files would land in the run directory as {', '.join(twice)}: the script "
                f"and its files are copied there under their own names ({REPORTING_NAME} and "
                f"{MESHCHECK_NAME} are ddpnb's). Rename one of them."
            )

    def payload(self) -> dict[str, bytes]:
        """Every file the run directory gets, by name: the script, its files, the reporting file."""
        out = {self.name: Path(self.path).read_bytes()}
        out.update({Path(f).name: Path(f).read_bytes() for f in self.files})
        out.update(self.generated)
        out[REPORTING_NAME] = REPORTING_PATH.read_bytes()
        return out

    def command(self, run_dir: str | os.PathLike) -> list[str]:
        """The script and its arguments as torchrun runs them, with ``run_dir`` its folder.

        An argument naming a file ddpnb writes (the worker's ``config.json``) gets the
        folder too, so the line runs from any working directory.
        """
        folder = str(run_dir).rstrip("/")
        args = [f"{folder}/{a}" if a in self.generated else a for a in self.args]
        return [f"{folder}/{self.name}", *args]


def worker_script(config, path: str | os.PathLike | None = None) -> Script:
    """ddpnb's tutorial worker as a Script: ``train_ddp.py --config config.json``.

    ``path``: another version of the worker to run under that name (notebook 06's
    pitfalls are variants of it); by default the package's own ``worker.py``. The run
    directory also gets ``config.json`` and ``ddpnb_constants.py``, which it imports.

    >>> worker_script(TrainConfig()).command("/runs/a")          # doctest: +SKIP
    ['/runs/a/train_ddp.py', '--config', '/runs/a/config.json']
    """
    from .source import WORKER_PATH

    constants = Path(__file__).with_name("constants.py").read_bytes()
    return Script(
        path or WORKER_PATH,
        args=("--config", "config.json"),
        rename="train_ddp.py",
        generated={"config.json": config.to_json().encode(), CONSTANTS_NAME: constants},
    )


def _compile(path: Path) -> None:
    """ConfigError naming the file, line and text of a syntax error (nothing has started)."""
    source = path.read_bytes()
    try:
        compile(source, str(path), "exec", dont_inherit=True)
    except SyntaxError as e:
        text = (e.text or "").rstrip()
        caret = " " * max((e.offset or 1) - 1 - (len(text) - len(text.lstrip())), 0) + "^"
        raise ConfigError(
            f"{path.name}, line {e.lineno}: SyntaxError: {e.msg}\n    {text.strip()}\n    {caret}\n"
            "Fix the script and launch again: nothing was started."
        ) from None
    except ValueError as e:  # a null byte: not a Python file
        raise ConfigError(f"{path}: not a Python source file ({e}).") from None
