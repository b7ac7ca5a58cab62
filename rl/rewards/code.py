"""Binary code reward: run the candidate with its tests in a subprocess; 1.0 if all pass.

The candidate is the last fenced code block of the response (```python ...```
or a bare ```), or the whole response if it has none. Tests are either Python
source with asserts, run after the candidate in the same file (HumanEval /
MBPP style: pass = exit status 0), or a list of {"input": str, "output": str}
cases fed on stdin (pass = every stdout matches, trailing whitespace ignored).

Limits: the child sets its own resource limits (RLIMIT_AS for memory,
RLIMIT_CPU for CPU time, RLIMIT_FSIZE for files, no core dumps) before running
the candidate, which keeps the parent free of preexec_fn (unsafe with threads).
It runs in a fresh temporary directory, in its own session so a wall-clock
timeout kills every process it started, with stdout/stderr going to files
capped by RLIMIT_FSIZE. This is a resource guard, not a security sandbox:
untrusted code at scale belongs in a container (the Agentic RL sandboxes).
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Sequence

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)```", re.DOTALL)

# Runs in the child before the candidate: limits first, then the program as __main__.
_BOOT = r"""
import resource, runpy, sys
mem, cpu, fsize = (int(x) for x in sys.argv[1:4])
resource.setrlimit(resource.RLIMIT_AS, (mem, mem))
resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))
resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
sys.argv = sys.argv[4:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""

_OUTPUT_CAP = 16 * 1024 * 1024


@dataclass
class CodeResult:
    passed: bool
    returncode: int | None  # None when killed on the wall-clock timeout
    timed_out: bool
    stdout: str  # tails, for debugging a failure
    stderr: str


def extract_code(response: str) -> str:
    """The last fenced block (python preferred when languages are marked), else the whole text."""
    blocks = _FENCE.findall(response or "")
    if not blocks:
        return response or ""
    python = [code for lang, code in blocks if lang.lower() in ("python", "py", "python3")]
    return (python or [code for _, code in blocks])[-1]


def _run(program: str, stdin: str, timeout_s: float, memory_mb: int) -> CodeResult:
    with tempfile.TemporaryDirectory(prefix="orthon_code_") as tmp:
        path = os.path.join(tmp, "candidate.py")
        with open(path, "w") as f:
            f.write(program)
        cpu = max(1, int(timeout_s + 0.999))
        cmd = [sys.executable, "-I", "-c", _BOOT, str(memory_mb * 1024 * 1024), str(cpu), str(_OUTPUT_CAP), path]
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONHASHSEED": "0", "OMP_NUM_THREADS": "1"}
        out_path, err_path = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        with open(out_path, "wb") as out, open(err_path, "wb") as err:
            proc = subprocess.Popen(
                cmd, stdin=subprocess.PIPE, stdout=out, stderr=err, cwd=tmp, env=env, start_new_session=True
            )
            timed_out = False
            try:
                proc.communicate(input=stdin.encode(), timeout=timeout_s)
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                # The whole session: the candidate may have started children of its own.
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
                proc.wait()
        with open(out_path, "rb") as f:
            stdout = f.read().decode(errors="replace")
        with open(err_path, "rb") as f:
            stderr = f.read().decode(errors="replace")
    code = None if timed_out else proc.returncode
    return CodeResult(passed=code == 0, returncode=code, timed_out=timed_out, stdout=stdout, stderr=stderr[-4000:])


def run_tests(
    code: str,
    tests: str | Sequence[dict],
    *,
    timeout_s: float = 10.0,
    memory_mb: int = 1024,
) -> CodeResult:
    """Run ``code`` against ``tests`` (assert source, or stdin/stdout cases) under the limits."""
    if isinstance(tests, str):
        return _run(code + "\n\n" + tests + "\n", "", timeout_s, memory_mb)
    if not tests:
        raise ValueError("run_tests: no test cases")
    last = None
    for i, case in enumerate(tests):
        if not isinstance(case, dict) or "input" not in case or "output" not in case:
            raise ValueError(f"run_tests: case {i} must be a dict with 'input' and 'output'")
        last = _run(code, str(case["input"]), timeout_s, memory_mb)
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
