"""Reward functions by name or dotted path, called so that a bad reward never stops a run.

A reward function is ``fn(response: str, label) -> number``. ``"math"`` and
``"code"`` are built in; anything else is a dotted path, ``pkg.mod.fn`` or
``pkg.mod:fn`` (plug-ins by path, as slime does: a new task never edits the
loop). ``SafeReward`` wraps one: a call that raises, runs past its timeout,
or returns something that is not a finite number (or, with ``binary``, not 0
or 1) gives 0.0 and is counted in ``RewardStats``.

The timeout runs the function in a daemon thread and stops waiting for it;
Python cannot kill a thread, so a reward that never returns keeps its thread
(counted as timed out). Rewards that may hang on their own input should
bound themselves, as the code reward does with its subprocess.
"""
from __future__ import annotations

import functools
import math
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from orthon.core.errors import ConfigError
from orthon.core.plugins import resolve as resolve_plugin
from orthon.rl.rewards.code import code_reward
from orthon.rl.rewards.math import math_reward
from orthon.rl.sandbox import SandboxUnavailable, sandbox_problem

RewardFn = Callable[[str, Any], Any]


def resolve_reward(name: str, *, code_timeout_s: float = 10.0, code_memory_mb: int = 1024,
                   latency_s: float = 0.0) -> RewardFn:
    """The reward function called ``name``: "math", "code", or a dotted path to a callable; with
    ``latency_s``, each call first waits that long (a stand-in for a sandbox's cost in benchmarks)."""
    if name == "math":
        fn = math_reward
    elif name == "code":
        problem = sandbox_problem()  # at set-up, not as a 0 reward on every call of a long run
        if problem:
            raise SandboxUnavailable(f"reward 'code' runs model code in the sandbox: {problem}")
        fn = functools.partial(code_reward, timeout_s=code_timeout_s, memory_mb=code_memory_mb)
    else:
        try:
            fn = resolve_plugin(name, "reward")
        except ConfigError as exc:
            raise ValueError(str(exc)) from None
        if not callable(fn):
            raise ValueError(f"reward {name!r}: not callable")
    return functools.partial(_delayed, fn, latency_s) if latency_s > 0 else fn


def _delayed(fn: RewardFn, latency_s: float, response: str, label: Any) -> Any:
    time.sleep(latency_s)
    return fn(response, label)


COUNTS = ("calls", "passed", "errors", "timeouts", "invalid")  # RewardStats' counts


@dataclass
class RewardStats:
    """Outcome counts of reward calls; thread-safe."""

    calls: int = 0
    passed: int = 0  # reward 1 (or > 0 when not binary)
    errors: int = 0  # raised
    timeouts: int = 0
    invalid: int = 0  # not a finite number, or not 0/1 when binary
    last_problem: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def record(self, outcome: str, problem: str = "") -> None:
        with self._lock:
            self.calls += 1
            if outcome != "ok":
                setattr(self, outcome, getattr(self, outcome) + 1)
                self.last_problem = problem
            elif problem == "passed":
                self.passed += 1

    def as_dict(self) -> dict[str, Any]:
        with self._lock:
            return {key: getattr(self, key) for key in (*COUNTS, "last_problem")}

    def load(self, counts: dict[str, Any]) -> None:
        """Continue from ``as_dict()``'s counts (a resumed run)."""
        with self._lock:
            for key in (*COUNTS, "last_problem"):
                setattr(self, key, counts[key])

    def add(self, counts: dict[str, int], last_problem: str = "") -> None:
        """Add another scorer's counts (another rank's, say); its last problem, if any, becomes the last."""
        with self._lock:
            for key in COUNTS:
                setattr(self, key, getattr(self, key) + counts[key])
            if last_problem:
                self.last_problem = last_problem

    @property
    def failures(self) -> int:
        return self.errors + self.timeouts + self.invalid


def call_with_timeout(fn: Callable[[], Any], timeout_s: float, name: str | None = None) -> dict[str, Any]:
    """``fn()`` in a daemon thread, waited for at most ``timeout_s``: {"value": its result} or {"error": what
    it raised}, never raised (a plug-in must never take the run down); {} when it ran past the time."""
    outcome: dict[str, Any] = {}

    def target():
        try:
            outcome["value"] = fn()
        except (Exception, SystemExit) as exc:
            outcome["error"] = exc

    worker = threading.Thread(target=target, name=name, daemon=True)
    worker.start()
    worker.join(timeout_s)
    return {} if worker.is_alive() else outcome


def _check_value(value: Any, binary: bool) -> tuple[float | None, str]:
    if isinstance(value, bool):
        return float(value), ""
    if hasattr(value, "item") and callable(value.item):  # numpy / torch scalars
        try:
            value = value.item()
        except Exception:
            pass
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None, f"returned {type(value).__name__} {value!r:.80}, not a number"
    value = float(value)
    if not math.isfinite(value):
        return None, f"returned {value}"
    if binary and value not in (0.0, 1.0):
        return None, f"returned {value}; rewards are binary (0 or 1)"
    return value, ""


class SafeReward:
    """Call a reward function with a timeout; failures give 0.0 and are counted, never raised."""

    def __init__(self, fn: RewardFn, *, timeout_s: float = 30.0, binary: bool = True,
                 name: str | None = None, stats: RewardStats | None = None):
        self.fn = fn
        self.timeout_s = timeout_s
        self.binary = binary
        self.name = name or getattr(fn, "__name__", repr(fn))
        self.stats = stats if stats is not None else RewardStats()

    @classmethod
    def from_config(cls, config) -> "SafeReward":
        fn = resolve_reward(config.name, code_timeout_s=config.code_timeout_s, code_memory_mb=config.code_memory_mb,
                            latency_s=config.latency_s)
        return cls(fn, timeout_s=config.timeout_s, binary=config.binary, name=config.name)

    def __call__(self, response: str, label: Any) -> float:
        outcome = call_with_timeout(lambda: self.fn(response, label), self.timeout_s, f"reward-{self.name}")
        if not outcome:
            self.stats.record("timeouts", f"{self.name}: no result after {self.timeout_s}s")
            return 0.0
        if "error" in outcome:
            exc = outcome["error"]
            self.stats.record("errors", f"{self.name}: {type(exc).__name__}: {exc}")
            return 0.0
        value, problem = _check_value(outcome.get("value"), self.binary)
        if value is None:
            self.stats.record("invalid", f"{self.name}: {problem}")
            return 0.0
        self.stats.record("ok", "passed" if value > 0 else "")
        return value
