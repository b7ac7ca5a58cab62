"""The command lines that launch an ``orthon`` command on many processes: torchrun (NVIDIA, CPU), msrun
(MindSpore on Ascend) and Ray (RL). Pure functions from settings to argv lists, checked before anything
runs; ``orthon launch`` prints them (one line a node) or runs this node's. The sbatch script is
``orthon.launch.sbatch``, the HCCL rank table ``orthon.launch.rank_table``."""
from __future__ import annotations

import functools
import ipaddress
import re
import shlex
from dataclasses import dataclass

from orthon.core.errors import ConfigError

# Every launcher starts the same entry point: the CLI as a module, so no console script needs to be on
# the PATH of the processes a launcher spawns.
ORTHON_MODULE = ["-m", "orthon.launch.cli"]
MSRUN_PORT = 8118  # msrun's default scheduler port
RAY_PORT = 6379  # ray start --head's default GCS port
# Seconds between SIGTERM and SIGKILL that the launchers leave a run to checkpoint its step.
STOP_GRACE = 300
_HOST = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9.\-]*[A-Za-z0-9])?$")


@dataclass(frozen=True)
class NodeCommand:
    """One command to start on one node: ``node`` is its index (None: any node), ``host`` its address
    when known, ``argv`` the command."""

    node: int | None
    host: str | None
    argv: list[str]

    def shell(self) -> str:
        return shlex.join(self.argv)


def orthon_command(words: list[str], commands) -> list[str]:
    """The orthon command a launcher starts (``pretrain -c RECIPE ...``), checked against ``commands``
    (the CLI's command names). A leading ``--`` (the separator after the launcher's options) is dropped."""
    words = list(words)
    if words and words[0] == "--":
        words = words[1:]
    if not words:
        raise ConfigError("no orthon command to launch: put it after --, e.g. "
                          "`orthon launch torchrun --nproc-per-node 8 -- pretrain -c configs/glm5.yaml`")
    if words[0] not in commands:
        raise ConfigError(f"{words[0]!r} is not an orthon command (choose from {', '.join(commands)}); "
                          f"write the command as after `orthon`, e.g. `-- pretrain -c RECIPE`")
    if words[0] == "launch":
        raise ConfigError("`orthon launch` cannot launch itself: give the command it should start, e.g. `-- pretrain ...`")
    return words


def check_host(host: str, what: str) -> str:
    """A host name or an IPv4 / IPv6 address, as launchers pass it on."""
    host = str(host).strip()
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    if not _HOST.match(host):
        raise ConfigError(f"{what}: {host!r} is not a host name or IP address")
    return host


def check_port(port: int, what: str) -> int:
    if not isinstance(port, int) or not 1024 <= port <= 65535:
        raise ConfigError(f"{what}: port {port!r} must be an integer in 1024..65535")
    return port


def positive(value: int, what: str) -> int:
    if not isinstance(value, int) or value < 1:
        raise ConfigError(f"{what}: must be a positive integer, got {value!r}")
    return value


def split_endpoint(endpoint: str, what: str = "rendezvous endpoint") -> tuple[str, int]:
    """``HOST:PORT`` (``[IPv6]:PORT``) -> (host, port)."""
    match = re.match(r"^\[([^\]]+)\]:(\d+)$", endpoint) or re.match(r"^([^:\[\]]+):(\d+)$", endpoint)
    if not match:
        raise ConfigError(f"{what}: {endpoint!r} is not HOST:PORT (e.g. node0:29500)")
    return check_host(match[1], what), check_port(int(match[2]), what)


