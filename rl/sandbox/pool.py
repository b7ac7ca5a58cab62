"""Warm sandboxes: started ahead of time, each given one job, then thrown away and replaced.

A call takes a sandbox that is already up (namespaces, mounts, interpreter: the cost of a cold call)
and a background thread starts its replacement. One job per sandbox keeps jobs apart: no job sees the
files, processes or interpreter state another left. With none waiting, a call starts one itself (cold).

The starter is one thread that lives as long as the pool, on purpose: bwrap's --die-with-parent is
PR_SET_PDEATHSIG, which fires when the *thread* that started the process ends, so a sandbox started by
a short-lived thread would be killed with it.
"""
from __future__ import annotations

import os
import threading
import time
from collections import deque

from orthon.core.errors import ConfigError, OrthonError
from orthon.rl.sandbox.bwrap import Runtime
from orthon.rl.sandbox.check import require_runtime
from orthon.rl.sandbox.limits import SandboxLimits
from orthon.rl.sandbox.process import Job, SandboxProcess
from orthon.rl.sandbox.result import SandboxResult

_RETRY_S = 1.0  # after a failed start, before the next


class SandboxPool:
    def __init__(self, size: int = 2, runtime: Runtime | None = None):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"sandbox pool: size must be a positive integer, got {size!r}")
        self.runtime = runtime or require_runtime()
        self.size = size
        self.warm_calls = 0
        self.cold_calls = 0
        self._idle: deque[SandboxProcess] = deque()
        self._cond = threading.Condition()
        self._closed = False
        self._owner = os.getpid()  # a forked child inherits this object, not the sandboxes behind it
        self._starter = threading.Thread(target=self._keep_filled, name="sandbox-pool", daemon=True)
        self._starter.start()

    def _keep_filled(self) -> None:
        while True:
            with self._cond:
                while not self._closed and len(self._idle) >= self.size:
                    self._cond.wait()
                if self._closed:
                    return
            try:
                sandbox = SandboxProcess(self.runtime)
            except OSError:
                with self._cond:
                    self._cond.wait(_RETRY_S)
                continue
            with self._cond:
                if self._closed:
                    sandbox.close()
                    return
                self._idle.append(sandbox)
                self._cond.notify_all()

    def _take(self) -> SandboxProcess | None:
        with self._cond:
            while self._idle:
                sandbox = self._idle.popleft()
                self._cond.notify_all()  # the starter replaces it
                if sandbox.alive():
                    return sandbox
                sandbox.close()
        return None

    def run(self, job: Job, limits: SandboxLimits) -> SandboxResult:
        if self._closed or os.getpid() != self._owner:
            raise OrthonError("sandbox pool: closed" if self._closed else "sandbox pool: belongs to the parent process")
        sandbox = self._take()
        with self._cond:
            if sandbox is None:
                self.cold_calls += 1
            else:
                self.warm_calls += 1
        if sandbox is None:
            sandbox = SandboxProcess(self.runtime)
        return sandbox.run(job, limits)

    def wait_ready(self, timeout_s: float = 30.0) -> bool:
        """Wait until ``size`` sandboxes are up and waiting (benchmarks, tests); False on timeout."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._cond:
                idle = list(self._idle)
            if len(idle) >= self.size and all(s.poll_ready(max(0.0, deadline - time.monotonic())) for s in idle):
                return True
            time.sleep(0.005)
        return False

    def close(self) -> None:
        if os.getpid() != self._owner:  # an inherited copy: the parent's sandboxes are the parent's to end
            return
        with self._cond:
            self._closed = True
            idle, self._idle = list(self._idle), deque()
            self._cond.notify_all()
        for sandbox in idle:
            sandbox.close()
        self._starter.join(timeout=10)

    def __enter__(self) -> "SandboxPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
