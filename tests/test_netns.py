"""Two nodes in two network namespaces joined by a veth pair: a real link, then a cut one.

Needs root and iproute2's ``ip`` (CI has both); the namespaces, the link and the
10.203.x.0/30 addresses exist only inside this test and are removed afterwards.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import tiny_config

import ddpnb

pytestmark = [pytest.mark.slow, pytest.mark.netns]

# Node 0's launcher runs inside namespace A, as it would on the master host.
NODE0 = textwrap.dedent(
    """
    import json, sys
    import ddpnb
    args = json.loads(sys.argv[1])
    try:
        ddpnb.launch(ddpnb.TrainConfig.from_dict(args["config"]), args["run_dir"], nnodes=2,
                     local_nodes=[0], master_addr=args["addr"], master_port=args["port"],
                     env={"GLOO_SOCKET_IFNAME": args["ifname"]}, progress="none")
        print(json.dumps({"error": None}))
    except ddpnb.DdpnbError as e:
        print(json.dumps({"error": type(e).__name__, "message": str(e),
                          "node_rank": getattr(e, "node_rank", None)}))
    """
)


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@pytest.fixture()
def veth_pair():
    """Namespaces A and B, linked by a veth pair: (namespaces, interfaces, addresses)."""
    if shutil.which("ip") is None:
        pytest.fail("this test needs iproute2's `ip` (apt-get install iproute2)")
    if os.geteuid() != 0:
        pytest.fail("this test needs root to create network namespaces (CI runs as root)")
    tag = os.getpid() % 100000
    ns = (f"ddpnb{tag}a", f"ddpnb{tag}b")
    dev = (f"dn{tag}a", f"dn{tag}b")
    subnet = f"10.203.{tag % 250}"
    addrs = (f"{subnet}.1", f"{subnet}.2")
    try:
        for n in ns:
            ip("netns", "add", n)
        ip("link", "add", dev[0], "type", "veth", "peer", "name", dev[1])
        for n, d, a in zip(ns, dev, addrs):
            ip("link", "set", d, "netns", n)
            ip("-n", n, "addr", "add", f"{a}/30", "dev", d)
            ip("-n", n, "link", "set", d, "up")
            ip("-n", n, "link", "set", "lo", "up")
        yield ns, dev, addrs
    finally:
        for n in ns:  # deleting a namespace deletes its end of the veth pair too
            subprocess.run(["ip", "netns", "del", n], capture_output=True)


def run_per_namespace(commands, env: dict, logs: Path, timeout: float):
    """Run ``(namespace, [VAR=value..., program, args...])`` pairs at once, each in its own
    process group, to the end: (their exit codes, the tail of each one's log)."""
    procs = []
    try:
        for ns, argv in commands:
            log = open(logs / f"{ns}.log", "wb")  # noqa: SIM115 (closed below)
            procs.append((log, subprocess.Popen(
                ["ip", "netns", "exec", ns, "env", *argv],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )))  # fmt: skip
        codes = [p.wait(timeout=timeout) for _, p in procs]
    finally:
        for log, p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
            log.close()
    return codes, {ns: (logs / f"{ns}.log").read_text()[-1500:] for ns, _ in commands}


def test_two_nodes_over_a_veth_link_then_the_link_is_cut(veth_pair, tiny_data, tmp_path):
    """About 40 s: two namespaces train, then the cut link must outlast gloo's timeout (10 s)."""
    (ns_a, ns_b), (dev_a, dev_b), (addr_a, _) = veth_pair
    run = tmp_path / "run"
    cfg = tiny_config(tiny_data, epochs=40, timeout_seconds=10, threads=1)
    port = 29617
    args = {
        "config": cfg.to_dict(),
        "run_dir": str(run),
        "addr": addr_a,
        "port": port,
        "ifname": dev_a,
    }
    node0 = subprocess.Popen(
        ["ip", "netns", "exec", ns_a, sys.executable, "-c", NODE0, json.dumps(args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    node1 = None
    try:
        deadline = time.time() + 60
        while not (run / "config.json").exists():  # node 0 has written the worker
            assert time.time() < deadline and node0.poll() is None, node0.communicate()
            time.sleep(0.2)
        (cmd,) = ddpnb.node_commands(
            cfg, run, hosts=list(veth_pair[2]), master_port=port, node_rank=1
        )
        assert f"--master_addr={addr_a}" in cmd  # the rendezvous goes over the veth link
        env = {**os.environ, "GLOO_SOCKET_IFNAME": dev_b, "OMP_NUM_THREADS": "1"}
        with open(tmp_path / "node1.log", "wb") as log:
            node1 = subprocess.Popen(
                ["ip", "netns", "exec", ns_b, sys.executable, "-m", "torch.distributed.run"]
                + cmd.split()[1:],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
            )
        deadline = time.time() + 120
        while not ddpnb.load_metrics(run).epochs:
            assert time.time() < deadline and node0.poll() is None, node0.communicate()
            time.sleep(0.2)
        assert ddpnb.load_metrics(run).final["world_size"] == 2  # both nodes trained
        ip("-n", ns_b, "link", "set", dev_b, "down")  # the cable is pulled
        cut_at = time.time()
        out, err = node0.communicate(timeout=cfg.timeout_seconds + 60)
        elapsed = time.time() - cut_at
    finally:
        for proc in (node0, node1):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    result = json.loads(out.strip().splitlines()[-1])
    assert result["error"] == "NodeLost", (result, err[-2000:])
    assert "nodes [1] run elsewhere" in result["message"] and result["node_rank"] == 1
    assert "resume=True" in result["message"]
    print(f"survivor stopped {elapsed:.1f} s after the cut")
    assert elapsed < cfg.timeout_seconds + 30, elapsed


GUIDE = Path(__file__).parents[1] / "docs" / "instructor.md"
ROOM = "/tmp/ddp-room"  # the guide's folder, the same path on both laptops
EXAMPLE_ADDRESSES = ("192.168.1.23", "192.168.1.57")  # the guide's laptops A and B


def guide_commands() -> list[str]:
    """The commands of the guide's "Two laptops, one run", as a participant types them."""
    section = GUIDE.read_text().split("## Two laptops, one run", 1)[1]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    lines = [line.strip() for block in blocks for line in block.splitlines()]
    return [line for line in lines if line.startswith(("mkdir ", "ddpnb ", "python -c "))]


def test_the_instructors_two_laptop_steps(veth_pair, tmp_path):
    """docs/instructor.md's steps, run as written: each "laptop" a network namespace. The
    printed c10d lines train on addresses that are not what this machine's host name resolves
    to (a cluster's separate training network): torchrun must not guess the node's address."""
    (ns_a, ns_b), devs, addrs = veth_pair
    room = tmp_path / "ddp-room"
    venv_bin = str(Path(sys.executable).parent)  # the `.venv` the participants activated
    env = {**os.environ, "PATH": f"{venv_bin}:{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}
    commands = guide_commands()
    assert [c.split()[:2] for c in commands] == [
        ["mkdir", "-p"], ["ddpnb", "prep"], ["ddpnb", "check"], ["python", "-c"],
        ["ddpnb", "commands"], ["ddpnb", "plot"],
    ]  # fmt: skip
    printed = {}
    for command in commands[:5]:  # data, fingerprint, worker, the lines: on laptop A
        for example, addr in zip(EXAMPLE_ADDRESSES, addrs):
            command = command.replace(example, addr)
        argv = [
            "ip",
            "netns",
            "exec",
            ns_a,
            *shlex.split(command.replace(ROOM, str(room)), comments=True),
        ]
        done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, (command, done.stdout[-2000:], done.stderr[-2000:])
        printed[command.split()[1]] = done.stdout
    assert "fingerprint: sha256:" in printed["check"]  # what the two participants compare
    torchruns = [ln for ln in printed["commands"].splitlines() if ln.startswith("torchrun ")]
    assert len(torchruns) == 2 and all(f"--local_addr={a}" in t for a, t in zip(addrs, torchruns))
    started = time.monotonic()
    laptops = [  # each laptop its own line, naming its own interface
        (ns, [f"GLOO_SOCKET_IFNAME={dev}", *shlex.split(line)])
        for ns, dev, line in zip((ns_a, ns_b), devs, torchruns)
    ]
    codes, logs = run_per_namespace(laptops, env, tmp_path, timeout=300)
    assert codes == [0, 0], logs
    run = ddpnb.load_metrics(room / "run")
    assert [e["epoch"] for e in run.epochs] == [1, 2] and run.final["world_size"] == 2
    print(f"two 'laptops' trained {len(run.epochs)} epochs in {time.monotonic() - started:.0f} s")
    plot = shlex.split(commands[5].replace(ROOM, str(room)), comments=True)
    subprocess.run(plot, env=env, check=True, capture_output=True, cwd=tmp_path, timeout=120)
    assert (tmp_path / "curves.png").stat().st_size > 10_000
