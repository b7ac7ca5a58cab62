"""``HTTPEngine``: the Engine protocol over SGLang's HTTP worker API, for `orthon serve` servers, real
SGLang servers and sglang-router in front of either.

``generate`` groups the requests by routing key and sampling parameters and sends each group as one
/generate (a batch of input_ids with one shared sampling_params: sglang-router takes no per-request
list), the groups concurrently. Requests with their own seeds (RL's) are groups of one: concurrent
single requests, which the server's continuous batching runs in shared waves. Each request's
``routing_keys`` entry (a session id) goes in the ``X-SMG-Routing-Key`` header, so sglang-router's
manual policy sends every request of a session to one engine.

Every call has a finite timeout (``timeout_s`` per socket operation). A server that refuses the
connection, times out, closes it, answers 5xx or answers something that is not the API raises
``EngineUnavailable`` (after ``retries`` more tries of the calls that are safe to repeat: generation
and reads), so a caller can retry the work on another engine; ``stats`` counts calls, retries and
failures. A request the server refuses (4xx) comes back "rejected" with the server's message, like
the in-process engine's rejections; a refused weight update raises CheckpointError.
"""
from __future__ import annotations

import http.client
import json
import os
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Mapping, Sequence
from urllib.parse import urlsplit

import torch

from orthon.core.errors import CheckpointError, ConfigError, EngineUnavailable
from orthon.engine.protocol import GenerationResult
from orthon.engine.sampling import SamplingParams, per_request_params
from orthon.engine.sglang_api import ROUTING_KEY_HEADER, error_message, result_from_answer, sampling_to_sglang


def _rejected(prompt, params: SamplingParams, version: int, message: str) -> GenerationResult:
    return GenerationResult(prompt=list(prompt), tokens=[], log_probs=torch.zeros(0), finish_reason="rejected",
                            weight_version=version, seed=params.seed, error=message)


def _reported_version(data, default: int | None) -> int | None:
    """The weight version an answer reports (a string of digits, as SGLang writes it), else ``default``."""
    value = data.get("weight_version") if isinstance(data, Mapping) else None
    return int(value) if isinstance(value, str) and value.isdigit() else default


