"""Can the nodes of a run reach node 0 and each other, on the interface torch will use?

Standard library and torch only, so it runs where ddpnb is not installed: over SSH, relayed by
:mod:`ddpnb.network`, or as a Slurm job's first step. The interface is the one ``ip -4 route
get`` names toward node 0 unless ``GLOO_SOCKET_IFNAME`` is set: gloo otherwise advertises its
host name's address, often loopback (pytorch/gloo#223).
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import queue
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


def listen(addr: str, port: int) -> socket.socket:
    """Accept on addr:port until closed, each client closing first (no TIME_WAIT here)."""
    sock = socket.create_server((addr, port), backlog=128)

    def drain(conn: socket.socket) -> None:
        with conn:
            conn.settimeout(10)
            try:
                conn.recv(1)  # returns once the client has closed
            except OSError:
                pass

    def serve() -> None:
        try:
            while True:
                threading.Thread(target=drain, args=(sock.accept()[0],), daemon=True).start()
        except OSError:  # closed
            pass

    threading.Thread(target=serve, daemon=True).start()
    return sock


def mesh(me: dict, share, rank: int, port: int, connect_timeout: float) -> list | None:
    """This node's part: listen, share, connect, share again; every node's record, or None.

    ``share(record)`` relays ``record`` and returns every node's (None: the relay is done).
    """
    if me["facts"]["address"]:
        me["mesh_port"] = listen(me["facts"]["address"], 0).getsockname()[1]
    me["versions"] = versions()
    nodes = share(me)
    if nodes is None:
        return None
    targets = {
        str(n): (p["facts"]["address"], p["mesh_port"])
        for n, p in enumerate(nodes)
        if p and p.get("mesh_port") and n != rank
    }
    master = me["facts"]["master"]
    if master and nodes[0] and not nodes[0]["listen_error"]:
        targets["master"] = (master, port)
    me["connects"].update(connect_all(targets, connect_timeout))
    return share(me)


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


def run_agent(args: dict) -> int:
    """One node's part, relayed: each record a stdout line, every node's back as a stdin line."""
    timer = threading.Timer(args["timeout"] + 15, os._exit, args=(3,))
    timer.daemon = True
    timer.start()  # whatever hangs, this process ends
    rank = args.get("rank", int(os.environ.get("SLURM_NODEID", 0)))
    facts = local_facts(args["master_addr"], args.get("ifname"))
    me = {"facts": facts, "listen_error": None, "mesh_port": None, "connects": {}}
    if args.get("env_file"):  # what a Slurm job's torchrun step sources
        with open(args["env_file"].replace("{node_rank}", str(rank)), "w") as f:
            env = ifname_env(facts["iface"], args["backend"], os.environ)
            f.write("".join(f"export {k}={v}\n" for k, v in env.items()))
    server = None
    if rank == 0:
        try:
            server = listen("", args["master_port"])
        except OSError as e:
            me["listen_error"] = os.strerror(e.errno) if e.errno else str(e)

    def share(record: dict) -> list | None:
        print(TAG + json.dumps(record), flush=True)
        line = sys.stdin.readline()  # the relay closes our input when it is done
        return json.loads(line) if line.strip() else None

    nodes = mesh(me, share, rank, args["master_port"], args["connect_timeout"])
    if nodes is not None:  # no problem found, and the relay asks for an all-reduce
        if server:  # node 0's port is the all-reduce's rendezvous once every node knows it is free
            server.shutdown(socket.SHUT_RDWR)
            server.close()
        if share({"port_free": True}) is not None:
            share({"all_reduce": _all_reduce(facts, rank, len(nodes), args)})
    return 0


def _all_reduce(facts: dict, rank: int, nnodes: int, args: dict) -> str:
    """One gloo all-reduce over the chosen interfaces: 'ok', or what went wrong."""
    if facts["iface"]:  # gloo binds where the check found the way to node 0
        os.environ.setdefault("GLOO_SOCKET_IFNAME", facts["iface"])
    import torch
    import torch.distributed as dist

    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{facts['master']}:{args['master_port']}",
            rank=rank,
            world_size=nnodes,
            timeout=timedelta(seconds=args["timeout"]),
        )
        x = torch.ones(1)
        dist.all_reduce(x)
        dist.destroy_process_group()
    except Exception as e:
        return f"the gloo all-reduce failed: {str(e).strip().splitlines()[0][:300]}"
    return "ok" if int(x.item()) == nnodes else f"the gloo all-reduce gave {x.item()}"


def _read_records(proc: subprocess.Popen, queues: list, why_ended, labelled: bool) -> None:
    """Each agent's records from ``proc``'s output onto its node's queue, then why it ended."""

    def read() -> None:
        said = [[] for _ in queues]
        for line in proc.stdout:
            m = re.match(r"\s*(\d+): ", line) if labelled else None
            n, text = (int(m[1]), line[m.end() :]) if m else (0, line)
            if text.startswith(TAG):
                queues[n].put(json.loads(text[len(TAG) :]))
            else:
                said[n].append(text)
        code = proc.wait()
        for records, lines in zip(queues, said):
            records.put({"error": why_ended(code, "".join(lines))})

    threading.Thread(target=read, daemon=True).start()


