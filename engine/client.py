"""``HTTPEngine``: the Engine protocol over SGLang's HTTP API (orthon serve, SGLang, or the router).

``generate`` sends one /generate per prompt, up to ``concurrency`` at once (the server's continuous
batching puts concurrent requests into one batch; the router routes each by its own key, sent as the
``X-SMG-Routing-Key`` header so sglang-router's manual policy keeps a session on one engine), and maps
the answers onto GenerationResults with fp32 log-probs. A prompt the server refuses comes back
"rejected" with the server's message. Every call has a finite timeout; a
refused connection, a timeout, a 5xx or an answer that is not the API's raises ``EngineUnavailable``
(callers retry elsewhere), never hangs.

Weights: ``update_weights(path)`` (/update_weights_from_disk), ``update_weights(DeltaPayload)`` (the
orthon delta route), and the paths' own calls: ``update_weights_from_delta_file``,
``init_weights_update_group`` + ``update_weights_from_distributed``, ``update_weights_from_shared``.
"""
from __future__ import annotations

import json
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import requests
import torch

from orthon.core.errors import EngineUnavailable
from orthon.engine.protocol import GenerationResult
from orthon.engine.sampling import SamplingParams

FINISH = {"stop": "stop", "length": "length", "abort": "abort"}


def sampling_json(p: SamplingParams) -> dict:
    out = {"max_new_tokens": p.max_new_tokens, "temperature": p.temperature, "top_p": p.top_p, "top_k": p.top_k}
    if p.stop_token_ids is not None:
        out["stop_token_ids"] = list(p.stop_token_ids)
    if p.seed is not None:
        out["sampling_seed"] = p.seed
    return out


