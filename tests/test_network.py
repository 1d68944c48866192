"""The network check before a run: real sshd hosts in network namespaces, real nftables.

Three hosts (tests/sshhosts.py) on two networks: SSH on the first (``ddpnb0``, where one
test puts every default route), a second one (``ddpnb1``) for training. Firewall rules are
nftables tables inside one host's namespace, removed after each test. No test passes the
fixture's ``GLOO_SOCKET_IFNAME``: the interfaces are the check's own choice.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from sshhosts import IFNAME, TRAIN_IFNAME, default_route, ssh_hosts

from ddpnb import meshcheck
from ddpnb.errors import NetworkError
from ddpnb.network import check_network, run_agents
from ddpnb.ssh import Ssh, parse_hosts

pytestmark = [pytest.mark.slow, pytest.mark.netns]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    tag = (os.getpid() + 500) % 1000  # not test_ssh.py's tag
    with ssh_hosts(tmp_path_factory.mktemp("net"), tag, count=3, second_network=True) as h:
        yield h
        assert not h.leftovers(), h.leftovers()  # every agent of every check has ended


@pytest.fixture()
def nft(hosts):
    """nft(n, rules): load an nftables table into host n's namespace for this test."""
    if shutil.which("nft") is None:
        pytest.fail("this test needs nftables' nft (apt-get install nftables; .ci/run does)")
    loaded = []

    def load(n: int, rules: str) -> None:
        ns = hosts.namespaces[n]
        subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=rules, text=True,
                       check=True, capture_output=True)  # fmt: skip
        loaded.append(ns)

    yield load
    for ns in loaded:
        subprocess.run(["ip", "netns", "exec", ns, "nft", "delete", "table", "inet", "ddpnbtest"])


def _check(hosts, n: int, master_addr: str, port: int, **kwargs):
    ssh = Ssh(str(hosts.ssh_config))
    return check_network(
        ssh, parse_hosts(hosts.names[:n]), sys.executable, master_addr=master_addr,
        master_port=port, **kwargs,
    )  # fmt: skip


def _no_leftovers(hosts, within: float = 5.0) -> dict:
    deadline = time.time() + within
    while hosts.leftovers() and time.time() < deadline:
        time.sleep(0.1)
    return hosts.leftovers()


def _meshcheck(hosts, tmp_path, n: int, master_addr: str, port: int):
    """The check a Slurm job's first step makes (all-reduce, env files), agents over SSH."""
    args = {"master_addr": master_addr, "master_port": port, "timeout": 20.0, "all_reduce": True,
            "connect_timeout": meshcheck.CONNECT_TIMEOUT, "ifname": None, "backend": "gloo",
            "env_file": str(tmp_path / "net-{node_rank}.env")}  # fmt: skip
    hosts_ = parse_hosts(hosts.names[:n])
    return run_agents(Ssh(str(hosts.ssh_config)), hosts_, sys.executable, args)


def test_two_hosts_pass_and_each_gets_the_interface_toward_node_0(hosts, tmp_path):
    started = time.monotonic()
    report = _check(hosts, 2, hosts.addrs[0], 29631)  # no GLOO_SOCKET_IFNAME given
    took = time.monotonic() - started
    assert report.ok and took < 20, (took, str(report))
    assert [r.interface for r in report.rows] == [IFNAME, IFNAME]
    assert [r.address for r in report.rows] == hosts.addrs[:2]
    assert [report.env(n) for n in (0, 1)] == [{"GLOO_SOCKET_IFNAME": IFNAME}] * 2
    assert [(r.reaches_node0, r.mesh) for r in report.rows] == [("ok", "ok")] * 2
    import torch

    assert report.rows[0].versions == report.rows[1].versions
    assert f"torch {torch.__version__}" in report.rows[1].versions
    assert "holds master_addr" in report.rows[0].why and "route get" in report.rows[1].why
    if socket.gethostbyname(socket.gethostname()).startswith("127."):  # as on this project's CI
        assert "which gloo would advertise" in report.rows[1].why
    table = str(report)
    for word in ("reaches node 0", "mesh", "hosta", "hostb", f"GLOO_SOCKET_IFNAME={IFNAME}"):
        assert word in table, table
    print(f"clean check of 2 hosts: {took:.1f} s\n{table}")
    # What the user set stays theirs; with nccl, NCCL's variable is chosen too.
    nccl = _check(hosts, 2, hosts.addrs[0], 29631, backend="nccl",
                  user_env={"GLOO_SOCKET_IFNAME": IFNAME})  # fmt: skip
    assert [nccl.env(n) for n in (0, 1)] == [{"NCCL_SOCKET_IFNAME": IFNAME}] * 2
    # The chosen interfaces carry a real gloo all-reduce, as a Slurm job's first step runs
    # it, each node writing its choice for the torchrun step to source.
    nodes, problems = _meshcheck(hosts, tmp_path, 2, hosts.addrs[0], 29632)
    assert problems == [] and [n["all_reduce"] for n in nodes] == ["ok", "ok"], nodes
    for n in (0, 1):
        assert (tmp_path / f"net-{n}.env").read_text() == f"export GLOO_SOCKET_IFNAME={IFNAME}\n"
    assert not _no_leftovers(hosts)


