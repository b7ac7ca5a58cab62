"""Continuous batching of concurrent callers onto one engine: requests queue, one worker thread takes
everything waiting and runs it as one ``generate`` call (a wave; the engine splits it into waves of its
``max_batch_size``), so sixteen HTTP callers arriving together cost one engine call, not sixteen.

While a wave decodes, waiting requests join it as its rows finish (continuous batching, on an engine
that takes them: orthon's in-process one, once its ``join_free_share`` of the rows are free; a request whose prompt is longer than the wave has cached,
or whose response would outgrow the wave, starts the next wave instead), and each request is answered
the step it finishes.

Around the waves: ``pause`` holds new waves (the requests wait; ``mode="abort"`` also returns every
waiting request aborted), ``resume`` lets them run again, ``abort`` returns waiting requests by rid,
and ``exclusive()`` gives a weight update the engine between two waves: it waits for the running wave,
holds new ones while it runs, and updates never run two at a time. On an engine that takes request
controls (orthon's in-process engine: ``orthon.engine.control``), ``abort`` and a pause in "abort" mode
also stop running requests after the engine's current step, each returned with its tokens so far
(SGLang's abort); elsewhere they reach only requests that have not started.
"""
from __future__ import annotations

import threading
import time
from collections import Counter, deque
from concurrent.futures import Future
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from orthon.engine.control import RequestControl
from orthon.engine.protocol import GenerationResult
from orthon.engine.sampling import SamplingParams

PAUSE_MODES = ("abort", "retract", "in_place")


@dataclass
class Pending:
    """A request waiting for its wave; ``future`` receives its GenerationResult; ``control`` reaches it
    while it runs (cancel it, watch its tokens)."""

    prompt: list[int]
    params: SamplingParams
    rid: str
    future: Future = field(default_factory=Future)
    control: RequestControl = field(default_factory=RequestControl)


def aborted(request: Pending, weight_version: int, why: str) -> GenerationResult:
    """The result of a request stopped before it ran: no tokens (SGLang's finish_reason "abort")."""
    return GenerationResult(prompt=list(request.prompt), tokens=[], log_probs=torch.zeros(0), finish_reason="abort",
                            weight_version=weight_version, seed=request.params.seed, error=why)


def _answer(request: Pending, result: GenerationResult) -> None:
    if not request.future.done():
        request.future.set_result(result)


DEFAULT_WINDOW_S = 0.003


