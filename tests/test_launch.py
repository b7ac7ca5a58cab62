"""`orthon launch`: the msrun lines and rank table, the torchrun line, the sbatch script and the Ray lines
are checked against their structure (torchrun's own argument parser reads the torchrun lines, bash
checks the script's syntax, orthon's RL recipe loader reads the driver's overrides), and bad input
fails with a message naming what is wrong."""
from __future__ import annotations

import json
import shlex
import subprocess

import pytest

from orthon.core.errors import ConfigError
from orthon.launch import cli
from orthon.launch.launchers import (msrun_commands, msrun_layout, orthon_command, ray_commands, torchrun_argv,
                                    torchrun_takes_shutdown_timeout)
from orthon.launch.rank_table import parse_host_list, rank_table
from orthon.launch.sbatch import parse_env, sbatch_script
from pretrain_support import ROOT

HOSTS = """\
# two 910B nodes, two NPUs each
10.0.0.1  192.168.1.1 192.168.1.2
10.0.0.2  192.168.2.1 192.168.2.2   # second node
"""


def _torchrun_args(argv):
    from torch.distributed.run import get_args_parser

    assert argv[0] == "torchrun"
    return get_args_parser().parse_args(argv[1:])


def _flags(words):
    """{flag: value} of msrun-style --flag=value words."""
    return dict(w[2:].split("=", 1) for w in words)


def _launch(capsys, *argv):
    code = cli.main(["launch", *map(str, argv)])
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------ torchrun
def test_torchrun_line_for_many_nodes_is_what_torchrun_parses():
    argv = torchrun_argv(["pretrain", "-c", "configs/glm5.yaml", "train.parallel=fsdp"], nnodes=4, nproc_per_node=8,
                         rdzv_endpoint="node0:29500", rdzv_id="glm5-run")
    args = _torchrun_args(argv)
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend) == ("4", "8", "c10d")
    assert (args.rdzv_endpoint, args.rdzv_id, args.standalone) == ("node0:29500", "glm5-run", False)
    assert args.module and args.training_script == "orthon.launch.cli"
    assert args.training_script_args == ["pretrain", "-c", "configs/glm5.yaml", "train.parallel=fsdp"]
    # A SIGTERM gives the workers 300 s to checkpoint before torchrun kills them (its own default: 30 s);
    # an older torchrun without the flag (torch 2.11's) gets a line without it.
    assert getattr(args, "shutdown_timeout", None) == (300 if torchrun_takes_shutdown_timeout() else None)
    assert getattr(_torchrun_args(torchrun_argv(["smoke"], stop_grace=0)), "shutdown_timeout", None) is None


def test_torchrun_on_one_node_is_standalone_and_ipv6_endpoints_keep_brackets():
    args = _torchrun_args(torchrun_argv(["smoke", "-c", "configs/tiny.yaml"], nproc_per_node=2))
    assert args.standalone and (args.nnodes, args.nproc_per_node) == ("1", "2")
    args = _torchrun_args(torchrun_argv(["smoke"], nnodes=2, rdzv_endpoint="[fd00::1]:29500"))
    assert args.rdzv_endpoint == "[fd00::1]:29500"