# ------------------------------------------------------------------ torchrun
def torchrun_argv(orthon: list[str], nnodes: int = 1, nproc_per_node: int = 1, rdzv_endpoint: str | None = None,
                  rdzv_backend: str = "c10d", rdzv_id: str = "orthon", max_restarts: int = 0,
                  stop_grace: int = STOP_GRACE, launcher: list[str] | None = None) -> list[str]:
    """``torchrun ... -m orthon.launch.cli ORTHON...``. One node without an endpoint runs ``--standalone``
    (torchrun picks a free local port); more nodes need ``rdzv_endpoint`` (HOST:PORT of the first node),
    the same line then starts on every node. ``launcher`` replaces the word ``torchrun`` (``--run`` uses
    this interpreter's ``python -m torch.distributed.run``).

    ``stop_grace``: seconds torchrun waits, after forwarding a SIGTERM to its workers, before it kills them
    (``--shutdown-timeout``; torchrun's own default is 30 s, 0 keeps it): the time a run stopped by the
    signal has to finish its step and write a checkpoint (``train.stop_signals``). An older torchrun without
    the flag (torch 2.11's) always waits its 30 s: the flag is left out there rather than refused by it."""
    positive(nnodes, "nnodes")
    positive(nproc_per_node, "nproc-per-node")
    if max_restarts < 0:
        raise ConfigError(f"max-restarts: must be >= 0, got {max_restarts}")
    if not isinstance(stop_grace, int) or stop_grace < 0:
        raise ConfigError(f"stop-grace: must be a whole number of seconds >= 0, got {stop_grace!r}")
    argv = list(launcher or ["torchrun"]) + [f"--nnodes={nnodes}", f"--nproc-per-node={nproc_per_node}"]
    if rdzv_endpoint is None:
        if nnodes > 1:
            raise ConfigError(f"nnodes: {nnodes} nodes need a rendezvous endpoint (--rdzv-endpoint HOST:PORT of "
                              f"the first node, e.g. node0:29500)")
        argv.append("--standalone")
    else:
        host, port = split_endpoint(rdzv_endpoint)
        if not re.match(r"^[A-Za-z0-9_.\-]+$", rdzv_id):
            raise ConfigError(f"rdzv-id: {rdzv_id!r} must be letters, digits, '.', '_' or '-'")
        endpoint = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        argv += [f"--rdzv-backend={rdzv_backend}", f"--rdzv-endpoint={endpoint}", f"--rdzv-id={rdzv_id}"]
    if max_restarts:
        argv.append(f"--max-restarts={max_restarts}")
    if stop_grace and torchrun_takes_shutdown_timeout():
        argv.append(f"--shutdown-timeout={stop_grace}")
    return argv + ORTHON_MODULE + list(orthon)


@functools.cache
def torchrun_takes_shutdown_timeout() -> bool:
    """Whether this torch's torchrun has ``--shutdown-timeout`` (2.13's does, 2.11's does not)."""
    from torch.distributed.run import get_args_parser

    return any("--shutdown-timeout" in action.option_strings for action in get_args_parser()._actions)


# ------------------------------------------------------------------ msrun
def msrun_layout(worker_num: int | None, local_worker_num: int | None, nodes: int | None) -> tuple[int, int, int]:
    """(worker_num, local_worker_num, nodes) with the missing ones derived; every node starts the same
    number of workers (msrun assigns rank ids node_rank x local_worker_num + i), so the counts must divide."""
    for value, what in ((worker_num, "worker-num"), (local_worker_num, "local-worker-num"), (nodes, "nodes")):
        if value is not None:
            positive(value, what)
    if nodes is not None and local_worker_num is not None and worker_num is not None:
        if worker_num != nodes * local_worker_num:
            raise ConfigError(f"worker-num: {worker_num} workers is not {nodes} nodes x {local_worker_num} local "
                              f"workers ({nodes * local_worker_num})")
    elif nodes is not None and local_worker_num is not None:
        worker_num = nodes * local_worker_num
    elif nodes is not None and worker_num is not None:
        if worker_num % nodes:
            raise ConfigError(f"worker-num: {worker_num} workers do not divide among {nodes} nodes")
        local_worker_num = worker_num // nodes
    elif worker_num is not None:
        local_worker_num = local_worker_num or worker_num
        if worker_num % local_worker_num:
            raise ConfigError(f"worker-num: {worker_num} workers do not divide into nodes of {local_worker_num} "
                              f"local workers")
        nodes = worker_num // local_worker_num
    else:
        raise ConfigError("worker-num: give the total number of workers (--worker-num), or the nodes (--nodes or a "
                          "host list) and the workers on each (--local-worker-num)")
    if local_worker_num > worker_num:
        raise ConfigError(f"local-worker-num: {local_worker_num} exceeds worker-num {worker_num}")
    return worker_num, local_worker_num, nodes


