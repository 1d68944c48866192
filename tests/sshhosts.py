"""Two SSH hosts on this machine: network namespaces on a bridge, each with real sshd.

Each host is a network namespace whose ``ddpnb0`` interface sits on a bridge in the root
namespace, and runs two Debian ``sshd`` servers with a throwaway host key:

- port 22 shares this machine's filesystem (a cluster with a shared filesystem);
- port 2222 also has a tmpfs over ``/tmp/ddpnb-private-<tag>`` (a host that sees none of
  the launcher's files there).

Both see root's shell startup files empty (:func:`_masked_rc`), as on a fresh server.

The client side is an ``ssh_config`` written here (key, known_hosts, user): nothing of
the machine's own SSH setup is read or changed. Everything is removed on exit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

SSHD = "/usr/sbin/sshd"
IFNAME = "ddpnb0"  # the interface name inside every host namespace (GLOO_SOCKET_IFNAME)
TRAIN_IFNAME = "ddpnb1"  # with second_network=True: each host's interface on the second one


@dataclasses.dataclass
class SshHosts:
    names: list[str]  # ssh_config aliases, shared filesystem: ["hosta", "hostb"]
    private: list[str]  # aliases of the private-filesystem servers: ["hosta-private", ...]
    addrs: list[str]
    namespaces: list[str]
    ssh_config: Path
    private_root: Path
    bridge: str
    links: list[str]  # each host's bridge-side interface (down = the cable is pulled)
    sshd_pids: dict[str, int]  # alias -> pid of its sshd (its own listener only)
    # second_network=True: a second bridge, each host's TRAIN_IFNAME on it at train_addrs[n].
    train_addrs: list[str] = dataclasses.field(default_factory=list)
    train_bridge: str | None = None

    def ns_pids(self, n: int) -> set[int]:
        """Every process in host n's network namespace."""
        out = subprocess.run(
            ["ip", "netns", "pids", self.namespaces[n]], capture_output=True, text=True
        )
        return {int(p) for p in out.stdout.split()}

    def leftovers(self) -> dict[str, list[int]]:
        """Processes in the namespaces other than the sshd listeners."""
        keep = set(self.sshd_pids.values())
        return {
            ns: sorted(self.ns_pids(n) - keep)
            for n, ns in enumerate(self.namespaces)
            if self.ns_pids(n) - keep
        }

    def in_private(self, n: int, argv: list[str]) -> subprocess.CompletedProcess:
        """Run argv in host n's private mount namespace (to plant files there)."""
        pid = self.sshd_pids[self.private[n]]
        return subprocess.run(
            ["nsenter", "-t", str(pid), "-m", "-n", *argv], capture_output=True, text=True
        )


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _wait_listening(ns: str, addr: str, port: int, proc: subprocess.Popen) -> None:
    deadline = time.time() + 10
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"sshd on {addr}:{port} exited: {proc.stderr.read()}")
        out = subprocess.run(
            ["ip", "netns", "exec", ns, "ss", "-Hltn", f"sport = :{port}"],
            capture_output=True,
            text=True,
        )
        if addr in out.stdout:
            return
        time.sleep(0.05)
    raise RuntimeError(f"sshd did not listen on {addr}:{port}")


def _second_network(ns: str, n: int, tag: int, bridge: str, addr: str) -> None:
    """Host n's TRAIN_IFNAME on ``bridge`` at ``addr``."""
    if n == 0:
        _ip("link", "add", bridge, "type", "bridge")
        _ip("link", "set", bridge, "up")
    link = f"dtr{tag}{chr(97 + n)}"
    _ip("link", "add", link, "type", "veth", "peer", "name", f"{link}p")
    _ip("link", "set", f"{link}p", "netns", ns)
    _ip("-n", ns, "link", "set", f"{link}p", "name", TRAIN_IFNAME)
    _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", TRAIN_IFNAME)
    _ip("-n", ns, "link", "set", TRAIN_IFNAME, "up")
    _ip("link", "set", link, "master", bridge)
    _ip("link", "set", link, "up")