def test_two_networks_each_host_picks_the_one_master_addr_is_on(hosts):
    # The default route (and SSH) go over ddpnb0; node 0's training address is on ddpnb1.
    with default_route(hosts):
        route = subprocess.run(["ip", "-n", hosts.namespaces[1], "-4", "route", "get",
                                "192.0.2.77"], capture_output=True, text=True).stdout  # fmt: skip
        assert f"dev {IFNAME}" in route
        report = _check(hosts, 3, hosts.train_addrs[0], 29633)
    assert [r.interface for r in report.rows] == [TRAIN_IFNAME] * 3, str(report)
    assert [r.address for r in report.rows] == hosts.train_addrs
    assert [report.env(n) for n in range(3)] == [{"GLOO_SOCKET_IFNAME": TRAIN_IFNAME}] * 3
    assert f"dev {TRAIN_IFNAME} src {hosts.train_addrs[2]}" in report.rows[2].why
    assert "holds master_addr" in report.rows[0].why


def test_a_firewall_dropping_the_rendezvous_port_is_named(hosts, nft):
    port = 29635
    nft(1, f"table inet ddpnbtest {{\n chain out {{\n type filter hook output priority 0\n"
           f"tcp dport {port} drop\n }}\n}}\n")  # fmt: skip
    started = time.monotonic()
    with pytest.raises(NetworkError) as e:
        _check(hosts, 3, hosts.addrs[0], port)
    took = time.monotonic() - started
    message = str(e.value)
    assert took < 30, took
    assert e.value.host == "hostb"
    assert f"hostb cannot reach node 0 (hosta) at {hosts.addrs[0]}:{port}" in message, message
    assert "timed out (a firewall drops it)" in message
    assert f"open TCP port {port} on node 0 (hosta) to hostb" in message
    assert "hostc cannot" not in message  # the other host is fine
    rows = e.value.report.rows
    assert [r.reaches_node0 for r in rows] == ["ok", "timed out", "ok"]
    assert [r.mesh for r in rows] == ["ok"] * 3  # ephemeral ports are still open
    print(f"rendezvous port dropped: named in {took:.1f} s")
    assert not _no_leftovers(hosts)


def test_ephemeral_ports_dropped_between_two_hosts_name_the_pair(hosts, nft, tmp_path):
    port = 29636
    # hostc drops new connections from hostb to every port but the rendezvous port.
    nft(2, f"table inet ddpnbtest {{\n chain in {{\n type filter hook input priority 0\n"
           f"ip saddr {hosts.addrs[1]} ct state new tcp dport != {port} drop\n }}\n}}\n")  # fmt: skip
    with pytest.raises(NetworkError) as e:
        _check(hosts, 3, hosts.addrs[0], port)
    message = str(e.value)
    assert f"hostb cannot connect to hostc at {hosts.addrs[2]}:" in message, message
    assert "(an ephemeral port, as gloo and NCCL use): timed out" in message
    assert "open TCP ports 32768-60999" in message or "ip_local_port_range" in message
    assert "on hostc to hostb" in message
    assert "cannot reach node 0" not in message and "hosta cannot" not in message
    rows = e.value.report.rows
    assert [r.reaches_node0 for r in rows] == ["ok"] * 3
    assert [r.mesh for r in rows] == ["ok", "cannot reach node 2", "ok"]
    # The Slurm step fails the same way, naming the pair, and runs no all-reduce.
    nodes, problems = _meshcheck(hosts, tmp_path, 3, hosts.addrs[0], port)
    said = meshcheck.explain(problems, "failed")
    assert "hostb cannot connect to hostc" in said and "ephemeral port" in said, said
    assert not any("all_reduce" in n for n in nodes)
    assert not _no_leftovers(hosts)


