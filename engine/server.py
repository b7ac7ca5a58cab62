"""An Engine behind SGLang's HTTP worker API (``orthon serve``), with continuous batching.

The same client (orthon.engine.client.HTTPEngine) drives these servers on a CPU and real SGLang
servers on GPU clusters, and sglang-router routes to either. Requests of concurrent callers wait in
one queue; a single worker thread takes everything waiting and runs it as one ``generate`` call of
the in-process engine (its waves of ``max_batch_size`` rows), so many callers share each batch.
Weight updates take the engine's lock, so they wait for the running batch and never interleave with
one; requests that arrive meanwhile wait in the queue.

Routes (SGLang's shapes): POST /generate, GET /health, /health_generate, /get_server_info
(/server_info), /get_model_info (/model_info), POST /flush_cache, /abort_request,
/pause_generation, /continue_generation, /update_weights_from_disk, /init_weights_update_group,
/update_weights_from_distributed; orthon's own: POST /orthon/update_weights_from_delta (the bytes
of a DeltaPayload, or {"path": file}), /orthon/update_weights_from_shared ({"handle"}), GET
/orthon/weight_hashes. Bad input is a 400 (413 over the size limit) with {"error": message}, and
the server goes on serving; a delta for another base is a 409 and changes nothing.
"""
from __future__ import annotations

import asyncio
import collections
import json
import threading
import time
from dataclasses import dataclass, field

import torch
from fastapi import Request  # at module level: route signatures are resolved from this module's globals

from orthon.core.errors import CheckpointError, WrongBaseVersion
from orthon.engine.protocol import GenerationResult
from orthon.engine.sampling import SamplingParams

FINISH_TYPES = {"stop": "stop", "length": "length", "context": "length", "abort": "abort"}