def relay(names: list, agents: list, args: dict, why_ended, labelled: bool = False):
    """Every node's records relayed to all of them, then each node's record and the problems.

    ``agents``: the launched :func:`run_agent` processes, one per node, or one whose lines
    are led by each node's ``N: `` (``labelled``, as ``srun --label``), each in a session
    of its own (ended here). ``names[n]``: node n's (None: ``node N (its host name)``).
    ``why_ended(exit_code, what_it_printed)``: a node's record when its agent ends.
    Rounds: the facts, then what each node reached, then (``all_reduce``, when all is well)
    a gloo all-reduce.
    """
    deadline = time.monotonic() + args["timeout"]
    nodes: list[dict] = [{"name": name} if name else {} for name in names]
    queues = [queue.Queue() for _ in names]
    for n, proc in enumerate(agents):
        _read_records(proc, queues if labelled else queues[n : n + 1], why_ended, labelled)

    def send(line: str) -> None:
        for proc in agents:
            try:
                proc.stdin.write(line + "\n")
                proc.stdin.flush()
            except OSError:
                pass  # it has ended: its last record says why

    def gather(by: float) -> str:
        for n, (node, records) in enumerate(zip(nodes, queues)):
            try:
                if "error" not in node:
                    node.update(records.get(timeout=max(0.0, by - time.monotonic())))
            except queue.Empty:
                node["error"] = "did not answer the network check in time (its launcher hung)"
            host = (node.get("facts") or {}).get("hostname")
            node.setdefault("name", f"node {n} ({host})" if host else f"node {n}")
        return json.dumps([None if "error" in node else node for node in nodes])

    try:
        send(gather(deadline - args["connect_timeout"] - 2))  # every node gets the live ones
        everyone = gather(deadline)
        problems = diagnose(nodes, args["master_addr"], args["master_port"])
        if args.get("all_reduce") and not problems:
            send(everyone)
            send(gather(time.monotonic() + 5))  # node 0's port is free for the all-reduce
            gather(time.monotonic() + args["timeout"])
            problems = [
                (n["name"], n.get("error") or n["all_reduce"])
                for n in nodes
                if n.get("all_reduce") != "ok"
            ]
        return nodes, problems
    finally:
        for proc in agents:
            try:
                proc.stdin.close()  # the agent reads end-of-file and exits
                proc.wait(timeout=5)
            except (OSError, subprocess.TimeoutExpired):
                pass
            if proc.poll() is None:
                os.killpg(proc.pid, 9)
                proc.wait()


def ifname_env(iface: str | None, backend: str, user_env) -> dict[str, str]:
    """The interface variables to set to ``iface``: those ``backend`` reads, unless set."""
    names = IFNAME_VARS if backend == "nccl" else IFNAME_VARS[:1]
    return {v: iface for v in names if iface and v not in user_env}


def slurm_step(args: argparse.Namespace) -> int:
    """A Slurm job's first step, on its first node: one agent per node (srun), relayed here."""
    agent = {
        "master_addr": args.master_addr,
        "master_port": args.master_port,
        "timeout": args.timeout,
        "connect_timeout": CONNECT_TIMEOUT,
        "all_reduce": True,
        "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        "backend": args.backend,
        "env_file": args.env_file,
    }
    argv = [
        "srun",
        "--label",
        "--ntasks-per-node=1",
        sys.executable,
        os.path.abspath(__file__),
        "--agent",
        json.dumps(agent),
    ]
    pipe = subprocess.PIPE  # srun sends its input to every node's agent
    srun = subprocess.Popen(
        argv, stdin=pipe, stdout=pipe, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    nodes, problems = relay(
        [None] * args.nnodes,
        [srun],
        agent,
        lambda code, said: (
            f"ended (srun exit {code}) before its check was done: "
            f"{said.strip()[-500:] or 'it printed nothing'}"
        ),
        labelled=True,
    )
    if problems:
        print(explain(problems, "The network check failed"), file=sys.stderr)
        return 1
    for node in nodes:
        print(
            f"{node['name']}, interface {node['facts']['iface']}: reaches node 0 and all "
            f"{args.nnodes - 1} peer(s); gloo all-reduce ok"
        )
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agent", help=argparse.SUPPRESS)
    parser.add_argument("--nnodes", type=int)
    parser.add_argument("--master-addr")
    parser.add_argument("--master-port", type=int)
    parser.add_argument("--timeout", type=float, default=20.0)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument(
        "--env-file",
        help="each node writes 'export GLOO_SOCKET_IFNAME=...' here ({node_rank} is replaced)",
    )
    args = parser.parse_args(argv)
    if args.agent:
        return run_agent(json.loads(args.agent))
    if None in (args.nnodes, args.master_addr, args.master_port):
        parser.error("--nnodes, --master-addr and --master-port are required")
    return slurm_step(args)


if __name__ == "__main__":
    sys.exit(main())
