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

from orthon.rl.sandbox import run_code, shared_pool

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)
PYTHON_FENCES = ("python", "py", "python3")
_OUTPUT_CAP = 16 * 1024 * 1024


@dataclass
class CodeResult:
    passed: bool
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


def output_lines(text: str) -> list[str]:
    """``text``'s lines as an expected output is compared: trailing whitespace and blank lines at the end ignored."""
    return [line.rstrip() for line in text.rstrip().splitlines()]


def _run(program: str, stdin: str, timeout_s: float, memory_mb: int) -> CodeResult:
    result = run_code(program, timeout_s, memory_mb, stdin=stdin, output_bytes=_OUTPUT_CAP, pool=shared_pool())
    return CodeResult(passed=result.status == "ok" and not result.truncated, timed_out=result.status == "timeout",
                      stdout=result.stdout, stderr=result.stderr[-4000:], status=result.status)


def run_tests(code: str, tests: str | Sequence[dict], *, timeout_s: float = 10.0, memory_mb: int = 1024) -> CodeResult:
    """Run ``code`` against ``tests`` (assert source, or stdin/stdout cases) in sandboxes of the process's
    shared pool, under the limits."""
    if isinstance(tests, str):
        return _run(code + "\n\n" + tests + "\n", "", timeout_s, memory_mb)
    if not tests:
        raise ValueError("run_tests: no test cases")
    for i, case in enumerate(tests):
        if not isinstance(case, dict) or "input" not in case or "output" not in case:
            raise ValueError(f"run_tests: case {i} must be a dict with 'input' and 'output'")
        last = _run(code, str(case["input"]), timeout_s, memory_mb)
        if not last.passed or output_lines(last.stdout) != output_lines(str(case["output"])):
            last.passed = False
            break
    last.stdout = last.stdout[-4000:]
    return last


def code_reward(response: str, tests, *, timeout_s: float = 10.0, memory_mb: int = 1024) -> float:
    """1.0 if the response's code passes every test, else 0.0."""
    return 1.0 if run_tests(extract_code(response), tests, timeout_s=timeout_s, memory_mb=memory_mb).passed else 0.0
