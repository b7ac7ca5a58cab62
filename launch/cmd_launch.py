"""`orthon launch msrun|torchrun|slurm|ray [options] -- COMMAND ...`: the command lines that start an orthon
command on many processes, printed as a shell snippet to paste (a `# node N` comment above each node's
line), or with --run started here (this node's line). The lines come from orthon.launch.launchers,
orthon.launch.sbatch and orthon.launch.rank_table."""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from orthon.core.errors import ConfigError, OrthonError
from orthon.launch.launchers import STOP_GRACE

# cli.py leaves the CPU threads to the processes this command starts (it computes nothing itself).
STARTS_PROCESSES = True
# What to install when a launcher's program is missing (--run).
_PROGRAMS = {"msrun": "it comes with MindSpore: pip install orthon[mindspore]",
             "ray": "it comes with Ray: pip install orthon[rl]",
             "sbatch": "run this on a Slurm login node"}


def register(parser, name):
    sub = parser.add_subparsers(dest="launcher", metavar="LAUNCHER", required=True)
    ms = sub.add_parser("msrun", help="MindSpore's launcher (Ascend 910B): one msrun line a node, and the HCCL rank table")
    ms.add_argument("--worker-num", type=int, help="workers in all (default: nodes x local workers)")
    ms.add_argument("--local-worker-num", type=int, help="workers on each node (default: the devices the host list gives)")
    ms.add_argument("--nodes", type=int, help="number of nodes (default: the host list's, else 1)")
    ms.add_argument("--hosts", help="host list: one node a line, ADDRESS DEVICE_IP... (see orthon.launch.rank_table); "
                                    "writes the rank table and names the first host master")
    ms.add_argument("--rank-table", default="rank_table.json", help="where to write the rank table (with --hosts)")
    ms.add_argument("--node-rank", type=int, default=0, help="the node --run starts (default 0)")
    ms.add_argument("--master-addr", help="scheduler address (default: the first host, else 127.0.0.1)")
    ms.add_argument("--master-port", type=int, default=8118)
    ms.add_argument("--log-dir", default="msrun_log")
    ms.add_argument("--no-join", dest="join", action="store_false",
                    help="msrun returns once the workers start (default: it waits and reports failures)")
    ms.add_argument("--cluster-time-out", type=int, default=600, help="seconds to wait for every worker to join")
    ms.add_argument("--bind-core", action="store_true", help="bind each worker to its share of the CPU cores")
    tr = sub.add_parser("torchrun", help="torchrun (NVIDIA GPUs, or CPU processes over gloo)")
    tr.add_argument("--nnodes", type=int, default=1)
    tr.add_argument("--nproc-per-node", type=int, default=1, help="processes a node (one a GPU)")
    tr.add_argument("--rdzv-endpoint", help="HOST:PORT of the first node (needed for more than one node)")
    tr.add_argument("--rdzv-backend", default="c10d")
    tr.add_argument("--rdzv-id", default="orthon", help="the job's name in the rendezvous")
    tr.add_argument("--max-restarts", type=int, default=0)
    tr.add_argument("--stop-grace", type=int, default=STOP_GRACE, metavar="SECONDS",
                    help="after a SIGTERM, torchrun waits this long before killing the processes: the run "
                         "checkpoints its step and stops (0: torchrun's 30 s)")
    sl = sub.add_parser("slurm", help="an sbatch script: one torchrun a node, one process a GPU")
    sl.add_argument("--nodes", type=int, default=1)
    sl.add_argument("--gpus-per-node", type=int, default=8)
    sl.add_argument("--cpus-per-task", type=int, help="CPUs of each node's task (OMP_NUM_THREADS = this / GPUs)")
    sl.add_argument("--time", help="time limit (HH:MM:SS or DAYS-HH:MM:SS)")
    sl.add_argument("--partition")
    sl.add_argument("--account")
    sl.add_argument("--job-name", default="orthon")
    sl.add_argument("--output", default="%x-%j.out", help="log file pattern (%%x job name, %%j job id)")
    sl.add_argument("--rdzv-port", type=int, default=29500)
    sl.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                    help="exported in the script (repeatable), e.g. NCCL_SOCKET_IFNAME=ib0")
    sl.add_argument("--no-exclusive", dest="exclusive", action="store_false", help="share the nodes with other jobs")
    sl.add_argument("--stop-grace", type=int, default=STOP_GRACE, metavar="SECONDS",
                    help="SIGTERM this long before the time limit: the run checkpoints its step and stops (0: none)")
    sl.add_argument("--script", help="write the script here (default: print it; --run writes orthon.sbatch)")
    ry = sub.add_parser("ray", help="a Ray cluster (ray start lines) and the RL driver on it")
    ry.add_argument("--nodes", type=int, default=1)
    ry.add_argument("--head-address", help="address of the head node (needed for more than one node)")
    ry.add_argument("--port", type=int, default=6379)
    ry.add_argument("--num-gpus", type=int, help="GPUs each node offers Ray (default: Ray detects them)")
    ry.add_argument("--num-cpus", type=int, help="CPUs each node offers Ray (default: Ray detects them)")
    for launcher in (ms, tr, sl, ry):
        launcher.add_argument("--run", action="store_true", help="start this node's command instead of printing it")
        launcher.add_argument("command", nargs=argparse.REMAINDER, help="-- the orthon command, e.g. -- pretrain -c RECIPE")


