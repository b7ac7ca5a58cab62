"""Binary rewards: math answer extraction and checking, code tests in the sandbox,
custom rewards by dotted path that never crash the run."""
import os
import threading
import time

import numpy as np
import pytest
import torch

import orthon.rl.rewards.math as math_module
from orthon.core.config import ConfigError, build
from orthon.rl.config import RewardConfig
from orthon.rl.sandbox import sandbox_problem
from orthon.rl.sandbox.hostile import processes_with
from orthon.rl.rewards import (
    RewardStats,
    SafeReward,
    code_reward,
    extract_answer,
    extract_code,
    math_reward,
    resolve_reward,
    run_tests,
)

# ---------------------------------------------------------------- math


@pytest.mark.parametrize(
    "text, answer",
    [
        ("so \\boxed{3} first, then \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),  # last box, nested braces
        ("The final answer is: 42.\nThanks", "42"),
        ("Reasoning...\n#### 1,234", "1,234"),
        ("answer: $x^2 + 1$", "x^2 + 1"),
        ("I had 3 apples and ate 5", "5"),
        ("3 - 10 = -7", "-7"),
        ("no digits here", None),
        ("", None),
    ],
)
def test_extract_answer(text, answer):
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    "response, label, reward",
    [
        ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
        ("answer: 0.5", "\\frac12", 1.0),
        ("\\boxed{1000}", "1,000", 1.0),
        ("so the total is 12", 12, 1.0),
        ("\\boxed{x+1}", "1+x", 1.0),
        ("\\boxed{2^{1/2}}", "\\sqrt{2}", 1.0),
        ("\\boxed{13}", "12", 0.0),
        ("answer: 3.15", "\\pi", 0.0),
        ("I do not know", "12", 0.0),
        ("", "12", 0.0),
        ("\\boxed{7}", "\\boxed{7}", 1.0),
    ],
)
def test_math_reward_is_binary_and_uses_math_verify(response, label, reward):
    assert math_module.math_verify is not None  # the maintained verifier is installed here
    assert math_reward(response, label) == reward


@pytest.mark.parametrize(
    "candidate, label, same",
    [
        ("\\frac{1}{2}", "0.5", True),
        ("2^{1/2}", "\\sqrt{2}", True),
        ("-7.0", "-7", True),
        ("1,000", "1000", True),
        ("3", "4", False),
        ("__import__('os').system('true')", "0", False),  # never reaches sympy's eval
        ("exit()", "0", False),
    ],
)
def test_fallback_without_math_verify(monkeypatch, candidate, label, same):
    monkeypatch.setattr(math_module, "math_verify", None)
    assert math_module.answers_match(candidate, label) is same


def test_math_reward_in_a_worker_thread():
    # math-verify's signal-based timeouts only work in the main thread; the reward must still run.
    out = []
    t = threading.Thread(target=lambda: out.append(math_reward("\\boxed{\\frac{3}{4}}", "0.75")))
    t.start()
    t.join(30)
    assert out == [1.0]


# ---------------------------------------------------------------- code

needs_sandbox = pytest.mark.skipif(sandbox_problem() is not None, reason=f"no sandbox here: {sandbox_problem()}")

GOOD = "Here you go:\n```python\ndef add(a, b):\n    return a + b\n```\n"
TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\n"


@needs_sandbox
def test_code_reward_pass_and_fail():
    assert extract_code(GOOD).strip() == "def add(a, b):\n    return a + b"
    assert extract_code("```\nprint(1)\n```\n```python\nx = 2\n```") == "x = 2\n"
    assert code_reward(GOOD, TESTS) == 1.0
    assert code_reward(GOOD.replace("a + b", "a - b"), TESTS) == 0.0
    assert code_reward("```python\ndef add(a, b) return\n```", TESTS) == 0.0  # syntax error
    assert code_reward("", TESTS) == 0.0


@needs_sandbox
def test_code_reward_stdin_stdout_cases():
    prog = "```python\nn = int(input())\nprint(n * n)\n```"
    assert code_reward(prog, [{"input": "3\n", "output": "9"}, {"input": "12", "output": "144\n"}]) == 1.0
    assert code_reward(prog, [{"input": "3", "output": "9"}, {"input": "4", "output": "15"}]) == 0.0
    with pytest.raises(ValueError, match="case 0"):
        run_tests("print(1)", [{"stdin": "1"}])