class ContinuousBatcher:
    def __init__(self, engine, window_s: float = DEFAULT_WINDOW_S, continuous: bool = True):
        """``window_s``: after the first request reaches an idle engine, the worker waits while more keep
        arriving (each within window_s of the last, at most 20 windows, until a full batch), so a burst
        of concurrent callers lands in one wave instead of its first request running alone.
        ``continuous``: requests join a running wave (False: each waits for the next wave)."""
        self.engine = engine
        self.window_s = window_s
        self._full = getattr(getattr(engine, "config", None), "max_batch_size", 64)
        self._queue: deque[Pending] = deque()
        self._cond = threading.Condition()
        self._paused = False
        self._running: list[Pending] = []  # the wave now on the engine
        self._controls = bool(getattr(engine, "takes_controls", False))
        self._continuous = continuous
        self._updates_waiting = 0
        self._update_lock = threading.Lock()  # one weight update at a time
        self._closed = False
        self.stats = Counter()  # generate_calls, requests, aborted, max_batch
        self.batch_sizes: Counter = Counter()  # requests per generate call -> how many calls had that many
        self._worker = threading.Thread(target=self._loop, name="orthon-batcher", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------ callers
    def submit(self, requests: list[Pending]) -> None:
        """Queue ``requests`` (their futures complete when their wave has run)."""
        with self._cond:
            if self._closed:
                for r in requests:
                    r.future.set_result(aborted(r, self.engine.weight_version, "the server is shutting down"))
                return
            self._queue.extend(requests)
            self.stats["requests"] += len(requests)
            self._cond.notify_all()

    def abort(self, rid: str | None = None, abort_all: bool = False, why: str = "aborted by request") -> int:
        """Return the waiting requests with ``rid`` (or all of them) aborted, and stop the running ones
        where the engine takes controls (they come back with their tokens so far); how many there were."""
        with self._cond:
            hit = [r for r in self._queue if abort_all or r.rid == rid]
            for r in hit:
                self._queue.remove(r)
            running = [r for r in self._running
                       if (abort_all or r.rid == rid) and not r.control.cancelled and not r.future.done()]
            if not self._controls:
                running = []
            for r in running:
                r.control.cancel(why)
            self.stats["aborted"] += len(hit) + len(running)
        for r in hit:
            r.future.set_result(aborted(r, self.engine.weight_version, why))
        return len(hit) + len(running)

    def pause(self, mode: str = "abort", timeout_s: float | None = None) -> bool:
        """Hold new waves; with mode "abort" the waiting requests are returned aborted and the running ones
        stopped (``abort``). Returns once the running wave (if any) has finished: True, or False when
        ``timeout_s`` passed first."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode: expected one of {PAUSE_MODES}, got {mode!r}")
        with self._cond:
            self._paused = True
        if mode == "abort":
            self.abort(abort_all=True, why="aborted by pause_generation")
        with self._cond:
            return self._cond.wait_for(lambda: not self._running, timeout_s)

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    @contextmanager
    def exclusive(self):
        """The engine to the caller alone (a weight update): after the running wave, before the next."""
        with self._update_lock:
            with self._cond:
                self._updates_waiting += 1
                try:
                    self._cond.wait_for(lambda: not self._running)
                except BaseException:
                    self._updates_waiting -= 1
                    raise
            try:
                yield self.engine
            finally:
                with self._cond:
                    self._updates_waiting -= 1
                    self._cond.notify_all()

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop taking requests, abort the waiting ones, let the running wave finish (up to timeout_s)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self.abort(abort_all=True, why="the server is shutting down")
        self._worker.join(timeout_s)

    def alive(self) -> bool:
        return self._worker.is_alive()

    def snapshot(self) -> dict:
        with self._cond:
            return {"waiting": len(self._queue), "running": len(self._running), "paused": self._paused,
                    "generate_calls": self.stats["generate_calls"], "requests": self.stats["requests"],
                    "aborted": self.stats["aborted"], "max_batch": self.stats["max_batch"], "joined": self.stats["joined"],
                    "batch_sizes": {str(k): v for k, v in sorted(self.batch_sizes.items())}}

    def _joins(self, room: int, fits) -> list:
        """Waiting requests that join the running wave as its rows free up (continuous batching; called by
        the engine between decode steps): up to ``room``, in arrival order, passing over those that do not
        fit it yet (they start the next wave). None while paused, closing, or a weight update waits (so the
        wave drains and the update gets the engine)."""
        with self._cond:
            if self._paused or self._updates_waiting or self._closed or not self._queue:
                return []
            taken = [r for r in self._queue if fits(len(r.prompt), r.params.max_new_tokens)][:room]
            for r in taken:
                self._queue.remove(r)
                r.control.on_finish = lambda result, r=r: _answer(r, result)
            self._running.extend(taken)
            self.stats["joined"] += len(taken)
        return [(r.prompt, r.params, r.control) for r in taken]

    # ------------------------------------------------------------ the worker
    def _ready(self) -> bool:
        return self._closed or (bool(self._queue) and not self._paused and not self._updates_waiting)

    def _gather(self) -> None:
        """Wait while the burst that woke the worker keeps growing (the condition's wait lets callers in)."""
        deadline = time.monotonic() + 20 * self.window_s
        while self.window_s > 0 and len(self._queue) < self._full and not self._closed:
            seen = len(self._queue)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._cond.wait_for(lambda: len(self._queue) != seen or self._closed,
                                                        min(self.window_s, remaining)):
                return

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(self._ready)
                if self._closed:
                    return
                self._gather()
                if not self._ready():  # paused, aborted or an update came in meanwhile
                    continue
                wave = list(self._queue)
                self._queue.clear()
                self._running = wave
                self.stats["generate_calls"] += 1
                self.stats["max_batch"] = max(self.stats["max_batch"], len(wave))
                self.batch_sizes[len(wave)] += 1
            try:
                prompts, params = [r.prompt for r in wave], [r.params for r in wave]
                if self._controls:  # each answered the step it finishes, not when the wave's longest does
                    for r in wave:
                        r.control.on_finish = lambda result, r=r: _answer(r, result)
                    results = self.engine.generate(prompts, params, controls=[r.control for r in wave],
                                                   joins=self._joins if self._continuous else None)
                else:
                    results = self.engine.generate(prompts, params)
                for r, result in zip(wave, results):
                    _answer(r, result)
            except BaseException as exc:  # an engine bug: every caller of the wave gets it, the loop goes on
                for r in wave:
                    if not r.future.done():
                        r.future.set_exception(exc)
            finally:
                with self._cond:
                    self._running = []
                    self._cond.notify_all()
