"""Real hosts over SSH: two network namespaces on a bridge, each with Debian's sshd.

Needs root, iproute2 and openssh-server (``.ci/run`` installs it). Every test reaches
the hosts through the ``ssh_config`` the fixture writes; nothing of this machine's own
SSH setup is used or changed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import nbformat
import pytest
from conftest import tiny_config, wait_for_hang
from sshhosts import ssh_hosts

import ddpnb
from ddpnb.errors import ConfigError, HostError, NodeLost, WorkerFailed

pytestmark = [pytest.mark.slow, pytest.mark.netns]


@pytest.fixture(scope="module")
def hosts(tmp_path_factory):
    with ssh_hosts(tmp_path_factory.mktemp("ssh"), os.getpid() % 1000) as h:
        yield h
        assert not h.leftovers(), h.leftovers()  # no test left a process on a host


def _launch(hosts, cfg, run_dir, names, **kwargs):
    return ddpnb.launch(
        cfg,
        run_dir,
        hosts=names,
        ssh_config=kwargs.pop("ssh_config", hosts.ssh_config),
        env=kwargs.pop("env", None),  # no interface variable: ddpnb chooses it
        progress="none",
        **kwargs,
    )


def _no_leftovers(hosts, within: float = 10.0) -> dict:
    deadline = time.time() + within
    while hosts.leftovers() and time.time() < deadline:
        time.sleep(0.2)
    return hosts.leftovers()


def test_two_hosts_train_like_two_simulated_nodes_from_the_cli(
    hosts, tiny_data, layout_run, tmp_path
):
    """``ddpnb train --hosts`` (the CLI calls the same launch as the API and the notebooks)."""
    cfg = tiny_config(tiny_data, threads=1)
    cfg.save(tmp_path / "cfg.json")
    run = (
        tmp_path / "my run 'one'"
    )  # spaces and quotes reach the hosts' shells quoted, never as code
    cmd = [sys.executable, "-m", "ddpnb", "train", "--config", str(tmp_path / "cfg.json"),
           "--run-dir", str(run), "--hosts", ",".join(hosts.names),
           "--ssh-config", str(hosts.ssh_config)]  # fmt: skip
    out = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "hosts hosta, hostb" in out.stdout  # the start line names them
    got, simulated = ddpnb.load_metrics(run), layout_run("2x1").metrics
    assert [r["epoch"] for r in got.epochs] == [1, 2]
    assert got.final["world_size"] == 2
    assert got.final["val_samples"] == simulated.final["val_samples"]
    # Same seed, same shards, same averaged gradients: the same numbers as simulated nodes.
    for key in ("train_loss", "val_acc", "val_loss"):
        assert got.series(key) == pytest.approx(simulated.series(key), rel=1e-5), key
    assert {recs[-1]["node_rank"] for recs in got.ranks.values()} == {0, 1}
    assert "ssh" in (run / "logs" / "node-1.log").read_text().splitlines()[0]  # the command
    assert not _no_leftovers(hosts)


def _checksums_agree(metrics) -> None:
    """After every epoch, every rank held the same weights."""
    by_epoch = {}
    for records in metrics.ranks.values():
        for r in records:
            by_epoch.setdefault(r["epoch"], set()).add(r["param_checksum"])
    assert all(len(sums) == 1 for sums in by_epoch.values()), by_epoch


def test_resume_and_a_restart_without_the_shared_filesystem(hosts, tiny_data, tmp_path):
    """Hosts that see none of the launcher's files (a private tmpfs at private_root): the run
    is copied out and brought back; only node 0's disk holds the checkpoint, and rank 0 sends
    it to every rank on a resume and on a torchrun restart. About 100 s: five trainings over
    SSH, each the proof of the next step (resume and restart need a run that came back)."""
    run = hosts.private_root / f"resume-{os.getpid()}"
    try:
        cfg = tiny_config(tiny_data, threads=1, epochs=2)
        job = _launch(hosts, cfg, run, hosts.private)
        assert job.scheduler.shared == [False, False]
        metrics = ddpnb.load_metrics(run)
        assert [r["epoch"] for r in metrics.epochs] == [1, 2]
        assert sorted(metrics.ranks) == [0, 1]  # both hosts' rank records came back
        assert all(len(recs) == 2 for recs in metrics.ranks.values())
        assert (run / "logs" / "node-1").is_dir()
        # Node 0's run directory comes back whole: what the script wrote, checkpoints too.
        assert (run / "checkpoints" / "last.pt").is_file()
        assert "last.pt" in hosts.in_private(0, ["ls", str(run / "checkpoints")]).stdout
        listing = hosts.in_private(1, ["ls", str(run)])
        assert "checkpoints" not in listing.stdout.split()  # node 1 never had one
        job = _launch(hosts, cfg.replace(epochs=3), run, hosts.private, resume=True)
        assert [r["epoch"] for r in job.metrics.epochs] == [1, 2, 3]  # each once
        assert "(node 0's, sent by rank 0) after epoch 2" in job.log_tail(1, 400)
        _checksums_agree(job.metrics)
        # A torchrun restart on such hosts: rank 1 is killed in epoch 2 and restarts.
        restarted = _launch(
            hosts,
            cfg.replace(epochs=3),
            run / "restart",
            hosts.private,
            max_restarts=1,
            env={"DDPNB_FAULT": "rank=1,epoch=2,step=2"},
        )
        rows = restarted.metrics.epochs
        assert [r["epoch"] for r in rows] == [1, 2, 3]
        assert [r["restart_count"] for r in rows] == [0, 1, 1]
        assert "after epoch 1" in restarted.log_tail(1, 400)
        _checksums_agree(restarted.metrics)
        # The hosts still hold that run when the launcher's copy is gone: refused, nothing
        # changed there; overwrite=True replaces what they held.
        shutil.rmtree(run / "restart")
        with pytest.raises(HostError, match=r"already holds a run \(found .*checkpoints"):
            _launch(hosts, cfg, run / "restart", hosts.private)
        assert "last.pt" in hosts.in_private(0, ["ls", str(run / "restart" / "checkpoints")]).stdout
        stale = run / "restart" / "logs" / "stale"  # what only the old run had
        assert hosts.in_private(1, ["touch", str(stale)]).returncode == 0
        again = _launch(
            hosts, cfg.replace(epochs=1), run / "restart", hosts.private, overwrite=True
        )
        assert [r["epoch"] for r in again.metrics.epochs] == [1]
        assert [r["restart_count"] for r in again.metrics.epochs] == [0]
        assert hosts.in_private(1, ["test", "-e", str(stale)]).returncode == 1
    finally:
        shutil.rmtree(run, ignore_errors=True)
    assert not _no_leftovers(hosts)


def test_a_worker_that_raises_names_its_host(hosts, tiny_data, tmp_path):
    cfg = tiny_config(tiny_data, threads=1, epochs=3)
    start = time.time()
    with pytest.raises(WorkerFailed) as info:
        _launch(
            hosts,
            cfg,
            tmp_path / "run",
            hosts.names,
            env={"DDPNB_FAULT": "rank=1,epoch=1,step=1,mode=raise"},
        )
    err = info.value
    assert (err.host, err.node_rank, err.global_rank, err.exit_code) == ("hostb", 1, 1, 1)
    assert "DDPNB_FAULT injected failure" in err.traceback
    assert time.time() - start < 60
    assert not _no_leftovers(hosts)


@pytest.mark.parametrize(
    "case",
    ["unreachable", "wrong key", "no interpreter", "other data", "quoted paths"],
)
def test_preflight_names_the_host_before_anything_starts(hosts, tiny_data, tmp_path, case):
    cfg = tiny_config(tiny_data, threads=1)
    names, kwargs = list(hosts.names), {}
    if case == "unreachable":
        names[1] = f"root@{hosts.addrs[0].rsplit('.', 1)[0]}.250"  # nothing answers there
    elif case == "wrong key":
        config = hosts.ssh_config.read_text().replace("IdentityFile ", "IdentityFile /nonexistent")
        kwargs["ssh_config"] = tmp_path / "other_ssh_config"
        kwargs["ssh_config"].write_text(config)
    elif case == "no interpreter":
        kwargs["python"] = "/opt/no such/python"
    elif case == "other data":
        data = hosts.private_root / f"data-{os.getpid()}"
        for n, drop in ((0, False), (1, True)):
            hosts.in_private(n, ["cp", "-r", str(tiny_data), str(data)])
            if drop:  # host b's copy lacks one image
                victim = sorted((tiny_data / "train" / "3").iterdir())[0].name
                hosts.in_private(n, ["rm", str(data / "train" / "3" / victim)])
        cfg = cfg.replace(data_dir=str(data))
        names = hosts.private
    elif case == "quoted paths":
        cfg = cfg.replace(data_dir=str(tmp_path / "my data 'x'"))
    start = time.time()
    with pytest.raises((HostError, ConfigError)) as info:
        _launch(hosts, cfg, tmp_path / "run dir", names, **kwargs)
    elapsed = time.time() - start
    message = str(info.value)
    assert elapsed < 20, elapsed
    assert not (tmp_path / "run dir" / "logs").exists()  # nothing started
    expected = {
        "unreachable": (names[1], "could not be reached"),
        "wrong key": ("hosta", "refused the login"),
        "no interpreter": ("hosta", "no Python interpreter at /opt/no such/python"),
        "other data": ("hostb-private", "differs from node 0's"),
        "quoted paths": ("hosta", "my data 'x'"),
    }[case]
    assert all(part in message for part in expected), message
    if case == "quoted paths":
        assert "no dataset at" in message
    if case == "other data":
        assert "hosta-private holds" not in message and "rsync -a" in message


KERNEL_KILL = textwrap.dedent(
    """
    import json, sys
    import ddpnb
    args = json.loads(sys.argv[1])
    job = ddpnb.launch(ddpnb.TrainConfig.from_dict(args["config"]), args["run_dir"],
                       hosts=args["hosts"], ssh_config=args["ssh_config"],
                       progress="none", wait=False)
    print("started", flush=True)
    job.wait()
    """
)


@pytest.mark.parametrize("how", ["sigkill", "sigint", "sigterm-cli"])
def test_the_launcher_ending_ends_every_host(hosts, tiny_data, tmp_path, how):
    """The launcher killed, interrupted or terminated mid-run: no process is left on any host.

    About 35 s each: a launch on two hosts (preflight, network check, two torchruns) must
    be training before the launcher is ended; then the hosts' agents get their grace."""
    cfg = tiny_config(tiny_data, threads=1, epochs=200)
    run = tmp_path / "run"
    if how in ("sigkill", "sigint"):  # a kernel killed outright, or a cell interrupted
        args = {"config": cfg.to_dict(), "run_dir": str(run), "hosts": hosts.names,
                "ssh_config": str(hosts.ssh_config)}  # fmt: skip
        cmd = [sys.executable, "-c", KERNEL_KILL, json.dumps(args)]
        sig = (
            signal.SIGKILL if how == "sigkill" else signal.SIGINT
        )  # SIGINT: Ctrl-C, a cell interrupt
    else:
        cfg.save(tmp_path / "cfg.json")
        cmd = [sys.executable, "-m", "ddpnb", "train", "--config", str(tmp_path / "cfg.json"),
               "--run-dir", str(run), "--hosts", ",".join(hosts.names),
               "--ssh-config", str(hosts.ssh_config), "--threads", "1"]  # fmt: skip
        sig = signal.SIGTERM
    env = dict(os.environ)
    launcher = subprocess.Popen(
        cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        deadline = time.time() + 90
        while not (run / "metrics.jsonl").exists():  # both hosts are training
            assert launcher.poll() is None and time.time() < deadline, launcher.communicate()
            time.sleep(0.2)
        assert all(len(hosts.ns_pids(n)) > 2 for n in range(2))  # agents and workers there
        launcher.send_signal(sig)
        killed_at = time.time()
        left = _no_leftovers(hosts, within=10)
        print(f"hosts empty {time.time() - killed_at:.1f} s after {how}")
        assert not left, left
        if how == "sigterm-cli":
            assert launcher.wait(timeout=10) == 128 + signal.SIGTERM
        if how == "sigint":
            _, err = launcher.communicate(timeout=10)
            assert "RunInterrupted: the run in" in err and "no process of it is left" in err
    finally:
        if launcher.poll() is None:
            launcher.kill()
        launcher.communicate()


def test_a_cut_link_is_a_lost_node_named_by_host(hosts, tiny_data, tmp_path):
    """About 50 s: a cut link is seen only when gloo's timeout (20 s here) runs out on the
    surviving host; then the run resumes over the mended link."""
    cfg = tiny_config(tiny_data, threads=1, epochs=200, timeout_seconds=20)
    job = _launch(hosts, cfg, tmp_path / "run", hosts.names, wait=False)
    try:
        deadline = time.time() + 90
        while not job.metrics.epochs:
            assert job.running and time.time() < deadline, job.log_tail(1)
            time.sleep(0.2)
        subprocess.run(["ip", "link", "set", hosts.links[1], "down"], check=True)
        cut_at = time.time()
        with pytest.raises(NodeLost) as info:
            job.wait()
        elapsed = time.time() - cut_at
    finally:
        subprocess.run(["ip", "link", "set", hosts.links[1], "up"], check=True)
        job.stop()
    assert info.value.host == "hostb" and info.value.node_rank == 1, str(info.value)
    assert "resume=True" in str(info.value)
    assert elapsed < cfg.timeout_seconds + 30, elapsed
    assert not _no_leftovers(hosts, within=cfg.timeout_seconds + 15)
    # The run is resumable: from node 0's last checkpoint, to one more epoch.
    done = len(job.metrics.epochs)
    cfg = cfg.replace(epochs=done + 1)
    job = _launch(hosts, cfg, tmp_path / "run", hosts.names, resume=True)
    assert [r["epoch"] for r in job.metrics.epochs] == list(range(1, done + 2))


def test_bad_arguments_are_refused_before_any_ssh(tiny_data, tmp_path):
    cfg = tiny_config(tiny_data)
    with pytest.raises(ConfigError, match="leave nnodes out"):
        ddpnb.launch(cfg, tmp_path / "a", hosts=["a", "b"], nnodes=3)
    with pytest.raises(ConfigError, match="leading '-'"):
        ddpnb.launch(cfg, tmp_path / "b", hosts=["-oProxyCommand=touch /tmp/x"])
    with pytest.raises(ConfigError, match="no spaces"):
        ddpnb.launch(cfg, tmp_path / "b", hosts=["gpu1", "my host"])
    with pytest.raises(ConfigError, match="need hosts"):
        ddpnb.launch(cfg, tmp_path / "c", ssh_config="x")
    assert not Path(tmp_path / "a").exists()


def _run_notebook_07(tmp_path, **params):
    import papermill

    from ddpnb.demo import NOTEBOOKS, ipc_kernel_manager

    out = tmp_path / "07.ipynb"
    papermill.execute_notebook(
        str(NOTEBOOKS / "07_real_machines.ipynb"),
        str(out),
        parameters={"progress": "text", **params},
        kernel_name="python3",
        execution_timeout=300,
        cwd=str(tmp_path),
        progress_bar=False,
        kernel_manager_class=ipc_kernel_manager(),
    )
    nb = nbformat.read(out, as_version=4)
    text = "".join(o.get("text", "") for c in nb.cells for o in c.get("outputs", []))
    return text


def test_notebook_07_with_no_hosts_teaches_and_starts_nothing(tiny_data, tmp_path):
    text = _run_notebook_07(tmp_path, data_dir=str(tiny_data))
    assert "hosts is empty: nothing was started." in text
    assert "# node 1:\nssh -t -- gpu2 'cd " in text and "--node_rank=1" in text  # to paste
    assert "reaches node 0" in text and "what it proves" in text  # what the check would do
    assert "nothing was started" in text and not (tmp_path / "runs").exists()


def test_notebook_07_on_two_hosts(hosts, tiny_data, layout_run, tmp_path):
    """Notebook 07 top to bottom on two SSH hosts, its curves beside the simulated run's.

    About 45 s: a kernel, the preflight and network check, and a training on the hosts; the
    notebook is the product the learner runs, so it runs whole."""
    simulated = layout_run("2x1").run_dir
    text = _run_notebook_07(
        tmp_path,
        hosts=hosts.names,
        ssh_config=str(hosts.ssh_config),
        data_dir=str(tiny_data),
        run_dir=str(tmp_path / "real"),
        simulated_dir=str(simulated),
        batch_size=8,
        threads=1,
        max_steps_per_epoch=3,
    )
    run = ddpnb.load_metrics(tmp_path / "real")  # node 0's run directory, brought back
    assert len(run.epochs) == 2 and run.final["world_size"] == 2
    assert 0 <= run.final["val_acc"] <= 1 and "here now:" in text
    assert "hostb" in text and "reaches node 0" in text  # the preflight's table
    assert "GLOO_SOCKET_IFNAME=ddpnb0" in text  # the interface each host got, and why
    assert not _no_leftovers(hosts)


OWN = Path(__file__).with_name("own")


def test_your_own_script_on_hosts_without_the_shared_filesystem(hosts, tmp_path):
    """A user's script with a module beside it, copied to hosts that share nothing, its
    outputs brought back. About 40 s: a launch on two hosts with copies both ways."""
    run = hosts.private_root / f"own-{os.getpid()}"
    try:
        script = ddpnb.Script(OWN / "linear.py", args=["2", "x y"], files=[OWN / "datautils.py"])
        job = ddpnb.launch(
            script, run, hosts=hosts.private, ssh_config=hosts.ssh_config, progress="none"
        )
        assert job.scheduler.shared == [False, False]
        assert (run / "model.pt").is_file()  # written on node 0's host, brought back
        assert [r["epoch"] for r in job.metrics.epochs] == [1, 2]
        assert "args ['2', 'x y']" in (run / "logs" / "node-1.log").read_text()
        listing = hosts.in_private(1, ["ls", str(run)])  # the files were copied out
        assert {"linear.py", "datautils.py", "ddpnb_reporting.py"} <= set(listing.stdout.split())
    finally:
        shutil.rmtree(run, ignore_errors=True)
    assert not _no_leftovers(hosts)


def test_a_project_with_folders_on_hosts_without_the_shared_filesystem(hosts, monkeypatch):
    """Folders and relative paths reach each host's own run directory as they are."""
    monkeypatch.chdir(Path(__file__).with_name("project"))  # relative paths: from here
    run = hosts.private_root / f"project-{os.getpid()}"
    try:
        files = ["mypkg", "config", "data/tiny/train.txt"]
        script = ddpnb.Script("train.py", args=["config/small.json"], files=files)
        job = ddpnb.launch(
            script, run, hosts=hosts.private, ssh_config=hosts.ssh_config, progress="none"
        )
        assert job.scheduler.shared == [False, False]
        assert (run / "out" / "model.pt").is_file()  # written on node 0's host, brought back
        assert "rank 1 epoch 2 loss" in (run / "logs" / "node-1.log").read_text()
        listing = hosts.in_private(1, ["find", str(run), "-type", "f"])  # node 1's own copy
        there = {str(Path(p).relative_to(run)) for p in listing.stdout.split()}
        assert {"train.py", "mypkg/model.py", "config/small.json", "data/tiny/train.txt"} <= there
    finally:
        shutil.rmtree(run, ignore_errors=True)
    assert not _no_leftovers(hosts)


def test_a_hang_on_hosts_without_the_shared_filesystem_is_named_by_host(hosts, tmp_path):
    """The ranks' stacks are copied from each host's own run directory; the hang names them."""
    run = hosts.private_root / f"hang-{os.getpid()}"
    script = ddpnb.Script(Path(__file__).with_name("hangs") / "barrier_rank0.py")
    job = ddpnb.launch(
        script,
        run,
        hosts=hosts.private,
        ssh_config=hosts.ssh_config,
        progress="none",
        env={"DDPNB_WATCH_INTERVAL": "0.5"},
        hang_timeout=6,
        on_hang="wait",
        wait=False,
    )
    try:
        assert job.scheduler.shared == [False, False]
        wait_for_hang(job, 60)
        assert job.waiting is not None and job.waiting.kind == "hang", job.waiting
        stacks = job.stacks()
        lines = {r.rank: (r.node, r.line()) for r in stacks.ranks}
        assert lines[0][0] == 0 and lines[0][1].startswith(
            "rank 0 waits in barrier at barrier_rank0.py:"
        )
        assert lines[1][0] == 1 and "DDP's gradient all-reduce" in lines[1][1]
        assert "different collectives" in stacks.verdict.message
    finally:
        job.stop()
        shutil.rmtree(run, ignore_errors=True)
    assert not _no_leftovers(hosts)


def test_the_printed_ssh_lines_work_when_pasted(hosts, tmp_path):
    """ssh_commands' lines, run by a shell as a user would paste them, one per host."""
    run = tmp_path / "pasted run"  # a space: the lines quote it
    run.mkdir()
    for name in ("linear.py", "datautils.py"):
        shutil.copy(OWN / name, run / name)
    script = ddpnb.Script(OWN / "linear.py", args=["1", "x y"], files=[OWN / "datautils.py"])
    rows = ddpnb.check_hosts(None, hosts.names, ssh_config=hosts.ssh_config)
    lines = ddpnb.ssh_commands(
        script,
        run,
        hosts.names,
        ssh_config=hosts.ssh_config,
        python=sys.executable,
        network=rows.network,  # each host's interface toward node 0, as launch sets it
    )
    assert all("DDPNB_" not in line and "<ddpnb agent>" not in line for line in lines)
    shells = [
        subprocess.Popen(
            ["bash", "-c", line], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        for line in lines
    ]
    try:
        outs = [p.communicate(timeout=60)[0] for p in shells]
    finally:
        for p in shells:
            if p.poll() is None:
                p.kill()
    assert [p.returncode for p in shells] == [0, 0], outs
    assert "rank 0 of 2 args ['1', 'x y']" in outs[0] and "rank 1 of 2" in outs[1]
    assert (run / "model.pt").is_file()
    assert not _no_leftovers(hosts)


def test_aborts_on_hosts_without_the_shared_filesystem(hosts):
    """A mismatch's abort is named by gloo's words and each rank's line, from logs copied back
    from each host; a rank that aborts after its script ended leaves the run finished.

    About 50 s: two launches on the hosts, each with its preflight, network check and copies
    both ways; the path (logs and stacks copied back) is what differs from simulated nodes."""
    hangs = Path(__file__).with_name("hangs")
    run = hosts.private_root / f"abort-{os.getpid()}"
    launch = lambda name: ddpnb.launch(  # noqa: E731
        ddpnb.Script(hangs / name),
        run,
        hosts=hosts.private,
        ssh_config=hosts.ssh_config,
        progress="none",
        overwrite=True,
    )
    try:
        with pytest.raises(WorkerFailed) as caught:
            launch("uneven_abort.py")
        head = str(caught.value).splitlines()[0]
        assert caught.value.cause == "collective_mismatch" and caught.value.host is not None
        assert "Is there a distributed collective mismatch in your code?" in head
        assert "rank 0 in all_reduce at uneven_abort.py:" in head
        assert "rank 1 in DDP's gradient all-reduce inside backward at uneven_abort.py:" in head
        with pytest.warns(RuntimeWarning, match="The run finished"):
            job = launch("abort_at_exit.py")
        assert job.error is None and (run / "model.pt").is_file()
        assert "worker global rank 1 on node 1 was killed by SIGABRT" in job.warnings[0]
    finally:
        shutil.rmtree(run, ignore_errors=True)
    assert not _no_leftovers(hosts)
