"""Reaching real machines over SSH: the system's OpenSSH client; the hosts need only Python.

Remote lines are built with ``shlex`` from argument lists; the probe and the file transfers
(tar streams) are small ``python -c`` programs, so the hosts need no ``scp`` or ``tar``.
"""

from __future__ import annotations

import dataclasses
import inspect
import io
import json
import os
import shlex
import subprocess
import tarfile
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path, PurePosixPath

from . import constants
from .errors import ConfigError, HostError

# Unless ssh_options say otherwise: ssh keeps an option's first value, the user's come first.
SSH_DEFAULTS = (
    "-o",
    "BatchMode=yes",  # never prompt: a prompt would hang the cell
    "-o",
    "ConnectTimeout=10",
    # A host that stops answering ends its ssh within ~15 s: the node is reported lost.
    "-o",
    "ServerAliveInterval=5",
    "-o",
    "ServerAliveCountMax=3",
)
PROBE_TIMEOUT = 15.0
SSH_FAILED = 255  # ssh's exit status for its own errors (connection, authentication)


@dataclasses.dataclass(frozen=True)
class Host:
    """One host as the user named it: ``name``, ``user@name``, ``name:port``, ``[v6]:port``.

    >>> Host.parse("alice@gpu2:2222")
    Host(spec='alice@gpu2:2222', name='gpu2', user='alice', port=2222)
    """

    spec: str
    name: str
    user: str | None = None
    port: int | None = None

    @classmethod
    def parse(cls, spec: str) -> Host:
        if not isinstance(spec, str) or not spec.strip() or spec != spec.strip():
            raise ConfigError(
                f"A host must be a name such as 'gpu1' or 'alice@gpu2:2222', got {spec!r}."
            )
        user, _, rest = spec.rpartition("@")
        port = None
        if rest.startswith("["):  # [IPv6]:port
            name, _, tail = rest[1:].partition("]")
            if tail:
                port = tail[1:]
        elif rest.count(":") == 1:
            name, port = rest.split(":")
        else:
            name = rest
        if port is not None:
            if not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"Host {spec!r}: the port after ':' must be 1..65535.")
            port = int(port)
        if not name or name.startswith("-") or any(c.isspace() for c in name):
            raise ConfigError(
                f"Host {spec!r} is not a host name or address (no spaces, no leading '-')."
            )
        return cls(spec, name, user or None, port)

    @property
    def destination(self) -> str:
        return f"{self.user}@{self.name}" if self.user else self.name


def parse_hosts(hosts: Sequence[str]) -> list[Host]:
    """The hosts of a run, node 0 first.

    >>> [h.name for h in parse_hosts(["gpu1", "alice@gpu2"])]
    ['gpu1', 'gpu2']
    """
    if isinstance(hosts, str) or not hosts:
        raise ConfigError(
            "hosts must be a non-empty list such as ['gpu1', 'gpu2'] (CLI: --hosts gpu1,gpu2)."
        )
    return [Host.parse(h) for h in hosts]


@dataclasses.dataclass(frozen=True)
class Ssh:
    """How to reach the hosts: ``ssh -F ssh_config`` plus ``ssh_options``, verbatim.

    >>> Ssh().command(Host.parse("gpu1"), "true")[-2:]
    ['gpu1', 'true']
    """

    config: str | None = None
    options: tuple[str, ...] = ()

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

    def base(self, host: Host) -> list[str]:
        args = ["ssh"]
        if self.config:
            args += ["-F", str(self.config)]
        args += [*self.options, *SSH_DEFAULTS]
        if host.port:
            args += ["-p", str(host.port)]
        return args

    def command(self, host: Host, remote: str) -> list[str]:
        """``ssh ... -- destination remote``."""
        return [*self.base(host), "-T", "--", host.destination, remote]

    def hostname(self, host: Host) -> str:
        """The address ssh connects to for ``host`` (its config's ``HostName``, ``ssh -G``)."""
        out = subprocess.run(
            [*self.base(host), "-G", "--", host.destination],
            capture_output=True,
            text=True,
            timeout=10,
            env=dict(os.environ),
        )
        for line in out.stdout.splitlines():
            key, _, value = line.partition(" ")
            if key == "hostname":
                return value.strip()
        return host.name


def remote_line(
    argv: Sequence[str], cwd: str | None = None, env: Mapping[str, str] | None = None
) -> str:
    """One remote-shell line running ``argv``; ``exec``: the program holds the session's stdin.

    >>> remote_line(["python", "-c", "print(1)"], cwd="/my runs", env={"A": "b c"})
    "cd '/my runs' && exec env 'A=b c' python -c 'print(1)'"
    """
    words = ["exec"]
    if env:
        words += ["env", *(f"{k}={v}" for k, v in env.items())]
    line = shlex.join([*words, *argv])
    return f"cd {shlex.quote(str(cwd))} && {line}" if cwd else line


