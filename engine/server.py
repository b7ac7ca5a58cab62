"""The engine server (`orthon serve WEIGHTS_DIR --port P`): an InProcessEngine behind SGLang's HTTP
worker API, so one client (``orthon.engine.client.HTTPEngine``) and sglang-router drive orthon's
servers on CPU and real SGLang servers on GPU clusters alike.

The routes are listed in the README (``orthon serve``); request and answer shapes are in
``orthon.engine.sglang_api``, the weight-update routes in ``orthon.engine.server_weights``.

Concurrent callers share waves (``orthon.engine.batcher``): a single thread runs everything waiting as
one engine call. A request can stream (server-sent events after each token) and be aborted while it
runs (``orthon.engine.control``). Bad input is a 400 (413 for a body over the limit) with {"error": message}, and the
server goes on serving; a batch with a request the engine rejects (a token id outside the vocabulary,
a prompt longer than the context) is refused whole, like SGLang refuses it.
"""
from __future__ import annotations

import asyncio
import re
import threading
import uuid
from contextlib import asynccontextmanager
from importlib import metadata
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from orthon.engine.batcher import DEFAULT_WINDOW_S, PAUSE_MODES, ContinuousBatcher, Pending
from orthon.engine.openai_routes import add_openai_routes
from orthon.engine.sampling import SamplingParams
from orthon.engine.server_state import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_DELTA_BYTES, ServerState, read_json
from orthon.engine.server_weights import add_weight_routes
from orthon.engine.sglang_api import BadRequest, answer, parse_generate, partial_answer, wants_stream
from orthon.engine.streaming import SSE_DONE, request_updates, sse

HEALTH_GENERATE_TIMEOUT_S = 30.0
ARCHITECTURE = "GlmMoeDsaForCausalLM"


def _version() -> str:
    try:
        return metadata.version("orthon")
    except metadata.PackageNotFoundError:
        return "unknown"


def build_state(weights_dir, engine_config=None, tokenizer: str | None = None,
                max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, max_delta_bytes: int = DEFAULT_MAX_DELTA_BYTES,
                batch_window_s: float = DEFAULT_WINDOW_S, chat=None, continuous: bool = True) -> ServerState:
    """The engine of a weights directory (orthon.pretrain.weights.load_weights; ``engine_config``: an
    EngineConfig, the defaults if None) and what serves it. The
    tokenizer: ``tokenizer`` if given, else the directory's own (``weights_tokenizer``), else none.
    ``chat``: the chat format /v1/chat/completions renders conversations with (none: that route refuses).
    ``continuous``: requests join a running batch (False: each waits for the next; orthon.engine.batcher)."""
    from orthon.data.tokenizer import load_tokenizer
    from orthon.engine.in_process import EngineConfig, InProcessEngine
    from orthon.pretrain.hf_io import read_hf_config
    from orthon.pretrain.weights import load_weights, weights_tokenizer

    weights_dir = Path(weights_dir).resolve()
    tokenizer_path = tokenizer or weights_tokenizer(weights_dir)
    text = load_tokenizer(tokenizer_path) if tokenizer_path else None
    engine = InProcessEngine(load_weights(weights_dir).eval(), engine_config or EngineConfig(), text)
    return ServerState(engine=engine, batcher=ContinuousBatcher(engine, batch_window_s, continuous), model_path=str(weights_dir),
                       tokenizer=text, tokenizer_path=str(tokenizer_path) if tokenizer_path else None,
                       max_body_bytes=max_body_bytes,
                       max_delta_bytes=max_delta_bytes, hf_config=read_hf_config(weights_dir), chat=chat)


def _rejections(results, items, batched: bool) -> list[str]:
    """The engine's reasons for the requests it refused, named by their place in the request (in
    ``text`` where the request came as text)."""
    out = []
    for i, (r, item) in enumerate(zip(results, items)):
        if not r.ok:
            reason = re.sub(r"^prompt \d+: ", "", r.error or "rejected")
            field = "input_ids" if item.text is None else "text"
            out.append(f"{field}[{i}]: {reason}" if batched else f"{field}: {reason}")
    return out


