"""SGLang's HTTP worker API as pure functions: request bodies to orthon's types and results to answers
(the server's side, ``orthon.engine.server``) and back (the client's side, ``orthon.engine.client``).

``POST /generate`` as SGLang takes it: ``input_ids`` (one list of token ids, or a batch of lists) or
``text`` (a string or a batch), ``sampling_params`` (one dict for all, or one per request), ``rid``
(a string or one per request), ``return_logprob``. The answer, one object per request (a list for a
batch): ``output_ids``, ``text`` and ``meta_info`` with ``id``, ``finish_reason`` ({"type": "stop",
"matched": id} / {"type": "length", "length": n} / {"type": "abort", "message": ...}),
``prompt_tokens``, ``completion_tokens``, ``cached_tokens``, ``weight_version`` (a string, as SGLang
reports it) and, when asked, ``output_token_logprobs`` as ``[[logprob, token_id, null], ...]``.
orthon adds ``orthon_finish_reason`` (its own reason: "context" is SGLang's "length") and
``sampling_seed`` (the seed the request's draws came from) to ``meta_info``.

Stop tokens: SGLang stops at the model's end-of-sequence token unless ``ignore_eos``, and at any of
``stop_token_ids`` besides; an orthon ``SamplingParams`` lists every stop token itself (None: the
eos). The client sends an explicit list with ``ignore_eos`` set, so both kinds of server stop at
exactly the tokens the caller named. ``stop`` (a string or a list) ends a response at text
(``orthon.engine.stop_strings``): ``finish_reason`` then says ``{"type": "stop", "matched": "the
string"}``, ``output_ids`` keep every token generated and ``text`` ends before the string unless
``no_stop_trim``.
"""
from __future__ import annotations

import math
import uuid
from dataclasses import dataclass, replace
from typing import Any, Mapping

import torch

from orthon.core.errors import ConfigError, OrthonError
from orthon.engine.protocol import GenerationResult
from orthon.engine.sampling import SamplingParams
from orthon.engine.stop_strings import trim_at_stop

SGLANG_MAX_NEW_TOKENS = 128  # SGLang's default when a request names none
ROUTING_KEY_HEADER = "X-SMG-Routing-Key"  # sglang-router's manual policy reads the session from it

# SGLang sampling keys orthon's engine does not implement: accepted at the value that turns them off.
_NEUTRAL = {"min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
            "min_new_tokens": 0, "n": 1, "stop_regex": None, "json_schema": None, "regex": None,
            "ebnf": None, "structural_tag": None, "logit_bias": None}
# SGLang sampling keys that only shape the text or the stream: accepted and ignored.
_COSMETIC = {"skip_special_tokens", "spaces_between_special_tokens", "stream_interval", "custom_params"}
# no_stop_trim: the answer's text keeps the stop string that ended it (read by parse_generate).
_SUPPORTED = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "stop", "no_stop_trim",
              "ignore_eos", "sampling_seed", "logprob_mode"}