# -- preflight: one probe per host, all in parallel ------------------------------------

PROBE = """
import importlib.metadata as md, json, os, socket, sys
args = json.loads(sys.argv[1])
out = {"hostname": socket.gethostname(), "python": sys.executable,
       "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()}
for pkg in ("torch", "torchvision"):
    try:
        out[pkg] = md.version(pkg)
    except md.PackageNotFoundError:
        out[pkg] = None
data = args["data_dir"]
if data and os.path.isdir(os.path.join(data, "train")) and os.path.isdir(os.path.join(data, "val")):
    out["fingerprint"] = dataset_fingerprint(data)
else:
    out["fingerprint"] = None
run_dir = args["run_dir"]
try:
    with open(os.path.join(run_dir, args["marker"])) as f:
        out["marker"] = f.read()
except OSError:
    out["marker"] = None
if args["port"] is not None:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the store binds: TIME_WAIT is free
    try:
        s.bind(("", args["port"]))
        out["port"] = s.getsockname()[1]
    except OSError:
        out["port"] = None
    finally:
        s.close()
if args["gpus"] and out["torch"]:
    import torch
    out["gpus"] = torch.cuda.device_count()
print("DDPNB-PROBE " + json.dumps(out))
"""


def _probe_source() -> str:
    # The package's own fingerprint code, so every host hashes alike.
    helpers = inspect.getsource(constants.dataset_files) + inspect.getsource(
        constants.dataset_fingerprint
    )
    return "import hashlib, os\nfrom pathlib import Path\n" + helpers + PROBE


@dataclasses.dataclass
class Probe:
    host: Host
    report: dict | None = None
    error: str | None = None


def probe(
    ssh: Ssh,
    host: Host,
    python: str,
    *,
    data_dir: str | None,
    run_dir: str,
    marker: str,
    port: int | None,
    gpus: bool,
    timeout: float = PROBE_TIMEOUT,
) -> Probe:
    """Ask ``host`` what the preflight needs to know; never raises."""
    args = {
        "data_dir": data_dir,
        "run_dir": run_dir,
        "marker": marker,
        "port": port,
        "gpus": gpus,
    }
    cmd = ssh.command(host, remote_line([python, "-c", _probe_source(), json.dumps(args)]))
    try:
        out = subprocess.run(
            cmd,
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            env=dict(os.environ),
        )
    except subprocess.TimeoutExpired:
        return Probe(host, error=f"did not answer within {timeout:.0f} s")
    except OSError as e:
        return Probe(host, error=f"could not run ssh ({e})")
    for line in out.stdout.splitlines():
        if line.startswith("DDPNB-PROBE "):
            return Probe(host, report=json.loads(line.split(" ", 1)[1]))
    return Probe(host, error=_explain(out.returncode, out.stderr, python))


def _explain(returncode: int, stderr: str, python: str) -> str:
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


def probe_all(ssh: Ssh, hosts: Sequence[Host], python: str, **kwargs) -> list[Probe]:
    """:func:`probe` on every host at once (node 0 is asked for the port)."""
    port = kwargs.pop("port")
    with ThreadPoolExecutor(max_workers=min(32, len(hosts))) as pool:
        futures = [
            pool.submit(probe, ssh, h, python, port=port if n == 0 else None, **kwargs)
            for n, h in enumerate(hosts)
        ]
        return [f.result() for f in futures]


