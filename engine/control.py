"""A handle on one request while the in-process engine decodes it: cancel it, or watch its tokens.

``InProcessEngine.generate(prompts, sampling, controls=[...])`` takes one ``RequestControl`` (or None)
per prompt. After every decode step the engine reads each controlled row: a row whose control was
cancelled leaves the batch there with finish reason "abort", keeping its tokens and log-probs so far
(SGLang aborts running requests the same way), and ``on_tokens`` gets the response so far while it runs
(what a streaming answer sends; the step that ends a request gives its result instead). Both run on the
engine's thread; a request without a control costs nothing. ``on_finish`` gets a request's result the
step it ends, so a server answers a short request without waiting for the longest of its wave.
"""
from __future__ import annotations

import threading
from typing import Callable

DEFAULT_ABORT_REASON = "aborted by request"


class RequestControl:
    def __init__(self, on_tokens: Callable[[list[int]], None] | None = None, on_finish: Callable | None = None):
        self.on_tokens = on_tokens  # called with the response's tokens so far after each step
        # Called with the request's GenerationResult the step it finishes, before the rest of its wave
        # (generate still returns it too); not under ``logprobs: rescore``, whose results come after the wave.
        self.on_finish = on_finish
        self._cancelled = threading.Event()
        self.reason = DEFAULT_ABORT_REASON

    def cancel(self, reason: str = DEFAULT_ABORT_REASON) -> None:
        """End the request after the engine's current step (before it starts, if it has not)."""
        self.reason = reason
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()