def msrun_argv(orthon: list[str], worker_num: int, local_worker_num: int, node_rank: int,
               master_addr: str = "127.0.0.1", master_port: int = MSRUN_PORT, log_dir: str = "msrun_log",
               join: bool = True, cluster_time_out: int = 600, bind_core: bool = False,
               rank_table_file: str | None = None) -> list[str]:
    """The msrun line of node ``node_rank``: msrun starts ``python -m orthon.launch.cli ORTHON...`` as
    each of its ``local_worker_num`` workers (and the scheduler on the node whose address is
    ``master_addr``); flags are spelled as msrun takes them (``--flag=value``, booleans True/False)."""
    worker_num, local_worker_num, nodes = msrun_layout(worker_num, local_worker_num, None)
    if not 0 <= node_rank < nodes:
        raise ConfigError(f"node-rank: {node_rank} is outside 0..{nodes - 1} ({worker_num} workers, "
                          f"{local_worker_num} a node)")
    positive(cluster_time_out, "cluster-time-out")
    argv = ["msrun", f"--worker_num={worker_num}", f"--local_worker_num={local_worker_num}",
            f"--master_addr={check_host(master_addr, 'master-addr')}",
            f"--master_port={check_port(master_port, 'master-port')}", f"--node_rank={node_rank}",
            f"--log_dir={log_dir}", f"--join={join}", f"--cluster_time_out={cluster_time_out}"]
    if bind_core:
        argv.append("--bind_core=True")
    if rank_table_file:
        argv.append(f"--rank_table_file={rank_table_file}")
    # msrun runs `python TASK ARGS` unless TASK is python itself: then the arguments go to python as given.
    return argv + ["python"] + ORTHON_MODULE + list(orthon)


def msrun_commands(orthon: list[str], worker_num: int, local_worker_num: int, hosts: list[str] | None = None,
                   **options) -> list[NodeCommand]:
    """One msrun line per node (node_rank 0..nodes-1); with ``hosts`` the master is the first host."""
    worker_num, local_worker_num, nodes = msrun_layout(worker_num, local_worker_num, len(hosts) if hosts else None)
    if hosts:
        options.setdefault("master_addr", hosts[0])
    return [NodeCommand(rank, hosts[rank] if hosts else None,
                        msrun_argv(orthon, worker_num, local_worker_num, rank, **options)) for rank in range(nodes)]


# ------------------------------------------------------------------ Ray (RL)
def rl_on_ray(orthon: list[str]) -> list[str]:
    """``orthon rl ...`` joined to the running Ray cluster: rl.cluster.enabled=true and rl.cluster.address=auto
    unless the command sets its own address; a command that is not ``rl``, or turns the cluster off, is an error."""
    if orthon[0] != "rl":
        raise ConfigError(f"orthon launch ray starts RL on a Ray cluster (`-- rl -c RECIPE --from RUN`); got "
                          f"{orthon[0]!r} (launch pretraining with torchrun, slurm or msrun)")
    overrides = {word.split("=", 1)[0]: word.split("=", 1)[1] for word in orthon[1:] if "=" in word
                 and not word.startswith("-")}
    if overrides.get("rl.cluster.enabled", "true").lower() not in ("true", "1", "yes"):
        raise ConfigError("rl.cluster.enabled: the command turns the Ray cluster off; drop that override")
    out = [word for word in orthon if not word.startswith("rl.cluster.enabled=")] + ["rl.cluster.enabled=true"]
    if "rl.cluster.address" not in overrides:
        out.append("rl.cluster.address=auto")
    return out


def ray_commands(orthon: list[str], nodes: int = 1, head_address: str | None = None, port: int = RAY_PORT,
                 num_gpus: int | None = None, num_cpus: int | None = None) -> list[NodeCommand]:
    """``ray start --head`` on node 0, ``ray start --address HEAD:PORT`` on the others, then the RL driver
    (``orthon rl ... rl.cluster.enabled=true rl.cluster.address=auto``) on node 0."""
    positive(nodes, "nodes")
    check_port(port, "port")
    resources = []
    if num_gpus is not None:
        if not isinstance(num_gpus, int) or num_gpus < 0:
            raise ConfigError(f"num-gpus: must be an integer >= 0, got {num_gpus!r}")
        resources.append(f"--num-gpus={num_gpus}")
    if num_cpus is not None:
        resources.append(f"--num-cpus={positive(num_cpus, 'num-cpus')}")
    if nodes > 1 and head_address is None:
        raise ConfigError(f"nodes: {nodes} nodes need the head node's address (--head-address) for `ray start --address`")
    head = check_host(head_address, "head-address") if head_address is not None else None
    commands = [NodeCommand(0, head, ["ray", "start", "--head", f"--port={port}"] + resources)]
    target = f"[{head}]:{port}" if head and ":" in head else f"{head}:{port}"
    commands += [NodeCommand(n, None, ["ray", "start", f"--address={target}"] + resources) for n in range(1, nodes)]
    commands.append(NodeCommand(0, head, ["orthon"] + rl_on_ray(orthon)))
    return commands
