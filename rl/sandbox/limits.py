"""The limits of one sandboxed job: wall and CPU time, memory, processes, output and file sizes."""
from __future__ import annotations

import math
from dataclasses import dataclass

from orthon.core.errors import ConfigError


@dataclass(frozen=True)
class SandboxLimits:
    timeout_s: float = 10.0  # wall clock, from the job's start to its last process's end
    cpu_s: float | None = None  # CPU seconds of each process (RLIMIT_CPU); None: the wall timeout, rounded up
    memory_mb: int = 512  # address space of each process (RLIMIT_AS); a job's total is at most nproc times it
    nproc: int = 16  # processes and threads inside the sandbox, its init and the job included (RLIMIT_NPROC)
    output_bytes: int = 1 << 20  # kept of stdout and of stderr each; the rest is read and discarded
    file_mb: int = 64  # largest file the job may write (RLIMIT_FSIZE)
    nofile: int = 256  # open file descriptors (RLIMIT_NOFILE)

    def __post_init__(self):
        for name in ("timeout_s", "memory_mb", "nproc", "output_bytes", "file_mb", "nofile"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or not math.isfinite(value):
                raise ConfigError(f"sandbox limits: {name} must be a positive number, got {value!r}")
        if self.cpu_s is not None and not (isinstance(self.cpu_s, (int, float)) and 0 < self.cpu_s < math.inf):
            raise ConfigError(f"sandbox limits: cpu_s must be a positive number or None, got {self.cpu_s!r}")
        if self.nproc < 2:
            raise ConfigError(f"sandbox limits: nproc must be >= 2 (the job and the namespace's init), got {self.nproc}")

    def for_boot(self) -> dict:
        """What the in-sandbox boot sets on itself before it runs the job (see boot.py)."""
        cpu = self.cpu_s if self.cpu_s is not None else self.timeout_s
        return {"cpu_s": max(1, math.ceil(cpu)), "memory_bytes": int(self.memory_mb) << 20, "nproc": int(self.nproc),
                "file_bytes": int(self.file_mb) << 20, "nofile": int(self.nofile)}
