"""Papermill batch runs: one notebook over a grid of parameters, gathered in one table."""

from __future__ import annotations

import ast
import contextlib
import csv
import hashlib
import io
import itertools
import json
import os
import re
import shutil
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .metrics import load_metrics, read_json
from .tables import Table

#: Notebook parameters that name where runs are written: pointed inside ``DIR/<point>/``.
RUN_DIR_PARAMETERS = ("run_dir", "run_root")
#: The final-epoch numbers each row shows (``metrics.jsonl``'s names).
METRICS = ("val_acc", "val_loss", "images_per_second", "world_size")
#: What a row says besides the parameters; a parameter of the same name is prefixed.
RESULT_KEYS = ("point", "status", "wall_s", *METRICS, "error", "notebook")
STATE = ".ddpnb"  # DIR/.ddpnb/<point>.json: each point's record
INTERRUPT_GRACE = 10.0  # seconds an interrupted cell has to stop its run before the kill
MAX_NAME = 100  # characters of a point's name (file names stay well under 255 bytes)


def resolve_type(text: str) -> Any:
    """A ``-p`` value as papermill's CLI reads it: True, False, None, an int, a float, or text."""
    if text in ("True", "False", "None"):
        return ast.literal_eval(text)
    for kind in (int, float):
        with contextlib.suppress(ValueError):
            return kind(text)
    return text


def parse_axis(name: str, text: str) -> list[Any]:
    """The values of ``-g NAME V1,V2,...``, each read as a ``-p`` value."""
    items = [item.strip() for item in text.split(",")]
    if not any(items):
        raise ConfigError(
            f"-g {name} {text!r} has no values: give one or more, comma-separated "
            f"(-g {name} 32,64), or set a single value with -p {name} VALUE."
        )
    if not all(items):
        raise ConfigError(
            f"-g {name} {text!r} has an empty value: remove the extra comma "
            f"({','.join(i for i in items if i)!r})."
        )
    return [resolve_type(item) for item in items]


def _text(value: Any) -> str:
    if value is None or isinstance(value, (str, bool, int, float)):
        return str(value)
    return json.dumps(value, default=str, separators=(",", ":"))


def point_names(points: Sequence[Mapping[str, Any]], default: str) -> list[str]:
    """A readable, file-system-safe, distinct name per point (``default`` without a grid)."""
    raw = [",".join(f"{k}={_text(v)}" for k, v in p.items()) or default for p in points]
    hashed = lambda name, r: f"{name[: MAX_NAME - 9]}-{hashlib.sha1(r.encode()).hexdigest()[:8]}"
    safe = [re.sub(r"[^A-Za-z0-9._+=,-]", "_", r).lstrip(".") or "point" for r in raw]
    names = [hashed(n, r) if len(n) > MAX_NAME else n for n, r in zip(safe, raw)]
    for i, name in enumerate(names):
        if names.count(name) > 1:  # two values made safe alike: tell them apart
            names[i] = hashed(name, raw[i])
    return names


class Point:
    """One point of a sweep: its values, parameters, and where its outputs go."""

    def __init__(self, name: str, values: dict, parameters: dict, out_dir: Path, cwd: Path):
        self.name, self.values, self.parameters, self.cwd = name, values, parameters, cwd
        self.notebook = out_dir / f"{name}.ipynb"
        self.folder = out_dir / name
        self.record_path = out_dir / STATE / f"{name}.json"

    def run_dirs(self) -> list[Path]:
        """The run directories (with a ``metrics.jsonl``) of ``run_dir`` or ``run_root``."""
        found = []
        for name, pattern in zip(RUN_DIR_PARAMETERS, ("metrics.jsonl", "*/metrics.jsonl")):
            value = self.parameters.get(name)
            if isinstance(value, str) and value:
                found += sorted(m.parent for m in (self.cwd / value).glob(pattern) if m.is_file())
        return found

    def final(self) -> dict:
        """The last epoch's numbers of its run ({} unless it has exactly one)."""
        runs = self.run_dirs()
        return load_metrics(runs[0]).final if len(runs) == 1 else {}

    def record(self) -> dict:
        return read_json(self.record_path)

    def write_record(self, **record: Any) -> None:
        self.record_path.parent.mkdir(parents=True, exist_ok=True)
        text = json.dumps({"point": self.name, **record}, indent=1, default=str) + "\n"
        _write(self.record_path, text)

    def is_done(self) -> bool:
        return self.record().get("status") == "done" and self.notebook.is_file()


