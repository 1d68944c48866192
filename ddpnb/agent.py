"""torchrun, with the rendezvous store of simulated nodes reachable from this host only.

torchrun's rendezvous (static or c10d) starts a TCPStore on node 0 that listens on
every interface. The store has no authentication: anyone who can reach the port can
join or disturb the run. When the rendezvous address is a loopback address (all
nodes on this machine) this script binds the store's socket to that address before
torchrun starts it, then runs torchrun unchanged. Any other address (real nodes)
runs plain torchrun: the store must be reachable over the network, which should be
a trusted one.

``python agent.py <torchrun options> train_ddp.py --config config.json``; run as a
script by path (not ``-m ddpnb.agent``), so the agent process imports torch only.
"""

from __future__ import annotations

import ipaddress
import socket
import sys

_held: list[socket.socket] = []  # listening sockets handed to the store: keep them open


def loopback_master_addr(argv: list[str]) -> str | None:
    """The rendezvous host of torchrun's argv if it is a loopback IP address, else None.

    >>> loopback_master_addr(["--master_addr=127.0.0.1", "--master_port=29500"])
    '127.0.0.1'
    """
    for arg in argv:
        key, _, value = arg.partition("=")
        if key == "--rdzv_endpoint":
            value = value.rsplit(":", 1)[0].strip("[]")
        elif key != "--master_addr":
            continue
        try:
            return value if ipaddress.ip_address(value).is_loopback else None
        except ValueError:
            return None
    return None


def bind_store_to(host: str) -> None:
    """Make the TCPStore that torchrun's rendezvous hosts listen on ``host`` only."""
    from torch.distributed.elastic.rendezvous import c10d_rendezvous_backend as c10d
    from torch.distributed.elastic.rendezvous import static_tcp_rendezvous as static

    tcp_store = static.TCPStore

    def store(*args, **kwargs):
        # The C++ store binds every interface; handed a bound socket, it listens on that.
        is_master = kwargs.get("is_master", args[3] if len(args) > 3 else False)
        if is_master:
            family = socket.AF_INET6 if ":" in host else socket.AF_INET
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, args[1] if len(args) > 1 else kwargs["port"]))
            sock.listen(1024)
            _held.append(sock)
            kwargs["master_listen_fd"] = sock.fileno()
        return tcp_store(*args, **kwargs)

    static.TCPStore = store
    c10d.TCPStore = store


def main(argv: list[str]) -> None:
    host = loopback_master_addr(argv)
    if host is not None:
        bind_store_to(host)
    from torch.distributed import run

    run.main(argv)


if __name__ == "__main__":
    del sys.path[0]  # ddpnb's folder: its module names (log, data, ...) must not shadow others
    main(sys.argv[1:])
