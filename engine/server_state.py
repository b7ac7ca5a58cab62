"""What an engine server holds (the engine, its batcher, the tokenizer, limits, weight-update groups) and
the request plumbing its routes share: bodies read under a size limit, JSON parsed with a clear error."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from orthon.engine.batcher import ContinuousBatcher
from orthon.engine.sglang_api import BadRequest

DEFAULT_MAX_BODY_BYTES = 4 << 20  # /generate and the control routes: a few MB of token ids
DEFAULT_MAX_DELTA_BYTES = 4 << 30  # a delta payload of a large model
# Reading past the limit drains the body (so the client sees the 413, not a broken pipe) up to this much.
_DRAIN_BYTES = 64 << 20


@dataclass
class ServerState:
    engine: object  # an InProcessEngine
    batcher: ContinuousBatcher
    model_path: str
    tokenizer: object | None = None  # an orthon.data.tokenizer.Tokenizer, or None: text requests get a 400
    tokenizer_path: str | None = None
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    max_delta_bytes: int = DEFAULT_MAX_DELTA_BYTES
    hf_config: dict = field(default_factory=dict)
    chat: object | None = None  # the model's chat format (orthon.engine.openai_api.ChatFormat) for /v1/chat
    groups: dict = field(default_factory=dict)  # weight-update group name -> orthon.engine.weight_transfer.UpdateGroup
    weight_updates: int = 0

    def require_tokenizer(self, field: str, instead: str = "") -> None:
        """BadRequest naming ``field`` (and what to send ``instead``) when the server has no tokenizer."""
        if self.tokenizer is None:
            raise BadRequest(f"{field}: this server has no tokenizer (none beside the weights and no --tokenizer)"
                             + (f"; {instead}" if instead else ""))

    def tokenize(self, text: str) -> list[int]:
        self.require_tokenizer("text", "send input_ids")
        return self.tokenizer.encode(text)

    def detokenize(self, ids: list[int]) -> str:
        return "" if self.tokenizer is None else self.tokenizer.decode(ids)


async def read_body(request, limit: int) -> bytes:
    """The request body, or BadRequest(413) when it is longer than ``limit`` bytes."""
    declared = request.headers.get("content-length")
    too_long = declared is not None and declared.isdigit() and int(declared) > limit
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            too_long = True
        if too_long:
            if size > _DRAIN_BYTES:
                break
            continue
        chunks.append(chunk)
    if too_long:
        raise BadRequest(f"body: {int(declared) if declared and declared.isdigit() else size} bytes, over this "
                         f"route's limit of {limit} bytes", status=413)
    return b"".join(chunks)


async def read_json(request, limit: int, empty_ok: bool = False):
    """The JSON body (a dict); BadRequest names what is wrong with it."""
    raw = await read_body(request, limit)
    if not raw.strip():
        if empty_ok:
            return {}
        raise BadRequest("body: empty (expected a JSON object)")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise BadRequest(f"body: not valid JSON ({exc})") from None
    if not isinstance(data, dict):
        raise BadRequest(f"body: expected a JSON object, got {type(data).__name__}")
    return data