def run(args, name):
    from orthon.launch.cli import COMMANDS
    from orthon.launch.launchers import orthon_command

    command = orthon_command(args.command, COMMANDS)
    plan = _PLANNERS[args.launcher](args, command)
    if not args.run:
        print(plan.text, end="")
        return 0
    for note in plan.notes:
        print(note, file=sys.stderr)
    for argv in plan.local:
        code = subprocess.call(_executable(argv), env={**os.environ, **plan.env})
        if code:
            return code
    return 0


class _Plan:
    """What a launcher produced: ``text`` to print (a shell snippet), ``local`` the commands --run starts
    here, ``notes`` what --run says first, ``env`` what --run adds to their environment."""

    def __init__(self, text: str, local: list[list[str]], notes: list[str] = (), env: dict | None = None):
        self.text, self.local, self.notes, self.env = text, local, list(notes), dict(env or {})


def _snippet(commands, notes=()) -> str:
    lines = [f"# {note}" for note in notes]
    several = len({c.node for c in commands}) > 1
    for c in commands:
        if several:
            lines.append(f"# node {c.node}" + (f" ({c.host})" if c.host else ""))
        lines.append(c.shell())
    return "\n".join(lines) + "\n"


def _mindspore_recipe(command: list[str]):
    """The recipe of the command msrun starts, checked: msrun's workers train through the MindSpore backend,
    which `orthon pretrain` has; with any other backend each worker would train a full copy of its own."""
    from orthon.launch import cmd_pretrain
    from orthon.launch.cli import parse_command_args
    from orthon.pretrain.recipe import load_recipe
    from orthon.pretrain.trainer import CONFIG_NAME

    if command[0] != "pretrain":
        raise ConfigError(f"orthon launch msrun starts MindSpore workers, which `orthon pretrain ... backend=mindspore` "
                          f"trains; got {command[0]!r} (mid-training and RL run on torch: orthon launch torchrun)")
    parser = argparse.ArgumentParser(prog="orthon pretrain")
    cmd_pretrain.register(parser, "pretrain")  # the workers' own parser: the same reading of the command
    args = parse_command_args(parser, command[1:])
    recipe = load_recipe(str(Path(args.resume) / CONFIG_NAME) if args.resume else args.config, args.overrides)
    if recipe.backend != "mindspore":
        raise ConfigError("backend: msrun's workers run the MindSpore backend; add backend=mindspore to the command "
                          "(and mindspore.device_target=Ascend on 910B nodes), or launch torch with orthon launch torchrun")
    for key in ("expert_parallel", "context_parallel"):
        if getattr(recipe.train, key) > 1:
            raise ConfigError(f"train.{key} = {getattr(recipe.train, key)}: the MindSpore backend's workers are data "
                              f"parallel only; add train.{key}=1 ({key.replace('_', ' ')}ism runs on torch: orthon "
                              f"launch torchrun)")
    return recipe


