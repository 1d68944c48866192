"""Live progress: an ipywidgets panel in JupyterLab, a few plain lines elsewhere."""

from __future__ import annotations

import contextlib
import io
import os
import sys
import time
from html import escape
from pathlib import Path
from typing import Any, Protocol

from .errors import RunHung
from .hang import TITLES
from .metrics import RunMetrics, read_jsonl, read_progress


class Followed(Protocol):
    """What a display reads of a running job (``ddpnb.Job`` has it): no import of job.py."""

    run_dir: Path
    epochs: int | None  # how many epochs the run trains, when it says
    error: BaseException | None
    started_at: float
    ended_at: float | None
    nnodes: int
    nproc_per_node: int
    world_size: int
    master_addr: str
    master_port: int
    waiting: Any  # the hang watch's verdict (ddpnb.hang.Verdict) while not "ok", else None

    def host(self, node: int) -> str | None: ...  # where it runs as named (SSH); None: here

    @property
    def metrics(self) -> RunMetrics: ...

    def node_status(self) -> dict[int, str]: ...


PLOT_INTERVAL = 1.0  # seconds between live-plot redraws at most
STATUS_COLORS = {
    "pending": "#6c71c4",  # queued by Slurm ("pending (Resources)")
    "starting": "#b58900",
    "running": "#268bd2",
    "waiting": "#cb4b16",  # its ranks wait in a collective (the hang watch, before its limit)
    "done": "#2aa160",
    "failed": "#dc322f",
    "hung": "#d33682",  # every rank waits in a collective and none moves
}
# The hang watch's verdicts, shown: ranks wait (before the limit), hang, or a slow phase.
WAITING_COLORS = {"waiting": "#cb4b16", "hang": "#d33682", "slow": "#b58900"}
HUNG_STOPPED = "stopped (on_hang='stop'); the RunHung error says where each rank waits."
BORDER = "1px solid var(--jp-border-color1, #ccc)"

# A PNG cannot follow JupyterLab's theme: in a dark theme invert it (hues kept), not a white block.
DARK_THEME_CSS = (
    "<style>body[data-jp-theme-light='false'] .ddpnb-plot"
    " { filter: invert(0.87) hue-rotate(180deg); }</style>"
)


def _program(argv: list[str]) -> str:
    """The program a command line runs: its ``-m`` module or script, else the executable."""
    args = iter(argv[1:])
    for arg in args:
        if arg == "-m":
            return next(args, "")
        if arg in ("-X", "-W"):  # options that take a value
            next(args, None)
        elif not arg.startswith("-"):
            return os.path.basename(arg)
    return os.path.basename(argv[0]) if argv else ""


def is_jupyter_server(argv: list[str]) -> bool:
    """True for a Jupyter server's command line (lab, notebook, hub), by program name only."""
    names = {os.path.basename(argv[0]) if argv else "", _program(argv)}
    runners = ("nbconvert", "papermill", "nbclient", "execute")
    return any(n.startswith("jupyter") or n == "notebook" for n in names) and not any(
        r in n for n in names for r in runners
    )