def test_loopback_master_addr_is_named_unless_every_node_is_one_host(hosts):
    # A host name that resolves to loopback (Debian's 127.0.1.1, this machine's 127.0.0.1)
    # passed as master_addr: every host would rendezvous with itself.
    with pytest.raises(NetworkError) as e:
        _check(hosts, 2, "127.0.0.1", 29637)
    message = str(e.value)
    assert "hostb resolves master_addr '127.0.0.1' to 127.0.0.1, its own loopback" in message
    assert f"use node 0's address ({hosts.addrs[0]}, {hosts.train_addrs[0]})" in message, message
    # Both nodes on one host (one network namespace): loopback is right, and chosen.
    ssh = Ssh(str(hosts.ssh_config))
    one = parse_hosts([hosts.names[0], hosts.names[0]])
    report = check_network(ssh, one, sys.executable, master_addr="127.0.0.1", master_port=29637)
    assert [r.interface for r in report.rows] == ["lo", "lo"] and report.ok
    assert not _no_leftovers(hosts)


# -- the check as part of launch(hosts=...) and `ddpnb check-hosts` ---------------------------

OWN = Path(__file__).with_name("own")


def _own_script(hosts, run_dir, **kwargs):
    import ddpnb

    script = ddpnb.Script(OWN / "linear.py", args=["1", "net"], files=[OWN / "datautils.py"])
    return ddpnb.launch(
        script, run_dir, hosts=hosts.names[:2], ssh_config=hosts.ssh_config, progress="none",
        **kwargs,
    )  # fmt: skip


def test_two_networks_a_script_trains_on_the_interface_of_master_addr(hosts, tmp_path):
    # SSH and the default route on ddpnb0, master_addr on ddpnb1: nobody sets an interface.
    with default_route(hosts):
        job = _own_script(hosts, tmp_path / "run", master_addr=hosts.train_addrs[0])
    assert [r["epoch"] for r in job.metrics.epochs] == [1]
    for n in (0, 1):  # the command each host ran names the interface the check chose
        command = "\n".join(job.log_paths[n].read_text().splitlines()[:2])
        assert f"GLOO_SOCKET_IFNAME={TRAIN_IFNAME}" in command, command
    assert (tmp_path / "run" / "model.pt").is_file()
    assert not _no_leftovers(hosts)


def test_launch_names_a_dropped_rendezvous_port_before_training(hosts, nft, tmp_path):

    port = 29637
    nft(1, f"table inet ddpnbtest {{\n chain out {{\n type filter hook output priority 0\n"
           f"tcp dport {port} drop\n }}\n}}\n")  # fmt: skip
    started = time.monotonic()
    with pytest.raises(NetworkError, match=f"hostb cannot reach node 0.*:{port}"):
        _own_script(hosts, tmp_path / "run", master_port=port)
    assert time.monotonic() - started < 30
    assert not list((tmp_path / "run" / "logs").glob("node-*.log"))  # no torchrun started
    assert not _no_leftovers(hosts)
    cli = [sys.executable, "-m", "ddpnb", "check-hosts", "--hosts", ",".join(hosts.names[:2]),
           "--ssh-config", str(hosts.ssh_config)]  # fmt: skip
    bad = subprocess.run([*cli, "--master-port", str(port)], capture_output=True, text=True)
    assert bad.returncode == 1 and "timed out (a firewall drops it)" in bad.stderr, bad.stderr
    good = subprocess.run([*cli, "--master-port", str(port + 1)], capture_output=True, text=True)
    assert good.returncode == 0, good.stderr
    assert "reaches node 0" in good.stdout and f"GLOO_SOCKET_IFNAME={IFNAME}" in good.stdout
    usage = subprocess.run([*cli, "--master-port", "x"], capture_output=True, text=True)
    assert usage.returncode == 2
