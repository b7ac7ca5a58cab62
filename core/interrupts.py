"""Signals that must not cut a step in half.

- Ctrl-C held back across a step that must finish once started (writing a checkpoint): a SIGINT that
  arrives inside is remembered and raised as KeyboardInterrupt when the step is done. Raised in the
  middle of torch's file writers, it would surface as their RuntimeError (a traceback instead of the
  one-line "interrupted; resume with ..."), and in a distributed save it would leave the other ranks
  waiting.
- Stop signals (SIGTERM: what Slurm sends at a job's time limit or on preemption, what Kubernetes sends
  before evicting a pod, and what torchrun forwards to its workers): recorded, never acted on in the
  middle of anything; the step loop asks after each step, saves a checkpoint and stops
  (``StopRequested``), so a preempted run loses no work. Ctrl-C keeps its meaning: stop now.
"""
from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

from orthon.core.errors import ConfigError

# Never stop signals: SIGINT is Ctrl-C's (stop now); SIGKILL / SIGSTOP cannot be caught.
_NOT_STOP_SIGNALS = {"SIGINT", "SIGKILL", "SIGSTOP"}


@contextmanager
def sigint_deferred():
    """Inside: SIGINT is recorded, not raised; on leaving, KeyboardInterrupt if one came (an exception from
    the body wins). A no-op outside the main thread, or where SIGINT is not Python's to handle."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.getsignal(signal.SIGINT)
    if previous in (signal.SIG_IGN, signal.SIG_DFL, None):
        yield
        return
    received: list[int] = []
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
    if received:
        raise KeyboardInterrupt


class StopRequested(Exception):
    """A run stopped on a stop signal at a step boundary, its state saved: exit with ``exit_code``
    (128 + the signal's number, as if the signal had ended the process) after saying how to resume."""

    def __init__(self, signal_name: str, step: int, unit: str = "step"):
        self.signal_name, self.step = signal_name, step
        super().__init__(f"stopped by {signal_name} after {unit} {step}, checkpoint saved")

    @property
    def exit_code(self) -> int:
        return 128 + int(signal.Signals[self.signal_name])


def check_stop_signals(names: Sequence[str]) -> None:
    """ConfigError unless every name is a signal that can serve as a stop signal."""
    for name in names:
        if name not in signal.Signals.__members__:
            raise ConfigError(f"stop_signals: {name!r} is not a signal name (e.g. SIGTERM, SIGUSR1)")
        if name in _NOT_STOP_SIGNALS:
            raise ConfigError(f"stop_signals: {name} cannot be a stop signal (SIGINT stops at once, as Ctrl-C; "
                              f"SIGKILL and SIGSTOP cannot be caught)")


@contextmanager
def stop_signals_recorded(names: Sequence[str]) -> Iterator[Callable[[], int] | None]:
    """Inside: each named signal is recorded, not acted on; yields a function returning the number of
    the first one received (0: none), or None when no names are given. On leaving, the previous
    handlers are back. Outside the main thread nothing can be installed, and the function always
    returns 0."""
    received: list[int] = []
    if not names:
        yield None
        return
    if threading.current_thread() is not threading.main_thread():
        yield lambda: 0
        return
    numbers = [signal.Signals[n] for n in names]
    previous = {n: signal.signal(n, lambda signum, frame: received.append(signum)) for n in numbers}
    try:
        yield lambda: received[0] if received else 0
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