def _write(path: Path, text: str) -> None:
    """Write through a temporary file, so that a reader never sees half of it."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, newline="")
    os.replace(tmp, path)


def notebook_parameters(notebook: Path) -> dict[str, Any]:
    """The ``parameters`` cell's names and defaults (``None`` where not a plain literal)."""
    import papermill

    try:
        found = papermill.inspect_notebook(str(notebook))
    except Exception as e:  # not JSON, not a notebook, no kernelspec papermill knows
        raise ConfigError(f"Cannot read notebook {notebook}: {e}. Give a Jupyter notebook.") from e
    defaults = dict.fromkeys(found)
    for name, info in found.items():
        with contextlib.suppress(ValueError, SyntaxError):
            defaults[name] = ast.literal_eval(info.get("default") or "None")
    return defaults


def _check_names(notebook: Path, known: dict, grid: Mapping, parameters: Mapping) -> None:
    if both := sorted(set(grid) & set(parameters)):
        raise ConfigError(
            f"{both[0]!r} is given both as a fixed parameter (-p) and as a grid axis (-g): "
            "keep one of them."
        )
    if unknown := [n for n in [*parameters, *grid] if n not in known]:
        raise ConfigError(
            f"{notebook} has no parameter {unknown[0]!r}. Its parameters cell names: "
            f"{', '.join(known)}."
            if known
            else f"{notebook} has no cell tagged 'parameters', so it takes none ({unknown[0]!r} "
            "given): tag its first code cell 'parameters' (Jupyter: View > Cell Toolbar > Tags)."
        )
    for name, values in grid.items():
        if isinstance(values, (str, bytes)) or not isinstance(values, Sequence):
            raise ConfigError(
                f"grid[{name!r}] must be a list of values, got {values!r}: e.g. "
                f"grid={{{name!r}: [32, 64]}}."
            )
        if not values:
            raise ConfigError(
                f"grid axis {name!r} has no values, so the sweep would have no points: give "
                "it one or more values, or leave it out."
            )


def plan(notebook: Path, out_dir: Path, grid: dict, parameters: dict, cwd: Path) -> list[Point]:
    """Every point of the sweep (absolute paths), checked; runs nothing. Raises ConfigError."""
    if not notebook.is_file():
        raise ConfigError(
            f"Notebook {notebook} does not exist: give the path of an .ipynb file "
            "(relative to the current folder)."
        )
    if out_dir.exists() and not out_dir.is_dir():
        raise ConfigError(f"--out {out_dir} is a file: give a folder for the sweep's outputs.")
    known = notebook_parameters(notebook)
    _check_names(notebook, known, grid, parameters)
    parameters = {
        k: os.fspath(v) if isinstance(v, os.PathLike) else v for k, v in parameters.items()
    }
    combos = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    points, seen = [], {}  # seen: (parameter, run directory) -> the point writing it
    for name, values in zip(point_names(combos, notebook.stem), combos):
        given = {**parameters, **values}
        for param in RUN_DIR_PARAMETERS:  # each point's runs inside its own folder
            if param in known and param not in given:
                default = known[param]
                leaf = Path(default).name if isinstance(default, str) and default else "run"
                given[param] = str(out_dir / name / leaf)
            if isinstance(value := given.get(param), str):
                key = (param, (cwd / value).resolve())
                if key in seen:
                    raise ConfigError(
                        f"Points {seen[key]} and {name} would both write {param}={value!r} "
                        f"and overwrite each other: leave {param} out (each point's run then goes "
                        f"into its own folder under the sweep's output folder), or make it a "
                        "grid axis with one value per point."
                    )
                seen[key] = name
        points.append(Point(name, values, given, out_dir, cwd))
    return points