async def _events(state: ServerState, pending: Pending, item):
    """A streamed /generate (server-sent events, as SGLang sends them): the answer so far as the engine
    decodes (``orthon.engine.streaming``), the final answer, then ``data: [DONE]``. A refused request is
    one event {"error": message}. A client that goes away aborts its request."""
    async for _, tokens in request_updates(state.batcher, [pending]):
        if tokens is not None:
            yield sse(partial_answer(item, pending.prompt, tokens, state.detokenize(tokens), state.engine.weight_version))
    result = pending.future.result()
    refused = _rejections([result], [item], False)
    yield sse({"error": refused[0]} if refused else answer(result, item, state.detokenize(result.tokens)))
    yield SSE_DONE


def create_app(state: ServerState) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app):
        yield
        state.batcher.close()
        for group in state.groups.values():
            group.close()

    app = FastAPI(title="orthon engine server", version=_version(), lifespan=lifespan)
    engine = state.engine
    config = engine.model.config

    @app.exception_handler(BadRequest)
    async def bad_request(request: Request, exc: BadRequest):
        if request.url.path.startswith("/v1/"):  # OpenAI's error shape, which its clients read
            return JSONResponse({"error": {"message": str(exc), "type": "invalid_request_error", "param": None,
                                           "code": None}}, status_code=exc.status)
        return JSONResponse({"error": str(exc)}, status_code=exc.status)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception):
        return JSONResponse({"error": f"{type(exc).__name__}: {exc}"}, status_code=500)

    @app.post("/generate")
    async def generate(request: Request):
        body = await read_json(request, state.max_body_bytes)
        items, batched = parse_generate(body, config.eos_token_id)
        stream = wants_stream(body, batched)
        if any(item.params.stop for item in items):
            state.require_tokenizer("sampling_params.stop", "use stop_token_ids")
        prompts = [item.prompt if item.prompt is not None else state.tokenize(item.text) for item in items]
        pending = [Pending(prompt, item.params, item.rid) for prompt, item in zip(prompts, items)]
        if stream:
            return StreamingResponse(_events(state, pending[0], items[0]), media_type="text/event-stream")
        state.batcher.submit(pending)
        results = await asyncio.gather(*(asyncio.wrap_future(p.future) for p in pending))
        refused = _rejections(results, items, batched)
        if refused:
            raise BadRequest("; ".join(refused))
        answers = [answer(r, item, state.detokenize(r.tokens)) for r, item in zip(results, items)]
        return JSONResponse(answers if batched else answers[0])

    @app.get("/health")
    async def health():
        if not state.batcher.alive():
            return JSONResponse({"error": "the batching thread is not running"}, status_code=503)
        return JSONResponse({})

    @app.get("/health_generate")
    async def health_generate():
        if state.batcher.snapshot()["paused"]:
            return JSONResponse({"error": "generation is paused"}, status_code=503)
        probe = Pending([config.bos_token_id or 0], SamplingParams(max_new_tokens=1, temperature=0.0),
                        f"health-{uuid.uuid4().hex}")
        state.batcher.submit([probe])
        try:
            result = await asyncio.wait_for(asyncio.wrap_future(probe.future), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            state.batcher.abort(probe.rid)
            return JSONResponse({"error": f"no token within {HEALTH_GENERATE_TIMEOUT_S} s"}, status_code=503)
        if len(result.tokens) != 1:
            return JSONResponse({"error": f"the probe ended {result.finish_reason}: {result.error}"}, status_code=503)
        return JSONResponse({"ok": True, "weight_version": str(result.weight_version)})

    def server_info():
        return {"version": _version(), "engine": "orthon", "model_path": state.model_path,
                "tokenizer_path": state.tokenizer_path, "weight_version": str(engine.weight_version),
                "max_batch_size": engine.config.max_batch_size, "max_total_tokens": engine.max_length,
                "batching": state.batcher.snapshot(), "weight_updates": state.weight_updates,
                "weight_update_groups": sorted(state.groups), "engine_health": engine.health(),
                "max_body_bytes": state.max_body_bytes, "max_delta_bytes": state.max_delta_bytes,
                "batch_window_ms": state.batcher.window_s * 1000}

    def model_info():
        return {"model_path": state.model_path, "tokenizer_path": state.tokenizer_path, "is_generation": True,
                "architectures": [ARCHITECTURE], "model_type": state.hf_config.get("model_type"),
                "vocab_size": config.vocab_size, "max_position_embeddings": config.max_position_embeddings,
                "eos_token_id": config.eos_token_id, "weight_version": str(engine.weight_version),
                "preferred_sampling_params": None, "config": state.hf_config}

    for path in ("/get_server_info", "/server_info"):
        app.get(path)(lambda: JSONResponse(server_info()))
    for path in ("/get_model_info", "/model_info"):
        app.get(path)(lambda: JSONResponse(model_info()))

    @app.get("/get_weight_version")
    async def get_weight_version():
        return JSONResponse({"weight_version": str(engine.weight_version)})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        def flush():
            with state.batcher.exclusive() as held:
                held.flush()

        await asyncio.to_thread(flush)
        return JSONResponse({"success": True, "message": "Cache flushed."})

    @app.post("/abort_request")
    async def abort_request(request: Request):
        body = await read_json(request, state.max_body_bytes)
        rid, abort_all = body.get("rid", ""), bool(body.get("abort_all", False))
        if not abort_all and (not isinstance(rid, str) or not rid):
            raise BadRequest("rid: expected the rid of a request (or abort_all: true)")
        count = state.batcher.abort(rid, abort_all)
        return JSONResponse({"success": True, "aborted": count})

    @app.post("/pause_generation")
    async def pause_generation(request: Request):
        body = await read_json(request, state.max_body_bytes, empty_ok=True)
        mode = body.get("mode", "abort")
        if mode not in PAUSE_MODES:
            raise BadRequest(f"mode: expected one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        await asyncio.to_thread(state.batcher.pause, mode)
        return JSONResponse({"message": "Generation paused successfully.", "status": "ok"})

    @app.post("/continue_generation")
    async def continue_generation():
        state.batcher.resume()
        return JSONResponse({"message": "Generation continued successfully.", "status": "ok"})

    add_weight_routes(app, state)
    add_openai_routes(app, state)
    return app


def serve(weights_dir, host: str = "127.0.0.1", port: int = 30000, engine_config=None,
          tokenizer: str | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
          max_delta_bytes: int = DEFAULT_MAX_DELTA_BYTES, batch_window_s: float = DEFAULT_WINDOW_S,
          log=lambda line: print(line, flush=True), chat=None, continuous: bool = True) -> None:
    """Serve until SIGTERM / SIGINT. Once listening, ``log`` gets one line: "serving WEIGHTS on
    http://host:port" (the port the OS gave when ``port`` is 0). On a signal: no new connections,
    waiting requests come back aborted, the running wave finishes (up to 10 s), then the process ends."""
    import uvicorn

    state = build_state(weights_dir, engine_config, tokenizer, max_body_bytes, max_delta_bytes, batch_window_s,
                        chat, continuous)

    class Server(uvicorn.Server):
        async def startup(self, sockets=None):
            await super().startup(sockets)
            if self.started:
                bound = self.servers[0].sockets[0].getsockname()[1]
                log(f"serving {weights_dir} on http://{host}:{bound}")

        def handle_exit(self, sig, frame):
            # From the signal handler: the batcher's lock may be held by the interrupted code, so a
            # thread of its own closes it.
            threading.Thread(target=state.batcher.close, daemon=True).start()
            super().handle_exit(sig, frame)

    config = uvicorn.Config(create_app(state), host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=10, lifespan="on")
    Server(config).run()