class BadRequest(OrthonError, ValueError):
    """A request the server refuses; ``status`` is its HTTP status (400, 409 or 413)."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class GenerateItem:
    """One request of a /generate body (a batch holds several)."""

    prompt: list[int] | None  # token ids; None when the request came as text
    text: str | None
    params: SamplingParams
    rid: str
    return_logprob: bool
    trim_stop: bool = True  # the answer's text ends before the stop string that ended it (SGLang's default)


# ------------------------------------------------------------------ requests (server side)
def _is_token(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def sampling_from_sglang(d: Any, eos_token_id: int | None, where: str = "sampling_params") -> SamplingParams:
    """orthon's SamplingParams of one SGLang ``sampling_params`` dict. ``eos_token_id``: the model's,
    added to the stop tokens unless ``ignore_eos``. BadRequest names the key that is wrong."""
    if d is None:
        d = {}
    if not isinstance(d, Mapping):
        raise BadRequest(f"{where}: expected an object, got {type(d).__name__}")
    for key, value in d.items():
        neutral = value is None or value == _NEUTRAL.get(key)
        if key in _NEUTRAL and not neutral:
            raise BadRequest(f"{where}.{key}: not supported by this engine (only {_NEUTRAL[key]!r})")
        if key not in _NEUTRAL and key not in _COSMETIC and key not in _SUPPORTED:
            raise BadRequest(f"{where}.{key}: unknown sampling parameter")
    stops = d.get("stop_token_ids")
    if stops is not None and (not isinstance(stops, list) or not all(_is_token(t) for t in stops)):
        raise BadRequest(f"{where}.stop_token_ids: expected a list of token ids, got {stops!r}")
    stop = d.get("stop") or []  # SGLang takes one string or a list; "" and [] are none
    if isinstance(stop, str):
        stop = [stop]
    if not isinstance(stop, list) or not all(isinstance(t, str) and t for t in stop):
        raise BadRequest(f"{where}.stop: expected a string or a list of non-empty strings, got {d.get('stop')!r}")
    if not isinstance(d.get("no_stop_trim", False), bool):
        raise BadRequest(f"{where}.no_stop_trim: expected true or false, got {d['no_stop_trim']!r}")
    ignore_eos = d.get("ignore_eos") or False
    if not isinstance(ignore_eos, bool):
        raise BadRequest(f"{where}.ignore_eos: expected true or false, got {ignore_eos!r}")
    if ignore_eos:
        stop_token_ids = tuple(stops or ())
    elif stops:
        stop_token_ids = tuple(stops) + (() if eos_token_id is None else (eos_token_id,))
    else:
        stop_token_ids = None  # the engine's default: the model's eos
    top_k = d.get("top_k", -1)
    if _is_token(top_k) and (top_k < 0 or top_k >= 1 << 30):
        top_k = 0  # SGLang's "off" is -1 (or a huge k); orthon's is 0
    fields = {"max_new_tokens": d.get("max_new_tokens", SGLANG_MAX_NEW_TOKENS), "temperature": d.get("temperature", 1.0),
              "top_p": d.get("top_p", 1.0), "top_k": top_k, "stop_token_ids": stop_token_ids, "stop": tuple(stop),
              "seed": d.get("sampling_seed"), "logprob_mode": d.get("logprob_mode", "policy")}
    for key in ("temperature", "top_p"):
        if isinstance(fields[key], bool) or not isinstance(fields[key], (int, float)):
            raise BadRequest(f"{where}.{key}: expected a number, got {fields[key]!r}")
    try:
        return SamplingParams(**fields)
    except ConfigError as exc:
        raise BadRequest(f"{where}: {exc}") from None


def _per_request(value, n: int, name: str, batched: bool) -> list:
    """``value`` for each of the n requests: one value shared, or (in a batch) a list of n."""
    if batched and isinstance(value, list):
        if len(value) != n:
            raise BadRequest(f"{name}: {len(value)} values for {n} requests")
        return value
    return [value] * n


def parse_generate(body: Any, eos_token_id: int | None) -> tuple[list[GenerateItem], bool]:
    """The requests of a /generate body and whether it was a batch (answered with a list)."""
    if not isinstance(body, Mapping):
        raise BadRequest(f"body: expected a JSON object, got {type(body).__name__}")
    ids, text = body.get("input_ids"), body.get("text")
    if ids is not None and text is not None:
        raise BadRequest("give input_ids or text, not both")
    if ids is not None:
        if not isinstance(ids, list) or not ids:
            raise BadRequest("input_ids: expected a non-empty list of token ids or a list of such lists")
        batched = isinstance(ids[0], list)
        prompts = ids if batched else [ids]
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, list) or not prompt or not all(_is_token(t) for t in prompt):
                where = f"input_ids[{i}]" if batched else "input_ids"
                raise BadRequest(f"{where}: expected a non-empty list of token ids (integers)")
        texts = [None] * len(prompts)
    elif text is not None:
        batched = isinstance(text, list)
        texts = text if batched else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest("text: expected a string or a non-empty list of strings")
        prompts = [None] * len(texts)
    else:
        raise BadRequest("missing input_ids (or text): nothing to generate from")
    n = len(prompts)
    sampling = _per_request(body.get("sampling_params"), n, "sampling_params", batched)
    rids = _per_request(body.get("rid"), n, "rid", batched)
    logprob = _per_request(body.get("return_logprob", False), n, "return_logprob", batched)
    items = []
    for i in range(n):
        where = f"sampling_params[{i}]" if batched and isinstance(body.get("sampling_params"), list) else "sampling_params"
        params = sampling_from_sglang(sampling[i], eos_token_id, where)
        rid = rids[i]
        if rid is None:
            rid = uuid.uuid4().hex
        elif not isinstance(rid, str):
            raise BadRequest(f"rid: expected a string, got {rid!r}")
        elif batched and not isinstance(body.get("rid"), list):
            rid = f"{rid}-{i}"  # one rid given for a batch: each request still needs its own
        if not isinstance(logprob[i], bool):
            raise BadRequest(f"return_logprob: expected true or false, got {logprob[i]!r}")
        if not logprob[i] and params.logprob_mode == "policy":
            params = replace(params, logprob_mode="none")  # nobody reads them: no rescore
        keep_stop = (sampling[i] or {}).get("no_stop_trim", False)  # a bool: checked with the params
        items.append(GenerateItem(prompts[i], texts[i], params, rid, logprob[i], trim_stop=not keep_stop))
    return items, batched


def wants_stream(body: Mapping, batched: bool) -> bool:
    """Whether a /generate body asks for a stream (server-sent events); one request at a time."""
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadRequest(f"stream: expected true or false, got {stream!r}")
    if stream and batched:
        raise BadRequest("stream: one request at a time (a batch is answered whole); send stream: false")
    return stream


def partial_answer(item: GenerateItem, prompt: list[int], tokens: list[int], text: str, weight_version: int) -> dict:
    """A stream's answer so far: the response's text and ids to now (each event holds all of them, as
    SGLang streams by default), no finish_reason yet."""
    meta = {"id": item.rid, "finish_reason": None, "prompt_tokens": len(prompt), "completion_tokens": len(tokens),
            "cached_tokens": 0, "weight_version": str(weight_version)}
    return {"text": text, "output_ids": list(tokens), "meta_info": meta}


def parse_weight_version(value) -> int | None:
    """SGLang's ``weight_version`` (a string) as orthon's int: an int or a digit string; None if absent."""
    if value is None:
        return None
    if isinstance(value, str) and value.isdigit():
        return int(value)
    if _is_token(value) and value >= 0:
        return value
    raise BadRequest(f"weight_version: expected a non-negative integer (or a string of digits), got {value!r}")


# ------------------------------------------------------------------ answers (server side)
def finish_reason(result: GenerationResult) -> dict:
    """SGLang's finish_reason object of an orthon result."""
    if result.finish_reason == "stop":
        matched = result.matched_stop if result.matched_stop is not None else result.tokens[-1] if result.tokens else None
        return {"type": "stop", "matched": matched}
    if result.finish_reason in ("length", "context"):
        return {"type": "length", "length": len(result.tokens)}
    return {"type": "abort", "message": result.error or "aborted"}


