"""One run, checked: the script, its config (ddpnb's worker), the topology, each node's environment."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .config import TrainConfig
from .constants import threads_for_host
from .errors import ConfigError
from .hang import watch_env
from .preflight import as_config, check_progress
from .reporting import FAULT_ENV, RUN_DIR_ENV, parse_fault
from .script import Script, worker_script
from .topology import Topology

HANG_TIMEOUT = 60.0  # seconds without progress, a rank waiting in a collective: the run hangs
WATCH_INTERVAL = 2.0  # seconds between a worker's snapshots of its stack
FIRST_HOST = "<the first host>"  # master_addr on SSH hosts until ssh names the first one's


class Plan:
    """One run, checked: the script, its config (ddpnb's worker) and where it runs."""

    def __init__(
        self,
        what: Script | TrainConfig | Mapping[str, Any],
        topology: Topology,
        *,
        progress: str,
        env: Mapping[str, str] | None,
        resume: bool = False,
        overwrite: bool = False,
        hang_timeout: float | None = HANG_TIMEOUT,
        on_hang: str = "stop",
    ) -> None:
        if isinstance(what, Script):
            self.script, self.config = what, None
        else:
            self.config = as_config(what)
            self.script = worker_script(self.config)
        self.topology = topology
        self.progress = check_progress(progress)
        if env is not None and not (
            isinstance(env, Mapping)
            and all(isinstance(k, str) and isinstance(v, str) for k, v in env.items())
        ):
            raise ConfigError("env must be a dict of strings, e.g. {'NCCL_DEBUG': 'INFO'}.")
        self.env = dict(env or {})
        try:  # the fault drill (notebook 04): read by every rank's first report.step
            parse_fault(self.env.get(FAULT_ENV, ""))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.run_dir = Path()
        self.payload: dict[str, bytes] = {}  # the script's files by name, read once by run()
        self.resume, self.overwrite = resume, overwrite  # what to do with a run already there
        self.hang_timeout, self.on_hang = check_hang(hang_timeout, on_hang)

    @property
    def follow(self) -> dict[str, Any]:
        """How the Job follows the run: the display, and the hang watch."""
        return {
            "progress": self.progress,
            "hang_timeout": self.hang_timeout,
            "on_hang": self.on_hang,
        }

    def user_env(self, node_dir: str, pythonpath: str | None = None) -> dict[str, str]:
        """The user's ``env`` and the variables that load ddpnb's hooks (none with the watch off).

        ``pythonpath``: the node's own PYTHONPATH; the user's comes after ddpnb's hooks folder.
        """
        env = {} if self.hang_timeout is None else watch_env(node_dir, WATCH_INTERVAL, pythonpath)
        user = dict(self.env)
        if "PYTHONPATH" in user and "PYTHONPATH" in env:
            user["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], user["PYTHONPATH"]])
        return {**env, **user}

    def node_env(
        self,
        node_dir: str,
        procs_on_host: int,
        cores: int | None = None,
        pythonpath: str | None = None,
    ) -> dict:
        """The run's variables for one node's agent (never this process's own environment)."""
        env = {
            RUN_DIR_ENV: node_dir,  # where ddpnb_reporting writes
            "DDPNB_PROCS_ON_HOST": str(procs_on_host),
            "PYTHONUNBUFFERED": "1",
            "DDPNB_LAUNCHED": "1",
        }
        cfg = self.config
        threads = (cfg.threads if cfg else 0) or threads_for_host(procs_on_host, cores)
        env["OMP_NUM_THREADS"] = str(threads)  # this process's share of the host's cores
        env.update(self.user_env(node_dir, pythonpath))
        return env


def check_hang(hang_timeout: float | None, on_hang: str) -> tuple[float | None, str]:
    """The hang watch's settings, checked (ConfigError names the fix)."""
    if on_hang not in ("stop", "wait"):
        raise ConfigError(
            f"on_hang must be 'stop' (end the run with RunHung, naming every rank's line) or "
            f"'wait' (show the hang and keep waiting until you stop it), got {on_hang!r}."
        )
    if hang_timeout is not None and (
        isinstance(hang_timeout, bool)
        or not isinstance(hang_timeout, (int, float))
        or not hang_timeout > 0
    ):
        raise ConfigError(
            f"hang_timeout must be a number of seconds > 0 (default {HANG_TIMEOUT:g}), or None to "
            f"turn the hang watch off, got {hang_timeout!r}."
        )
    return (None if hang_timeout is None else float(hang_timeout)), on_hang
