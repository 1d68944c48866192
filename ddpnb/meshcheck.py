"""Can the nodes of a run reach node 0 and each other, on the interface torch will use?

Standard library and torch only, so it runs where ddpnb is not installed: over SSH, relayed by
:mod:`ddpnb.network`, or as a Slurm job's first step. The interface is the one ``ip -4 route
get`` names toward node 0 unless ``GLOO_SOCKET_IFNAME`` is set: gloo otherwise advertises its
host name's address, often loopback (pytorch/gloo#223).
"""

from __future__ import annotations

import argparse
import errno
import itertools
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

CONNECT_TIMEOUT = 5.0  # seconds one TCP connect may take before it counts as dropped
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
TAG = "DDPNB-NET "  # starts each record the agent prints over SSH


def resolve(name: str) -> list[str]:
    """The IPv4 addresses ``name`` resolves to here, in the resolver's order."""
    try:
        infos = socket.getaddrinfo(name, None, socket.AF_INET, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError):
        return []
    return list(dict.fromkeys(info[4][0] for info in infos))


def _ip(*args: str) -> str:
    """What ``ip ARGS`` prints; empty where it fails or there is no ``ip``."""
    try:
        out = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout if out.returncode == 0 else ""


def interfaces() -> dict[str, list[str]]:
    """Interface name -> its IPv4 addresses (``ip -o -4 addr``, else ioctl)."""
    found: dict[str, list[str]] = {}
    for line in _ip("-o", "-4", "addr", "show").splitlines():
        words = line.split()
        if len(words) > 3 and words[2] == "inet":
            found.setdefault(words[1].split("@")[0], []).append(words[3].split("/")[0])
    if found:
        return found
    import fcntl
    import struct

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR
                raw = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            found[name] = [socket.inet_ntoa(raw[20:24])]
    return found


def _holder(ifaces: dict[str, list[str]], addr: str) -> str | None:
    return next((name for name, addrs in ifaces.items() if addr in addrs), None)


def route_to(addr: str, ifaces: dict[str, list[str]]) -> dict:
    """How this node reaches ``addr``: ``dev``, ``src``, ``local`` and the route line."""
    line = (_ip("-4", "route", "get", addr).strip().splitlines() or [""])[0]
    words = line.split()
    pick = {k: words[words.index(k) + 1] for k in ("dev", "src") if k in words[:-1]}
    if not pick:  # no `ip`: the source address of a UDP socket aimed at addr
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
                s.connect((addr, 9))
                pick["src"] = s.getsockname()[0]
        except OSError as e:
            return {"dev": None, "src": None, "local": False, "route": f"no route ({e})"}
        pick["dev"] = _holder(ifaces, pick["src"])
        line = f"{addr} src {pick['src']} (from a UDP socket; no `ip` here)"
    local = words[:1] == ["local"]
    if local:  # the address is this node's own: the interface that holds it
        pick = {"dev": _holder(ifaces, addr) or pick.get("dev"), "src": addr}
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
    """torch, CUDA and NCCL versions (None if absent), without importing torch (slow; GPUs)."""
    import importlib.metadata as md
    import importlib.util

    found = dict.fromkeys(("torch", "cuda", "nccl"))
    try:
        folder = importlib.util.find_spec("torch").submodule_search_locations[0]
        with open(os.path.join(folder, "version.py")) as f:
            text = f.read()
    except (AttributeError, IndexError, TypeError, ImportError, OSError):
        text = ""
    for key, name in (("__version__", "torch"), ("cuda", "cuda")):
        match = re.search(rf"^{key}\b[^=\n]*=\s*['\"]([^'\"\n]+)", text, re.M)
        found[name] = match and match.group(1)
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
    with ThreadPoolExecutor(max(1, len(targets))) as pool:
        return dict(zip(targets, pool.map(lambda t: connect(*t, timeout), targets.values())))


