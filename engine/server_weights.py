"""The engine server's weight-update routes: SGLang's three (from disk; a process group, then a
broadcast) and orthon's (a delta payload in the body or named by its file, buckets in shared memory) and a hash
per tensor to check them. Tensors are named as the HF layout names them (routed experts one tensor each, as
SGLang's loader takes them) or as the model's state dict; the hashes are the HF layout's.

Every update runs between two waves (``ContinuousBatcher.exclusive``): it waits for the running wave,
holds the next, and never interleaves with another update. Each one changes the version the server
reports: the one the request names, else the old one + 1 (a delta names its own). A failed update
changes nothing and answers 400 ({"success": false, "message": ..., "error": ...}); a delta whose base
is not what the engine holds answers 409.

A delta may also travel by the broadcast path (``load_format: "orthon_delta"``: its bytes by
``weight_transfer.broadcast_bytes``, no tensor metadata) or as one uint8 tensor named
``orthon.engine.delta.DELTA_TENSOR_NAME`` holding its bytes, by either tensor path.
"""
from __future__ import annotations

import asyncio
from pathlib import Path

from fastapi import Request
from fastapi.responses import JSONResponse

from orthon.core.errors import CheckpointError
from orthon.engine.delta import DELTA_TENSOR_NAME, DeltaPayload
from orthon.engine.server_state import ServerState, read_body, read_json
from orthon.engine.sglang_api import BadRequest, parse_weight_version
from orthon.engine.tensor_bytes import tensor_hashes
from orthon.engine.weight_transfer import TensorMeta, broadcast_bytes, open_update_group, read_shared, receive_tensors
from orthon.pretrain.hf_io import experts_to_hf

DELTA_FORMAT = "orthon_delta"  # load_format of a delta payload broadcast as bytes
DEFAULT_GROUP = "weight_update_group"  # SGLang's default group_name
GROUP_TIMEOUT_S = 60.0  # how long a group waits for its members and a broadcast for its sender


def _done(state: ServerState, message: str) -> JSONResponse:
    state.weight_updates += 1
    return JSONResponse({"success": True, "message": message, "num_paused_requests": 0,
                         "weight_version": str(state.engine.weight_version)})


def _refused(message: str, status: int = 400) -> JSONResponse:
    return JSONResponse({"success": False, "message": message, "error": message}, status_code=status)


def _update(state: ServerState, weights, version: int | None, flush: bool = False) -> None:
    with state.batcher.exclusive() as engine:
        engine.update_weights(weights, version=version)
        if flush:
            engine.flush()


def _apply_delta(state: ServerState, data) -> None:
    """Parse a delta payload (400 when damaged) and apply it (409 when its base is not the engine's)."""
    try:
        payload = DeltaPayload.from_bytes(data)
    except CheckpointError as exc:
        raise BadRequest(str(exc)) from None
    with state.batcher.exclusive() as engine:
        if payload.base_version != engine.weight_version:
            raise BadRequest(f"delta payload: from weight version {payload.base_version}, the engine holds "
                             f"{engine.weight_version}; weights unchanged (a full sync is needed)", status=409)
        try:
            engine.update_weights(payload)
        except CheckpointError as exc:
            raise BadRequest(f"{exc}; weights unchanged", status=409) from None


async def _run(work, *args) -> JSONResponse | None:
    """``work(*args)`` off the event loop; the errors a bad update raises as a refusal."""
    try:
        await asyncio.to_thread(work, *args)
    except BadRequest as exc:
        return _refused(str(exc), exc.status)
    except (ValueError, KeyError, OSError, RuntimeError) as exc:  # CheckpointError, ConfigError, timeouts, gloo
        message = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        return _refused(f"{type(exc).__name__}: {message}")
    return None


def _apply_pairs(state: ServerState, pairs, version: int | None, flush: bool = False) -> None:
    """Received (name, tensor) pairs: new weights, or the delta payload a (DELTA_TENSOR_NAME, uint8
    tensor) bucket carries."""
    if len(pairs) == 1 and pairs[0][0] == DELTA_TENSOR_NAME:
        _apply_delta(state, pairs[0][1].contiguous().cpu().numpy().tobytes())
    else:
        _update(state, pairs, version, flush)


