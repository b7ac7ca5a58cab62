"""Streaming answers: a server's view of its requests while they run, and server-sent events.

``request_updates`` submits requests to the batcher and yields (index, tokens so far) as the engine
decodes them and (index, None) as each finishes (its result is then in its future). Updates the client
has not yet taken are merged into the newest of each request, so a slow reader costs no backlog.
Leaving the loop early, as a stream whose client went away does, aborts the requests still running.
"""
from __future__ import annotations

import asyncio
import json
from typing import AsyncIterator

from orthon.engine.batcher import ContinuousBatcher, Pending


def sse(data) -> str:
    """One server-sent event holding ``data`` as JSON."""
    return f"data: {json.dumps(data)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


async def request_updates(batcher: ContinuousBatcher, pending: list[Pending]) -> AsyncIterator[tuple[int, list[int] | None]]:
    loop = asyncio.get_running_loop()
    latest: dict[int, list[int]] = {}
    finished: list[int] = []
    wake = asyncio.Event()

    def tokens_of(index: int, tokens: list[int]) -> None:
        latest[index] = tokens
        wake.set()

    def done(index: int) -> None:
        finished.append(index)
        wake.set()

    for index, p in enumerate(pending):
        p.control.on_tokens = lambda tokens, i=index: loop.call_soon_threadsafe(tokens_of, i, tokens)
        p.future.add_done_callback(lambda _, i=index: loop.call_soon_threadsafe(done, i))
    batcher.submit(pending)
    remaining = len(pending)
    try:
        while remaining:
            await wake.wait()
            wake.clear()
            ended, finished[:] = list(finished), []
            for index in sorted(latest):
                tokens = latest.pop(index)
                if index not in ended:
                    yield index, tokens
            for index in ended:
                remaining -= 1
                yield index, None
    finally:
        for p in pending:
            if not p.future.done():
                batcher.abort(p.rid, why="the client went away")