def listen(addr: str, port: int) -> int:
    """Accept on addr:port from now on, each client closing first (no TIME_WAIT here)."""
    sock = socket.create_server((addr, port), backlog=128)

    def drain(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            try:
                conn.recv(1)  # returns once the client has closed
            except OSError:
                pass

    def serve() -> None:
        while True:
            threading.Thread(target=drain, args=(sock.accept()[0],), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    return sock.getsockname()[1]


def mesh(me: dict, share, rank: int, port: int, deadline: float, connect_timeout: float):
    """This node's part: listen, share, connect, share again; every node's record, or None.

    ``share(record, by)`` relays ``record`` and returns every node's (None if silent by ``by``).
    """
    if me["facts"]["address"]:
        me["mesh_port"] = listen(me["facts"]["address"], 0)
    me["versions"] = versions()
    nodes = share(me, deadline - connect_timeout - 2)
    if nodes is None:
        return None
    targets = {
        str(n): (p["facts"]["address"], p["mesh_port"])
        for n, p in enumerate(nodes)
        if p and p.get("mesh_port") and n != rank
    }
    master = me["facts"]["master"]
    if "master" not in me["connects"] and master and nodes[0] and not nodes[0]["listen_error"]:
        targets["master"] = (master, port)
    me["connects"].update(connect_all(targets, connect_timeout))
    return share(me, deadline)


SEEN = {
    "refused": "refused (nothing listens there: wrong address or port)",
    "timed out": "timed out (a firewall drops it)",
    "no route": "no route to that address",
}


def diagnose(nodes: list[dict], master_addr: str, port: int) -> list[tuple[str, str]]:
    """Every problem as (node name, what is wrong and the fix); empty when all is well.

    ``nodes[n]``: ``name``, and ``error`` or the record :func:`mesh` shares.
    """
    problems = [(n["name"], n["error"]) for n in nodes if n.get("error")]
    node0, live = nodes[0], [n for n in nodes if n.get("facts")]
    if node0.get("facts") and node0.get("listen_error"):
        problems.append((node0["name"], f"cannot listen on the rendezvous port {port} "
                         f"({node0['listen_error']}): pass another master_port, or stop what "
                         "holds it"))  # fmt: skip
    ifaces = (node0.get("facts") or {}).get("interfaces", {})
    hint = ", ".join(a for name, addrs in ifaces.items() if name != "lo" for a in addrs)
    one_machine = len({n["facts"]["machine"] for n in live}) == 1
    for n in live:
        problems += [
            (n["name"], text)
            for text in _problems_of(n, nodes, master_addr, port, one_machine, hint or
                                     "node 0's address on the network the nodes share")
        ]  # fmt: skip
    have = [n for n in nodes if n.get("versions")]
    return problems + [
        (n["name"], f"has {show_versions(n['versions'])} but {have[0]['name']} has "
         f"{show_versions(have[0]['versions'])}: install the same torch build on every node")
        for n in have[1:]
        if version_key(n["versions"]) != version_key(have[0]["versions"])
    ]  # fmt: skip


def _problems_of(n: dict, nodes: list[dict], master_addr: str, port: int, one_machine: bool,
                 hint: str):  # fmt: skip
    f, name, name0 = n["facts"], n["name"], nodes[0]["name"]
    if not f["master"]:
        yield (f"cannot resolve master_addr {master_addr!r}: use node 0's address ({hint}) for "
               "master_addr, or add the name to its /etc/hosts or DNS")  # fmt: skip
    elif f["master"].startswith("127.") and not one_machine:
        yield (f"resolves master_addr {master_addr!r} to {f['master']}, its own loopback, not "
               f"node 0: use node 0's address ({hint}) for master_addr")  # fmt: skip
    elif f["user_ifname"] and not f["address"]:
        yield (f"has no interface {f['user_ifname']} with an IPv4 address (GLOO_SOCKET_IFNAME "
               f"was set): its interfaces are {', '.join(sorted(f['interfaces']))}; unset it "
               f"and ddpnb picks {f['dev']}")  # fmt: skip
    seen = n["connects"].get("master", "ok")
    if seen != "ok":
        fix = {
            "timed out": f"open TCP port {port} on node 0 ({name0}) to {name} in the firewall, "
            "or pass a master_port it lets through",
            "no route": f"use an address of node 0 on a network {name} shares for master_addr",
        }.get(seen, f"check that {f['master']} is node 0's ({name0}) address and pass it as "
              "master_addr")  # fmt: skip
        yield (f"cannot reach node 0 ({name0}) at {f['master']}:{port}: "
               f"{SEEN.get(seen, seen)}. Fix: {fix}")  # fmt: skip
    for peer, seen in sorted(n["connects"].items()):
        if peer != "master" and seen != "ok":
            p = nodes[int(peer)]
            yield (f"cannot connect to {p['name']} at {p['facts']['address']}:{p['mesh_port']} "
                   f"(an ephemeral port, as gloo and NCCL use): {SEEN.get(seen, seen)}. Fix: "
                   f"open TCP ports {p['facts']['ports']} ({p['name']}'s "
                   f"net.ipv4.ip_local_port_range) on {p['name']} to {name}, or narrow that "
                   "range on every node and open it")  # fmt: skip


def version_key(v: dict) -> tuple:
    return ((v.get("torch") or "").split("+")[0], v.get("cuda"), v.get("nccl"))


def show_versions(v: dict | None) -> str:
    if not v:
        return "?"
    if not v.get("torch"):
        return "no torch"
    return f"torch {v['torch']}, CUDA {v.get('cuda') or '-'}, NCCL {v.get('nccl') or '-'}"


def explain(problems: list[tuple[str, str]], head: str) -> str:
    return head + ":\n" + "\n".join(f"  - {name} {text}" for name, text in problems)


def _new_record(facts: dict, **more) -> dict:
    return {"facts": facts, "listen_error": None, "mesh_port": None, "connects": {}, **more}


def run_agent(args: dict) -> int:
    """Over SSH: each record a stdout line; every node's comes back as a stdin line."""
    timer = threading.Timer(args["timeout"] + 5, os._exit, args=(3,))
    timer.daemon = True
    timer.start()  # whatever hangs, this process ends
    deadline = time.monotonic() + args["timeout"]
    me = _new_record(local_facts(args["master_addr"], args.get("ifname")))
    if args["rank"] == 0:
        try:
            listen("", args["master_port"])
        except OSError as e:
            me["listen_error"] = os.strerror(e.errno) if e.errno else str(e)

    def share(record: dict, by: float) -> list | None:
        print(TAG + json.dumps(record), flush=True)
        line = sys.stdin.readline()  # the launcher closes our input when it has all
        return json.loads(line) if line.strip() else None

    mesh(me, share, args["rank"], args["master_port"], deadline, args["connect_timeout"])
    return 0


def _slurm_mesh(args: argparse.Namespace, me: dict, deadline: float):
    """Every node's record via node 0's store, and the store; None when out of reach."""
    from torch.distributed import TCPStore

    master, rank, port, seen = me["facts"]["master"], args.node_rank, args.master_port, "ok"
    while master and rank and time.monotonic() < deadline:
        seen = connect(master, port, min(CONNECT_TIMEOUT, max(0.5, deadline - time.monotonic())))
        if seen != "refused":
            break
        time.sleep(0.2)  # refused: node 0 may not listen yet
    me["connects"]["master"] = seen
    if not master or seen != "ok":
        return None, None
    left = timedelta(seconds=max(1.0, deadline - time.monotonic()))
    store = TCPStore(master, port, args.nnodes, rank == 0, timeout=left, wait_for_workers=False)
    rounds = itertools.count(1)

    def share(record: dict | None, by: float) -> list:
        keys = [f"meshcheck/{next(rounds)}/{n}" for n in range(args.nnodes)]
        store.set(keys[rank], json.dumps(record))
        try:
            store.wait(keys, timedelta(seconds=max(0.1, by - time.monotonic())))
        except Exception:  # some did not report: read who did
            pass
        return [json.loads(store.get(k)) if store.check([k]) else None for k in keys]

    nodes = mesh(me, share, rank, port, deadline, CONNECT_TIMEOUT)
    share(None, time.monotonic() + (2.0 if rank == 0 else 0.0))  # node 0 keeps the store
    return nodes, store  # until every node has read the results


def _all_reduce(store, rank: int, nnodes: int, timeout: float) -> str | None:
    """One gloo all-reduce over the chosen interfaces; None when every node got nnodes."""
    import torch
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo",
            store=dist.PrefixStore("meshcheck/gloo", store),
            rank=rank,
            world_size=nnodes,
            timeout=timedelta(seconds=max(1.0, timeout)),
        )
        x = torch.ones(1)
        dist.all_reduce(x)
        dist.destroy_process_group()
    except Exception as e:
        return f"the gloo all-reduce failed: {str(e).strip().splitlines()[0][:300]}"
    return None if int(x.item()) == nnodes else f"the gloo all-reduce gave {x.item()}"


def ifname_env(iface: str | None, backend: str, user_env) -> dict[str, str]:
    """The interface variables to set to ``iface``: those ``backend`` reads, unless set."""
    names = IFNAME_VARS if backend == "nccl" else IFNAME_VARS[:1]
    return {v: iface for v in names if iface and v not in user_env}


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
    facts = local_facts(args.master_addr, os.environ.get("GLOO_SOCKET_IFNAME"))
    me = _new_record(facts, name=f"node {args.node_rank} ({facts['hostname']})")
    if args.env_file:  # what the torchrun step sources
        with open(args.env_file.replace("{node_rank}", str(args.node_rank)), "w") as f:
            env = ifname_env(facts["iface"], args.backend, os.environ)
            f.write("".join(f"export {k}={v}\n" for k, v in env.items()))
    nodes, store = _slurm_mesh(args, me, deadline)
    rank = args.node_rank
    known = nodes or [me if n == rank else None for n in range(args.nnodes)]  # out of reach
    named = [rec or {"name": f"node {n}"} for n, rec in enumerate(known)]
    problems = diagnose(named, args.master_addr, args.master_port) + [
        (f"node {n}", f"did not report within {args.timeout:.0f} s: see its own output")
        for n, rec in enumerate(nodes or [])
        if rec is None
    ]
    if nodes and not problems:
        if facts["iface"]:  # gloo binds where the check found the way to node 0
            os.environ.setdefault("GLOO_SOCKET_IFNAME", facts["iface"])
        left = deadline - time.monotonic()
        failed = _all_reduce(store, rank, args.nnodes, max(3.0, left))
        problems = [(me["name"], failed)] if failed else []
    head = f"{me['name']}, interface {facts['iface']}: "
    if problems:
        if rank == 0 or nodes is None:
            print(explain(problems, head + "the network check failed"), file=sys.stderr)
        else:
            print(head + "the network check failed; node 0's output names every problem",
                  file=sys.stderr)  # fmt: skip
        return 1
    print(head + f"reaches node 0 and all {args.nnodes - 1} peer(s); gloo all-reduce ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())