@contextlib.contextmanager
def default_route(hosts: SshHosts):
    """Every host's default route via the first network's bridge, for the block.

    Only for a block: with a default route, a host's DNS queries (torch's reverse lookups)
    would wait for their timeout instead of failing at once, as this machine does not
    forward; so the resolvers of /etc/resolv.conf stay unreachable, as without the route.
    """
    gateway = hosts.addrs[0].rsplit(".", 1)[0] + ".1"
    resolvers = re.findall(r"^\s*nameserver\s+([0-9.]+)\s*$", _resolv_conf(), re.MULTILINE)
    try:
        for ns in hosts.namespaces:
            _ip("-n", ns, "route", "add", "default", "via", gateway, "dev", IFNAME)
            for addr in resolvers:
                _ip("-n", ns, "route", "replace", "unreachable", f"{addr}/32")
        yield gateway
    finally:
        for ns in hosts.namespaces:
            subprocess.run(["ip", "-n", ns, "route", "del", "default"], capture_output=True)
            for addr in resolvers:
                subprocess.run(["ip", "-n", ns, "route", "del", f"{addr}/32"], capture_output=True)


def _resolv_conf() -> str:
    try:
        return Path("/etc/resolv.conf").read_text()
    except OSError:
        return ""


def _masked_rc() -> list[str]:
    """Root's shell startup files, which every host's sessions see empty.

    bash runs ~/.bashrc for every SSH command; this machine's runs ``pyenv init``, whose
    ``pyenv rehash`` waits 60 s for a lock that a session killed mid-rehash (as the tests
    that end hosts do) leaves behind: every later SSH command then waited past the 15 s
    preflight. A test host starts clean, like a fresh server, whatever this machine's are.
    """
    home = Path(os.path.expanduser("~root"))
    names = (".bashrc", ".bash_profile", ".bash_login", ".profile")
    return [str(home / name) for name in names if (home / name).is_file()]