def _msrun(args, command) -> _Plan:
    from orthon.core.files import atomic_write_json
    from orthon.launch.launchers import msrun_commands, msrun_layout
    from orthon.launch.rank_table import rank_table, read_host_list

    notes, hosts, options, table, env = [], None, {}, None, {}
    if args.hosts:
        entries = read_host_list(args.hosts)
        if args.nodes is not None and args.nodes != len(entries):
            raise ConfigError(f"nodes: {args.nodes}, but the host list {args.hosts} has {len(entries)} nodes")
        table = rank_table(entries, args.local_worker_num)
        per_node = len(table["server_list"][0]["device"])
        worker_num, local, _ = msrun_layout(args.worker_num, per_node, len(entries))
        path = Path(os.path.abspath(args.rank_table))
        hosts = [h.server_id for h in entries]
        options["rank_table_file"] = str(path)
        notes.append(f"rank table for {len(entries)} nodes x {per_node} NPUs: {path} (copy it to the same path on every node)")
    else:
        worker_num, local, _ = msrun_layout(args.worker_num, args.local_worker_num, args.nodes)
    recipe = _mindspore_recipe(command)
    if table is not None:
        if recipe.mindspore.device_target != "Ascend":
            raise ConfigError(f"mindspore.device_target: {recipe.mindspore.device_target}, but --hosts writes an HCCL "
                              f"rank table, which only Ascend NPUs read; add mindspore.device_target=Ascend")
        atomic_write_json(path, table)
    if recipe.mindspore.device_target == "CPU" and not os.environ.get("OMP_NUM_THREADS"):
        # msrun leaves threads to its workers, and each would take every core: share them out instead.
        threads = max(1, (os.cpu_count() or 1) // local)
        env["OMP_NUM_THREADS"] = str(threads)
        notes.append(f"CPU workers share a node's cores: export OMP_NUM_THREADS={threads} before msrun "
                     f"({local} workers a node; --run sets it)")
    if args.master_addr:
        options["master_addr"] = args.master_addr
    commands = msrun_commands(command, worker_num, local, hosts, master_port=args.master_port, log_dir=args.log_dir,
                              join=args.join, cluster_time_out=args.cluster_time_out, bind_core=args.bind_core,
                              **options)
    if not 0 <= args.node_rank < len(commands):
        raise ConfigError(f"node-rank: {args.node_rank} is outside 0..{len(commands) - 1}")
    return _Plan(_snippet(commands, notes), [commands[args.node_rank].argv], [f"orthon launch: {n}" for n in notes], env)


def _torchrun(args, command) -> _Plan:
    from orthon.launch.launchers import NodeCommand, torchrun_argv

    options = dict(nnodes=args.nnodes, nproc_per_node=args.nproc_per_node, rdzv_endpoint=args.rdzv_endpoint,
                   rdzv_backend=args.rdzv_backend, rdzv_id=args.rdzv_id, max_restarts=args.max_restarts,
                   stop_grace=args.stop_grace)
    argv = torchrun_argv(command, **options)
    notes = [f"the same line on each of the {args.nnodes} nodes"] if args.nnodes > 1 else []
    # --run: this interpreter's torchrun, so the processes import the orthon installed beside it.
    local = torchrun_argv(command, launcher=[sys.executable, "-m", "torch.distributed.run"], **options)
    return _Plan(_snippet([NodeCommand(None, None, argv)], notes), [local])


def _slurm(args, command) -> _Plan:
    from orthon.core.files import atomic_write_text
    from orthon.launch.sbatch import parse_env, sbatch_script

    script = sbatch_script(command, args.nodes, args.gpus_per_node, args.cpus_per_task, args.time, args.partition,
                           args.account, args.job_name, args.output, args.rdzv_port, parse_env(args.env),
                           args.exclusive, args.stop_grace)
    path = args.script or ("orthon.sbatch" if args.run else None)
    if path is None:
        return _Plan(script, [])
    atomic_write_text(path, script)
    return _Plan(f"# wrote {path}\nsbatch {path}\n", [["sbatch", str(path)]], [f"orthon launch: wrote {path}"])


def _ray(args, command) -> _Plan:
    from orthon.launch.launchers import ray_commands

    commands = ray_commands(command, args.nodes, args.head_address, args.port, args.num_gpus, args.num_cpus)
    head = [c.argv for c in commands if c.node == 0]
    return _Plan(_snippet(commands), head)


def _executable(argv: list[str]) -> list[str]:
    """argv with its program made runnable here: orthon through this interpreter, the others from the PATH
    (a clear error naming what to install when missing)."""
    program = argv[0]
    if program == "orthon":
        return [sys.executable, "-m", "orthon.launch.cli"] + argv[1:]
    if program == sys.executable or shutil.which(program):
        return argv
    hint = _PROGRAMS.get(program, "install it first")
    raise OrthonError(f"{program} is not on the PATH; {hint}")


_PLANNERS = {"msrun": _msrun, "torchrun": _torchrun, "slurm": _slurm, "ray": _ray}