def answer(result: GenerationResult, item: GenerateItem, text: str) -> dict:
    meta = {"id": item.rid, "finish_reason": finish_reason(result), "orthon_finish_reason": result.finish_reason,
            "prompt_tokens": len(result.prompt), "completion_tokens": len(result.tokens), "cached_tokens": result.cached_tokens,
            "weight_version": str(result.weight_version), "sampling_seed": result.seed}
    if item.return_logprob:
        meta["output_token_logprobs"] = [[float(lp), int(t), None]
                                         for lp, t in zip(result.log_probs.tolist(), result.tokens)]
    if item.trim_stop:
        text = trim_at_stop(text, result.matched_stop)
    return {"text": text, "output_ids": list(result.tokens), "meta_info": meta}


# ------------------------------------------------------------------ requests and answers (client side)
def sampling_to_sglang(params: SamplingParams) -> dict:
    """An orthon SamplingParams as SGLang's ``sampling_params`` (what either kind of server reads)."""
    out = {"max_new_tokens": params.max_new_tokens, "temperature": params.temperature, "top_p": params.top_p,
           "top_k": params.top_k if params.top_k > 0 else -1}
    if params.stop_token_ids is not None:  # exactly these (orthon's meaning): SGLang must not add the eos
        out["stop_token_ids"] = list(params.stop_token_ids)
        out["ignore_eos"] = True
    if params.stop:
        out["stop"] = list(params.stop)
    if params.seed is not None:
        out["sampling_seed"] = params.seed
    if params.logprob_mode != "policy":
        out["logprob_mode"] = params.logprob_mode  # an orthon extension (SGLang and its router drop it)
    return out