@contextlib.contextmanager
def ssh_hosts(tmp: Path, tag: int, count: int = 2, second_network: bool = False):
    """Start ``count`` SSH hosts; yield an :class:`SshHosts`.

    With ``second_network`` every host also sits on a second bridge (``TRAIN_IFNAME``,
    10.205.x.0/24). No host has a default route (:func:`default_route` adds one for a block).
    """
    for tool in ("ip", "ssh", "ssh-keygen", "nsenter", "unshare", SSHD):
        if shutil.which(tool) is None:
            raise RuntimeError(f"needs {tool} (apt-get install openssh-server iproute2)")
    if os.geteuid() != 0:
        raise RuntimeError("needs root for network namespaces (CI runs as root)")
    tmp.mkdir(parents=True, exist_ok=True)
    subnet = f"10.204.{tag % 250}"
    bridge = f"dbr{tag}"
    namespaces = [f"ddpnbssh{tag}{chr(97 + n)}" for n in range(count)]
    links = [f"dsh{tag}{chr(97 + n)}" for n in range(count)]
    addrs = [f"{subnet}.{n + 2}" for n in range(count)]
    private_root = Path(f"/tmp/ddpnb-private-{tag}")
    train_bridge = f"dtb{tag}" if second_network else None
    train_addrs = [f"10.205.{tag % 250}.{n + 2}" for n in range(count)] if second_network else []
    procs: dict[str, subprocess.Popen] = {}
    made_run_sshd = not os.path.isdir("/run/sshd")
    try:
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / "host_key")], check=True
        )
        subprocess.run(
            ["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp / "id")], check=True
        )
        shutil.copyfile(tmp / "id.pub", tmp / "authorized_keys")
        empty, masked = tmp / "empty_rc", _masked_rc()
        empty.write_text("")
        os.makedirs("/run/sshd", mode=0o755, exist_ok=True)  # sshd's privilege-separation dir
        private_root.mkdir(exist_ok=True)
        _ip("link", "add", bridge, "type", "bridge")
        _ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        _ip("link", "set", bridge, "up")
        hostkey = (tmp / "host_key.pub").read_text().split()[:2]
        known, client = [], []
        names, private = [], []
        for n, (ns, link, addr) in enumerate(zip(namespaces, links, addrs)):
            _ip("netns", "add", ns)
            _ip("link", "add", link, "type", "veth", "peer", "name", f"{link}p")
            _ip("link", "set", f"{link}p", "netns", ns)
            _ip("-n", ns, "link", "set", f"{link}p", "name", IFNAME)
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", IFNAME)
            _ip("-n", ns, "link", "set", IFNAME, "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("link", "set", link, "master", bridge)
            _ip("link", "set", link, "up")
            if train_bridge:
                _second_network(ns, n, tag, train_bridge, train_addrs[n])
            alias = f"host{chr(97 + n)}"
            for name, port, is_private in ((alias, 22, False), (f"{alias}-private", 2222, True)):
                conf = tmp / f"sshd-{name}.conf"
                conf.write_text(
                    f"Port {port}\nListenAddress {addr}\nHostKey {tmp / 'host_key'}\n"
                    f"AuthorizedKeysFile {tmp / 'authorized_keys'}\nPidFile none\n"
                    "PermitRootLogin prohibit-password\nPasswordAuthentication no\n"
                    "KbdInteractiveAuthentication no\nUsePAM no\nStrictModes no\n"
                    "PrintMotd no\nLogLevel ERROR\n"
                )
                sshd = [SSHD, "-D", "-e", "-f", str(conf)]
                # sshd and every session it starts see empty shell startup files in root's
                # home (see _masked_rc) and, on the private server, a tmpfs at private_root.
                mounts = [f"mount --bind {empty} {rc}" for rc in masked]
                if is_private:
                    mounts.append(f"mount -t tmpfs ddpnb-private {private_root}")
                script = " && ".join([*mounts, 'exec "$@"'])
                sshd = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script,
                        "sh", *sshd]  # fmt: skip
                procs[name] = subprocess.Popen(
                    ["ip", "netns", "exec", ns, *sshd],
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=subprocess.PIPE,
                    text=True,
                    start_new_session=True,
                )
                _wait_listening(ns, addr, port, procs[name])
                where = addr if port == 22 else f"[{addr}]:{port}"
                known.append(f"{where} {' '.join(hostkey)}")
                client.append(f"Host {name}\n  HostName {addr}\n  Port {port}\n")
                (private if is_private else names).append(name)
        (tmp / "known_hosts").write_text("\n".join(known) + "\n")
        client.append(
            f"Host *\n  User root\n  IdentityFile {tmp / 'id'}\n  IdentitiesOnly yes\n"
            f"  UserKnownHostsFile {tmp / 'known_hosts'}\n  GlobalKnownHostsFile /dev/null\n"
            "  StrictHostKeyChecking yes\n  LogLevel ERROR\n"
        )
        (tmp / "ssh_config").write_text("".join(client))
        yield SshHosts(
            names=names,
            private=private,
            addrs=addrs,
            namespaces=namespaces,
            ssh_config=tmp / "ssh_config",
            private_root=private_root,
            bridge=bridge,
            links=links,
            sshd_pids={name: p.pid for name, p in procs.items()},
            train_addrs=train_addrs,
            train_bridge=train_bridge,
        )
    finally:
        for ns in namespaces:  # whatever a test left running in a host goes first
            out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in out.stdout.split():
                with contextlib.suppress(OSError):
                    os.kill(int(pid), 9)
        for proc in procs.values():
            with contextlib.suppress(OSError):
                os.killpg(proc.pid, 9)
            proc.wait()
        for ns in namespaces:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)
        if train_bridge:
            subprocess.run(["ip", "link", "del", train_bridge], capture_output=True)
        with contextlib.suppress(OSError):
            private_root.rmdir()
        if made_run_sshd:
            with contextlib.suppress(OSError):
                os.rmdir("/run/sshd")