class BadRequest(ValueError):
    """A request the server refuses; ``status`` is the HTTP code."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


@dataclass
class _Pending:
    ids: list[int]
    params: SamplingParams
    rid: str
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    aborted: bool = False


@dataclass
class ServerStats:
    requests: int = 0
    batches: int = 0  # engine.generate calls
    largest_batch: int = 0
    aborted: int = 0
    bad_requests: int = 0
    weight_updates: int = 0
    routing_keys: collections.Counter = field(default_factory=collections.Counter)

    def as_dict(self) -> dict:
        return {"requests": self.requests, "batches": self.batches, "largest_batch": self.largest_batch,
                "aborted": self.aborted, "bad_requests": self.bad_requests, "weight_updates": self.weight_updates,
                "routing_keys": dict(self.routing_keys)}


def _int(value, name: str, low: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or (low is not None and value < low):
        raise BadRequest(f"{name}: must be an integer{'' if low is None else f' >= {low}'}, got {value!r}")
    return value


def sampling_from_json(raw) -> SamplingParams:
    """SGLang's sampling_params as orthon's SamplingParams (top_k -1 is SGLang's "off")."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest(f"sampling_params: must be an object, got {type(raw).__name__}")
    try:
        top_k = raw.get("top_k", 0)
        stops = raw.get("stop_token_ids")
        if stops is not None:
            if not isinstance(stops, list):
                raise BadRequest(f"sampling_params.stop_token_ids: must be a list of integers, got {stops!r}")
            stops = tuple(_int(t, "sampling_params.stop_token_ids[]", 0) for t in stops)
        seed = raw.get("sampling_seed")
        return SamplingParams(
            max_new_tokens=_int(raw.get("max_new_tokens", 128), "sampling_params.max_new_tokens", 0),
            temperature=float(raw.get("temperature", 1.0)), top_p=float(raw.get("top_p", 1.0)),
            top_k=0 if top_k == -1 else _int(top_k, "sampling_params.top_k", 0), stop_token_ids=stops,
            seed=None if seed is None else _int(seed, "sampling_params.sampling_seed"))
    except (TypeError, ValueError) as exc:  # ConfigError from SamplingParams is a ValueError
        raise BadRequest(f"sampling_params: {exc}") from None


def result_json(result: GenerationResult, rid: str, prompt_tokens: int, text: str | None, logprobs: bool) -> dict:
    finish = {"type": FINISH_TYPES[result.finish_reason]}
    if result.finish_reason == "stop" and result.tokens:
        finish["matched"] = result.tokens[-1]
    elif finish["type"] == "length":
        finish["length"] = len(result.tokens)
    meta = {"id": rid, "finish_reason": finish, "prompt_tokens": prompt_tokens,
            "completion_tokens": len(result.tokens), "weight_version": result.weight_version}
    if logprobs:
        meta["output_token_logprobs"] = [[float(lp), int(t), None] for lp, t in zip(result.log_probs.tolist(), result.tokens)]
    return {"text": text if text is not None else "", "output_ids": list(result.tokens), "meta_info": meta}


class EngineServer:
    """The serving state: the engine, the queue, its worker thread, the weight-update group."""

    def __init__(self, engine, model_path: str, tokenizer=None, max_request_bytes: int = 8 << 20,
                 max_delta_bytes: int = 4 << 30):
        self.engine, self.model_path, self.tokenizer = engine, str(model_path), tokenizer
        self.max_request_bytes, self.max_delta_bytes = max_request_bytes, max_delta_bytes
        self.stats = ServerStats()
        self._queue: collections.deque[_Pending] = collections.deque()
        self._cond = threading.Condition()
        self._paused = False
        self._stopping = False
        self._rid = 0
        self.group = None  # the weight-update process group (init_weights_update_group)
        self.started = time.time()
        self._worker = threading.Thread(target=self._serve, name="engine-batcher", daemon=True)
        self._worker.start()

    # ------------------------------------------------------------ the batcher
    def _serve(self) -> None:
        while True:
            with self._cond:
                while not self._stopping and (self._paused or not self._queue):
                    self._cond.wait()
                if self._stopping:
                    return
                batch = [p for p in self._queue if not p.aborted]
                self._queue.clear()
            if not batch:
                continue
            self.stats.batches += 1
            self.stats.largest_batch = max(self.stats.largest_batch, len(batch))
            try:
                results = self.engine.generate([p.ids for p in batch], [p.params for p in batch])
                outcome = [(p, r, None) for p, r in zip(batch, results)]
            except Exception as exc:  # the engine failed on this batch: its callers get a 500, the server goes on
                outcome = [(p, None, exc) for p in batch]
            for pending, result, error in outcome:
                pending.loop.call_soon_threadsafe(_settle, pending.future, result, error)

    def submit(self, ids: list[int], params: SamplingParams, rid: str | None, loop) -> _Pending:
        with self._cond:
            self._rid += 1
            pending = _Pending(ids, params, rid or f"req-{self._rid}", loop.create_future(), loop)
            self._queue.append(pending)
            self.stats.requests += 1
            self._cond.notify()
            return pending

    def abort(self, rid: str | None = None) -> int:
        """Abort waiting requests (one by rid, or all): they finish with "abort" and no tokens."""
        with self._cond:
            hit = [p for p in self._queue if not p.aborted and (rid is None or p.rid == rid)]
            for p in hit:
                p.aborted = True
                result = GenerationResult(p.ids, [], torch.zeros(0), "abort", self.engine.weight_version, p.params.seed)
                p.loop.call_soon_threadsafe(_settle, p.future, result, None)
            self.stats.aborted += len(hit)
            return len(hit)

    def pause(self, abort_waiting: bool = False) -> None:
        with self._cond:
            self._paused = True
        if abort_waiting:
            self.abort()

    def resume(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        self.abort()
        if self.group is not None:
            self.group.close()

    @property
    def healthy(self) -> bool:
        return self._worker.is_alive()

    # ------------------------------------------------------------ weights
    def update_weights(self, source, version: int | None = None) -> int:
        version = self.engine.update_weights(source, version=version)
        self.stats.weight_updates += 1
        return version

    def init_group(self, body: dict) -> None:
        from orthon.engine.weight_transfer import open_update_group

        if self.group is not None:
            self.group.close()
        self.group = None
        self.group = open_update_group(str(body["master_address"]), _int(body["master_port"], "master_port", 1),
                                       _int(body.get("rank_offset", 1), "rank_offset", 1),
                                       _int(body["world_size"], "world_size", 2), str(body.get("backend", "gloo")),
                                       float(body.get("timeout_s", 120.0)))

    def update_from_distributed(self, body: dict) -> int:
        from orthon.engine.delta import DeltaPayload
        from orthon.engine.weight_transfer import TensorMeta, broadcast_bytes, receive_tensors

        if self.group is None:
            raise BadRequest("update_weights_from_distributed: no update group (call /init_weights_update_group first)")
        version = _version(body.get("weight_version"))
        if body.get("load_format") == "orthon_delta":
            return self.update_weights(DeltaPayload.from_bytes(broadcast_bytes(self.group, None)))
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes)):
            raise BadRequest("update_weights_from_distributed: names, dtypes and shapes must be lists of one length")
        metas = [TensorMeta(str(n), str(d).removeprefix("torch."), tuple(int(x) for x in s))
                 for n, d, s in zip(names, dtypes, shapes)]
        return self.update_weights(receive_tensors(self.group, metas), version)

    def update_from_shared(self, body: dict) -> int:
        from orthon.engine.delta import DELTA_TENSOR_NAME, DeltaPayload
        from orthon.engine.weight_transfer import read_shared

        handle = body.get("handle")
        if not isinstance(handle, dict):
            raise BadRequest("update_weights_from_shared: 'handle' must be the object SharedBuckets.write returned")
        pairs = read_shared(handle)
        if len(pairs) == 1 and pairs[0][0] == DELTA_TENSOR_NAME:
            return self.update_weights(DeltaPayload.from_bytes(pairs[0][1].numpy().tobytes()))
        return self.update_weights(pairs, _version(handle.get("version")))