@pytest.mark.parametrize("kwargs, message", [
    (dict(nnodes=2), "2 nodes need a rendezvous endpoint"),
    (dict(nnodes=2, rdzv_endpoint="node0"), "'node0' is not HOST:PORT"),
    (dict(nnodes=2, rdzv_endpoint="node0:80"), "port 80 must be an integer in 1024..65535"),
    (dict(nproc_per_node=0), "nproc-per-node: must be a positive integer, got 0"),
    (dict(stop_grace=-1), "stop-grace: must be a whole number of seconds >= 0, got -1"),
])
def test_torchrun_bad_settings_name_what_is_wrong(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        torchrun_argv(["pretrain"], **kwargs)


def test_the_orthon_command_must_be_one():
    assert orthon_command(["--", "pretrain", "-c", "x"], cli.COMMANDS) == ["pretrain", "-c", "x"]
    with pytest.raises(ConfigError, match="no orthon command to launch: put it after --"):
        orthon_command(["--"], cli.COMMANDS)
    with pytest.raises(ConfigError, match="'pretrian' is not an orthon command"):
        orthon_command(["pretrian"], cli.COMMANDS)
    with pytest.raises(ConfigError, match="cannot launch itself"):
        orthon_command(["launch", "torchrun"], cli.COMMANDS)


# ------------------------------------------------------------------ msrun + rank table
def test_rank_table_of_a_host_list():
    table = rank_table(parse_host_list(HOSTS))
    assert table == {
        "version": "1.0", "server_count": "2", "status": "completed",
        "server_list": [
            {"server_id": "10.0.0.1", "device": [
                {"device_id": "0", "device_ip": "192.168.1.1", "rank_id": "0"},
                {"device_id": "1", "device_ip": "192.168.1.2", "rank_id": "1"}]},
            {"server_id": "10.0.0.2", "device": [
                {"device_id": "0", "device_ip": "192.168.2.1", "rank_id": "2"},
                {"device_id": "1", "device_ip": "192.168.2.2", "rank_id": "3"}]},
        ],
    }


def test_one_node_without_device_ips_gets_a_table_of_its_devices():
    table = rank_table(parse_host_list("node-a\n"), devices_per_node=8)
    assert [d["rank_id"] for d in table["server_list"][0]["device"]] == [str(i) for i in range(8)]
    assert all("device_ip" not in d for d in table["server_list"][0]["device"])


@pytest.mark.parametrize("text, message", [
    ("", "host list: empty"),
    ("# only a comment\n", "host list: empty"),
    ("10.0.0.1 192.168.1.1\n10.0.0.1 192.168.2.1\n", "10.0.0.1 appears twice \\(lines 1 and 2\\)"),
    ("10.0.0.1 192.168.1.1\n10.0.0.2 192.168.1.1\n", "device IP 192.168.1.1 appears twice"),
    ("10.0.0.1 192.168.1.1 192.168.1.2\n10.0.0.2 192.168.2.1\n", "different numbers of device IPs"),
    ("10.0.0.1 192.168.1.1\n10.0.0.2\n", "line 2: 10.0.0.2 lists no device IPs"),
    ("10.0.0.1 192.168.1.x\n", "line 1: device IP '192.168.1.x' is not an IP address"),
    ("bad_host! 192.168.1.1\n", "line 1: 'bad_host!' is not a host name or IP address"),
])
def test_bad_host_lists_name_the_problem(text, message):
    with pytest.raises(ConfigError, match=message):
        rank_table(parse_host_list(text))


def test_msrun_lines_one_a_node():
    commands = msrun_commands(["pretrain", "-c", "configs/glm5.yaml"], 16, 8, ["10.0.0.1", "10.0.0.2"],
                              rank_table_file="/shared/rank_table.json", cluster_time_out=300)
    assert [c.node for c in commands] == [0, 1] and [c.host for c in commands] == ["10.0.0.1", "10.0.0.2"]
    for rank, command in enumerate(commands):
        argv = command.argv
        assert argv[0] == "msrun"
        task = argv.index("python")
        assert _flags(argv[1:task]) == {
            "worker_num": "16", "local_worker_num": "8", "master_addr": "10.0.0.1", "master_port": "8118",
            "node_rank": str(rank), "log_dir": "msrun_log", "join": "True", "cluster_time_out": "300",
            "rank_table_file": "/shared/rank_table.json"}
        assert argv[task:] == ["python", "-m", "orthon.launch.cli", "pretrain", "-c", "configs/glm5.yaml"]


@pytest.mark.parametrize("args, expected", [
    ((16, None, 2), (16, 8, 2)), ((None, 8, 4), (32, 8, 4)), ((8, None, None), (8, 8, 1)), ((16, 8, None), (16, 8, 2)),
])
def test_msrun_layout_derives_the_missing_counts(args, expected):
    assert msrun_layout(*args) == expected


@pytest.mark.parametrize("args, message", [
    ((12, 8, None), "12 workers do not divide into nodes of 8 local workers"),
    ((12, None, 5), "12 workers do not divide among 5 nodes"),
    ((12, 4, 2), "12 workers is not 2 nodes x 4 local workers"),
    ((None, None, None), "give the total number of workers"),
    ((0, None, None), "worker-num: must be a positive integer, got 0"),
])
def test_msrun_worker_counts_that_do_not_divide_are_refused(args, message):
    with pytest.raises(ConfigError, match=message):
        msrun_layout(*args)


def test_orthon_launch_msrun_writes_the_rank_table_and_prints_each_node(tmp_path, capsys):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text(HOSTS)
    table = tmp_path / "rt.json"
    code, out, _ = _launch(capsys, "msrun", "--hosts", hosts, "--rank-table", table, "--",
                           "pretrain", "-c", "configs/glm5.yaml", "backend=mindspore", "mindspore.device_target=Ascend")
    assert code == 0
    assert json.loads(table.read_text()) == rank_table(parse_host_list(HOSTS))
    lines = [line for line in out.splitlines() if not line.startswith("#")]
    comments = [line for line in out.splitlines() if line.startswith("#")]
    assert comments[1:] == ["# node 0 (10.0.0.1)", "# node 1 (10.0.0.2)"] and str(table) in comments[0]
    assert [_flags(shlex.split(line)[1:10])["node_rank"] for line in lines] == ["0", "1"]
    assert all(f"--rank_table_file={table}" in shlex.split(line) for line in lines)


def test_orthon_launch_msrun_bad_input_is_one_line(tmp_path, capsys):
    hosts = tmp_path / "hosts.txt"
    hosts.write_text("10.0.0.1 192.168.1.1\n10.0.0.1 192.168.1.2\n")
    code, out, err = _launch(capsys, "msrun", "--hosts", hosts, "--", "pretrain")
    assert code == 2 and out == ""
    assert err.strip() == ("orthon launch: config error: host list: 10.0.0.1 appears twice (lines 1 and 2); "
                           "each node once")
    code, _, err = _launch(capsys, "msrun", "--worker-num", "12", "--local-worker-num", "8", "--", "pretrain")
    assert code == 2 and "12 workers do not divide into nodes of 8 local workers" in err


def test_msrun_run_without_mindspore_names_the_extra(capsys, monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    code, _, err = _launch(capsys, "msrun", "--worker-num", "2", "--run", "--", "pretrain", "backend=mindspore")
    assert code == 2 and "msrun is not on the PATH; it comes with MindSpore: pip install orthon[mindspore]" in err


# ------------------------------------------------------------------ slurm
def _directives(script):
    return dict(line.split(None, 1)[1][2:].split("=", 1) if "=" in line else (line.split(None, 1)[1][2:], None)
                for line in script.splitlines() if line.startswith("#SBATCH"))


def test_sbatch_script_structure(tmp_path):
    script = sbatch_script(["pretrain", "-c", "configs/glm5.yaml", "train.run_dir=$SCRATCH/glm5"], nodes=4,
                           gpus_per_node=8, cpus_per_task=96, time="2-00:00:00", partition="gpu", account="llm",
                           env=parse_env(["NCCL_SOCKET_IFNAME=ib0", "NCCL_DEBUG=INFO"]))
    assert script.startswith("#!/bin/bash\n")
    assert _directives(script) == {"job-name": "orthon", "nodes": "4", "ntasks-per-node": "1", "gpus-per-node": "8",
                                   "cpus-per-task": "96", "time": "2-00:00:00", "partition": "gpu", "account": "llm",
                                   "output": "%x-%j.out", "exclusive": None, "signal": "TERM@300"}
    lines = script.splitlines()
    assert 'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)' in lines
    assert "MASTER_PORT=29500" in lines
    exports = dict(line[len("export "):].split("=", 1) for line in lines if line.startswith("export ") and "=" in line)
    assert exports == {"NCCL_DEBUG": "INFO", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1", "NCCL_SOCKET_IFNAME": "ib0",
                       "OMP_NUM_THREADS": "12"}
    srun = [line for line in lines if line.startswith("srun ")]
    assert len(srun) == 1
    words = shlex.split(srun[0])
    assert words[:2] == ["srun", "--kill-on-bad-exit=1"]
    args = _torchrun_args(words[2:])
    assert (args.nnodes, args.nproc_per_node, args.rdzv_backend) == ("$SLURM_NNODES", "8", "c10d")
    assert (args.rdzv_endpoint, args.rdzv_id) == ("$MASTER_ADDR:$MASTER_PORT", "$SLURM_JOB_ID")
    # as long as Slurm's --signal=TERM@300 leaves before the time limit (torchrun of torch 2.11: its own 30 s)
    assert getattr(args, "shutdown_timeout", None) == (300 if torchrun_takes_shutdown_timeout() else None)
    assert args.module and args.training_script_args == ["pretrain", "-c", "configs/glm5.yaml",
                                                         "train.run_dir=$SCRATCH/glm5"]
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0


@pytest.mark.parametrize("kwargs, message", [
    (dict(nodes=0, gpus_per_node=8), "nodes: must be a positive integer, got 0"),
    (dict(nodes=1, gpus_per_node=8, cpus_per_task=4), "4 CPUs for 8 GPU processes"),
    (dict(nodes=1, gpus_per_node=8, time="two days"), "'two days' is not a Slurm time limit"),
    (dict(nodes=1, gpus_per_node=8, partition="gpu; rm -rf"), "partition: 'gpu; rm -rf' may hold only"),
    (dict(nodes=1, gpus_per_node=8, stop_grace=-5), "stop-grace: must be a whole number of seconds >= 0, got -5"),
])
def test_sbatch_bad_settings(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        sbatch_script(["pretrain"], **kwargs)
    with pytest.raises(ConfigError, match="'NCCL DEBUG' is not KEY=VALUE"):
        parse_env(["NCCL DEBUG"])


def test_orthon_launch_slurm_writes_the_script(tmp_path, capsys):
    path = tmp_path / "glm5.sbatch"
    code, out, _ = _launch(capsys, "slurm", "--nodes", 2, "--gpus-per-node", 4, "--script", path, "--", "smoke", "-c",
                           "configs/tiny.yaml")
    assert code == 0 and out == f"# wrote {path}\nsbatch {path}\n"
    assert _directives(path.read_text())["nodes"] == "2"
    _launch(capsys, "slurm", "--stop-grace", 0, "--script", path, "--", "smoke", "-c", "configs/tiny.yaml")
    script = path.read_text()
    assert "signal" not in _directives(script) and "--shutdown-timeout" not in script


# ------------------------------------------------------------------ ray
def test_ray_lines_and_the_rl_driver_overrides_load():
    from orthon.rl.recipe import load_rl_recipe

    commands = ray_commands(["rl", "-c", "configs/rl_tiny.yaml", "--from", "runs/tiny_arith"], nodes=3,
                            head_address="10.0.0.1", num_gpus=8)
    assert [c.argv for c in commands[:3]] == [
        ["ray", "start", "--head", "--port=6379", "--num-gpus=8"],
        ["ray", "start", "--address=10.0.0.1:6379", "--num-gpus=8"],
        ["ray", "start", "--address=10.0.0.1:6379", "--num-gpus=8"]]
    driver = commands[3]
    assert driver.node == 0 and driver.argv[:6] == ["orthon", "rl", "-c", "configs/rl_tiny.yaml", "--from",
                                                   "runs/tiny_arith"]
    overrides = driver.argv[6:]
    assert overrides == ["rl.cluster.enabled=true", "rl.cluster.address=auto"]
    recipe = load_rl_recipe(ROOT / "configs/rl_tiny.yaml", overrides)
    assert recipe.rl.cluster.enabled is True and recipe.rl.cluster.address == "auto"


def test_ray_keeps_a_given_address_and_refuses_what_cannot_run():
    commands = ray_commands(["rl", "rl.cluster.address=ray://head:10001"])
    assert commands[-1].argv == ["orthon", "rl", "rl.cluster.address=ray://head:10001", "rl.cluster.enabled=true"]
    with pytest.raises(ConfigError, match="starts RL on a Ray cluster"):
        ray_commands(["pretrain", "-c", "x"])
    with pytest.raises(ConfigError, match="turns the Ray cluster off"):
        ray_commands(["rl", "rl.cluster.enabled=false"])
    with pytest.raises(ConfigError, match="3 nodes need the head node's address"):
        ray_commands(["rl"], nodes=3)
