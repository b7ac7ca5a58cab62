"""The sandbox's API: run Python source or a shell command under limits, cold or from a pool of warm sandboxes."""
from __future__ import annotations

import atexit
import os
import threading

from orthon.rl.sandbox.check import require_runtime
from orthon.rl.sandbox.limits import SandboxLimits
from orthon.rl.sandbox.pool import SandboxPool
from orthon.rl.sandbox.process import Job, SandboxProcess
from orthon.rl.sandbox.result import SandboxResult

_shared: SandboxPool | None = None
_shared_lock = threading.Lock()


def _forget_in_child() -> None:
    # A forked child gets a pool of its own: the parent's sandboxes and starter thread are not its to use.
    global _shared, _shared_lock
    _shared, _shared_lock = None, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)


def shared_pool(size: int = 2) -> SandboxPool:
    """The process's pool of warm sandboxes (started on first use, closed at exit); ``size`` counts on
    first use only; a forked child starts its own."""
    global _shared
    with _shared_lock:
        if _shared is None:
            _shared = SandboxPool(size)
            atexit.register(_shared.close)
        return _shared


def run_job(job: Job, limits: SandboxLimits, pool: SandboxPool | None = None) -> SandboxResult:
    """One job in a fresh sandbox: a warm one from ``pool``, or one started for it (cold)."""
    if pool is not None:
        return pool.run(job, limits)
    return SandboxProcess(require_runtime()).run(job, limits)


def run_code(code: str, timeout_s: float = 10.0, memory_mb: int = 512, *, stdin: bytes | str = b"",
             files: dict | None = None, collect: tuple[str, ...] = (), pool: SandboxPool | None = None,
             **limits) -> SandboxResult:
    """Run Python source as ``__main__`` in a sandbox (the system python3, the workspace /sandbox as the
    current and the only writable directory). ``limits``: the other SandboxLimits fields (cpu_s, nproc,
    output_bytes, file_mb, nofile)."""
    return run_job(Job("python", code, stdin, dict(files or {}), tuple(collect)),
                   SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb, **limits), pool)


def run_shell(command: str, timeout_s: float = 10.0, memory_mb: int = 512, *, stdin: bytes | str = b"",
              files: dict | None = None, collect: tuple[str, ...] = (), pool: SandboxPool | None = None,
              **limits) -> SandboxResult:
    """Run ``/bin/sh -c command`` in a sandbox, as run_code does Python."""
    return run_job(Job("shell", command, stdin, dict(files or {}), tuple(collect)),
                   SandboxLimits(timeout_s=timeout_s, memory_mb=memory_mb, **limits), pool)
