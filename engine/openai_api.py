"""OpenAI's completions and chat completions API as pure functions: request bodies to orthon's requests,
results to answers (``orthon.engine.openai_routes`` serves them under /v1).

What orthon's engine computes is mapped one to one: ``max_tokens`` (chat: ``max_completion_tokens``
too), ``temperature``, ``top_p``, ``seed`` (choice i of ``n`` draws from seed + i), ``stop`` (up to 4
strings; the answer's text ends before them), ``n``, ``stream``, and the log-prob of each sampled token
(completions ``logprobs: 0``, chat ``logprobs: true``). What it does not compute is refused by name
with a 400 rather than ignored: ``echo`` and prompt log-probs, top alternatives (``logprobs`` > 0,
``top_logprobs`` > 0), ``best_of`` > 1, ``suffix``, penalties, ``logit_bias``, tools and response formats.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, replace
from typing import Any, Mapping, Protocol

from orthon.core.errors import ConfigError
from orthon.engine.protocol import GenerationResult
from orthon.engine.sampling import SamplingParams
from orthon.engine.sglang_api import BadRequest, _is_token
from orthon.engine.stop_strings import response_text

COMPLETIONS_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# Keys that only change what OpenAI's own service does (billing, storage, moderation, latency tiers).
_IGNORED = {"model", "user", "metadata", "store", "service_tier", "stream_options", "parallel_tool_calls"}
# Keys asking for what the engine does not compute: accepted only at the value that turns them off.
_OFF = {"presence_penalty": 0, "frequency_penalty": 0, "logit_bias": None, "best_of": 1, "suffix": None,
        "echo": False, "tools": None, "tool_choice": None, "functions": None, "function_call": None,
        "response_format": None, "top_logprobs": 0, "prediction": None, "modalities": None, "audio": None,
        "reasoning_effort": None}
# OpenAI's chat roles as the chat format's ("developer" is a newer name for "system").
CHAT_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant",
              "tool": "observation"}


class ChatFormat(Protocol):
    """How a model's conversations are written (``orthon.rl.chat.ChatTemplate`` is orthon's)."""

    stop: tuple[str, ...]  # the text that ends an assistant turn (the next role's marker)
    think: tuple[str, str] | None  # the markers around a turn's leading reasoning, if the format has them

    def render(self, messages: list[tuple[str, str]]) -> str:
        """(role, content) pairs in the format's roles, ending with an open assistant turn."""
        ...


def split_reasoning(text: str, think: tuple[str, str] | None) -> tuple[str, str]:
    """(reasoning, content) of an assistant turn's text, or of the part generated so far: the same
    split whether the text is whole or growing (text that may still become the opening marker, or a
    reasoning block not yet closed, counts as reasoning so far), so a stream never takes back text."""
    if think is None:
        return "", text
    opening, closing = think
    if text.startswith(opening):
        body = text[len(opening):]
        reasoning, _, content = body.partition(closing)
        return reasoning, content
    if opening.startswith(text):
        return "", ""
    return "", text


@dataclass
class OpenAIRequest:
    prompts: list  # text or token ids, one per prompt (each answered n times)
    params: SamplingParams
    n: int
    stream: bool
    logprobs: bool
    model: str


def _number(body: Mapping, key: str, default, kind=(int, float)):
    value = body.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, kind):
        raise BadRequest(f"{key}: expected a number, got {value!r}")
    return value


def _common(body: Any, keys: set[str], max_tokens_keys: tuple[str, ...], default_max: int) -> tuple[SamplingParams, int, bool]:
    """The sampling settings, n and stream of a body, every key checked."""
    if not isinstance(body, Mapping):
        raise BadRequest(f"body: expected a JSON object, got {type(body).__name__}")
    for key, value in body.items():
        if key in _OFF and value not in (None, _OFF[key], [], {}):
            raise BadRequest(f"{key}: not supported by this engine (only {_OFF[key]!r})")
        if key not in _OFF and key not in _IGNORED and key not in keys:
            raise BadRequest(f"{key}: unknown parameter")
    max_tokens = next((body[k] for k in max_tokens_keys if body.get(k) is not None), default_max)
    if not _is_token(max_tokens) or max_tokens < 1:
        raise BadRequest(f"{max_tokens_keys[0]}: expected an integer >= 1, got {max_tokens!r}")
    n = _number(body, "n", 1, int)
    if n < 1 or n > 128:
        raise BadRequest(f"n: expected 1..128, got {n}")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(f"stop: expected a string or up to 4 non-empty strings, got {body.get('stop')!r}")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"stream: expected true or false, got {stream!r}")
    seed = body.get("seed")
    if seed is not None and not _is_token(seed):
        raise BadRequest(f"seed: expected an integer, got {seed!r}")
    try:
        params = SamplingParams(max_new_tokens=max_tokens, temperature=_number(body, "temperature", 1.0),
                                top_p=_number(body, "top_p", 1.0), seed=seed, stop=tuple(stop))
    except ConfigError as exc:
        raise BadRequest(str(exc)) from None
    return params, n, stream


