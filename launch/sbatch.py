"""The Slurm batch script that runs an orthon command on GPU nodes: one task a node, each a torchrun that
starts one process a GPU; the rendezvous is the allocation's first node (``scontrol show hostnames``)
and the job id, so the same script works for any node list Slurm grants."""
from __future__ import annotations

import re
import shlex

from orthon.core.errors import ConfigError
from orthon.launch.launchers import STOP_GRACE, positive, torchrun_argv

# Set unless the caller gives its own value: NCCL reports problems (not every call), and a failed
# collective raises instead of hanging the job until its time limit.
DEFAULT_ENV = {
    "NCCL_DEBUG": "WARN",
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
}
RDZV_PORT = 29500
_TIME = re.compile(r"^(\d+-)?\d{1,2}(:\d{2}){0,2}$|^\d+$")
_NAME = re.compile(r"^[A-Za-z0-9_.\-]+$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_env(pairs: list[str]) -> dict[str, str]:
    """``KEY=VALUE`` words -> {KEY: VALUE}."""
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not _ENV_NAME.match(key):
            raise ConfigError(f"env: {pair!r} is not KEY=VALUE (a shell variable name, e.g. NCCL_SOCKET_IFNAME=ib0)")
        env[key] = value
    return env


def sbatch_script(orthon: list[str], nodes: int, gpus_per_node: int, cpus_per_task: int | None = None,
                  time: str | None = None, partition: str | None = None, account: str | None = None,
                  job_name: str = "orthon", output: str = "%x-%j.out", rdzv_port: int = RDZV_PORT,
                  env: dict[str, str] | None = None, exclusive: bool = True, stop_grace: int = STOP_GRACE) -> str:
    """The sbatch script: directives, the rendezvous from SLURM_* variables, the environment, and the
    ``srun torchrun ... -m orthon.launch.cli ORTHON...`` line.

    ``stop_grace`` seconds (0: none): Slurm sends SIGTERM that long before the time limit
    (``--signal=TERM@``), torchrun forwards it and waits as long before killing its workers
    (``--shutdown-timeout``, 30 s by default), and the run saves a checkpoint after its current
    step and stops (``train.stop_signals``): the time to finish a step and write a checkpoint."""
    positive(nodes, "nodes")
    positive(gpus_per_node, "gpus-per-node")
    if cpus_per_task is not None and cpus_per_task < gpus_per_node:
        raise ConfigError(f"cpus-per-task: {cpus_per_task} CPUs for {gpus_per_node} GPU processes; give at least "
                          f"one CPU each")
    if time is not None and not _TIME.match(time):
        raise ConfigError(f"time: {time!r} is not a Slurm time limit (MINUTES, HH:MM:SS or DAYS-HH:MM:SS)")
    for value, what in ((job_name, "job-name"), (partition, "partition"), (account, "account")):
        if value is not None and not _NAME.match(value):
            raise ConfigError(f"{what}: {value!r} may hold only letters, digits, '.', '_' and '-'")
    # torchrun's checks (node counts, the command) with placeholders the script fills in at run time.
    torchrun = torchrun_argv(orthon, nodes, gpus_per_node, rdzv_endpoint=f"localhost:{rdzv_port}", stop_grace=stop_grace)
    launcher = ["torchrun", "--nnodes=$SLURM_NNODES", f"--nproc-per-node={gpus_per_node}", "--rdzv-backend=c10d",
                "--rdzv-endpoint=$MASTER_ADDR:$MASTER_PORT", "--rdzv-id=$SLURM_JOB_ID"]
    launcher += [word for word in torchrun if word.startswith("--shutdown-timeout=")]
    command = torchrun[torchrun.index("-m"):]
    directives = [f"--job-name={job_name}", f"--nodes={nodes}", "--ntasks-per-node=1",
                  f"--gpus-per-node={gpus_per_node}"]
    directives += [f"--{key}={value}" for key, value in (("cpus-per-task", cpus_per_task), ("time", time),
                                                         ("partition", partition), ("account", account))
                   if value is not None]
    directives.append(f"--output={output}")
    if exclusive:
        directives.append("--exclusive")
    if stop_grace:
        directives.append(f"--signal=TERM@{stop_grace}")
    environment = {**DEFAULT_ENV, **(env or {})}
    if cpus_per_task is not None:
        environment.setdefault("OMP_NUM_THREADS", str(cpus_per_task // gpus_per_node))
    lines = ["#!/bin/bash"] + [f"#SBATCH {d}" for d in directives] + [
        "set -euo pipefail",
        "",
        "# Rendezvous: the first node of the allocation hosts it; the job id names it.",
        'MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)',
        f"MASTER_PORT={rdzv_port}",
        "export MASTER_ADDR MASTER_PORT",
        "",
    ] + [f"export {key}={shlex.quote(value)}" for key, value in environment.items()] + [
        "",
        "# One task a node; torchrun starts one process a GPU on it.",
        "srun --kill-on-bad-exit=1 " + " ".join(_shell_word(w) for w in launcher + command),
        "",
    ]
    return "\n".join(lines)


def _shell_word(word: str) -> str:
    """Quote a word for bash, leaving $VARIABLES of the script expandable (inside double quotes)."""
    if "$" in word:
        return '"' + word.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`") + '"'
    return shlex.quote(word)