def result_from_answer(data: Any, prompt: list[int], params: SamplingParams, fallback_version: int) -> GenerationResult:
    """The GenerationResult of one /generate answer object; ValueError when it is not one (garbage).
    ``fallback_version``: the version reported when the server names none a digit string can give
    (a real SGLang server reports "default" until a weight update names a version)."""
    if not isinstance(data, Mapping) or not isinstance(data.get("meta_info"), Mapping):
        raise ValueError(f"not a /generate answer (no meta_info): {str(data)[:200]}")
    meta = data["meta_info"]
    tokens = data.get("output_ids")
    if not isinstance(tokens, list) or not all(_is_token(t) for t in tokens):
        raise ValueError(f"output_ids: expected a list of token ids, got {str(tokens)[:200]}")
    reason = meta.get("orthon_finish_reason")
    if reason not in ("stop", "length", "context", "abort"):
        kind = meta.get("finish_reason")
        kind = kind.get("type") if isinstance(kind, Mapping) else kind
        if kind not in ("stop", "length", "abort"):
            raise ValueError(f"finish_reason: unknown {meta.get('finish_reason')!r}")
        reason = kind
    logprobs = meta.get("output_token_logprobs")
    if logprobs is None:
        raise ValueError("no output_token_logprobs in the answer (the request asked for them)")
    if (not isinstance(logprobs, list) or len(logprobs) != len(tokens)
            or not all(isinstance(e, list) and len(e) >= 2 and isinstance(e[0], (int, float)) for e in logprobs)):
        raise ValueError(f"output_token_logprobs: expected one [logprob, token_id, ...] per output token, "
                         f"got {str(logprobs)[:200]}")
    values = [float(e[0]) for e in logprobs]
    if any(math.isnan(v) for v in values):
        raise ValueError("output_token_logprobs: NaN log-prob")
    version = meta.get("weight_version")
    if isinstance(version, str) and version.isdigit():
        version = int(version)
    elif not _is_token(version):
        version = fallback_version
    seed = meta.get("sampling_seed", params.seed)
    matched = meta.get("finish_reason")
    matched = matched.get("matched") if reason == "stop" and isinstance(matched, Mapping) else None
    error = None
    if reason == "abort":
        message = meta.get("finish_reason")
        error = message.get("message") if isinstance(message, Mapping) else None
    cached = meta.get("cached_tokens", 0)
    return GenerationResult(prompt=list(prompt), tokens=list(tokens), log_probs=torch.tensor(values, dtype=torch.float32),
                            finish_reason=reason, weight_version=version, seed=seed if _is_token(seed) else None,
                            error=error, matched_stop=matched if isinstance(matched, str) else None,
                            cached_tokens=cached if _is_token(cached) and cached >= 0 else 0)


def error_message(data: Any) -> str:
    """The message of an error answer, in orthon's ({"error": msg}), SGLang's ({"error": {"message": msg}}
    or {"message": msg}) or FastAPI's ({"detail": msg}) shape."""
    if isinstance(data, Mapping):
        for key in ("error", "message", "detail"):
            value = data.get(key)
            if isinstance(value, Mapping):
                value = value.get("message", value)
            if value:
                return str(value)
    return str(data)[:500]
