"""Drive a private JupyterLab server, and find the processes a run left.

Nothing is downloaded: the server is this interpreter's JupyterLab, the browser is Debian's
``chromium`` driven by Playwright's Python package (never ``playwright install``).
"""

from __future__ import annotations

import json
import os
import re
import secrets
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import nbformat

from ddpnb.agent import descendants
from ddpnb.constants import free_port
from ddpnb.scheduler import alive

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",  # containers' small /dev/shm crashes tabs otherwise
]
INSTALL_HINT = (
    "The browser tests need Debian's chromium at /usr/bin/chromium "
    "(sudo apt-get install -y chromium) and Playwright's Python package "
    "(pip install -e '.[test]'); never run 'playwright install'. .ci/run installs both."
)
# The test's own user setting: every cell in the DOM (no windowing) so the test can find
# them all. The news and update pop-ups are turned off by `make lab` itself (its overrides).
LAB_SETTINGS = {
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none"},
}
VENV = Path(sys.prefix)  # make lab's .venv when the tests run from it, as make test does


def artifacts_dir() -> Path:
    """Where screenshots go: $DDPNB_BROWSER_ARTIFACTS or runs/browser-artifacts/."""
    path = Path(os.environ.get("DDPNB_BROWSER_ARTIFACTS", REPO / "runs" / "browser-artifacts"))
    path.mkdir(parents=True, exist_ok=True)
    return path


def with_parameters(src: Path, dst: Path, **values) -> Path:
    """Copy a notebook, changing only the values in its ``parameters`` cell."""
    nb = nbformat.read(src, as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    lines, missing = [], dict(values)
    for line in cell.source.splitlines():
        m = re.match(r"^(\w+) = .*?(\s+#.*)?$", line)
        if m and m.group(1) in missing:
            line = f"{m.group(1)} = {missing.pop(m.group(1))!r}{m.group(2) or ''}"
        lines.append(line)
    assert not missing, f"{src.name} has no parameters {sorted(missing)}"
    cell.source = "\n".join(lines)
    nbformat.write(nb, dst)
    return dst


def training_pids(runs: Path) -> list[int]:
    """PIDs of torchrun agents and workers of runs under ``runs`` (their cmdline names it)."""
    marker = str(runs).encode()
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmdline = f.read()
        except OSError:
            continue
        if marker in cmdline:
            pids.append(int(entry))
    return pids


# Loopback requests must not go through an http_proxy from the environment (CI runners).
_NO_PROXY = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class Lab:
    """``make lab`` on a free loopback port, serving ``root`` (its ``LAB_DIR``).

    The server is started by the Makefile's own ``lab`` target, so it gets the same
    options, overrides and notebook copies a participant gets; only the port and token
    are added (``LAB_ARGS``).
    """

    def __init__(self, root: Path, home: Path) -> None:
        self.root = root
        self.port = free_port()
        self.token = secrets.token_hex(16)
        self.url = f"http://127.0.0.1:{self.port}"
        settings = home / "lab-settings"
        for name, value in LAB_SETTINGS.items():
            (settings / name).parent.mkdir(parents=True, exist_ok=True)
            (settings / name).write_text(json.dumps(value))
        drop = ("DDPNB_PROGRESS", "MAKEFLAGS", "MFLAGS", "MAKELEVEL")  # a make test's own
        env = {k: v for k, v in os.environ.items() if k not in drop}
        env.update(
            PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])),
            JUPYTERLAB_SETTINGS_DIR=str(settings),
            JUPYTERLAB_WORKSPACES_DIR=str(home / "workspaces"),
            JUPYTER_RUNTIME_DIR=str(home / "runtime"),
        )
        lab_args = [
            f"--port={self.port}",
            "--ServerApp.port_retries=0",
            f"--IdentityProvider.token={self.token}",
            "--LabApp.extension_manager=readonly",  # no PyPI queries
        ]
        self.log_path = home / "lab.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    "make",
                    "--no-print-directory",
                    "-C",
                    str(REPO),
                    "-o",
                    f"{VENV}/.installed",  # installed already: never reinstall from a test
                    f"VENV={VENV}",
                    f"LAB_DIR={root}",
                    f"LAB_ARGS={' '.join(lab_args)}",
                    "lab",
                ],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.pids_seen: set[int] = {self.proc.pid}
        try:
            self._wait_ready(timeout=60)
        except BaseException:  # no fixture teardown runs for a server that never started
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            raise

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"JupyterLab exited:\n{self.log_path.read_text()[-3000:]}")
            try:
                self.api("status")
                return
            except OSError:
                time.sleep(0.3)
        raise RuntimeError(f"JupyterLab not ready in {timeout} s:\n{self.log_path.read_text()}")

    def api(self, path: str) -> dict | list:
        """GET the server's REST API, e.g. ``api("sessions")``."""
        req = urllib.request.Request(
            f"{self.url}/api/{path}", headers={"Authorization": f"token {self.token}"}
        )
        with _NO_PROXY.open(req, timeout=10) as r:
            return json.loads(r.read())

    def remember_pids(self) -> None:
        """Note the server's processes (kernels and what they started) to check later."""
        if self.proc.poll() is None:
            self.pids_seen.update(descendants(self.proc.pid))

    def shutdown(self, timeout: float = 20) -> float:
        """Shut the server down as Ctrl-C would; return the seconds it took."""
        self.remember_pids()
        t = time.monotonic()
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # jupyter shuts its kernels down on TERM
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                pass
        return time.monotonic() - t

    def kill_leftovers(self) -> None:
        for pid in sorted(self.pids_seen | set(training_pids(self.root / "runs"))):
            if alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