def _check_existing(points: list[Point], notebook: Path) -> None:
    """Nothing a user produced is replaced, no point done redone otherwise (without ``overwrite``);
    a point that failed is retried, with the settings given now (a corrected data_dir)."""
    for point in points:
        if not (record := point.record()):
            if taken := [p for p in (point.notebook, point.folder) if p.exists()]:
                raise ConfigError(
                    f"{taken[0]} exists and was not written by a sweep: move it, choose another "
                    "output folder, or pass overwrite=True (--overwrite) to replace it."
                )
            continue
        if record.get("status") != "done":
            continue  # a failed or stopped point is run again, with the settings given now
        changed = []
        if record.get("notebook") != str(notebook):
            changed.append(f"notebook {record.get('notebook')} then, {notebook} now")
        # As they read back from a record: tuples become lists, paths text.
        given = (record.get("parameters") or {}, point.parameters)
        then, now = (json.loads(json.dumps(d, default=str)) for d in given)
        for name in dict.fromkeys([*then, *now]):
            if then.get(name, ...) != now.get(name, ...):
                before, after = (repr(d[name]) if name in d else "unset" for d in (then, now))
                changed.append(f"{name} {before} then, {after} now")
        if changed:
            raise ConfigError(
                f"Point {point.name} in {point.notebook.parent} was run with other settings "
                f"({'; '.join(changed)}): choose another output folder, or pass "
                "overwrite=True (--overwrite) to redo it with these."
            )


def _signal_kernels(managers: list, sig: int, skip: set[int] = frozenset()) -> set[int]:
    """Signal the process group of each kernel started so far (each leads its own)."""
    groups = {getattr(getattr(km, "provisioner", None), "pgid", None) for km in managers}
    groups -= {None, 0, *skip}
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
    return groups


def _stop_point(managers: list, finished: threading.Event, grace: float) -> None:
    """Interrupt the kernel (a ddpnb run in it stops); kill it after ``grace`` s or a 2nd Ctrl-C."""
    interrupted: set[int] = set()
    deadline = time.monotonic() + grace
    with contextlib.suppress(KeyboardInterrupt):
        while not finished.is_set() and time.monotonic() < deadline:
            interrupted |= _signal_kernels(managers, signal.SIGINT, skip=interrupted)
            finished.wait(0.2)
    _signal_kernels(managers, signal.SIGKILL)
    with contextlib.suppress(KeyboardInterrupt):
        finished.wait(2.0)  # papermill notices and writes the notebook as far as it ran


def _first_line(error: BaseException) -> str:
    name, value = type(error).__name__, str(error)
    if getattr(error, "ename", None) is not None:  # papermill's: the cell's own exception
        name, value = str(error.ename), getattr(error, "evalue", None)
    text = f"{name}: {value}" if value else name
    return next((ln.strip() for ln in text.splitlines() if ln.strip()), type(error).__name__)


def ipc_kernel_manager():
    """A kernel manager whose kernel talks over local IPC sockets, not loopback TCP (over
    TCP every kernel warns that its traffic is unencrypted; IPC sockets are user-only files)."""
    from jupyter_client.manager import AsyncKernelManager

    class IpcKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            self.transport = "ipc"

    return IpcKernelManager


