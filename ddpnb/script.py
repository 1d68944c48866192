"""What a run executes: a torchrun script, its arguments, and the files it needs beside it.

Any script that runs under ``torchrun`` runs under ddpnb, in the run directory on every node.
"""

from __future__ import annotations

import dataclasses
import os
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path

from .errors import ConfigError

REPORTING_NAME = "ddpnb_reporting.py"
MESHCHECK_NAME = "ddpnb_meshcheck.py"  # the network check a Slurm job runs first
REPORTING_PATH = Path(__file__).with_name("reporting.py")
CONSTANTS_NAME = "ddpnb_constants.py"  # what ddpnb's worker shares with the package
HOOKS_DIR = ".ddpnb"  # ddpnb's hooks in the run directory (ddpnb.hang writes them)
MAX_COPY_MB = 100.0


@dataclasses.dataclass(frozen=True)
class Script:
    """A torchrun script, the arguments after it, and the files it needs beside it.

    A ``Script`` goes wherever a ``TrainConfig`` does. ``files`` (modules, configs, small data)
    are copied to the run directory, a relative path at its place, an absolute one at the top;
    above ``max_copy_mb`` in all the launch refuses: keep large data on a shared filesystem.
    """

    path: str | os.PathLike
    args: Sequence[str] = ()
    files: Sequence[str | os.PathLike] = ()
    max_copy_mb: float = MAX_COPY_MB
    # ddpnb's worker only: its name in the run directory, and the files written for it.
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
        if bad := [a for a in self.args if not isinstance(a, str)]:
            raise ConfigError(f"Script args must be strings (as on a command line): {bad!r}.")
        limit = self.max_copy_mb
        if isinstance(limit, bool) or not isinstance(limit, (int, float)) or not limit > 0:
            raise ConfigError(f"max_copy_mb must be a number of megabytes > 0, got {limit!r}.")
        for path in (*([] if self.rename else [self.path]), *self.files):
            _place(path)  # a relative path climbing out of the current folder: refused now

    @property
    def name(self) -> str:
        """The script's path in the run directory (relative, with ``/``)."""
        return self.rename or _place(self.path)

    def check(self) -> None:
        """Raise ConfigError unless every file exists, has a place of its own, and fits."""
        given = [Path(self.path), *map(Path, self.files)]
        if missing := [str(p) for p in given if not p.exists()]:
            raise ConfigError(
                f"{', '.join(missing)}: no such file or folder. Pass the path of the script "
                "(and of each file or folder it needs) as it is on this machine; a relative "
                f"path is relative to the current folder, {os.getcwd()}."
            )
        if not given[0].is_file():
            raise ConfigError(
                f"{self.path}: a folder; the script is a file (e.g. {self.path}/train.py)."
            )
        sources = self._sources()
        names = [n for n, _, _ in sources] + [*self.generated, REPORTING_NAME, MESHCHECK_NAME]
        twice = sorted({n for n in names if names.count(n) > 1})
        twice += sorted({n for n in names if n.split("/")[0] == HOOKS_DIR})
        if twice:
            raise ConfigError(
                f"Two files would land in the run directory as {', '.join(twice)}: the script "
                "and its files keep their relative paths there (absolute paths land at the top; "
                f"{REPORTING_NAME}, {MESHCHECK_NAME} and {HOOKS_DIR}/ are ddpnb's). Rename or "
                "move one of them."
            )
        for path in [p for p in given if p.suffix == ".py" and p.is_file()]:
            _compile(path)
        sizes = Counter()  # bytes by path given
        for _, file, path in sources:
            sizes[path] += file.stat().st_size
        total = sum(sizes.values())
        if total > self.max_copy_mb * 1e6:
            items = ", ".join(f"{path} ({_size(size)})" for path, size in sizes.most_common(3))
            need = int(total / 1e6) + 1
            raise ConfigError(
                f"The script and its files are {_size(total)}, more than max_copy_mb="
                f"{self.max_copy_mb:g} to copy into the run directory (and to every host that "
                f"does not share it); the largest: {items}. Nothing was started. Keep large data "
                "on a filesystem every node shares and pass its absolute path in the script's "
                f"arguments (never copied), or allow the copy: Script(..., max_copy_mb={need}) "
                f"(CLI: --max-copy-mb {need})."
            )

    def payload(self) -> dict[str, bytes]:
        """Every file the run directory gets, by its path there."""
        out = {name: path.read_bytes() for name, path, _ in self._sources()}
        return {**out, **self.generated, REPORTING_NAME: REPORTING_PATH.read_bytes()}

    def _sources(self) -> list[tuple[str, Path, str]]:
        """(place in the run directory, file here, path given) of every file copied, once."""
        out = {}  # (place, real file) -> the first (place, file, path given)
        for place, path in [(self.name, self.path), *((_place(f), f) for f in self.files)]:
            for name, file in _walk(place, Path(path)):
                out.setdefault((name, os.path.realpath(file)), (name, file, str(path)))
        return list(out.values())

    def command(self, run_dir: str | os.PathLike) -> list[str]:
        """The script and its arguments as torchrun runs them, with ``run_dir`` its folder."""
        folder = str(run_dir).rstrip("/")
        args = [f"{folder}/{a}" if a in self.generated else a for a in self.args]
        return [f"{folder}/{self.name}", *args]

    @classmethod
    def worker(cls, config, path: str | os.PathLike | None = None) -> Script:
        """ddpnb's tutorial worker as a Script: ``train_ddp.py --config config.json``.

        ``path``: another version of the worker to run under that name (notebook 06's pitfalls).
        """
        from .source import WORKER_PATH

        constants = Path(__file__).with_name("constants.py").read_bytes()
        return cls(
            path or WORKER_PATH,
            args=("--config", "config.json"),
            rename="train_ddp.py",
            generated={"config.json": config.to_json().encode(), CONSTANTS_NAME: constants},
        )


