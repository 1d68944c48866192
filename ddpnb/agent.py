"""torchrun, its unauthenticated store bound to loopback for a loopback rendezvous address.

It stops its workers when the launcher's lifeline pipe closes. Run by path (``python agent.py
<torchrun options> SCRIPT``), it imports torch only."""

from __future__ import annotations

import ipaddress
import os
import signal
import socket
import sys
import threading
import time
from contextlib import suppress

LIFELINE_ENV = "DDPNB_LIFELINE_FD"  # the read end of the launcher's pipe, in the agent
LIFELINE_GRACE_SECONDS = 5.0  # from SIGTERM to SIGKILL once the launcher is gone

_held: list[socket.socket] = []  # listening sockets handed to the store: keep them open


def is_loopback(host: str) -> bool:
    """True if ``host`` names this machine only: a loopback IP, or a name resolving to loopback."""
    return loopback_bind_address(host) is not None


def loopback_bind_address(host: str) -> str | None:
    """The loopback IP to bind for ``host`` (``localhost``: 127.0.0.1), or None."""
    host = host.strip("[]")
    with suppress(ValueError):
        return host if ipaddress.ip_address(host).is_loopback else None
    if host.lower() in ("localhost", "localhost.localdomain") or host.endswith(".localhost"):
        return "127.0.0.1"  # RFC 6761: always loopback, whatever the resolver says
    try:
        infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    except (OSError, UnicodeError):
        return None
    addrs = [info[4][0] for info in infos]
    if not addrs or not all(ipaddress.ip_address(a.split("%")[0]).is_loopback for a in addrs):
        return None
    # Prefer IPv4: clients try each address of the name, and 127.0.0.1 is always there.
    return next((a for a in addrs if ":" not in a), addrs[0])


def loopback_master_addr(argv: list[str]) -> str | None:
    """The address to bind the store to if torchrun's rendezvous host is loopback, else None."""
    for arg in argv:
        key, _, value = arg.partition("=")
        if key == "--master_addr":
            return loopback_bind_address(value)
        if key == "--rdzv_endpoint":
            return loopback_bind_address(value.rsplit(":", 1)[0])
    return None


def watch_lifeline(fd: int) -> None:
    """End this agent and its workers once the launcher's pipe ``fd`` closes, however it ends."""

    def watch() -> None:
        while os.read(fd, 1):  # the launcher never writes; only EOF wakes us
            pass
        print("ddpnb agent: the launcher is gone; stopping this node.", file=sys.stderr, flush=True)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(LIFELINE_GRACE_SECONDS)
        for pid in descendants(os.getpid()):
            with suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        os._exit(143)

    threading.Thread(target=watch, name="ddpnb-lifeline", daemon=True).start()


def descendants(pid: int) -> list[int]:
    """Processes below ``pid`` (Linux /proc; elsewhere the workers notice the agent is gone)."""
    children: dict[int, list[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc") if os.path.isdir("/proc") else []):
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry))
    found = [pid]
    for parent in found:  # the list grows as it is read: breadth first
        found += children.get(parent, [])
    return found[1:]


def bind_store_to(host: str) -> None:
    """Make the TCPStore that torchrun's rendezvous hosts listen on ``host`` only."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous as static

    tcp_store = static.TCPStore

    def store(*args, **kwargs):
        # The C++ store binds every interface; handed a bound socket, it listens on that.
        if kwargs.get("is_master", args[3] if len(args) > 3 else False):
            port = args[1] if len(args) > 1 else kwargs["port"]
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.create_server((host, port), family=family, backlog=1024)  # SO_REUSEADDR
            _held.append(sock)
            kwargs["master_listen_fd"] = sock.fileno()
        return tcp_store(*args, **kwargs)

    static.TCPStore = c10d.TCPStore = store


def main(argv: list[str]) -> None:
    if (fd := os.environ.pop(LIFELINE_ENV, None)) is not None:  # the workers must not see it
        watch_lifeline(int(fd))
    if (host := loopback_master_addr(argv)) is not None:
        bind_store_to(host)
    from torch.distributed import run

    run.main(argv)


if __name__ == "__main__":
    del sys.path[0]  # ddpnb's folder: its module names (log, data, ...) must not shadow others
    main(sys.argv[1:])
