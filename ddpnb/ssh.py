"""Reaching real machines with the system's OpenSSH client; the hosts need only Python: what
runs there (the probe, tar streams of files) is :func:`helpers`, sent as ``python -c``."""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from .constants import (
    _cgroup_limit,
    cpu_quota,
    dataset_files,
    dataset_fingerprint,
    free_port,
    usable_cpus,
)
from .errors import ConfigError

# Unless ssh_options say otherwise (ssh keeps an option's first value): never prompt, which
# would hang the cell; a host that stops answering ends its ssh within ~15 s (a lost node).
SSH_DEFAULTS = ("-o", "BatchMode=yes", "-o", "ConnectTimeout=10")
SSH_DEFAULTS += ("-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=3")
SSH_FAILED = 255  # ssh's exit status for its own errors (connection, authentication)


@dataclasses.dataclass(frozen=True)
class Host:
    """One host as the user named it: ``name``, ``user@name``, ``name:port``, ``[v6]:port``."""

    spec: str
    name: str
    user: str | None = None
    port: int | None = None

    @classmethod
    def parse(cls, spec: str) -> Host:
        user, _, rest = str(spec).rpartition("@")
        name, port = rest, None
        if rest.startswith("["):  # [IPv6]:port
            name, _, port = rest[1:].partition("]")
            port = port[1:] or None
        elif rest.count(":") == 1:
            name, port = rest.split(":")
        if not isinstance(spec, str) or not name or name[0] == "-" or re.search(r"\s", spec):
            raise ConfigError(
                "A host must be a name or address such as 'gpu1' or 'alice@gpu2:2222' (no spaces, "
                f"no leading '-'), got {spec!r}."
            )
        if port is not None and not (port.isdigit() and 0 < int(port) < 65536):
            raise ConfigError(f"Host {spec!r}: the port after ':' must be 1..65535.")
        return cls(spec, name, user or None, port and int(port))

    @property
    def destination(self) -> str:
        return f"{self.user}@{self.name}" if self.user else self.name


def parse_hosts(hosts: Sequence[str]) -> list[Host]:
    """The hosts of a run, node 0 first."""
    if isinstance(hosts, str) or not hosts:
        raise ConfigError(
            "hosts must be a non-empty list such as ['gpu1', 'gpu2'] (CLI: --hosts gpu1,gpu2)."
        )
    return [Host.parse(h) for h in hosts]


