import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import tiny_config

import ddpnb
from ddpnb.constants import free_port
from ddpnb.errors import ConfigError


def test_static_node_commands():
    cmds = ddpnb.node_commands(
        ddpnb.TrainConfig(),
        "/shared/run",
        hosts=["10.0.0.1", "10.0.0.2"],
        nproc_per_node=4,
        master_port=29400,
    )
    assert len(cmds) == 2
    for rank, cmd in enumerate(cmds):
        argv = shlex.split(cmd)
        assert argv[0] == "torchrun"
        assert f"--node_rank={rank}" in argv and "--nnodes=2" in argv
        assert "--master_addr=10.0.0.1" in argv and "--master_port=29400" in argv
        assert "--nproc_per_node=4" in argv
        assert argv[-3:] == ["/shared/run/train_ddp.py", "--config", "/shared/run/config.json"]


def test_c10d_node_commands_name_their_host_and_the_store_host():
    cmds = ddpnb.node_commands(ddpnb.TrainConfig(), "/r", hosts=["a", "b", "c"], rendezvous="c10d")
    assert all("--rdzv_backend=c10d" in c and "--rdzv_endpoint=a:29500" in c for c in cmds)
    # torchrun would guess both from the host name, which may resolve to another network.
    assert [c.count("is_host=1") for c in cmds] == [1, 0, 0]
    assert [f"--local_addr={h}" in c for h, c in zip("abc", cmds)] == [True] * 3
    assert len({c.replace("is_host=1", "is_host=0").split("--local_addr")[0] for c in cmds}) == 1


def test_node_rank_must_be_below_nnodes():
    with pytest.raises(ConfigError, match="node_rank < nnodes"):
        ddpnb.node_commands(ddpnb.TrainConfig(), "/r", hosts=["a", "b"], node_rank=2)


def test_public_master_address_warns():
    with pytest.warns(UserWarning, match="trusted private network"):
        ddpnb.node_commands(ddpnb.TrainConfig(), "/r", hosts=["8.8.8.8", "10.0.0.2"])


def test_slurm_script_content(tmp_path):
    text = ddpnb.slurm_script(
        ddpnb.TrainConfig(),
        "/shared/run",
        nnodes=4,
        nproc_per_node=8,
        gpus_per_node=8,
        path=tmp_path / "train.sbatch",
    )
    assert (tmp_path / "train.sbatch").read_text() == text
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        'scontrol show hostnames "$SLURM_JOB_NODELIST"',
        "srun --kill-on-bad-exit=1 --open-mode=append --output=/shared/run/logs/node-%n.log",
        'bash -c "$(declare -f run_node); run_node"',
        "exec torchrun \\\n        --nnodes=4 \\\n",
        '"--rdzv_conf=join_timeout=300,is_host=$(($SLURM_NODEID == 0))"',
        '"--local_addr=${addr:-$SLURMD_NODENAME}"',
        "--rdzv_backend=c10d",
        '"--rdzv_endpoint=$head_node:29500"',
        '"--rdzv_id=$SLURM_JOB_ID"',
        '"--log_dir=$run_dir/logs/node-$SLURM_NODEID"',
        'export DDPNB_RUN_DIR="$run_dir" DDPNB_LAUNCHED=1',  # ddpnb's worker reads them
        "At start-up the ranks compare dataset fingerprints",
        "--nproc_per_node=8",
        # each node's 8 workers share the CPUs Slurm gives the job there, unless it brought a count
        "export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cpus > 8 ? cpus / 8 : 1 ))}",
        "/shared/run/train_ddp.py \\\n        --config \\\n        /shared/run/config.json",
    ):
        assert line in text
    r = subprocess.run(["bash", "-n", str(tmp_path / "train.sbatch")])
    assert r.returncode == 0
    # A script of the user's, printed to submit by hand: nothing of ddpnb's worker in it.
    (tmp_path / "mine.py").write_text("print('hi')\n")
    mine = ddpnb.slurm_script(ddpnb.Script(tmp_path / "mine.py", args=["3"]), "/shared/own")
    assert "DDPNB_" not in mine and "fingerprint" not in mine and "unauthenticated" in mine
    assert "/shared/own/mine.py \\\n        3" in mine and "export run_dir=/shared/own" in mine


def test_cli_commands_and_slurm(tmp_path):
    r = subprocess.run(
        [sys.executable, "-m", "ddpnb", "commands", "--run-dir", "/r", "--hosts", "n1,n2"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "# on n1, node_rank 0 (master" in r.stdout and "--node_rank=1" in r.stdout
    assert "fingerprint" in r.stdout
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "ddpnb",
            "slurm",
            "--run-dir",
            "/r",
            "--nnodes",
            "3",
            "--out",
            str(tmp_path / "s.sbatch"),
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "#SBATCH --nodes=3" in (tmp_path / "s.sbatch").read_text()


@pytest.mark.slow
def test_nodes_with_different_data_refuse_to_train(tiny_data, data_copy, tmp_path):
    # Node 0 through the launcher, node 1 by hand with the printed command, but on a
    # copy of the data with one image changed: every rank must stop and name node 1.
    img = next((data_copy / "train" / "0").iterdir())
    img.write_bytes(
        (tiny_data / "train" / "1" / next((tiny_data / "train" / "1").iterdir()).name).read_bytes()
    )
    port = free_port()
    job = ddpnb.launch(
        tiny_config(tiny_data),
        tmp_path / "n0",
        nnodes=2,
        local_nodes=[0],
        master_port=port,
        wait=False,
        progress="none",
    )
    ddpnb.write_worker(tiny_config(data_copy), tmp_path / "n1")
    (cmd,) = ddpnb.node_commands(
        tiny_config(data_copy),
        tmp_path / "n1",
        hosts=["127.0.0.1"] * 2,
        master_port=port,
        node_rank=1,
    )
    argv = shlex.split(cmd)
    argv[0:1] = [sys.executable, "-m", "torch.distributed.run"]
    other = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    with pytest.raises(ddpnb.WorkerFailed, match="differs between nodes: node 1"):
        job.wait()
    assert other.returncode != 0 and "differs between nodes: node 1" in other.stdout + other.stderr


def test_a_free_port_is_below_the_ephemeral_range():
    """The kernel gives ephemeral ports to any outgoing connection: one could take the master
    port in the seconds before torchrun binds it (seen under a loaded test run)."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(20000 <= p < low for p in ports) and len(ports) > 1, ports