def parse_completion(body: Any, default_model: str) -> OpenAIRequest:
    """A /v1/completions body: ``prompt`` a string, a list of strings, token ids or lists of them."""
    params, n, stream = _common(body, {"prompt", "max_tokens", "temperature", "top_p", "n", "stop", "stream", "seed",
                                       "logprobs"}, ("max_tokens",), COMPLETIONS_MAX_TOKENS)
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt)):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) or (isinstance(p, list) and p and all(
            _is_token(t) for t in p)) for p in prompt):
        prompts = list(prompt)
    else:
        raise BadRequest("prompt: expected a string, a list of strings, a list of token ids or a list of such lists")
    logprobs = body.get("logprobs")
    if logprobs is not None and (isinstance(logprobs, bool) or logprobs != 0):
        raise BadRequest(f"logprobs: only 0 (the sampled tokens' log-probs; no top alternatives), got {logprobs!r}")
    return OpenAIRequest(prompts, params, n, stream, logprobs == 0, str(body.get("model") or default_model))


def parse_chat(body: Any, chat: ChatFormat, default_model: str, default_max: int) -> OpenAIRequest:
    """A /v1/chat/completions body: ``messages`` rendered by the model's chat format; the assistant's turn
    also ends at the format's next-role markers."""
    params, n, stream = _common(body, {"messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n",
                                       "stop", "stream", "seed", "logprobs"},
                                ("max_completion_tokens", "max_tokens"), default_max)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise BadRequest("messages: expected a non-empty list of {role, content} objects")
    pairs = []
    for i, m in enumerate(messages):
        role = m.get("role") if isinstance(m, Mapping) else None
        if role not in CHAT_ROLES:
            raise BadRequest(f"messages[{i}].role: expected one of {', '.join(CHAT_ROLES)}, got {role!r}")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text ones
            if not all(isinstance(p, Mapping) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise BadRequest(f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise BadRequest(f"messages[{i}].content: expected a string or text parts, got {type(content).__name__}")
        pairs.append((CHAT_ROLES[role], content))
    logprobs = body.get("logprobs", False)
    if not isinstance(logprobs, bool):
        raise BadRequest(f"logprobs: expected true or false, got {logprobs!r}")
    stops = params.stop + tuple(s for s in chat.stop if s not in params.stop)
    params = replace(params, stop=stops)
    return OpenAIRequest([chat.render(pairs)], params, n, stream, logprobs, str(body.get("model") or default_model))


def finish_reason(result: GenerationResult) -> str:
    return {"stop": "stop", "length": "length", "context": "length"}.get(result.finish_reason, result.finish_reason)


def usage(results: list[GenerationResult], prompt_lengths: list[int], n: int) -> dict:
    """OpenAI's usage of n choices a prompt (choice k of prompt i at i x n + k): each prompt counted
    once, with the tokens of it the engine took from its prefix cache rather than computed."""
    prompt = sum(prompt_lengths[::n])
    completion = sum(len(r.tokens) for r in results)
    cached = sum(r.cached_tokens for r in results[::n])
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached}}


def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex}"


def completion_answer(request: OpenAIRequest, results: list[GenerationResult], decode, prompt_lengths) -> dict:
    choices = []
    for i, r in enumerate(results):
        choice = {"index": i, "text": response_text(r, decode), "finish_reason": finish_reason(r), "logprobs": None}
        if request.logprobs:
            choice["logprobs"] = {"tokens": [decode([t]) for t in r.tokens], "token_logprobs": r.log_probs.tolist(),
                                  "top_logprobs": None, "text_offset": None}
        choices.append(choice)
    return {"id": new_id("cmpl"), "object": "text_completion", "created": int(time.time()), "model": request.model,
            "choices": choices, "usage": usage(results, prompt_lengths, request.n)}


def chat_answer(request: OpenAIRequest, results: list[GenerationResult], decode, chat: ChatFormat, prompt_lengths) -> dict:
    choices = []
    for i, r in enumerate(results):
        reasoning, content = split_reasoning(response_text(r, decode), chat.think)
        message = {"role": "assistant", "content": content}
        if reasoning:
            message["reasoning_content"] = reasoning
        choice = {"index": i, "message": message, "finish_reason": finish_reason(r), "logprobs": None}
        if request.logprobs:
            choice["logprobs"] = {"content": [{"token": decode([t]), "logprob": lp, "bytes": None, "top_logprobs": []}
                                              for t, lp in zip(r.tokens, r.log_probs.tolist())]}
        choices.append(choice)
    return {"id": new_id("chatcmpl"), "object": "chat.completion", "created": int(time.time()),
            "model": request.model, "choices": choices, "usage": usage(results, prompt_lengths, request.n)}


def stream_chunk(kind: str, chunk_id: str, model: str, index: int, text: str | None, finish: str | None,
                 first: bool = False, reasoning: str | None = None) -> dict:
    """One event of a stream: the text (chat: and reasoning) added since the last one (None: none)."""
    if kind == "chat":
        delta = (({"role": "assistant"} if first else {}) | ({"reasoning_content": reasoning} if reasoning else {})
                 | ({"content": text} if text is not None else {}))
        choice = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {"id": chunk_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model,
                "choices": [choice]}
    choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": None}
    return {"id": chunk_id, "object": "text_completion", "created": int(time.time()), "model": model,
            "choices": [choice]}
