"""One run, checked: the script, its config (ddpnb's worker), the topology, each node's environment."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .config import TrainConfig
from .constants import threads_for_host
from .errors import ConfigError
from .preflight import as_config, check_progress
from .reporting import FAULT_ENV, RUN_DIR_ENV, parse_fault
from .script import Script, worker_script
from .topology import Topology

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

    def node_env(self, node_dir: str, procs_on_host: int, cores: int | None = None) -> dict:
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
        env.update(self.env)
        return env