def _settle(future: asyncio.Future, result, error) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


def _version(value) -> int | None:
    """SGLang takes weight_version as a string; orthon's versions are integers."""
    if value is None:
        return None
    if isinstance(value, str) and value.isdigit():
        return int(value)
    return _int(value, "weight_version", 0)


def build_app(server: EngineServer):
    """The FastAPI application of ``server``."""
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI(title="orthon engine server")

    def error(message: str, status: int = 400):
        server.stats.bad_requests += 1
        return JSONResponse({"error": message, "success": False, "message": message}, status_code=status)

    async def body_json(request: Request, limit: int) -> dict:
        raw = await request.body()
        if len(raw) > limit:
            raise BadRequest(f"request body of {len(raw)} bytes is over the limit of {limit}", 413)
        try:
            data = json.loads(raw or b"{}")
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(f"malformed JSON: {exc}") from None
        if not isinstance(data, dict):
            raise BadRequest(f"the request must be a JSON object, got {type(data).__name__}")
        return data

    def handled(fn):
        async def route(request: Request):
            try:
                return await fn(request)
            except BadRequest as exc:
                return error(str(exc), exc.status)
            except WrongBaseVersion as exc:  # a delta for another base: nothing changed
                return error(str(exc), 409)
            except CheckpointError as exc:  # a damaged payload, a weights directory that does not fit
                return error(str(exc), 400)
            except (KeyError, TypeError, ValueError, FileNotFoundError) as exc:
                return error(f"{type(exc).__name__}: {exc}")
        route.__name__ = fn.__name__
        return route

    @handled
    async def generate(request: Request):
        body = await body_json(request, server.max_request_bytes)
        single = True
        if "input_ids" in body and body["input_ids"] is not None:
            ids = body["input_ids"]
            if isinstance(ids, list) and ids and isinstance(ids[0], list):
                single = False
            else:
                ids = [ids]
            for row in ids:
                if not isinstance(row, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in row):
                    raise BadRequest("input_ids: must be a list of integers (or a list of such lists)")
        elif "text" in body and body["text"] is not None:
            if server.tokenizer is None:
                raise BadRequest("text: this server has no tokenizer (start it with --tokenizer); send input_ids")
            texts = body["text"] if isinstance(body["text"], list) else [body["text"]]
            single = not isinstance(body["text"], list)
            ids = [server.tokenizer.encode(str(t)) for t in texts]
        else:
            raise BadRequest("the request needs input_ids or text")
        raw_params = body.get("sampling_params")
        params = ([sampling_from_json(p) for p in raw_params] if isinstance(raw_params, list)
                  else [sampling_from_json(raw_params)] * len(ids))
        if len(params) != len(ids):
            raise BadRequest(f"sampling_params: {len(params)} for {len(ids)} prompts")
        rids = body.get("rid")
        rids = rids if isinstance(rids, list) else [rids] * len(ids) if len(ids) == 1 else [None] * len(ids)
        key = request.headers.get("x-smg-routing-key")
        if key:
            server.stats.routing_keys[key] += len(ids)
        loop = asyncio.get_running_loop()
        pending = [server.submit(i, p, r, loop) for i, p, r in zip(ids, params, rids)]
        results = await asyncio.gather(*(p.future for p in pending))
        rejected = [r.error for r in results if r.finish_reason == "rejected"]
        if rejected:
            raise BadRequest("; ".join(rejected))
        logprobs = bool(body.get("return_logprob", False))
        decode = server.tokenizer.decode if server.tokenizer is not None else None
        out = [result_json(r, p.rid, len(p.ids), decode(r.tokens) if decode else None, logprobs)
               for p, r in zip(pending, results)]
        return JSONResponse(out[0] if single else out)

    async def health(request: Request):
        return JSONResponse({"status": "ok"} if server.healthy else {"status": "dead"}, status_code=200 if server.healthy else 503)

    async def health_generate(request: Request):
        loop = asyncio.get_running_loop()
        pending = server.submit([0], SamplingParams(max_new_tokens=1, temperature=0.0), None, loop)
        try:
            await asyncio.wait_for(pending.future, 30.0)
        except Exception as exc:
            return JSONResponse({"status": f"generation failed: {exc}"}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def server_info(request: Request):
        return JSONResponse({"version": "orthon", "model_path": server.model_path,
                             "weight_version": server.engine.weight_version, "uptime_s": time.time() - server.started,
                             "batching": server.stats.as_dict(), "engine": server.engine.health()})

    async def model_info(request: Request):
        config = server.engine.model.config
        return JSONResponse({"model_path": server.model_path, "tokenizer_path": getattr(server.tokenizer, "path", None),
                             "is_generation": True, "architecture": "GlmMoeDsaForCausalLM",
                             "vocab_size": config.vocab_size, "max_length": server.engine.max_length,
                             "weight_version": server.engine.weight_version})

    @handled
    async def flush_cache(request: Request):
        await asyncio.to_thread(server.engine.flush)
        return JSONResponse({"success": True})

    @handled
    async def abort_request(request: Request):
        body = await body_json(request, server.max_request_bytes)
        return JSONResponse({"success": True, "aborted": server.abort(body.get("rid"))})

    @handled
    async def pause_generation(request: Request):
        body = await body_json(request, server.max_request_bytes)
        server.pause(abort_waiting=body.get("mode", "abort") == "abort")
        return JSONResponse({"success": True})

    async def continue_generation(request: Request):
        server.resume()
        return JSONResponse({"success": True})

    def updated(version: int):
        return JSONResponse({"success": True, "message": "weights updated", "weight_version": version})

    @handled
    async def update_from_disk(request: Request):
        body = await body_json(request, server.max_request_bytes)
        if not isinstance(body.get("model_path"), str):
            raise BadRequest("model_path: the weights directory to load is required")
        return updated(await asyncio.to_thread(server.update_weights, body["model_path"], _version(body.get("weight_version"))))

    @handled
    async def init_group(request: Request):
        body = await body_json(request, server.max_request_bytes)
        await asyncio.to_thread(server.init_group, body)
        return JSONResponse({"success": True, "message": "update group ready"})

    @handled
    async def update_from_distributed(request: Request):
        body = await body_json(request, server.max_request_bytes)
        return updated(await asyncio.to_thread(server.update_from_distributed, body))

    @handled
    async def update_from_delta(request: Request):
        from orthon.engine.delta import DeltaPayload

        if request.headers.get("content-type", "").startswith("application/json"):
            body = await body_json(request, server.max_request_bytes)
            with open(str(body["path"]), "rb") as f:
                data = f.read()
        else:
            data = await request.body()
            if len(data) > server.max_delta_bytes:
                raise BadRequest(f"delta payload of {len(data)} bytes is over the limit of {server.max_delta_bytes}", 413)
        return updated(await asyncio.to_thread(server.update_weights, DeltaPayload.from_bytes(data)))

    @handled
    async def update_from_shared(request: Request):
        body = await body_json(request, server.max_request_bytes)
        return updated(await asyncio.to_thread(server.update_from_shared, body))

    async def weight_hashes(request: Request):
        from orthon.engine.tensor_bytes import tensor_hashes

        return JSONResponse(await asyncio.to_thread(lambda: tensor_hashes(server.engine.model.state_dict())))

    routes = [("POST", "/generate", generate), ("GET", "/health", health), ("GET", "/health_generate", health_generate),
              ("GET", "/get_server_info", server_info), ("GET", "/server_info", server_info),
              ("GET", "/get_model_info", model_info), ("GET", "/model_info", model_info),
              ("POST", "/flush_cache", flush_cache), ("GET", "/flush_cache", flush_cache),
              ("POST", "/abort_request", abort_request), ("POST", "/pause_generation", pause_generation),
              ("POST", "/continue_generation", continue_generation),
              ("POST", "/update_weights_from_disk", update_from_disk),
              ("POST", "/init_weights_update_group", init_group),
              ("POST", "/update_weights_from_distributed", update_from_distributed),
              ("POST", "/orthon/update_weights_from_delta", update_from_delta),
              ("POST", "/orthon/update_weights_from_shared", update_from_shared),
              ("GET", "/orthon/weight_hashes", weight_hashes)]
    for method, path, fn in routes:
        app.add_api_route(path, fn, methods=[method])
    return app


def serve(engine, model_path: str, host: str = "127.0.0.1", port: int = 30000, tokenizer=None,
          ready=None) -> None:
    """Run the server until SIGINT / SIGTERM (uvicorn's handlers stop it gracefully)."""
    import uvicorn

    server = EngineServer(engine, model_path, tokenizer)
    config = uvicorn.Config(build_app(server), host=host, port=port, log_level="warning", access_log=False)
    web = uvicorn.Server(config)
    if ready is not None:
        original = web.startup

        async def startup(*args, **kwargs):
            await original(*args, **kwargs)
            ready()

        web.startup = startup
    try:
        web.run()
    finally:
        server.stop()
