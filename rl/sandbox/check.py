"""Whether this machine runs the sandbox: bwrap present, and a sandbox that actually starts and runs Python."""
from __future__ import annotations

import functools

from orthon.rl.sandbox.bwrap import Runtime, SandboxUnavailable, find_runtime
from orthon.rl.sandbox.limits import SandboxLimits
from orthon.rl.sandbox.process import Job, SandboxProcess

_USERNS_HINT = ("bubblewrap needs unprivileged user namespaces: user.max_user_namespaces > 0, on Debian "
                "kernel.unprivileged_userns_clone = 1, on Ubuntu kernel.apparmor_restrict_unprivileged_userns = 0")


@functools.lru_cache(maxsize=1)
def runtime_or_problem() -> tuple[Runtime | None, str | None]:
    """(runtime, None) when a sandbox starts and runs Python here, else (None, why not); checked once."""
    try:
        runtime = find_runtime()
    except SandboxUnavailable as exc:
        return None, str(exc)
    result = SandboxProcess(runtime).run(Job("python", "print(6 * 7)"), SandboxLimits(timeout_s=30))
    if result.status != "ok" or result.stdout.strip() != "42":
        return None, (f"bubblewrap could not run a sandbox here ({result.status}, exit code {result.exit_code}: "
                      f"{result.stderr.strip()[-400:]!r}); {_USERNS_HINT}")
    return runtime, None


def sandbox_problem() -> str | None:
    """Why the sandbox cannot run on this machine, or None when it can."""
    return runtime_or_problem()[1]


def require_runtime() -> Runtime:
    runtime, problem = runtime_or_problem()
    if runtime is None:
        raise SandboxUnavailable(problem)
    return runtime
