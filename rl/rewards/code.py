"""Binary code reward: run the candidate with its tests in the sandbox (orthon.rl.sandbox); 1.0 if all pass.

The candidate is the last fenced code block of the response (```python ...```
or a bare ```), or the whole response if it has none. Tests are either Python
source with asserts, run after the candidate in the same file (HumanEval /
MBPP style: pass = exit status 0), or a list of {"input": str, "output": str}
cases fed on stdin (pass = every stdout matches, trailing whitespace ignored).

Each run is one job in a fresh bubblewrap sandbox, a warm one from the process's shared pool: its
own namespaces, no network, nothing of the user's files, the limits of ``SandboxLimits`` (wall and CPU
time ``timeout_s``, address space ``memory_mb``, processes, output). Output past the cap fails the case.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Sequence

from orthon.rl.sandbox import SandboxPool, run_code, shared_pool

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
PYTHON_FENCES = ("python", "py", "python3")
_OUTPUT_CAP = 16 * 1024 * 1024


@dataclass
class CodeResult:
    passed: bool
    returncode: int | None  # None when killed on the wall-clock timeout
    timed_out: bool  # the wall-clock or the CPU-time limit
    stdout: str  # tails, for debugging a failure
    stderr: str
    status: str = ""  # the sandbox's: ok / error / timeout / killed


def extract_code(response: str, languages: Sequence[str] = PYTHON_FENCES) -> str:
    """The last fenced block (one marked with one of ``languages`` preferred), else the whole text."""
    blocks = _FENCE.findall(response or "")
    if not blocks:
        return response or ""
    marked = [code for lang, code in blocks if lang.lower() in languages]
    return (marked or [code for _, code in blocks])[-1]


def _run(program: str, stdin: str, timeout_s: float, memory_mb: int, pool: SandboxPool | None) -> CodeResult:
    result = run_code(program, timeout_s, memory_mb, stdin=stdin, output_bytes=_OUTPUT_CAP,
                      pool=pool if pool is not None else shared_pool())
    return CodeResult(passed=result.status == "ok" and not result.truncated, returncode=result.exit_code,
                      timed_out=result.status == "timeout", stdout=result.stdout, stderr=result.stderr[-4000:],
                      status=result.status)


def run_tests(
    code: str,
    tests: str | Sequence[dict],
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
    pool: SandboxPool | None = None,
) -> CodeResult:
    """Run ``code`` against ``tests`` (assert source, or stdin/stdout cases) in sandboxes under the limits;
    from ``pool``, else the process's shared pool."""
    if isinstance(tests, str):
        return _run(code + "\n\n" + tests + "\n", "", timeout_s, memory_mb, pool)
    if not tests:
        raise ValueError("run_tests: no test cases")
    last = None
    for i, case in enumerate(tests):
        if not isinstance(case, dict) or "input" not in case or "output" not in case:
            raise ValueError(f"run_tests: case {i} must be a dict with 'input' and 'output'")
        last = _run(code, str(case["input"]), timeout_s, memory_mb, pool)
        expected = str(case["output"]).rstrip()
        got = "\n".join(line.rstrip() for line in last.stdout.rstrip().splitlines())
        want = "\n".join(line.rstrip() for line in expected.splitlines())
        if not last.passed or got != want:
            last.passed = False
            last.stdout = last.stdout[-4000:]
            return last
    last.stdout = last.stdout[-4000:]
    return last


def code_reward(response: str, tests, *, timeout_s: float = 10.0, memory_mb: int = 1024) -> float:
    """1.0 if the response's code passes every test, else 0.0."""
    return 1.0 if run_tests(extract_code(response), tests, timeout_s=timeout_s, memory_mb=memory_mb).passed else 0.0