def _run_point(point: Point, source: Path, timeout: float | None, kernel_name: str | None) -> str:
    """Run one point (its folder cleared first) in a thread, so that Ctrl-C reaches this one;
    its record says how it went."""
    import papermill

    if point.folder.is_dir() and point.record():  # ours: a failed or redone point's runs
        shutil.rmtree(point.folder)
    point.folder.mkdir(parents=True, exist_ok=True)
    base = {"notebook": str(source), "parameters": point.parameters}
    point.write_record(status="running", **base)
    managers: list = []  # every kernel manager the run creates
    outcome: list[BaseException] = []
    # An Event, not Thread.join: before Python 3.13 a join interrupted by Ctrl-C can mark
    # the thread as ended while it still runs (the bpo-45274 branch of _wait_for_tstate_lock).
    finished = threading.Event()

    class Recording(ipc_kernel_manager()):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            managers.append(self)

    def run() -> None:
        try:
            papermill.execute_notebook(
                str(source),
                str(point.notebook),
                parameters=point.parameters,
                kernel_name=kernel_name,
                execution_timeout=timeout,
                cwd=str(point.cwd),
                progress_bar=False,
                kernel_manager_class=Recording,
            )
        except BaseException as e:  # noqa: BLE001 - reported in the table
            outcome.append(e)
        finally:
            finished.set()

    start, status, error = time.monotonic(), "interrupted", "interrupted"
    try:  # Ctrl-C leaves the point interrupted
        threading.Thread(target=run, name=f"ddpnb-sweep {point.name}", daemon=True).start()
        try:
            finished.wait()
        except KeyboardInterrupt:
            _stop_point(managers, finished, INTERRUPT_GRACE)
            raise
        error = _first_line(outcome[0]) if outcome else ""
        status = "failed" if error else "done"
    finally:
        point.write_record(status=status, wall_s=time.monotonic() - start, error=error, **base)
    return status


