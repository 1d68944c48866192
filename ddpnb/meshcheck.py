"""Can the nodes of a run reach node 0 and each other, on the interface torch will use?

One file, the Python standard library and torch, nothing of ddpnb: it runs where ddpnb is
not installed. Two ways in:

- On a Slurm allocation, as the batch job's first step (one task per node)::

      srun --ntasks-per-node=1 --kill-on-bad-exit=1 python meshcheck.py \\
          --nnodes "$SLURM_NNODES" --node-rank "$SLURM_NODEID" \\
          --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --timeout 20

  Node 0 hosts a TCP store on the rendezvous port; every node connects to it (a failure
  names the node, the address, the port and what was seen: refused, timed out, no route),
  then every node connects to every other node's ephemeral listener, then all run one gloo
  all-reduce over the interface each chose. Exit status 0 when all is well, 1 with the
  problems and their fixes on stderr otherwise.
- Over SSH, from :func:`ddpnb.network.check_network`, which sends this file as
  ``python -c`` with ``--agent JSON``: one line of facts, then one line of results.

The interface is what ``ip -4 route get MASTER_ADDR`` says carries the node's traffic to
node 0 (on node 0, the interface that holds that address), unless ``GLOO_SOCKET_IFNAME`` is
set: gloo otherwise advertises the address its host name resolves to, which is loopback
on many machines (pytorch/gloo#223).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
import subprocess
import sys
import threading
import time

CONNECT_TIMEOUT = 5.0  # seconds one TCP connect may take before it counts as dropped
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


# -- what one node can tell about itself ------------------------------------------------


def resolve(name: str) -> list[str]:
    """The IPv4 addresses ``name`` resolves to here, in the resolver's order."""
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return []
    return list(dict.fromkeys(info[4][0] for info in infos))