class HTTPEngine:
    def __init__(self, url: str, timeout_s: float = 120.0, update_timeout_s: float = 600.0, concurrency: int = 64):
        self.url = url.rstrip("/")
        self.concurrency = concurrency  # requests in flight at once from one generate call
        self.timeout_s, self.update_timeout_s = timeout_s, update_timeout_s
        self.weight_version = 0  # the last version an answer or an update reported
        self._session = requests.Session()
        adapter = requests.adapters.HTTPAdapter(pool_connections=4, pool_maxsize=max(concurrency, 10))
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)

    # ------------------------------------------------------------ transport
    def _call(self, method: str, path: str, timeout: float | None = None, headers=None, **kwargs):
        """The JSON answer; EngineUnavailable when the server cannot answer, ValueError (with the
        server's message) when it refuses the request (4xx)."""
        try:
            answer = self._session.request(method, self.url + path, timeout=timeout or self.timeout_s,
                                           headers=headers, **kwargs)
        except requests.RequestException as exc:
            raise EngineUnavailable(f"{self.url}{path}: {type(exc).__name__}: {exc}") from None
        try:
            data = answer.json()
        except ValueError:
            raise EngineUnavailable(f"{self.url}{path}: HTTP {answer.status_code}, not JSON: {answer.text[:200]!r}") from None
        if answer.status_code >= 500:
            raise EngineUnavailable(f"{self.url}{path}: HTTP {answer.status_code}: {data}")
        if answer.status_code >= 400:
            message = data.get("error") or data.get("message") if isinstance(data, dict) else data
            raise ValueError(f"{self.url}{path}: HTTP {answer.status_code}: {message}")
        return data

    # ------------------------------------------------------------ generation
    def generate(self, prompts: Sequence[Sequence[int]], sampling=None, routing_keys=None) -> list[GenerationResult]:
        sampling = SamplingParams() if sampling is None else sampling
        if isinstance(sampling, SamplingParams):
            if sampling.seed is not None:
                per = [SamplingParams(**{**vars(sampling), "seed": sampling.seed + i}) for i in range(len(prompts))]
            else:
                per = [sampling] * len(prompts)
        else:
            per = list(sampling)
        keys = list(routing_keys) if routing_keys is not None else [None] * len(prompts)
        if not len(per) == len(keys) == len(prompts):
            raise ValueError(f"generate: {len(prompts)} prompts, {len(per)} SamplingParams, {len(keys)} routing keys")
        prompts = [[int(t) for t in p] for p in prompts]
        if len(prompts) <= 1:
            return [self._one(*args) for args in zip(prompts, per, keys)]
        with ThreadPoolExecutor(min(self.concurrency, len(prompts))) as pool:
            return list(pool.map(self._one, prompts, per, keys))

    def _one(self, prompt: list[int], params: SamplingParams, key: str | None) -> GenerationResult:
        """One request (the server batches concurrent ones; the router routes each by its key)."""
        headers = {"X-SMG-Routing-Key": key} if key else None
        body = {"input_ids": prompt, "sampling_params": sampling_json(params), "return_logprob": True}
        try:
            answer = self._call("POST", "/generate", headers=headers, json=body)
        except ValueError as exc:  # the server refused this prompt
            return GenerationResult(prompt, [], torch.zeros(0), "rejected", self.weight_version, params.seed, error=str(exc))
        return self._result(prompt, answer, params.seed)

    def _result(self, prompt, answer, seed) -> GenerationResult:
        try:
            meta = answer["meta_info"]
            tokens = [int(t) for t in answer["output_ids"]]
            logprobs = torch.tensor([float(x[0]) for x in meta.get("output_token_logprobs") or []], dtype=torch.float32)
            reason = FINISH[meta["finish_reason"]["type"]]
            version = int(meta.get("weight_version", self.weight_version))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise EngineUnavailable(f"{self.url}/generate: an answer that is not SGLang's: {exc!r}") from None
        if logprobs.numel() != len(tokens):
            raise EngineUnavailable(f"{self.url}/generate: {logprobs.numel()} log-probs for {len(tokens)} tokens")
        self.weight_version = version
        return GenerationResult(prompt, tokens, logprobs, reason, version, seed)

    # ------------------------------------------------------------ weights
    def _updated(self, answer) -> int:
        self.weight_version = int(answer["weight_version"])
        return self.weight_version

    def update_weights(self, weights, version: int | None = None) -> int:
        """A weights directory (reloaded from disk) or a DeltaPayload (its bytes over HTTP)."""
        if isinstance(weights, (str, os.PathLike)):
            body = {"model_path": str(weights)}
            if version is not None:
                body["weight_version"] = str(version)
            return self._updated(self._call("POST", "/update_weights_from_disk", self.update_timeout_s, json=body))
        if hasattr(weights, "to_bytes"):
            return self._updated(self._call("POST", "/orthon/update_weights_from_delta", self.update_timeout_s,
                                            data=weights.to_bytes(), headers={"Content-Type": "application/octet-stream"}))
        raise TypeError("HTTPEngine.update_weights: send tensors by one of the sync paths (disk, distributed, shared); "
                        f"got {type(weights).__name__}")

    def update_weights_from_delta_file(self, path: str) -> int:
        return self._updated(self._call("POST", "/orthon/update_weights_from_delta", self.update_timeout_s,
                                        data=json.dumps({"path": str(path)}), headers={"Content-Type": "application/json"}))

    def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int, world_size: int,
                                  backend: str = "gloo", group_name: str = "orthon") -> None:
        self._call("POST", "/init_weights_update_group", self.update_timeout_s,
                   json={"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                         "world_size": world_size, "backend": backend, "group_name": group_name})

    def update_weights_from_distributed(self, metas, version: int | None, delta: bool = False) -> int:
        body = {"names": [m.name for m in metas], "dtypes": [m.dtype for m in metas],
                "shapes": [list(m.shape) for m in metas], "group_name": "orthon"}
        if version is not None:
            body["weight_version"] = str(version)
        if delta:
            body["load_format"] = "orthon_delta"
        return self._updated(self._call("POST", "/update_weights_from_distributed", self.update_timeout_s, json=body))

    def update_weights_from_shared(self, handle: dict) -> int:
        return self._updated(self._call("POST", "/orthon/update_weights_from_shared", self.update_timeout_s,
                                        json={"handle": handle}))

    def weight_hashes(self) -> dict[str, str]:
        return self._call("GET", "/orthon/weight_hashes", self.update_timeout_s)

    # ------------------------------------------------------------ state
    def health(self) -> dict:
        info = self._call("GET", "/get_server_info", min(self.timeout_s, 10.0))
        self.weight_version = int(info.get("weight_version", self.weight_version))
        return {"ok": True, "engine": "http", "url": self.url, "weight_version": self.weight_version,
                "batching": info.get("batching", {})}

    def flush(self) -> None:
        self._call("POST", "/flush_cache")

    def pause(self, abort_waiting: bool = False) -> None:
        self._call("POST", "/pause_generation", json={"mode": "abort" if abort_waiting else "in_place"})

    def resume(self) -> None:
        self._call("POST", "/continue_generation")