def check_probes(
    probes: Sequence[Probe],
    *,
    data_dir: str | None,  # None: not ddpnb's worker
    nproc_per_node: int,
    gpus: bool,
    port: int | None,
) -> None:
    """Raise one :class:`HostError` naming every host that cannot run the job, and why."""
    problems = [(p.host, p.error) for p in probes if p.error]
    reports = [(p.host, p.report) for p in probes if p.report]
    needed = ("torch", "torchvision") if data_dir is not None else ("torch",)
    for host, r in reports:
        missing = " or ".join(pkg for pkg in needed if not r[pkg])
        if missing:
            why = f"has no {missing} for {r['python']}: pip install {' '.join(needed)} there (or "
            problems.append((host, why + "pass python= naming an interpreter that has it)"))
        elif data_dir is not None and r["fingerprint"] is None:
            why = f"has no dataset at {data_dir} (train/ and val/): copy it there with rsync -a"
            problems.append((host, why))
        elif gpus and r.get("gpus", 0) < nproc_per_node:
            why = f"has {r.get('gpus', 0)} GPU(s), fewer than nproc_per_node={nproc_per_node}"
            problems.append((host, why))
    if problems:
        raise HostError(
            _lines("Preflight failed; nothing was started", problems), host=problems[0][0].spec
        )

    def release(r: dict) -> dict:
        return {k: (r[k] or "").split("+")[0] for k in needed}

    odd = [(h, r) for h, r in reports if release(r) != release(reports[0][1])]
    if odd:
        base = release(reports[0][1])
        head = f"The hosts run different versions of torch/torchvision (node 0: {base}); "
        found = [(h, f"has torch {r['torch']}, torchvision {r['torchvision']}") for h, r in odd]
        raise HostError(_lines(head + "install the same on every host", found), host=odd[0][0].spec)
    first = reports[0][1]["fingerprint"]
    differ = [(h, r) for h, r in reports if r["fingerprint"] != first] if data_dir else []
    if differ:
        head = (
            f"The dataset at {data_dir} differs from node 0's ({reports[0][0].spec}, fingerprint "
            f"{first[:12]}). Copy node 0's data to them, e.g. rsync -a {data_dir}/ HOST:{data_dir}/"
        )
        found = [(h, f"holds fingerprint {r['fingerprint'][:12]}") for h, r in differ]
        raise HostError(_lines(head, found), host=differ[0][0].spec)
    if port is not None and reports[0][1].get("port") is None:
        raise HostError(
            f"Port {port} is already in use on node 0 ({reports[0][0].spec}). Pass another "
            "master_port, or None to pick a free one.",
            host=reports[0][0].spec,
        )


def _lines(head: str, problems: Sequence[tuple[Host, str]]) -> str:
    return head + ":\n" + "\n".join(f"  - {h.spec} {why}." for h, why in problems)


# -- files: tar streams over the SSH connection ------------------------------------------

UNPACK = """
import os, sys, tarfile
dest = sys.argv[1]
os.makedirs(dest, exist_ok=True)
with tarfile.open(fileobj=sys.stdin.buffer, mode="r|") as tar:
    for m in tar:
        parts = m.name.split("/")
        if m.name.startswith("/") or ".." in parts or not (m.isfile() or m.isdir()):
            continue
        tar.extract(m, dest, set_attrs=False)
"""

PACK = """
import os, sys, tarfile
root, names = sys.argv[1], sys.argv[2:]
with tarfile.open(fileobj=sys.stdout.buffer, mode="w|") as tar:
    for name in names:
        if os.path.exists(os.path.join(root, name)):
            tar.add(os.path.join(root, name), arcname=name)
"""


def push(
    ssh: Ssh,
    host: Host,
    python: str,
    remote_dir: str,
    files: Mapping[str, bytes],
    timeout: float = 60,
) -> None:
    """Write ``files`` (name -> content) into ``remote_dir`` on ``host``."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o644
            tar.addfile(info, io.BytesIO(data))
    cmd = ssh.command(host, remote_line([python, "-c", UNPACK, remote_dir]))
    out = subprocess.run(
        cmd, input=buf.getvalue(), capture_output=True, timeout=timeout, env=dict(os.environ)
    )
    if out.returncode != 0:
        raise HostError(
            f"Could not copy the worker to {host.spec}:{remote_dir}: "
            f"{_explain(out.returncode, out.stderr.decode(errors='replace'), python)}.",
            host=host.spec,
        )


def pull(
    ssh: Ssh,
    host: Host,
    python: str,
    remote_dir: str,
    names: Sequence[str],
    local_dir: Path,
    timeout: float = 60,
) -> bool:
    """Copy ``names`` under ``remote_dir`` from ``host`` into ``local_dir``; False if unreadable."""
    cmd = ssh.command(host, remote_line([python, "-c", PACK, remote_dir, *names]))
    try:
        out = subprocess.run(
            cmd,
            capture_output=True,
            timeout=timeout,
            env=dict(os.environ),
            stdin=subprocess.DEVNULL,
        )
    except subprocess.TimeoutExpired:
        return False
    if out.returncode != 0:
        return False
    with tarfile.open(fileobj=io.BytesIO(out.stdout), mode="r:") as tar:
        for m in tar.getmembers():
            parts = PurePosixPath(m.name).parts
            if m.name.startswith("/") or ".." in parts or not (m.isfile() or m.isdir()):
                continue
            target = local_dir.joinpath(*parts)
            if m.isdir():
                target.mkdir(parents=True, exist_ok=True)
                continue
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = target.with_name(f".{target.name}.pull")
            tmp.write_bytes(tar.extractfile(m).read())
            os.replace(tmp, target)  # a reader never sees half a file
    return True
