"""OpenAI's API on the engine server: ``GET /v1/models``, ``POST /v1/completions`` and
``POST /v1/chat/completions`` (the shapes and what is supported: ``orthon.engine.openai_api``), so any
OpenAI client, or an evaluation harness speaking it, can use an orthon model. The requests share the
server's batcher with /generate; a stream sends each choice's new text as it is generated (text that may
still turn out to be a stop string is held back), and a client that goes away aborts its requests."""
from __future__ import annotations

import asyncio
from dataclasses import replace
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from orthon.engine.batcher import Pending
from orthon.engine.openai_api import (OpenAIRequest, chat_answer, completion_answer, finish_reason, new_id,
                                      parse_chat, parse_completion, split_reasoning, stream_chunk)
from orthon.engine.server_state import ServerState, read_json
from orthon.engine.sglang_api import BadRequest
from orthon.engine.stop_strings import response_text, settled_text
from orthon.engine.streaming import SSE_DONE, request_updates, sse


def _pending(state: ServerState, request: OpenAIRequest) -> list[Pending]:
    """n requests a prompt, prompt by prompt (choice i of them all draws from seed + i where a seed is given)."""
    if request.params.stop:
        state.require_tokenizer("stop")
    base = request.params
    if not request.logprobs:
        base = replace(base, logprob_mode="none")  # nobody reads them: no rescore
    out = []
    for prompt in request.prompts:
        ids = state.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        for _ in range(request.n):
            seed = None if base.seed is None else base.seed + len(out)
            out.append(Pending(ids, replace(base, seed=seed), new_id("req")))
    return out


def _refused(results, n: int) -> None:
    problems = [f"prompt {i // n}: {r.error.split(': ', 1)[-1]}" for i, r in enumerate(results) if not r.ok]
    if problems:
        raise BadRequest("; ".join(problems))


async def _stream(state: ServerState, request: OpenAIRequest, pending: list[Pending], kind: str):
    """Each choice's new text (chat: and reasoning) as it settles, its end with its finish reason, then [DONE]."""
    chunk_id = new_id("chatcmpl" if kind == "chat" else "cmpl")
    think = state.chat.think if kind == "chat" else None
    holds = request.params.stop + (think if think else ())
    sent = [("", "")] * len(pending)  # (reasoning, content) sent so far, per choice
    settled = [0] * len(pending)  # characters of each choice's text sent so far

    def delta(index: int, text: str, finish: str | None) -> str:
        reasoning, content = split_reasoning(text, think)
        (old_reasoning, old_content), sent[index] = sent[index], (reasoning, content)
        new_content, new_reasoning = content[len(old_content):], reasoning[len(old_reasoning):]
        return sse(stream_chunk(kind, chunk_id, request.model, index, new_content if new_content or finish else None,
                                finish, reasoning=new_reasoning or None))

    if kind == "chat":  # the role first, as OpenAI streams it
        for index in range(len(pending)):
            yield sse(stream_chunk(kind, chunk_id, request.model, index, None, None, first=True))
    async for index, tokens in request_updates(state.batcher, pending):
        if tokens is not None:
            text = settled_text(state.detokenize(tokens), holds)
            if len(text) > settled[index]:
                settled[index] = len(text)
                yield delta(index, text, None)
            continue
        result = pending[index].future.result()
        if not result.ok:
            yield sse({"error": {"message": f"prompt {index // request.n}: {result.error.split(': ', 1)[-1]}",
                                 "type": "invalid_request_error"}})
            continue
        yield delta(index, response_text(result, state.detokenize), finish_reason(result))
    yield SSE_DONE


def add_openai_routes(app: FastAPI, state: ServerState) -> None:
    model_name = Path(state.model_path).name

    @app.get("/v1/models")
    async def models():
        return JSONResponse({"object": "list", "data": [{"id": model_name, "object": "model", "created": 0,
                                                         "owned_by": "orthon", "root": state.model_path}]})

    async def serve(request: OpenAIRequest, kind: str):
        pending = _pending(state, request)
        if request.stream:
            return StreamingResponse(_stream(state, request, pending, kind), media_type="text/event-stream")
        state.batcher.submit(pending)
        results = await asyncio.gather(*(asyncio.wrap_future(p.future) for p in pending))
        _refused(results, request.n)
        lengths = [len(p.prompt) for p in pending]
        if kind == "chat":
            return JSONResponse(chat_answer(request, results, state.detokenize, state.chat, lengths))
        return JSONResponse(completion_answer(request, results, state.detokenize, lengths))

    @app.post("/v1/completions")
    async def completions(http: Request):
        body = await read_json(http, state.max_body_bytes)
        return await serve(parse_completion(body, model_name), "completion")

    @app.post("/v1/chat/completions")
    async def chat_completions(http: Request):
        body = await read_json(http, state.max_body_bytes)
        if state.chat is None:
            raise BadRequest("messages: this server has no chat format (orthon serve gives it orthon's)")
        state.require_tokenizer("messages")
        return await serve(parse_chat(body, state.chat, model_name, state.engine.max_length), "chat")
