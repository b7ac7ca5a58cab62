"""What a sandboxed job gives back, and how its end becomes a status."""
from __future__ import annotations

import signal
from dataclasses import dataclass, field

STATUSES = ("ok", "error", "timeout", "killed")


@dataclass
class SandboxResult:
    status: str  # ok: exit 0; error: another exit code; timeout: wall or CPU limit; killed: ended by a signal
    exit_code: int | None  # the job's exit code; 128 + N when signal N ended it; None when the wall timeout killed it
    stdout: str
    stderr: str
    wall_s: float
    truncated: bool  # stdout, stderr or a collected file was longer than the limit and was cut
    signal: str | None = None  # the signal that ended the job (SIGSEGV, SIGXCPU, ...), if one did
    files: dict[str, bytes] = field(default_factory=dict, repr=False)  # collected from the workspace

    def as_json(self) -> dict:
        """The CLI's object: every field but the collected files."""
        return {"status": self.status, "exit_code": self.exit_code, "signal": self.signal, "stdout": self.stdout,
                "stderr": self.stderr, "wall_s": round(self.wall_s, 4), "truncated": self.truncated}


def signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def classify(exit_code: int | None, wall_timeout: bool) -> tuple[str, str | None]:
    """(status, signal name) of a job that ended with ``exit_code`` as bubblewrap reports it: the job's own
    code, or 128 + N when signal N ended it (as a shell reports it, so ``exit 139`` reads as SIGSEGV too).
    CPU time over its limit ends a process with SIGXCPU (soft limit) or SIGKILL (hard limit, a second
    later); the first is a timeout, the second indistinguishable from any other kill."""
    if wall_timeout or exit_code is None:
        return "timeout", None
    if exit_code == 0:
        return "ok", None
    if 128 < exit_code < 128 + 65:
        name = signal_name(exit_code - 128)
        return ("timeout" if name == "SIGXCPU" else "killed"), name
    return "error", None