def _live_frontend() -> bool:
    """True inside a kernel that a Jupyter frontend (not papermill/nbconvert) drives."""
    shell = sys.modules.get("IPython") and sys.modules["IPython"].get_ipython()
    if shell is None or type(shell).__name__ != "ZMQInteractiveShell":
        return False
    try:
        with open(f"/proc/{os.getppid()}/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return True  # not Linux: trust the kernel type
    return is_jupyter_server(argv)


def make_progress(mode: str, job: Followed):
    """The display for ``mode`` ('auto', 'widgets', 'text', 'none')."""
    mode = os.environ.get("DDPNB_PROGRESS", mode) if mode == "auto" else mode
    if mode == "auto":
        mode = "widgets" if _live_frontend() else "text"
    if mode == "widgets":
        try:
            return WidgetProgress(job)
        except ImportError:
            mode = "text"
    return TextProgress(job) if mode == "text" else NoProgress()


class NoProgress:
    def update(self) -> None:
        pass

    def close(self, job: Followed) -> None:
        pass


EPOCH_FIELDS = (  # how an epoch row's numbers print, in order; a script may report any
    ("train_loss", "train_loss {:.4f}"),
    ("train_acc", "train_acc {:.3f}"),
    ("val_loss", "val_loss {:.4f}"),
    ("val_acc", "val_acc {:.3f}"),
    ("images_per_second", "{:.0f} img/s"),
    ("epoch_seconds", "{:.1f} s"),
)


def _epoch_line(row: dict, epochs: int | None) -> str:
    parts = [f"epoch {row.get('epoch', '?')}/{epochs or '?'}"]
    parts += [fmt.format(row[k]) for k, fmt in EPOCH_FIELDS if isinstance(row.get(k), (int, float))]
    known = {"epoch", "world_size", "restart_count", *(k for k, _ in EPOCH_FIELDS)}
    # A script's own numbers (ddpnb's worker reports only the fields above).
    own = [f"{k} {v:.4g}" for k, v in row.items() if k not in known and type(v) in (int, float)]
    parts += own[:4]
    if row.get("restart_count"):
        parts.append(f"(restart {row['restart_count']})")
    return "  ".join(parts)


def _verdict(job: Followed):
    """The hang watch's verdict to show while not "ok"; None once it stopped the run: the
    RunHung raised says it then (its message, ``e.stacks``), so that it is said once."""
    return None if isinstance(job.error, RunHung) else job.waiting


def _start_line(job: Followed) -> str:
    hosts = [job.host(n) for n in range(job.nnodes)]  # None: this machine
    return (
        f"ddpnb: {job.nnodes} node(s) x {job.nproc_per_node} process(es) = world size "
        f"{job.world_size}; node 0 is the master and hosts the rendezvous at "
        f"{job.master_addr}:{job.master_port}; run dir {job.run_dir}"
        + (f"; hosts {', '.join(hosts)}" if all(hosts) else "")
    )


def _finish_line(job: Followed) -> str:
    seconds = (job.ended_at or time.time()) - job.started_at
    if isinstance(job.error, KeyboardInterrupt):  # the user's choice, not a failure
        return f"ddpnb: run interrupted after {seconds:.1f} s; every process of it was stopped"
    if job.error is not None:
        return f"ddpnb: run FAILED after {seconds:.1f} s ({type(job.error).__name__})"
    final = job.metrics.final
    acc = f", final val_acc {final['val_acc']:.4f}" if "val_acc" in final else ""
    return f"ddpnb: run finished in {seconds:.1f} s{acc}"


class TextProgress:
    """A start line, a line per epoch, a finish line."""

    def __init__(self, job: Followed) -> None:
        self.job = job
        self.printed = 0
        self.said: str | None = None  # the hang watch's verdict kind last printed
        print(_start_line(job), flush=True)

    def update(self) -> None:
        rows = read_jsonl(self.job.run_dir / "metrics.jsonl")
        for row in rows[self.printed :]:
            print(_epoch_line(row, self.job.epochs), flush=True)
        self.printed = max(self.printed, len(rows))
        waiting = _verdict(self.job)
        kind = waiting.kind if waiting is not None else None
        if kind != self.said and kind in WAITING_COLORS:
            print(f"ddpnb: {TITLES[kind].lower()}: {waiting.message}", flush=True)
        self.said = kind

    def close(self, job: Followed) -> None:
        self.update()
        print(_finish_line(job), flush=True)


def _named(widget, name: str):
    """``widget`` with the CSS class ``ddpnb-<name>``, which names it to the browser test."""
    widget.add_class(f"ddpnb-{name}")
    return widget


class WidgetProgress:
    """One row per node, epoch and step bars, and a live loss/accuracy plot."""

    def __init__(self, job: Followed) -> None:
        import ipywidgets as w
        from IPython.display import display

        self.job = job
        self.plotted, self.plot_updates = -1, 0
        self.last_plot = self.busy_said = 0.0
        self.title = w.HTML(f"<b>{_start_line(job)}</b>")
        self.node_rows = [_named(w.HTML(), "node") for _ in range(job.nnodes)]

        def bar(name: str, top: int):
            kw = dict(description=name, bar_style="info", layout=w.Layout(width="60%"))
            return _named(w.IntProgress(max=top, **kw), f"{name}-bar")

        self.epoch_bar, self.step_bar = bar("epoch", job.epochs or 1), bar("step", 1)
        self.status = _named(w.HTML(), "status")
        self.waiting = _named(w.HTML(), "hang")  # the hang watch: a hang or a slow phase, named
        # Hidden until its first picture: an empty image shows as a broken-image icon.
        hidden = w.Layout(max_width="720px", display="none")
        self.plot = _named(w.Image(format="png", layout=hidden), "plot")
        box = w.Layout(border=BORDER, padding="4px", max_height="220px", overflow="auto")
        bars = [self.epoch_bar, self.step_bar]
        parts = [w.HTML(DARK_THEME_CSS), self.title, w.VBox(self.node_rows, layout=box), *bars]
        self.panel = _named(w.VBox([*parts, self.status, self.waiting, self.plot]), "progress")
        display(self.panel)
        self.update()

    def _set_nodes(self) -> None:
        steps = self.job.steps()  # the run's optimizer steps, from the hang watch
        for n, state in self.job.node_status().items():
            color = STATUS_COLORS.get(state.split(" ")[0], "#888")  # grey: stopped, external
            per, first = self.job.nproc_per_node, n * self.job.nproc_per_node
            ranks = f"rank {first}" if per == 1 else f"ranks {first}-{first + per - 1}"
            role = f" on {escape(host)}" if (host := self.job.host(n)) else ""  # SSH's hosts
            role += " (master, hosts the rendezvous)" if n == 0 else ""
            last = escape(self.job.last_line(n)[:200])  # the node's latest line; CSS cuts its end
            if steps is not None:
                last = f"{steps} optimizer steps · {last}"
            elapsed = (self.job.ended_at or time.time()) - self.job.started_at
            # One line however narrow the panel (a file browser open beside it): the last
            # line takes the room that is left and its end is cut.
            html = (
                "<div style='display:flex;align-items:baseline;gap:0.35em;white-space:nowrap'>"
                f"<span style='flex:none;min-width:5.5em'>node {n}</span>"
                f"<span style='flex:none;background:{color};color:white;border-radius:3px;"
                f"padding:0 6px;min-width:5em;text-align:center'>{state}</span>"
                f"<span class='ddpnb-elapsed' style='flex:none;min-width:3.5em;"
                f"text-align:right'>{elapsed:.0f} s</span>"
                f"<span style='flex:none;opacity:0.8'>{ranks}{role}</span>"
                f"<code class='ddpnb-last-line' style='flex:0 1 42em;min-width:0;opacity:0.7;"
                f"font-size:85%;overflow:hidden;text-overflow:ellipsis'>{last}</code></div>"
            )
            if self.node_rows[n].value != html:
                self.node_rows[n].value = html

    def _set_waiting(self) -> None:
        verdict, html = _verdict(self.job), ""
        kind, text = (verdict.kind, escape(verdict.message)) if verdict is not None else (None, "")
        if isinstance(self.job.error, RunHung):  # the error's message is the paragraph
            kind, text = "hang", HUNG_STOPPED
        if kind in WAITING_COLORS:
            html = (
                f"<div style='border-left:4px solid {WAITING_COLORS[kind]};padding:2px 8px;"
                f"margin:4px 0'><b>{TITLES[kind]}</b>: {text}</div>"
            )
        if self.waiting.value != html:
            self.waiting.value = html

    def update(self) -> None:
        now = time.monotonic()
        if now - self.busy_said >= 1.0:  # the widgets' subshell says "idle" while the cell runs
            self.busy_said = now
            with contextlib.suppress(Exception):  # another kernel: only JupyterLab's label is off
                sys.modules["IPython"].get_ipython().kernel._publish_status("busy", "shell")
        self._set_nodes()
        self._set_waiting()
        prog = read_progress(self.job.run_dir)
        rows = read_jsonl(self.job.run_dir / "metrics.jsonl")
        if prog.get("phase") in ("train", "done") and "steps" in prog:
            self.epoch_bar.max = max(1, self.job.epochs or prog.get("epochs") or 1)
            self.step_bar.max = max(1, prog["steps"])
            self.step_bar.value = prog["step"]
            self.epoch_bar.value = len(rows)
            loss = f" loss {prog['loss']:.4f}" if "loss" in prog else ""
            self.status.value = (
                f"epoch {prog['epoch']}/{prog['epochs']}, step {prog['step']}/{prog['steps']}{loss}"
            )
        if len(rows) != self.plotted and now - self.last_plot > PLOT_INTERVAL and rows:
            from .plot import plot_curves

            fig = plot_curves(RunMetrics(self.job.run_dir, rows, {}, {}))
            fig.set_size_inches(7.2, 2.9)
            for ax in fig.axes:  # the run's whole range of epochs, filled as they end
                ax.set_xlim(0.5, max(self.job.epochs or len(rows), 1) + 0.5)
            buf = io.BytesIO()
            fig.savefig(buf, format="png", dpi=90)
            self.plot.value, self.plot.layout.display = buf.getvalue(), None
            self.plotted, self.last_plot = len(rows), now
            self.plot_updates += 1

    def close(self, job: Followed) -> None:
        self.last_plot = 0.0
        self.update()
        stopped = isinstance(job.error, KeyboardInterrupt)
        for bar in (self.epoch_bar, self.step_bar):
            bar.bar_style = "warning" if stopped else "success" if job.error is None else "danger"
            if job.error is None:
                bar.value = bar.max
        self.status.value = _finish_line(job)