@dataclasses.dataclass
class Ssh:
    """How to reach the hosts: ``ssh -F ssh_config`` plus ``ssh_options``, verbatim."""

    config: str | os.PathLike | None = None
    options: Sequence[str] = ()

    def __post_init__(self) -> None:
        if self.config is not None and not Path(self.config).is_file():
            raise ConfigError(
                f"ssh_config {self.config} is not a file. Pass the path of an OpenSSH client "
                "config (ssh -F), or None for ~/.ssh/config."
            )
        if isinstance(self.options, str) or not all(isinstance(o, str) for o in self.options):
            raise ConfigError(
                "ssh_options must be a list of ssh arguments, e.g. ['-o', 'StrictHostKeyChecking=no']."
            )

    def args(self, host: Host, *flags: str, defaults: bool = True) -> list[str]:
        """``ssh [-F config] options [SSH_DEFAULTS] [-p port] flags -- destination``."""
        args = ["ssh", *(["-F", str(self.config)] if self.config else []), *self.options]
        args += SSH_DEFAULTS if defaults else ()
        args += ["-p", str(host.port)] if host.port else []
        return [*args, *flags, "--", host.destination]

    def command(self, host: Host, remote: str) -> list[str]:
        return [*self.args(host, "-T"), remote]

    def helper(
        self, host: Host, python: str, name: str, args: list, timeout: float, input: bytes = b""
    ) -> tuple[bytes, str | None]:
        """``name(*args)`` of :func:`helpers` on ``host``, ``input`` its stdin: its output, and
        why it failed (None if it did not)."""
        cmd = self.command(host, remote_line([python, "-c", helpers(), name, json.dumps(args)]))
        try:
            out = subprocess.run(cmd, input=input, capture_output=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            hint = (
                f"`ssh {host.spec} true` should return at once; a ~/.bashrc that waits delays all"
            )
            return b"", f"did not answer within {timeout:.0f} s ({hint})"
        except OSError as e:
            return b"", f"could not run ssh ({e})"
        why = ssh_failure(out.returncode, out.stderr.decode(errors="replace"), python)
        return out.stdout, why if out.returncode else None

    def hostname(self, host: Host) -> str:
        """The address ssh connects to for ``host`` (its config's ``HostName``, ``ssh -G``)."""
        out = subprocess.run(self.args(host, "-G"), capture_output=True, text=True, timeout=10)
        found = re.search(r"^hostname (.+)$", out.stdout, re.M)
        return found[1].strip() if found else host.name


def remote_line(
    argv: Sequence[str], cwd: str | None = None, env: Mapping[str, str] | None = None
) -> str:
    """``cd CWD && exec env K=V ARGV``, quoted (``exec``: the program holds the session's stdin)."""
    words = ["exec"]
    if env:
        words += ["env", *(f"{k}={v}" for k, v in env.items())]
    line = shlex.join([*words, *argv])
    return f"cd {shlex.quote(str(cwd))} && {line}" if cwd else line


def ssh_failure(returncode: int, stderr: str, python: str) -> str:
    """ssh's or the remote shell's failure, with the fix."""
    last = " ".join(stderr.strip().splitlines()[-2:]) or f"exit code {returncode}"
    if returncode == SSH_FAILED:
        if "Permission denied" in stderr or "Too many authentication failures" in stderr:
            return (
                f"refused the login ({last}). ddpnb logs in without prompting (BatchMode): "
                "install your public key there (ssh-copy-id) or set IdentityFile in ssh_config"
            )
        if "Host key verification failed" in stderr:
            return f"has an unknown or changed host key ({last}): log in once with ssh to accept it"
        return f"could not be reached over SSH ({last})"
    if returncode in (126, 127):
        return (
            f"has no Python interpreter at {python} ({last}). Pass python= (CLI: --python) "
            "naming the interpreter with torch and torchvision on the hosts"
        )
    return f"failed the probe ({last})"


# -- what runs on the hosts: helpers(), these functions' source ---------------------------------


def probe(args: dict) -> None:
    """Print what the preflight needs to know about this host.

    ``args``: ``data_dir``; ``marker`` (a path: does this host see it?); the ``held`` names in
    ``dir``; ``free_port`` (pick one for node 0's rendezvous); ``gpus``.
    """
    import importlib.metadata as md

    out = {"python": sys.executable, "cpus": usable_cpus()}  # a CPU limit counts too
    for pkg in ("torch", "torchvision"):  # None: not installed
        out[pkg] = next((d.version for d in md.distributions(name=pkg)), None)
    data = args["data_dir"]
    found = data and all(os.path.isdir(os.path.join(data, s)) for s in ("train", "val"))
    out["fingerprint"] = dataset_fingerprint(data) if found else None
    out["shared"] = os.path.exists(args["marker"])
    out["held"] = [n for n in args["held"] if os.path.lexists(os.path.join(args["dir"], n))]
    if args["free_port"]:
        out["port"] = free_port("")
    if args["gpus"] and out["torch"]:
        import torch

        out["gpus"] = torch.cuda.device_count()
    print("DDPNB-PROBE " + json.dumps(out))


def pack(root: str, names: list[str], stream=None) -> None:
    """Write those of ``names`` that ``root`` holds to a tar stream (stdout)."""
    with tarfile.open(fileobj=stream or sys.stdout.buffer, mode="w|") as tar:
        for name in names:
            if os.path.exists(os.path.join(root, name)):
                tar.add(os.path.join(root, name), arcname=name)


def unpack(dest: str, clean: list[str] = (), stream=None) -> None:
    """Remove ``clean`` from ``dest``, then extract a tar stream (stdin) there: its files and
    folders only, never outside ``dest``, each file replaced whole."""
    for path in (os.path.join(dest, name) for name in clean):
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        elif os.path.lexists(path):
            os.unlink(path)
    os.makedirs(dest, exist_ok=True)
    with tarfile.open(fileobj=stream or sys.stdin.buffer, mode="r|") as tar:
        for m in tar:
            parts = m.name.split("/")
            if m.name.startswith("/") or ".." in parts or not (m.isfile() or m.isdir()):
                continue
            target = os.path.join(dest, *parts)
            os.makedirs(target if m.isdir() else os.path.dirname(target), exist_ok=True)
            if m.isfile():
                tmp = os.path.join(os.path.dirname(target), f".{parts[-1]}.part")
                with open(tmp, "wb") as f:
                    shutil.copyfileobj(tar.extractfile(m), f)
                os.replace(tmp, target)  # a reader never sees half a file


_SHIPPED = (dataset_files, dataset_fingerprint, free_port, usable_cpus, cpu_quota, _cgroup_limit)
_SHIPPED += (probe, pack, unpack)


@functools.cache
def helpers() -> str:
    """The program the hosts run: the source of :data:`_SHIPPED` and a call by name."""
    return (
        "from __future__ import annotations\n"
        "import hashlib, json, os, random, shutil, socket, sys, tarfile\nfrom pathlib import Path\n"
        + "".join(inspect.getsource(f) for f in _SHIPPED)
        + "globals()[sys.argv[1]](*json.loads(sys.argv[2]))\n"
    )
