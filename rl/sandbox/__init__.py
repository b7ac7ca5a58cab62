"""A sandbox for model-written code, on bubblewrap: its own namespaces (user, PID, network, IPC, UTS),
limits on wall and CPU time, memory, processes, output and file sizes, a private workspace as the only
writable place, and nothing of the user's files. ``run_code`` / ``run_shell`` run one job; a
``SandboxPool`` keeps sandboxes started ahead of time so a call skips the start-up."""
from orthon.rl.sandbox.bwrap import SandboxUnavailable
from orthon.rl.sandbox.check import sandbox_problem
from orthon.rl.sandbox.limits import SandboxLimits
from orthon.rl.sandbox.pool import SandboxPool
from orthon.rl.sandbox.process import Job
from orthon.rl.sandbox.result import SandboxResult, observation
from orthon.rl.sandbox.run import run_code, run_job, run_shell, shared_pool

__all__ = [
    "Job", "SandboxLimits", "SandboxPool", "SandboxResult", "SandboxUnavailable", "observation",
    "run_code", "run_job", "run_shell", "sandbox_problem", "shared_pool",
]