def interfaces() -> dict[str, list[str]]:
    """Interface name -> its IPv4 addresses (``ip -o -4 addr``, else ioctl)."""
    try:
        out = subprocess.run(
            ["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=5
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        out = ""
    found: dict[str, list[str]] = {}
    for line in out.splitlines():
        words = line.split()
        if len(words) > 3 and words[2] == "inet":
            found.setdefault(words[1].split("@")[0], []).append(words[3].split("/")[0])
    return found or _ioctl_interfaces()


def _ioctl_interfaces() -> dict[str, list[str]]:
    import fcntl
    import struct

    found = {}
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue  # SIOCGIFADDR: no IPv4 address
            found[name] = [socket.inet_ntoa(raw[20:24])]
    return found


def route_to(addr: str, ifaces: dict[str, list[str]]) -> dict:
    """How this node reaches ``addr``: ``dev``, ``src``, ``local`` and the route line."""
    try:
        out = subprocess.run(
            ["ip", "-4", "route", "get", addr], capture_output=True, text=True, timeout=5
        )
        line = out.stdout.strip().splitlines()[0] if out.returncode == 0 else ""
    except (OSError, subprocess.TimeoutExpired, IndexError):
        line = ""
    words = line.split()
    pick = {k: words[words.index(k) + 1] for k in ("dev", "src") if k in words[:-1]}
    if not pick:  # no `ip`: the source address of a UDP socket aimed at addr
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((addr, 9))
                pick["src"] = s.getsockname()[0]
        except OSError as e:
            return {"dev": None, "src": None, "local": False, "route": f"no route ({e})"}
        owner = [n for n, addrs in ifaces.items() if pick["src"] in addrs]
        pick["dev"] = owner[0] if owner else None
        line = f"{addr} src {pick['src']} (from a UDP socket; no `ip` here)"
    local = bool(words) and words[0] == "local"
    if local:  # the address is this node's own: the interface that holds it
        owner = [n for n, addrs in ifaces.items() if addr in addrs]
        pick = {"dev": owner[0] if owner else pick.get("dev"), "src": addr}
    return {"dev": pick.get("dev"), "src": pick.get("src"), "local": local, "route": line}


def machine_id() -> str:
    """Same value on two nodes = same kernel and same network namespace (loopback is shared)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        return f"{boot}/{os.stat('/proc/self/ns/net').st_ino}"
    except OSError:
        return socket.gethostname()


def port_range() -> str:
    """The ephemeral ports this node's listeners get (net.ipv4.ip_local_port_range)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return "-".join(f.read().split())
    except OSError:
        return "32768-60999"


def versions() -> dict:
    """torch, CUDA and NCCL versions of this node's torch (None where absent).

    Read from torch's ``version.py`` and the NCCL wheel's metadata, without importing torch
    (seconds on a busy host, and it must not touch the GPUs).
    """
    import ast
    import importlib.metadata as md
    import importlib.util

    found = {"torch": None, "cuda": None, "nccl": None}
    spec = importlib.util.find_spec("torch")
    for folder in (spec and spec.submodule_search_locations) or []:
        try:
            with open(os.path.join(folder, "version.py")) as f:
                tree = ast.parse(f.read())
        except (OSError, SyntaxError):
            continue
        for node in tree.body:
            target = getattr(node, "target", None) or (getattr(node, "targets", None) or [None])[0]
            name = {"__version__": "torch", "cuda": "cuda"}.get(getattr(target, "id", None))
            if name and isinstance(node.value, ast.Constant):
                found[name] = node.value.value
        break
    for cuda in ("13", "12", "11"):  # pip's torch loads NCCL from this wheel
        try:
            found["nccl"] = md.version(f"nvidia-nccl-cu{cuda}")
            break
        except md.PackageNotFoundError:
            pass
    return found


def local_facts(master_addr: str, ifname: str | None = None) -> dict:
    """What this node knows before talking to anyone: names, addresses, the interface."""
    facts = {"hostname": socket.gethostname(), "machine": machine_id(), "ports": port_range()}
    facts["hostname_addrs"] = resolve(facts["hostname"])
    facts["master_addrs"] = resolve(master_addr)
    facts["interfaces"] = ifaces = interfaces()
    facts["master"] = master = (facts["master_addrs"] or [None])[0]
    route = route_to(master, ifaces) if master else {"dev": None, "src": None, "local": False}
    facts.update(route)
    facts["user_ifname"] = ifname
    if ifname:
        facts["iface"], facts["address"] = ifname, (ifaces.get(ifname) or [None])[0]
    else:
        facts["iface"], facts["address"] = route["dev"], route["src"]
    facts["why"] = _why(facts, master_addr)
    return facts


def _why(facts: dict, master_addr: str) -> str:
    if facts["user_ifname"]:
        why = f"GLOO_SOCKET_IFNAME={facts['user_ifname']} was set"
    elif facts["local"]:
        why = f"{facts['dev']} holds master_addr {master_addr} ({facts['master']})"
    elif facts["dev"]:
        why = f"its route to node 0: ip route get {facts['master']} says dev {facts['dev']}"
        why += f" src {facts['src']}"
    else:
        return f"no route to master_addr {master_addr}"
    loop = [a for a in facts["hostname_addrs"] if a.startswith("127.")]
    if loop and facts["iface"] != "lo":
        why += (
            f"; its host name {facts['hostname']!r} resolves to {loop[0]}, which gloo would "
            "advertise to its peers without an interface set"
        )
    return why


# -- talking to the others --------------------------------------------------------------


def connect(addr: str, port: int, timeout: float = CONNECT_TIMEOUT) -> str:
    """'ok', or what a TCP connect to addr:port saw: refused, timed out, no route."""
    try:
        with socket.create_connection((addr, port), timeout=timeout):
            return "ok"
    except ConnectionRefusedError:
        return "refused"
    except TimeoutError:
        return "timed out"
    except OSError as e:
        if e.errno in (errno.ENETUNREACH, errno.EHOSTUNREACH):
            return "no route"
        return f"failed ({e.strerror or e})"


def connect_all(targets: dict[str, tuple[str, int]], timeout: float) -> dict[str, str]:
    """:func:`connect` to every ``key: (addr, port)`` at once."""
    results: dict[str, str] = {}

    def one(key: str, addr: str, port: int) -> None:
        results[key] = connect(addr, port, timeout)

    threads = [
        threading.Thread(target=one, args=(k, a, p), daemon=True) for k, (a, p) in targets.items()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout + 1)
    return {k: results.get(k, "timed out") for k in targets}


class Listener:
    """A TCP listener that accepts and lets each client close first (no TIME_WAIT here)."""

    def __init__(self, addr: str, port: int) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self.sock.bind((addr, port))
            self.sock.listen(64)
        except OSError:
            self.sock.close()
            raise
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self._drain, args=(conn,), daemon=True).start()

    @staticmethod
    def _drain(conn: socket.socket) -> None:
        conn.settimeout(10)
        try:
            while conn.recv(64):
                pass
        except OSError:
            pass
        finally:
            conn.close()

    def close(self) -> None:
        self.sock.close()


# -- what is wrong, and the fix ---------------------------------------------------------


def diagnose(nodes: list[dict], master_addr: str, master_port: int) -> list[tuple[str, str]]:
    """Every problem as (node name, what is wrong and the fix); empty when all is well.

    ``nodes[n]`` holds ``name``, and either ``error`` or ``facts`` with ``connects``
    (``'master'`` and each peer's node number -> what its connect saw), ``versions`` and,
    on node 0, ``listen_error``.
    """
    problems = [(n["name"], n["error"]) for n in nodes if n.get("error")]
    live = [n for n in nodes if n.get("facts")]
    if not live:
        return problems
    problems += _diagnose_addresses(nodes, master_addr, master_port)
    problems += _diagnose_master(nodes, master_addr, master_port)
    problems += _diagnose_mesh(nodes)
    problems += _diagnose_versions(nodes)
    return problems


def _node0_addresses(nodes: list[dict]) -> list[str]:
    facts = nodes[0].get("facts") or {}
    return [a for name, addrs in facts.get("interfaces", {}).items() for a in addrs if name != "lo"]


def _diagnose_addresses(nodes: list[dict], master_addr: str, port: int) -> list[tuple[str, str]]:
    problems = []
    one_machine = len({n["facts"]["machine"] for n in nodes if n.get("facts")}) == 1
    hint = ", ".join(_node0_addresses(nodes)) or "node 0's address on the network the nodes share"
    for n in nodes:
        f = n.get("facts")
        if not f:
            continue
        if not f["master"]:
            problems.append(
                (n["name"], f"cannot resolve master_addr {master_addr!r}: use node 0's address "
                 f"({hint}) for master_addr, or add the name to its /etc/hosts or DNS")
            )  # fmt: skip
        elif f["master"].startswith("127.") and not one_machine:
            problems.append(
                (n["name"], f"resolves master_addr {master_addr!r} to {f['master']}, its own "
                 f"loopback, not node 0: use node 0's address ({hint}) for master_addr")
            )  # fmt: skip
        elif f["user_ifname"] and not f["address"]:
            problems.append(
                (n["name"], f"has no interface {f['user_ifname']} with an IPv4 address "
                 f"(GLOO_SOCKET_IFNAME was set): its interfaces are "
                 f"{', '.join(sorted(f['interfaces']))}; unset it and ddpnb picks {f['dev']}")
            )  # fmt: skip
    return problems


SEEN = {
    "refused": "refused (nothing listens there: wrong address or port)",
    "timed out": "timed out (a firewall drops it)",
    "no route": "no route to that address",
}


def master_problem(name: str, addr: str, port: int, seen: str, name0: str) -> str:
    """What ``name`` saw connecting to node 0 at addr:port, and the fix."""
    fix = {
        "timed out": f"open TCP port {port} on node 0 ({name0}) to {name} in the firewall, "
        "or pass a master_port it lets through",
        "no route": f"use an address of node 0 on a network {name} shares for master_addr",
    }.get(seen, f"check that {addr} is node 0's ({name0}) address and pass it as master_addr")
    return f"cannot reach node 0 ({name0}) at {addr}:{port}: {SEEN.get(seen, seen)}. Fix: {fix}"


def _diagnose_master(nodes: list[dict], master_addr: str, port: int) -> list[tuple[str, str]]:
    name0 = nodes[0]["name"]
    listen = nodes[0].get("facts") and nodes[0].get("listen_error")
    if listen:
        return [(name0, f"cannot listen on the rendezvous port {port} ({listen}): pass another "
                 "master_port, or stop what holds it")]  # fmt: skip
    problems = []
    for n in nodes:
        seen = (n.get("connects") or {}).get("master")
        if not n.get("facts") or not n["facts"]["master"] or seen in (None, "ok"):
            continue
        problems.append(
            (n["name"], master_problem(n["name"], n["facts"]["master"], port, seen, name0))
        )
    return problems


def _diagnose_mesh(nodes: list[dict]) -> list[tuple[str, str]]:
    problems = []
    for n in nodes:
        for peer, seen in sorted((n.get("connects") or {}).items()):
            if peer == "master" or seen == "ok":
                continue
            p = nodes[int(peer)]
            f = p["facts"]
            problems.append(
                (n["name"], f"cannot connect to {p['name']} at {f['address']}:{p['mesh_port']} "
                 f"(an ephemeral port, as gloo and NCCL use): {SEEN.get(seen, seen)}. Fix: open "
                 f"TCP ports {f['ports']} ({p['name']}'s net.ipv4.ip_local_port_range) on "
                 f"{p['name']} to {n['name']}, or narrow that range on every node and open it")
            )  # fmt: skip
    return problems


def version_key(v: dict) -> tuple:
    return ((v.get("torch") or "").split("+")[0], v.get("cuda"), v.get("nccl"))


def show_versions(v: dict | None) -> str:
    if not v:
        return "?"
    if not v.get("torch"):
        return "no torch"
    return f"torch {v['torch']}, CUDA {v.get('cuda') or '-'}, NCCL {v.get('nccl') or '-'}"


def _diagnose_versions(nodes: list[dict]) -> list[tuple[str, str]]:
    have = [n for n in nodes if n.get("versions")]
    if not have:
        return []
    base = have[0]
    return [
        (n["name"], f"has {show_versions(n['versions'])} but {base['name']} has "
         f"{show_versions(base['versions'])}: install the same torch build on every node")
        for n in have[1:]
        if version_key(n["versions"]) != version_key(base["versions"])
    ]  # fmt: skip


def explain(problems: list[tuple[str, str]], head: str) -> str:
    return head + ":\n" + "\n".join(f"  - {name} {text}" for name, text in problems)


# -- over SSH: one agent per host, driven by ddpnb.network ------------------------------


def run_agent(args: dict) -> int:
    """Facts, then (after the driver sends the targets) connects and versions; two lines."""
    timer = threading.Timer(args["timeout"], os._exit, args=(3,))
    timer.daemon = True
    timer.start()  # whatever hangs, this process ends
    facts = local_facts(args["master_addr"], args.get("ifname"))
    out = {"facts": facts, "listen_error": None, "mesh_port": None}
    keep = []
    if args["node0"]:
        try:
            keep.append(Listener("", args["master_port"]))
        except OSError as e:
            out["listen_error"] = e.strerror or str(e)
    if facts["address"]:
        keep.append(Listener(facts["address"], 0))
        out["mesh_port"] = keep[-1].port
    found: dict = {}
    probe = threading.Thread(target=lambda: found.update(versions()), daemon=True)
    probe.start()
    print("DDPNB-NET1 " + json.dumps(out), flush=True)
    line = sys.stdin.readline()
    if not line:
        return 0
    got, by = json.loads(line), time.monotonic()
    targets = {k: tuple(v) for k, v in got["targets"].items()}
    if facts["master"] and not out["listen_error"]:
        targets["master"] = (facts["master"], args["master_port"])
    connects = connect_all(targets, args["connect_timeout"])
    probe.join(max(0.1, by + got["left"] - 1 - time.monotonic()))  # versions, if in time
    print("DDPNB-NET2 " + json.dumps({"connects": connects, "versions": found}), flush=True)
    sys.stdin.read()  # the driver closes our input when it has read everything
    return 0


# -- on a Slurm allocation: one process per node, a TCP store on node 0 -----------------


def _wait_for_master(addr: str, port: int, deadline: float) -> str:
    """Connect until node 0 listens (it may start later), or the deadline passes."""
    seen = "timed out"
    while time.monotonic() < deadline:
        seen = connect(addr, port, min(CONNECT_TIMEOUT, max(0.5, deadline - time.monotonic())))
        if seen in ("ok", "timed out", "no route"):
            return seen
        time.sleep(0.2)  # refused: node 0 may not listen yet
    return seen


def _gather(store, prefix: str, nnodes: int, timeout: float) -> list[dict | None]:
    """Every node's value under prefix/N, None for those that did not report in time."""
    import datetime

    keys = [f"{prefix}/{n}" for n in range(nnodes)]
    try:
        store.wait(keys, datetime.timedelta(seconds=max(0.1, timeout)))
    except Exception:  # some did not report: read who did
        pass
    return [json.loads(store.get(k)) if store.check([k]) else None for k in keys]


def _all_reduce(store, rank: int, nnodes: int, timeout: float) -> str | None:
    """One gloo all-reduce over the chosen interfaces; None when every node got nnodes."""
    import datetime

    import torch
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("meshcheck/gloo", store),
            rank=rank,
            world_size=nnodes,
            timeout=datetime.timedelta(seconds=max(1.0, timeout)),
        )
        x = torch.ones(1)
        dist.all_reduce(x)
        dist.destroy_process_group()
    except Exception as e:
        return f"the gloo all-reduce failed: {str(e).strip().splitlines()[0][:300]}"
    return None if int(x.item()) == nnodes else f"the gloo all-reduce gave {x.item()}"


