"""One run, checked: the script, its config (ddpnb's worker), each node's environment."""

from __future__ import annotations

import dataclasses
import functools
import os
from collections.abc import Mapping

from .config import TrainConfig
from .constants import threads_for_host
from .errors import ConfigError
from .hang import hooks_payload, watch_env
from .preflight import check_progress
from .reporting import FAULT_ENV, RUN_DIR_ENV, parse_fault
from .script import Script

HANG_TIMEOUT = 60.0  # seconds without progress, waiting in a collective
WATCH_INTERVAL = 2.0  # seconds between a worker's snapshots of its stack
# NCCL's flight recorder, which the hang watch reads on NCCL (ddpnb.watch.nccl_collectives):
# a ring of each process's last 2000 collectives, set unless the user set either name (torch
# reads TORCH_FR_BUFFER_SIZE first; the older TORCH_NCCL_TRACE_BUFFER_SIZE warns on every
# rank). Its cost: per collective an entry (op, sizes, a reference to the Python stack at the
# call), at most 2000 kept; on gloo, where torch 2.14 records the same ring, 3000 all_reduces
# took 36-43 us each with it and without, and memory grew alike. With it, NCCL's timeout also
# dumps the ring (TORCH_NCCL_DUMP_ON_TIMEOUT, on by default in recent torch) to
# TORCH_NCCL_DEBUG_INFO_TEMP_FILE (default /tmp/nccl_trace_rank_<rank>), which fr_trace reads.
FLIGHT_RECORDER = {"TORCH_FR_BUFFER_SIZE": "2000"}
FLIGHT_RECORDER_NAMES = ("TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_TRACE_BUFFER_SIZE")


@dataclasses.dataclass(frozen=True)
class Plan:
    """One run, checked once built, then never changed (``config``: None for your own script)."""

    script: Script
    config: TrainConfig | None
    env: Mapping[str, str] = dataclasses.field(default_factory=dict)
    progress: str = "auto"
    resume: bool = False
    overwrite: bool = False
    hang_timeout: float | None = HANG_TIMEOUT
    on_hang: str = "stop"
    payload: Mapping[str, bytes] = dataclasses.field(init=False)  # the script's files
    files: dict[str, bytes] = dataclasses.field(init=False)  # and ddpnb's hooks: every node's

    def __post_init__(self) -> None:  # its normalised values set here, once
        put = functools.partial(object.__setattr__, self)
        env = self.env
        texts = isinstance(env, Mapping) and all(isinstance(s, str) for s in (*env, *env.values()))
        if env is not None and not texts:
            raise ConfigError("env must be a dict of strings, e.g. {'NCCL_DEBUG': 'INFO'}.")
        put("env", dict(env or {}))
        try:  # the fault drill (notebook 04): read by every rank's first report.step
            parse_fault(self.env.get(FAULT_ENV, ""))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.on_hang not in ("stop", "wait"):
            raise ConfigError(
                f"on_hang must be 'stop' (end the run with RunHung, naming every rank's line) or "
                f"'wait' (show the hang and keep waiting until you stop it), got {self.on_hang!r}."
            )
        limit = self.hang_timeout
        number = isinstance(limit, (int, float)) and not isinstance(limit, bool)
        if limit is not None and not (number and limit > 0):
            raise ConfigError(
                f"hang_timeout must be a number of seconds > 0 (default {HANG_TIMEOUT:g}), or None "
                f"to turn the hang watch off, got {limit!r}."
            )
        put("hang_timeout", None if limit is None else float(limit))
        check_progress(self.progress)
        put("payload", self.script.payload())
        put("files", {**self.payload, **hooks_payload()})

    @property
    def follow(self) -> dict:
        return dict(progress=self.progress, hang_timeout=self.hang_timeout, on_hang=self.on_hang)

    def user_env(self, node_dir: str, pythonpath: str | None = None) -> dict[str, str]:
        """The user's ``env`` and what loads ddpnb's hooks; ``pythonpath``: the node's own."""
        env = {} if self.hang_timeout is None else watch_env(node_dir, WATCH_INTERVAL, pythonpath)
        user = dict(self.env)
        if env and not any(n in user or n in os.environ for n in FLIGHT_RECORDER_NAMES):
            env.update(FLIGHT_RECORDER)
        if "PYTHONPATH" in user and "PYTHONPATH" in env:
            user["PYTHONPATH"] = os.pathsep.join([env["PYTHONPATH"], user["PYTHONPATH"]])
        return {**env, **user}

    def node_env(
        self, node_dir: str, procs: int, cores: int | None = None, pythonpath: str | None = None
    ) -> dict:
        """The run's variables for one node's agent (``procs``: the run's on that host)."""
        threads = (self.config and self.config.threads) or threads_for_host(procs, cores)
        return {
            RUN_DIR_ENV: node_dir,
            "DDPNB_PROCS_ON_HOST": str(procs),
            "PYTHONUNBUFFERED": "1",
            "DDPNB_LAUNCHED": "1",
            "OMP_NUM_THREADS": str(threads),
            **self.user_env(node_dir, pythonpath),
        }
