"""What a sandboxed job gives back, and how its end becomes a status."""
from __future__ import annotations

import signal
from dataclasses import dataclass, field


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


def _ending(result: SandboxResult) -> str:
    if result.status == "timeout":
        return f"[timed out after {result.wall_s:.1f} s]" if result.signal is None else "[CPU time limit reached]"
    if result.status == "killed":
        return f"[killed by {result.signal}]"
    if result.status == "error":
        return f"[exit code {result.exit_code}]"
    return ""


def observation(result: SandboxResult, max_chars: int) -> tuple[str, bool]:
    """What a model is shown of a tool call: stdout, stderr, then a line for any end but a clean exit, in at
    most ``max_chars`` characters. A longer output keeps its head and its tail (where a traceback's last
    line is) around a note of how much was cut. Returns (text, whether anything was cut here or by the
    sandbox's output cap), so the caller can count truncations."""
    body = result.stdout
    if result.stderr:
        body += ("\n" if body and not body.endswith("\n") else "") + result.stderr
    notes = "\n".join(n for n in ("[output cut at the sandbox's limit]" if result.truncated else "", _ending(result)) if n)
    tail = ("\n" if body and notes and not body.endswith("\n") else "") + notes
    room = max_chars - len(tail)
    cut = len(body) > room
    if cut:
        marker = f"\n[... {len(body)} characters, the middle cut ...]\n"
        keep = max(0, room - len(marker))
        body = body[:keep // 2] + marker + body[len(body) - (keep - keep // 2):] if keep else ""
    return (body + tail)[:max_chars], cut or result.truncated