@needs_sandbox
def test_code_time_limit_kills_the_process_group():
    # The child's pid is the sandbox's own (a PID namespace): the host finds it by the marker it carries.
    marker = f"{os.getpid()}.{time.monotonic_ns() % 10**6}"
    program = (
        "import subprocess\n"
        f"subprocess.Popen(['sleep', '{marker}'])\n"
        "print('started', flush=True)\n"
        "while True:\n    pass\n"
    )
    start = time.monotonic()
    result = run_tests(program, "", timeout_s=1.0)
    assert not result.passed and result.timed_out and result.status == "timeout"
    assert result.stdout == "started\n"
    assert time.monotonic() - start < 20  # a generous bound: it did stop, not hang for 60 s
    deadline = time.monotonic() + 5
    while processes_with(marker) and time.monotonic() < deadline:  # the namespace ends just after bwrap
        time.sleep(0.05)
    assert processes_with(marker) == [], "a child of the candidate survived the timeout"


@needs_sandbox
def test_code_memory_limit():
    result = run_tests("x = bytearray(2 * 1024 ** 3)\n", "", timeout_s=10, memory_mb=256)
    assert not result.passed and "MemoryError" in result.stderr


# ---------------------------------------------------------------- registry


def _raises(response, label):
    raise RuntimeError("judge unreachable")


def test_resolve_builtin_and_dotted_paths():
    assert resolve_reward("math") is math_reward
    if sandbox_problem() is None:  # without one, "code" refuses at set-up (SandboxUnavailable)
        assert resolve_reward("code")(GOOD, TESTS) == 1.0
    for name in ("operator.eq", "operator:eq"):
        reward = SafeReward(resolve_reward(name))
        assert reward("7", "7") == 1.0 and reward("7", "8") == 0.0
    with pytest.raises(ValueError, match="cannot import"):
        resolve_reward("no_such_pkg_xyz.fn")
    with pytest.raises(ValueError, match="no attribute"):
        resolve_reward("operator.no_such_fn")
    with pytest.raises(ValueError, match="not callable"):
        resolve_reward("math.pi")


def test_bad_rewards_give_zero_and_are_counted():
    stats = RewardStats()
    cases = [
        (_raises, "errors"),
        (lambda r, l: "yes", "invalid"),
        (lambda r, l: None, "invalid"),
        (lambda r, l: float("nan"), "invalid"),
        (lambda r, l: 0.5, "invalid"),  # binary rewards only
        (lambda r, l: (_ for _ in ()).throw(SystemExit(3)), "errors"),
    ]
    for fn, kind in cases:
        before = getattr(stats, kind)
        assert SafeReward(fn, stats=stats)("resp", "label") == 0.0
        assert getattr(stats, kind) == before + 1
    slow = SafeReward(lambda r, l: time.sleep(2) or 1.0, timeout_s=0.1, stats=stats)
    assert slow("resp", "label") == 0.0
    assert stats.timeouts == 1
    # numpy / torch scalars and bools are numbers
    for value in (np.float32(1.0), torch.tensor(1.0), True, 1):
        assert SafeReward(lambda r, l, v=value: v, stats=stats)("r", "l") == 1.0
    assert SafeReward(lambda r, l: 0.5, binary=False, stats=stats)("r", "l") == 0.5
    d = stats.as_dict()
    assert (d["calls"], d["errors"], d["invalid"], d["timeouts"], d["passed"]) == (12, 2, 4, 1, 5)
    assert "no result after 0.1s" in d["last_problem"]  # the last failure was the timeout
    assert stats.failures == 7


def test_reward_from_config():
    cfg = build(RewardConfig, {"name": "math", "timeout_s": 5})
    reward = SafeReward.from_config(cfg)
    assert reward("\\boxed{4}", "4") == 1.0 and reward("\\boxed{5}", "4") == 0.0
    assert reward.stats.as_dict()["calls"] == 2 and reward.stats.passed == 1
    with pytest.raises(ConfigError, match="timeout_s"):
        build(RewardConfig, {"timeout_s": 0})