def write_env(path: str, facts: dict, backend: str) -> None:
    """A shell file exporting the interface variables the user has not set."""
    names = IFNAME_VARS if backend == "nccl" else IFNAME_VARS[:1]
    lines = [
        f"export {v}={facts['iface']}" for v in names if facts["iface"] and v not in os.environ
    ]
    with open(path, "w") as f:
        f.write("".join(line + "\n" for line in lines))


def _check_node(args: argparse.Namespace, deadline: float) -> tuple[dict, list | None]:
    """This node's part: (its record, every node's record, or None if node 0 is out of reach)."""
    import datetime

    from torch.distributed import TCPStore

    facts = local_facts(args.master_addr, os.environ.get("GLOO_SOCKET_IFNAME"))
    name = f"node {args.node_rank} ({facts['hostname']})"
    me = {"name": name, "facts": facts, "node": args.node_rank, "connects": {}}
    if not facts["master"]:
        return me, None
    if args.node_rank != 0:
        me["connects"]["master"] = _wait_for_master(facts["master"], args.master_port, deadline)
        if me["connects"]["master"] != "ok":
            return me, None
    left = datetime.timedelta(seconds=max(1.0, deadline - time.monotonic()))
    store = TCPStore(facts["master"], args.master_port, args.nnodes, args.node_rank == 0,
                     timeout=left, wait_for_workers=False)  # fmt: skip
    listener = Listener(facts["address"], 0) if facts["address"] else None
    me["mesh_port"] = listener.port if listener else None
    me["versions"] = versions()
    store.set(f"meshcheck/facts/{args.node_rank}", json.dumps(me))
    peers = _gather(store, "meshcheck/facts", args.nnodes, deadline - time.monotonic() - 4)
    targets = {
        str(n): (p["facts"]["address"], p["mesh_port"])
        for n, p in enumerate(peers)
        if p and n != args.node_rank and p["mesh_port"]
    }
    me["connects"] = {"master": "ok", **connect_all(targets, CONNECT_TIMEOUT)}
    store.set(f"meshcheck/result/{args.node_rank}", json.dumps(me))
    nodes = _gather(store, "meshcheck/result", args.nnodes, deadline - time.monotonic() - 2)
    # node 0 holds the store: it stays until every node has read the results
    store.set(f"meshcheck/read/{args.node_rank}", "1")
    if args.node_rank == 0:
        _gather(store, "meshcheck/read", args.nnodes, 2.0)
    me["store"] = store
    return me, nodes


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agent", help=argparse.SUPPRESS)
    parser.add_argument("--nnodes", type=int)
    parser.add_argument("--node-rank", type=int)
    parser.add_argument("--master-addr")
    parser.add_argument("--master-port", type=int)
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--env-file", help="write 'export GLOO_SOCKET_IFNAME=...' here "
                        "({node_rank} is replaced)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.agent:
        return run_agent(json.loads(args.agent))
    if None in (args.nnodes, args.node_rank, args.master_addr, args.master_port):
        parser.error("--nnodes, --node-rank, --master-addr and --master-port are required")
    return check_allocation(args)