class HTTPEngine:
    """An Engine served over HTTP at ``url`` (``orthon.engine.protocol.Engine``)."""

    def __init__(self, url: str, timeout_s: float = 120.0, retries: int = 1, max_concurrency: int = 64,
                 retry_backoff_s: float = 0.2):
        parts = urlsplit(url if "://" in url else f"http://{url}")
        if parts.scheme != "http" or not parts.hostname:
            raise ConfigError(f"engine url {url!r}: expected http://host:port")
        if not timeout_s > 0 or retries < 0 or max_concurrency < 1:
            raise ConfigError(f"HTTPEngine: timeout_s must be > 0, retries >= 0, max_concurrency >= 1 "
                              f"(got {timeout_s}, {retries}, {max_concurrency})")
        self.url = f"http://{parts.netloc}"
        self._host, self._port = parts.hostname, parts.port or 80
        self.timeout_s, self.retries, self.retry_backoff_s = float(timeout_s), int(retries), retry_backoff_s
        self.max_concurrency = max_concurrency
        self.weight_version = 0  # the version of the last answer or update; generate results carry their own
        self.stats: Counter = Counter()
        self._pool: ThreadPoolExecutor | None = None
        self._lock = threading.Lock()  # the stats and the pool, shared by generate's threads

    def __repr__(self) -> str:
        return f"HTTPEngine({self.url!r})"

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1

    # ------------------------------------------------------------ transport
    def _once(self, method: str, path: str, body: bytes | None, headers: Mapping[str, str], timeout_s: float):
        """(status, parsed JSON or the raw text) of one HTTP exchange; EngineUnavailable when there was none."""
        connection = http.client.HTTPConnection(self._host, self._port, timeout=timeout_s)
        try:
            connection.request(method, path, body=body, headers=dict(headers))
            response = connection.getresponse()
            raw = response.read()
            status = response.status
        except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out, closed mid-answer
            what = f"no answer within {timeout_s:g} s" if isinstance(exc, TimeoutError) else f"{type(exc).__name__}: {exc}"
            raise EngineUnavailable(f"engine {self.url}: {method} {path}: {what}") from None
        finally:
            connection.close()
        try:
            data = json.loads(raw) if raw.strip() else {}
        except (UnicodeDecodeError, json.JSONDecodeError):
            data = raw.decode("utf-8", "replace")
        if status >= 500:
            raise EngineUnavailable(f"engine {self.url}: {method} {path} answered {status}: {error_message(data)}")
        if status < 400 and isinstance(data, str):
            raise EngineUnavailable(f"engine {self.url}: {method} {path} answered garbage (not JSON): {data[:200]!r}")
        return status, data

    def _call(self, method: str, path: str, payload: Any = None, *, raw: bytes | None = None,
              headers: Mapping[str, str] | None = None, timeout_s: float | None = None, retry: bool = False):
        """One API call: ``payload`` sent as JSON (or ``raw`` bytes); ``retry``: the call may be repeated."""
        body = raw if raw is not None else (None if payload is None else json.dumps(payload).encode())
        sent = {"Content-Type": "application/octet-stream" if raw is not None else "application/json", **(headers or {})}
        attempts = 1 + (self.retries if retry else 0)
        for attempt in range(attempts):
            self._count("calls")
            try:
                return self._once(method, path, body, sent, timeout_s or self.timeout_s)
            except EngineUnavailable:
                self._count("failures")
                if attempt + 1 == attempts:
                    raise
                self._count("retries")
                time.sleep(self.retry_backoff_s * 2**attempt)

    def _ok(self, method: str, path: str, payload: Any = None, **kw) -> Any:
        """The answer of a call that must succeed; a refusal (4xx) raises CheckpointError with its message."""
        status, data = self._call(method, path, payload, **kw)
        if status >= 400 or (isinstance(data, Mapping) and data.get("success") is False):
            raise CheckpointError(f"engine {self.url}: {path} refused ({status}): {error_message(data)}")
        return data

    def _map(self, fn, items: list) -> list:
        if len(items) == 1:
            return [fn(items[0])]
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="http-engine")
        return list(self._pool.map(fn, items))

    # ------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 routing_keys: Sequence[str | None] | None = None) -> list[GenerationResult]:
        """The Engine's generate over HTTP. ``routing_keys``: one per prompt (None: no key), sent as the
        X-SMG-Routing-Key header."""
        prompts = [list(p.tolist() if isinstance(p, torch.Tensor) else p) for p in prompts]
        params = per_request_params(sampling, len(prompts))
        keys = [None] * len(prompts) if routing_keys is None else list(routing_keys)
        if len(keys) != len(prompts):
            raise ValueError(f"generate: {len(keys)} routing keys for {len(prompts)} prompts")
        groups: dict[tuple, list[int]] = {}
        for i, (p, key) in enumerate(zip(params, keys)):
            groups.setdefault((key, json.dumps(sampling_to_sglang(p), sort_keys=True)), []).append(i)
        results: list[GenerationResult | None] = [None] * len(prompts)
        answered = self._map(lambda group: (group[1], self._generate_group(prompts, params, group[0][0], group[1])),
                             list(groups.items()))
        for indices, group_results in answered:
            for i, result in zip(indices, group_results):
                results[i] = result
        return results

    def _generate_group(self, prompts, params, key: str | None, indices: list[int]) -> list[GenerationResult]:
        """One /generate for requests that share a routing key and sampling parameters."""
        batched = len(indices) > 1
        body = {"input_ids": [prompts[i] for i in indices] if batched else prompts[indices[0]],
                "sampling_params": sampling_to_sglang(params[indices[0]]), "return_logprob": True}
        status, data = self._call("POST", "/generate", body, headers={ROUTING_KEY_HEADER: key} if key else None,
                                  retry=True)
        if status >= 400:
            if batched:  # a batch is refused whole: ask one by one, so only the bad requests are rejected
                return [r for i in indices for r in self._generate_group(prompts, params, key, [i])]
            self._count("rejected")
            return [_rejected(prompts[indices[0]], params[indices[0]], self.weight_version, error_message(data))]
        answers = data if batched else [data]
        if not isinstance(answers, list) or len(answers) != len(indices):
            raise EngineUnavailable(f"engine {self.url}: /generate answered garbage: {str(data)[:200]}")
        try:
            out = [result_from_answer(a, prompts[i], params[i], self.weight_version) for a, i in zip(answers, indices)]
        except ValueError as exc:
            self._count("failures")
            raise EngineUnavailable(f"engine {self.url}: /generate answered garbage: {exc}") from None
        return out

    # ------------------------------------------------------------ weights
    def _took(self, data, version: int | None) -> int:
        """The version an update answer reports (orthon's servers), else the one asked for, else the server's."""
        reported = _reported_version(data, version)
        self.weight_version = self.get_weight_version() if reported is None else reported
        return self.weight_version

    def update_weights(self, weights, version: int | None = None) -> int:
        """New weights: a path (a weights directory or .safetensors file the server can read:
        /update_weights_from_disk) or a delta payload (``orthon.engine.delta.DeltaPayload``: its bytes to
        /orthon/update_weights_from_delta). Tensors travel by ``update_weights_from_distributed`` or
        ``update_weights_from_shared``. Returns the server's new weight version."""
        if isinstance(weights, (str, os.PathLike)):
            payload = {"model_path": os.fspath(weights)}
            if version is not None:
                payload["weight_version"] = str(version)
            return self._took(self._ok("POST", "/update_weights_from_disk", payload), version)
        if hasattr(weights, "to_bytes") and hasattr(weights, "base_version"):
            if version is not None and version != getattr(weights, "version", version):
                raise ValueError(f"update_weights: version {version} given for a delta to version {weights.version}")
            return self._took(self._ok("POST", "/orthon/update_weights_from_delta", raw=weights.to_bytes()), weights.version)
        raise TypeError(f"HTTPEngine.update_weights: expected a weights path or a DeltaPayload, got "
                        f"{type(weights).__name__} (send tensors with update_weights_from_distributed or "
                        f"update_weights_from_shared)")

    def update_weights_from_delta_file(self, path) -> int:
        """A delta payload the server reads from a file (a shared disk)."""
        return self._took(self._ok("POST", "/orthon/update_weights_from_delta", {"path": os.fspath(path)}), None)

    def update_weights_from_shared(self, handle: Mapping) -> int:
        """Buckets in shared memory (``orthon.engine.weight_transfer.SharedBuckets.write``'s handle):
        the colocated path, server and writer on one machine."""
        return self._took(self._ok("POST", "/orthon/update_weights_from_shared", {"handle": dict(handle)}),
                          handle.get("version"))

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  group_name: str = "weight_update_group", backend: str = "gloo",
                                  timeout_s: float = 60.0) -> None:
        """The server joins the trainer's weight-update group as rank ``rank_offset`` (the call returns
        once every member joined, so the trainer joins concurrently)."""
        self._ok("POST", "/init_weights_update_group",
                 {"master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
                  "world_size": int(world_size), "group_name": group_name, "backend": backend, "timeout_s": timeout_s},
                 timeout_s=max(self.timeout_s, timeout_s + 10))

    def update_weights_from_distributed(self, metas, version: int | None = None, delta: bool = False,
                                        group_name: str = "weight_update_group", flush_cache: bool = True) -> int:
        """The server receives the tensors ``metas`` describes (``TensorMeta``s) from the group's rank 0,
        which broadcasts them concurrently (``weight_transfer.broadcast_tensors``). ``delta``: rank 0
        broadcasts a delta payload's bytes instead (``weight_transfer.broadcast_bytes``; ``metas`` is
        ignored, the payload names its version)."""
        if delta:
            payload = {"names": [], "dtypes": [], "shapes": [], "group_name": group_name, "load_format": "orthon_delta"}
            return self._took(self._ok("POST", "/update_weights_from_distributed", payload), None)
        payload = {"names": [m.name for m in metas], "dtypes": [m.dtype for m in metas],
                   "shapes": [list(m.shape) for m in metas], "group_name": group_name, "flush_cache": flush_cache}
        if version is not None:
            payload["weight_version"] = str(version)
        return self._took(self._ok("POST", "/update_weights_from_distributed", payload), version)

    def weight_hashes(self) -> dict[str, str]:
        """One hash per tensor of the server's weights (``weight_transfer.tensor_hashes``)."""
        return dict(self._ok("GET", "/orthon/weight_hashes", retry=True)["hashes"])

    def get_weight_version(self) -> int:
        return _reported_version(self._ok("GET", "/get_weight_version", retry=True), self.weight_version)

    # ------------------------------------------------------------ control
    def health(self) -> dict:
        """{"ok": bool, "weight_version": int, ...}: /health answers 200, with the server's info when it
        gives it. Never raises: an engine that does not answer is {"ok": False, "error": why}."""
        try:
            status, data = self._call("GET", "/health", timeout_s=min(self.timeout_s, 10.0))
            if status != 200:
                return {"ok": False, "error": f"/health answered {status}: {error_message(data)}",
                        "weight_version": self.weight_version}
            status, info = self._call("GET", "/get_server_info", timeout_s=min(self.timeout_s, 10.0))
        except EngineUnavailable as exc:
            return {"ok": False, "error": str(exc), "weight_version": self.weight_version}
        info = info if status == 200 and isinstance(info, dict) else {}
        self.weight_version = _reported_version(info, self.weight_version)
        return {"ok": True, "url": self.url, "weight_version": self.weight_version, "server": info}

    def flush(self) -> None:
        self._ok("POST", "/flush_cache")

    def pause(self, mode: str = "abort") -> None:
        """Hold new waves (mode "abort": the waiting requests come back aborted); returns once the running
        wave finished."""
        self._ok("POST", "/pause_generation", {"mode": mode})

    def resume(self) -> None:
        self._ok("POST", "/continue_generation", {})