class SweepResult(Table):
    """The sweep's table, one row per point as in ``summary.csv``; ``figure``: ``curves.png``."""

    def __init__(self, rows, out_dir: Path, axes: list[str], fixed: dict, runs: dict):
        super().__init__(rows)
        self.out_dir, self.axes, self.fixed, self.runs = out_dir, axes, fixed, runs
        self.summary = out_dir / "summary.csv"
        self.figure: Path | None = None

    @property
    def ok(self) -> bool:
        return all(row["status"] in ("done", "skipped") for row in self)

    def shown(self, *more: str) -> Table:
        keys = ["point", *self.axes, "status", "wall_s", *METRICS, *more]
        return Table({k: row.get(k, "") for k in keys} for row in self)

    def __str__(self) -> str:
        lines = [str(self.shown())]
        lines += [f"{r['point']}: {r['error']}" for r in self if r["status"] == "failed"]
        lines.append(f"table: {_shown(self.summary)}")
        if self.figure:
            lines.append(f"curves: {_shown(self.figure)}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        fixed = ", ".join(f"{k}={_text(v)}" for k, v in self.fixed.items())
        caption = f"sweep in {self.out_dir}" + (f"; fixed: {fixed}" if fixed else "")
        return self.shown("error").html(caption)

    def curves(self):
        """Every point's run curves in one Figure, labelled by point; ``None`` while none."""
        from .plot import plot_curves

        runs = [(name, path, len(paths)) for name, paths in self.runs.items() for path in paths]
        labels = [name if n == 1 else f"{name}/{Path(path).name}" for name, path, n in runs]
        return plot_curves([path for _, path, _ in runs], labels=labels) if runs else None


def _shown(path: Path) -> str:
    """``path`` relative to the current folder when it lies below it."""
    return str(path.relative_to(os.getcwd()) if path.is_relative_to(os.getcwd()) else path)


def _row(point: Point, status: str) -> dict:
    record, final = point.record(), point.final()
    params = {
        (f"parameter {k}" if k in RESULT_KEYS else k): _text(v) for k, v in point.parameters.items()
    }
    wall = record.get("wall_s")
    ran = isinstance(wall, (int, float)) and status != "not run"
    # The grid's values keep their type (numbers line up right).
    return {"point": point.name, **params, **point.values} | dict(
        status=status,
        wall_s=round(wall, 1) if ran else "",
        **{k: final.get(k, "") for k in METRICS},
        error=record.get("error", "") if status == "failed" else "",
        notebook=point.notebook.name if point.notebook.exists() else "",
    )


def _gather(points: list[Point], statuses: dict, grid: Mapping, fixed: Mapping, draw: bool = True):
    """The table as it stands, written to summary.csv; with ``draw``, curves.png too."""
    rows = [_row(p, statuses.get(p.name) or ("done" if p.is_done() else "not run")) for p in points]
    out_dir = points[0].notebook.parent
    text = io.StringIO()
    writer = csv.DictWriter(text, list(dict.fromkeys(k for row in rows for k in row)))
    writer.writeheader()
    writer.writerows(rows)
    _write(out_dir / "summary.csv", text.getvalue())
    runs = {p.name: p.run_dirs() for p in points}
    result = SweepResult(rows, out_dir, list(grid), dict(fixed), runs)
    fig = result.curves() if draw else None  # a pure function of the points' run directories
    if fig is not None:
        result.figure = out_dir / "curves.png"
        fig.savefig(result.figure, dpi=110)
    return result


def _say(point: Point, index: int, total: int, status: str) -> None:
    record = point.record()
    wall = record.get("wall_s") or 0.0
    if status == "skipped":
        text = f"skipped: done before ({point.notebook.name})"
    elif status == "failed":
        text = f"failed after {wall:.0f} s: {record.get('error')} (see {_shown(point.notebook)})"
    else:
        final = point.final()
        figures = f": val_acc {final['val_acc']:.4f}" if "val_acc" in final else ""
        text = f"done in {wall:.0f} s{figures}"
    print(f"[{index}/{total}] {point.name}: {text}", flush=True)


def sweep(
    notebook: str | os.PathLike,
    out_dir: str | os.PathLike,
    grid: Mapping[str, Sequence[Any]] | None = None,
    parameters: Mapping[str, Any] | None = None,
    *,
    overwrite: bool = False,
    timeout: float | None = 3600,
    kernel_name: str | None = None,
    cwd: str | os.PathLike | None = None,
) -> SweepResult:
    """Run ``notebook`` with papermill once per point of ``grid`` (``{name: [values...]}``;
    ``parameters`` hold for every point) into ``out_dir/<point>.ipynb`` and ``out_dir/<point>/``
    (where ``run_dir`` or ``run_root`` point when not given); gather one table.

    ``overwrite``: redo the points done (a rerun skips them, retries failed ones) and replace
    outputs a sweep did not write. ``timeout``: seconds per cell (``None``: no limit). ``cwd``:
    the folder the notebooks run in. A failed point does not stop the others (``result.ok``).
    """
    cwd = Path(cwd or os.getcwd()).resolve()
    source, out_dir = (Path(os.path.normpath(cwd / path)) for path in (notebook, out_dir))
    grid, parameters = dict(grid or {}), dict(parameters or {})
    points = plan(source, out_dir, grid, parameters, cwd)
    if not overwrite:
        _check_existing(points, source)
    out_dir.mkdir(parents=True, exist_ok=True)
    statuses: dict[str, str] = {}
    for i, point in enumerate(points, 1):
        if point.is_done() and not overwrite:
            statuses[point.name] = "skipped"
        else:
            print(f"[{i}/{len(points)}] {point.name}: running", flush=True)
            try:
                statuses[point.name] = _run_point(point, source, timeout, kernel_name)
            except KeyboardInterrupt:
                statuses[point.name] = "interrupted"
                _gather(points, statuses, grid, parameters, draw=False)
                raise
        _say(point, i, len(points), statuses[point.name])
        result = _gather(points, statuses, grid, parameters)
    return result
