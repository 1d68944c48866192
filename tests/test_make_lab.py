"""``make lab`` in a terminal: Ctrl-C twice stops JupyterLab, as the README says; its own
terminals open in the lab's folder with the venv's ``ddpnb`` on PATH.

The server runs under a real pseudo-terminal (its controlling terminal), and Ctrl-C is
typed into it: the terminal, not the test, turns it into SIGINT for the foreground
process group, as for a participant at a keyboard.
"""

from __future__ import annotations

import fcntl
import os
import secrets
import select
import subprocess
import sys
import termios
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parent.parent
VENV = Path(sys.prefix)
CTRL_C = b"\x03"


def _read_until(fd: int, want: bytes, seen: bytearray, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while want not in seen:
        left = deadline - time.monotonic()
        assert left > 0, (
            f"{want!r} not printed within {timeout} s:\n{seen.decode(errors='replace')[-3000:]}"
        )
        ready, _, _ = select.select([fd], [], [], min(left, 0.5))
        if ready:
            try:
                seen += os.read(fd, 65536)
            except OSError:  # the terminal closed: the server is gone
                return


def _in_a_lab_terminal(port: int, token: str, command: str, want: str) -> str:
    """What ``command`` prints in a terminal opened as JupyterLab's launcher opens one (the
    file browser's folder, here its root '', as ``cwd``), until ``want`` is printed."""
    import asyncio
    import json
    import urllib.request

    from tornado.websocket import websocket_connect

    base = f"127.0.0.1:{port}"
    request = urllib.request.Request(
        f"http://{base}/api/terminals?token={token}",
        data=json.dumps({"cwd": ""}).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=20) as r:
        name = json.load(r)["name"]

    async def talk() -> str:
        ws = await websocket_connect(f"ws://{base}/terminals/websocket/{name}?token={token}")
        await ws.write_message(json.dumps(["stdin", f"{command}\r"]))
        said, deadline = "", time.monotonic() + 20
        while want not in said and time.monotonic() < deadline:
            message = await asyncio.wait_for(ws.read_message(), deadline - time.monotonic())
            kind, *rest = json.loads(message or '["disconnect"]')
            said += rest[0] if kind == "stdout" else ""
        ws.close()
        return said

    return asyncio.run(talk())


def test_ctrl_c_twice_stops_make_lab(tmp_path):
    from ddpnb.constants import free_port

    port, token = free_port(), secrets.token_hex(8)
    master, slave = os.openpty()

    def controlling_terminal() -> None:  # a session of its own, the pty its terminal
        os.setsid()
        fcntl.ioctl(slave, termios.TIOCSCTTY, 0)

    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    env["JUPYTER_RUNTIME_DIR"] = str(tmp_path / "runtime")
    env["SHELL"] = "/bin/sh"  # the terminals' shell: not this machine's ~/.bashrc (pyenv's)
    args = f"--port={port} --ServerApp.port_retries=0 --IdentityProvider.token={token}"
    proc = subprocess.Popen(
        ["make", "--no-print-directory", "-C", str(REPO), "-o", f"{VENV}/.installed",
         f"VENV={VENV}", f"LAB_DIR={tmp_path / 'lab'}", f"LAB_ARGS={args}", "lab"],
        stdin=slave, stdout=slave, stderr=slave, env=env, preexec_fn=controlling_terminal,
    )  # fmt: skip
    os.close(slave)
    seen = bytearray()
    try:
        _read_until(master, b"http://127.0.0.1:", seen, 90)
        # The README's commands typed in JupyterLab's terminal: in the lab's folder, the
        # venv's ddpnb on PATH.
        where = f"at {tmp_path / 'lab'} {VENV / 'bin' / 'ddpnb'} end"
        said = _in_a_lab_terminal(port, token, "echo at $(pwd) $(command -v ddpnb) end", where)
        assert where in said, said
        time.sleep(1)
        os.write(master, CTRL_C)
        _read_until(master, b"Shut down this Jupyter server", seen, 20)
        os.write(master, CTRL_C)
        code = proc.wait(timeout=30)  # no third key, no answer to the question
        _read_until(master, b"Shutting down", seen, 5)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
        os.close(master)
    text = seen.decode(errors="replace")
    # make stops with the interrupt too (-SIGINT); JupyterLab shut down cleanly first.
    assert code in (0, -2, 2, 130) and "Shutting down" in text, (code, text[-2000:])
    try:
        os.killpg(proc.pid, 0)
        left = True
    except ProcessLookupError:
        left = False
    assert not left, "a process of make lab's group outlived the two Ctrl-C"