def add_weight_routes(app, state: ServerState) -> None:
    @app.post("/update_weights_from_disk")
    async def update_weights_from_disk(request: Request):
        body = await read_json(request, state.max_body_bytes)
        path = body.get("model_path")
        if not isinstance(path, str) or not path:
            raise BadRequest("model_path: expected the path of a weights directory or .safetensors file")
        version = parse_weight_version(body.get("weight_version"))
        if body.get("abort_all_requests"):
            state.batcher.abort(abort_all=True, why="aborted for a weight update")
        refused = await _run(_update, state, path, version, bool(body.get("flush_cache", False)))
        if refused is not None:
            return refused
        state.model_path = path  # as SGLang reports the checkpoint it last loaded
        return _done(state, f"weights loaded from {path}")

    @app.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        body = await read_json(request, state.max_body_bytes)
        try:
            address, port = str(body["master_address"]), int(body["master_port"])
            rank, world = int(body.get("rank_offset", 1)), int(body["world_size"])
            backend, timeout_s = str(body.get("backend", "gloo")), float(body.get("timeout_s", GROUP_TIMEOUT_S))
        except (KeyError, TypeError, ValueError) as exc:
            raise BadRequest(f"init_weights_update_group: expected master_address, master_port, rank_offset, "
                             f"world_size (and optionally backend, timeout_s) ({type(exc).__name__}: {exc})") from None
        name = str(body.get("group_name") or DEFAULT_GROUP)
        old = state.groups.pop(name, None)
        if old is not None:
            old.close()

        def join():
            state.groups[name] = open_update_group(address, port, rank, world, backend, timeout_s)

        refused = await _run(join)
        message = f"joined {name} as rank {rank} of {world} ({backend})"
        return refused or JSONResponse({"success": True, "message": message})

    @app.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        body = await read_json(request, state.max_body_bytes, empty_ok=True)
        group = state.groups.pop(str(body.get("group_name") or DEFAULT_GROUP), None)
        if group is not None:
            group.close()
        return JSONResponse({"success": True, "message": "group closed" if group else "no such group"})

    @app.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        body = await read_json(request, state.max_body_bytes)
        name = str(body.get("group_name") or DEFAULT_GROUP)
        group = state.groups.get(name)
        if group is None:
            raise BadRequest(f"group_name {name!r}: no such weight-update group (call /init_weights_update_group first)")
        if body.get("load_format") == DELTA_FORMAT:
            refused = await _run(lambda: _apply_delta(state, broadcast_bytes(group, None, src=0)))
            return refused or _done(state, f"delta received over {name}")
        names, dtypes, shapes = body.get("names"), body.get("dtypes"), body.get("shapes")
        if not (isinstance(names, list) and isinstance(dtypes, list) and isinstance(shapes, list)
                and len(names) == len(dtypes) == len(shapes) and names):
            raise BadRequest("names, dtypes, shapes: expected three lists of one entry per tensor")
        try:
            metas = [TensorMeta(str(n), str(d).removeprefix("torch."), tuple(s)) for n, d, s in zip(names, dtypes, shapes)]
        except (CheckpointError, TypeError, ValueError) as exc:
            raise BadRequest(f"tensor metadata: {exc}") from None
        version = parse_weight_version(body.get("weight_version"))
        flush = bool(body.get("flush_cache", True))
        refused = await _run(lambda: _apply_pairs(state, receive_tensors(group, metas, src=0), version, flush))
        return refused or _done(state, f"{len(metas)} tensors received over {name}")

    @app.post("/orthon/update_weights_from_delta")
    async def update_weights_from_delta(request: Request):
        """The payload's bytes as the body, or (a JSON body) {"path": a payload file on a shared disk}."""
        if request.headers.get("content-type", "").startswith("application/json"):
            body = await read_json(request, state.max_body_bytes)
            path = body.get("path")
            if not isinstance(path, str) or not Path(path).is_file():
                raise BadRequest(f"path: {path!r} is not a delta payload file")
            size = Path(path).stat().st_size
            if size > state.max_delta_bytes:
                raise BadRequest(f"{path}: {size} bytes, over the delta limit of {state.max_delta_bytes}", status=413)
            refused = await _run(lambda: _apply_delta(state, Path(path).read_bytes()))
            return refused or _done(state, f"delta from {path} applied")
        data = await read_body(request, state.max_delta_bytes)
        refused = await _run(_apply_delta, state, data)
        return refused or _done(state, f"delta of {len(data)} bytes applied")

    @app.post("/orthon/update_weights_from_shared")
    async def update_weights_from_shared(request: Request):
        body = await read_json(request, state.max_body_bytes)
        handle = body.get("handle")
        if not isinstance(handle, dict):
            raise BadRequest("handle: expected the object SharedBuckets.write returned")
        version = parse_weight_version(handle.get("version"))
        refused = await _run(lambda: _apply_pairs(state, read_shared(handle), version))
        return refused or _done(state, "weights read from shared memory")

    @app.get("/orthon/weight_hashes")
    async def weight_hashes():
        def hashes():
            with state.batcher.exclusive() as engine:
                return tensor_hashes(experts_to_hf(engine.model.state_dict())), engine.weight_version

        found, version = await asyncio.to_thread(hashes)
        return JSONResponse({"hashes": found, "weight_version": str(version)})