def _place(path: str | os.PathLike) -> str:
    """Where ``path`` lands in the run directory (see :class:`Script`)."""
    if Path(path).is_absolute():
        return Path(path).name
    place = Path(os.path.normpath(path)).as_posix()
    if place == "." or place.split("/")[0] == "..":
        raise ConfigError(
            f"{path}: not inside the current folder ({os.getcwd()}). A relative path keeps its "
            "place in the run directory, so it must name something inside the current folder: "
            "pass it as an absolute path (it lands at the top of the run directory), or run "
            "from the folder above and name it from there. Nothing was started."
        )
    return place


def _walk(place: str, path: Path) -> list[tuple[str, Path]]:
    """A file, or a folder's files (not in __pycache__, no broken links), by place."""
    if not path.is_dir():
        return [(place, path)]
    files = (f.relative_to(path) for f in sorted(path.rglob("*")) if f.is_file())
    return [(f"{place}/{f.as_posix()}", path / f) for f in files if "__pycache__" not in f.parts]


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 1e5 else f"{n / 1e3:.1f} kB"


def _compile(path: Path) -> None:
    """ConfigError naming the file, line and text of a syntax error (nothing has started)."""
    try:
        compile(path.read_bytes(), str(path), "exec", dont_inherit=True)
    except SyntaxError as e:
        text = (e.text or "").rstrip()
        caret = " " * max((e.offset or 1) - 1 - (len(text) - len(text.lstrip())), 0) + "^"
        raise ConfigError(
            f"{path.name}, line {e.lineno}: SyntaxError: {e.msg}\n    {text.strip()}\n    {caret}\n"
            "Fix the script and launch again: nothing was started."
        ) from None
    except ValueError as e:  # a null byte: not a Python file
        raise ConfigError(f"{path}: not a Python source file ({e}).") from None


def script_options(parser) -> None:
    """``--file`` and ``--max-copy-mb``: what ``ddpnb run`` and ``ddpnb check-script`` copy."""
    parser.add_argument(
        "--file",
        action="append",
        default=[],
        metavar="PATH",
        help="a file or folder the script needs (a module, a package, a config, small data); "
        "a relative path keeps its place, relative to the current folder (data/a.bin lands as "
        "RUN_DIR/data/a.bin), an absolute one lands at the top of the run directory; repeat",
    )
    parser.add_argument(
        "--max-copy-mb",
        type=float,
        default=MAX_COPY_MB,
        metavar="MB",
        help=f"refuse to copy more than this of the script and its files (default "
        f"{MAX_COPY_MB:g}); large data belongs on a shared filesystem, named in SCRIPT_ARGS",
    )