def check_allocation(args: argparse.Namespace) -> int:
    """The Slurm check on this node: 0 when all is well, 1 with the problems on stderr."""
    deadline = time.monotonic() + args.timeout
    me, nodes = _check_node(args, deadline)
    if args.env_file:
        write_env(args.env_file.replace("{node_rank}", str(args.node_rank)), me["facts"],
                  args.backend)  # fmt: skip
    if nodes is None:  # this node cannot resolve node 0's address, or reach it
        seen = me["connects"].get("master")
        problems = [(me["name"], f"cannot resolve master_addr {args.master_addr!r}")]
        if seen:
            problems = [(me["name"], master_problem(me["name"], me["facts"]["master"],
                                                    args.master_port, seen, "node 0"))]  # fmt: skip
    else:
        missing = [n for n, rec in enumerate(nodes) if rec is None]
        known = [rec or {"name": f"node {n}"} for n, rec in enumerate(nodes)]
        problems = diagnose(known, args.master_addr, args.master_port) + [
            (f"node {n}", f"did not report within {args.timeout:.0f} s: see its own output")
            for n in missing
        ]
        if not problems:
            if me["facts"]["iface"]:  # gloo binds where the check found the way to node 0
                os.environ.setdefault("GLOO_SOCKET_IFNAME", me["facts"]["iface"])
            left = deadline - time.monotonic()
            failed = _all_reduce(me["store"], args.node_rank, args.nnodes, max(3.0, left))
            problems = [(me["name"], failed)] if failed else []
    head = f"{me['name']}, interface {me['facts']['iface']}: "
    if problems:
        if args.node_rank == 0 or nodes is None:
            print(explain(problems, head + "the network check failed"), file=sys.stderr)
        else:
            print(head + "the network check failed; node 0's output names every problem",
                  file=sys.stderr)  # fmt: skip
        return 1
    print(head + f"reaches node 0 and all {args.nnodes - 1} peer(s); gloo all-reduce ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
