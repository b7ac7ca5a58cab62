"""Ctrl-C held back across a step that must finish once started (writing a checkpoint): a SIGINT that
arrives inside is remembered and raised as KeyboardInterrupt when the step is done. Raised in the middle
of torch's file writers, it would surface as their RuntimeError (a traceback instead of the one-line
"interrupted; resume with ..."), and in a distributed save it would leave the other ranks waiting."""
from __future__ import annotations

import signal
import threading
from contextlib import contextmanager


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
