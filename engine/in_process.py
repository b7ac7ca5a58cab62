"""The in-process engine: batched, KV-cached generation on orthon's own model (an ``Engine``).

The one generation path of orthon: RL rollouts, ``orthon generate`` and the passkey evaluation all run
through it. ``InProcessEngine(model).generate(prompts, sampling)`` continues each prompt and returns,
per prompt, the response tokens with the fp32 log-prob of every sampled token recorded at generation
time ("token in, token out": the trainer never re-derives pi_rollout). By default the log-prob is that
of the unmodified policy (temperature 1, no top-k / top-p), the quantity the trainer recomputes with
``orthon.pretrain.logprobs.sequence_log_probs`` on the same code, so rho = 1 up to float32 round-off
when the weights match.

How a batch runs: prompts are sorted by length and taken in waves of ``max_batch_size``; a wave is
left-padded (pads are document -1 and RoPE positions are shifted, so each row sees only its own
tokens), prefilled in one forward (what the prefix cache holds of a prompt's start copied in rather than
run: orthon.engine.prefix_cache), then decoded one token per step through the absorbed-attention
cache path (the fused runner of orthon.engine.fused_decode by default). A row leaves the batch
(``KVCache.select``) the step it finishes (or the step after its ``RequestControl`` was cancelled:
``orthon.engine.control``), so the cost follows the live rows; with ``joins`` (a server's batcher),
requests that arrive meanwhile take the freed rows once ``join_free_share`` of them are free
(continuous batching: each prefilled on a cache of its own, its entries placed to end where the wave's
rows do, the slots no live row uses dropped as the wave lives on), and each decodes as it would alone.
Bad requests (empty prompt, token id outside the vocabulary, prompt that leaves no room in the context)
come back as "rejected" results with the reason, counted in ``stats``; the rest of the batch runs.

``update_weights`` copies new tensors (a state dict, a weights directory or file, a delta) into the
existing parameters (same storage, no re-allocation: a colocated trainer or a delta sync can rely on
the addresses) and changes ``weight_version``.
"""
from __future__ import annotations

import math
import os
import threading
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Mapping, Sequence

import numpy as np
import torch
from safetensors.torch import load_file

from orthon.core.errors import CheckpointError, ConfigError, WrongBaseVersion
from orthon.engine.control import RequestControl
from orthon.engine.delta import row_views
from orthon.engine.fused_decode import DecodeWeights, weights_fingerprint
from orthon.engine.prefix_cache import PrefixCache
from orthon.engine.protocol import GenerationResult, WeightDelta, WeightsSource
from orthon.engine.sampling import SamplingParams, per_request_params, request_uniforms, sample_step, stop_table
from orthon.engine.stop_strings import StopStringWatch
from orthon.pretrain.hf_io import (check_state, experts_from_hf, experts_to_hf, is_expert_stack, load_hf_state,
                                   stack_to_hf)
from orthon.pretrain.logprobs import gather_log_probs, sequence_log_probs
from orthon.pretrain.model import GLMForCausalLM


@dataclass
class EngineConfig:
    # Longest prompt + response; None: the model's max_position_embeddings (a smaller value wins).
    max_length: int | None = None
    max_batch_size: int = 64  # rows decoded together; more prompts run in successive waves
    seed: int = 0  # draws the seed of every request that brings none
    # Where the recorded policy log-probs come from. "decode": the logits each token was sampled from
    # (cached decoding; equal to the trainer's recompute up to fp32 round-off, about 1e-5 at most on a
    # trained model). "rescore": one more forward of each finished wave through the trainer's own
    # scoring function (orthon.pretrain.logprobs), which gives the same bits whatever the batch holds, so
    # rollout and trainer log-probs match exactly on the same weights. Costs one prefill per wave
    # (orthon rl's synchronous loop on its own engine leaves it to the trainer, whose forward it is).
    logprobs: Literal["decode", "rescore"] = "decode"
    # Decode steps through fused, pre-packed weights (orthon.engine.fused_decode): the same function as the
    # model's cached forward to float round-off, about 1.6x faster at batch 8 on a CPU. False: the
    # model's own forward (bit-compatible with the layer-by-layer code).
    fused_decode: bool = True
    # Tokens of prefilled and generated sequences kept for reuse (orthon.engine.prefix_cache: a prompt's
    # longest prefix held is copied into the cache instead of recomputed; identical prompts in a batch
    # are prefilled once, a long prefix several share runs once). 0: no reuse of any kind. A token
    # costs layers x (kv_lora_rank + qk_rope_head_dim) + indexed layers x index_head_dim values: 1.8 KB
    # for the tiny model in fp32, 110 KB for GLM-5 in bf16.
    prefix_cache_tokens: int = 65536
    # Continuous batching (``generate(..., joins=)``): waiting requests join the running batch once this
    # share of its max_batch_size rows (at least one) is free. Joining one row at a time as rows finish
    # keeps the batch fullest but pays a prefill and a copy of the batch's cache per join; on a CPU a
    # quarter gives more tokens a second on every mix measured (bench/continuous_batching.py), at some
    # latency for a short request arriving while the batch is nearly full. 0: join at every free row.
    join_free_share: float = 0.25

    def __post_init__(self):
        if self.max_length is not None and (isinstance(self.max_length, bool) or self.max_length < 2):
            raise ConfigError(f"max_length: must be >= 2 or None, got {self.max_length!r}")
        if isinstance(self.max_batch_size, bool) or self.max_batch_size < 1:
            raise ConfigError(f"max_batch_size: must be >= 1, got {self.max_batch_size!r}")
        if isinstance(self.prefix_cache_tokens, bool) or self.prefix_cache_tokens < 0:
            raise ConfigError(f"prefix_cache_tokens: must be >= 0, got {self.prefix_cache_tokens!r}")
        if isinstance(self.join_free_share, bool) or not 0 <= self.join_free_share <= 1:
            raise ConfigError(f"join_free_share: must be in [0, 1], got {self.join_free_share!r}")
        if self.logprobs not in ("decode", "rescore"):
            raise ConfigError(f"logprobs: must be 'decode' or 'rescore', got {self.logprobs!r}")


def _check_version(version) -> int:
    if isinstance(version, bool) or not isinstance(version, (int, np.integer)) or version < 0:
        raise ValueError(f"weight version: must be an int >= 0, got {version!r}")
    return int(version)


@dataclass
class _Request:
    index: int  # position in the caller's list
    prompt: list[int]
    params: SamplingParams
    seed: int | None
    stops: tuple[int, ...]
    budget: int  # new tokens allowed: min(max_new_tokens, room left in the context)
    context_bound: bool  # the budget is the context's, not max_new_tokens
    control: RequestControl | None = None
    cached: int = 0  # prompt tokens whose entries came from the prefix cache


def _per_row(counts, n: int) -> list[int]:
    """A decode step's token counts as one int a live row (``counts``: a tensor of them, or one int for
    every row while no row joined late)."""
    return counts.tolist() if isinstance(counts, torch.Tensor) else [counts] * n


def _run_groups(runs: list[int], overhead: int = 64) -> list[list[int]]:
    """Rows (by index) in one prefill batch, or two where that runs fewer tokens: a batch runs each row's
    last max(runs) tokens, so rows with little left to run (most of the prompt held in the prefix cache)
    beside rows with much would rerun what is held. The split puts the k rows with the longest runs in
    a batch of their own, k chosen for the fewest tokens run; a second batch must save ``overhead``
    tokens (a forward's fixed cost) to be worth it."""
    order = sorted(range(len(runs)), key=lambda r: -runs[r])
    longest = runs[order[0]]
    best, split = len(runs) * longest, None
    for k in range(1, len(order)):
        cost = k * longest + (len(order) - k) * runs[order[k]] + overhead
        if cost < best:
            best, split = cost, k
    return [order] if split is None else [order[:split], order[split:]]


def _shared_prefixes(prompts: list[list[int]], min_len: int = 32) -> list[tuple[list[int], list[int]]]:
    """Sets of prompts (by index) that start with the same ``min_len`` or more tokens, each with the
    prefix its prompts share (shorter than the shortest of them, which must still run a token of its
    own). Sorted, prompts with a common prefix are neighbours: a set is a run of neighbours whose
    common prefixes are all long enough."""
    def common(a, b):
        n = min(len(a), len(b))
        return next((i for i in range(n) if a[i] != b[i]), n)

    order = sorted(range(len(prompts)), key=lambda i: prompts[i])
    found, start, shared = [], 0, None
    for k in range(1, len(order) + 1):
        n = common(prompts[order[k - 1]], prompts[order[k]]) if k < len(order) else 0
        if n >= min_len:
            shared = n if shared is None else min(shared, n)
            continue
        members = order[start:k]
        if shared is not None:
            shared = min(shared, min(len(prompts[i]) for i in members) - 1)
            if shared >= min_len:
                found.append((prompts[members[0]][:shared], members))
        start, shared = k, None
    return found


def _left_padded(prompts: list[list[int]], device, width: int | None = None):
    """The prompts as one left-padded batch for a prefill, ``width`` wide (the longest prompt's length by
    default): (ids, pads, docs, positions); the pads are document -1 and the RoPE positions start at each
    prompt's first token (docs and positions None when no prompt is padded)."""
    lengths = torch.tensor([len(p) for p in prompts], device=device)
    width = int(lengths.max()) if width is None else width
    pads = width - lengths
    ids = torch.zeros(len(prompts), width, dtype=torch.long, device=device)
    for row, prompt in enumerate(prompts):
        ids[row, int(pads[row]):] = torch.tensor(prompt, device=device)
    if not bool((pads > 0).any()):
        return ids, pads, None, None
    slots = torch.arange(width, device=device)
    return ids, pads, torch.where(slots[None] < pads[:, None], -1, 0), (slots[None] - pads[:, None]).clamp(min=0)


class _Wave:
    """A wave's requests, their sampling settings, and what its decode writes: each row's tokens and
    log-probs, how many it made, whether a stop (token or string) or a cancel ended it, the results
    already handed over. Rows that join while it decodes are appended (``add``); a row's first token
    is sampled at step ``start`` of the wave."""

    def __init__(self, requests: list[_Request], device, tokenizer):
        self.device = device
        lengths = torch.tensor([len(r.prompt) for r in requests], device=device)
        self.steps = max(r.budget for r in requests)
        self.pads = int(lengths.max()) - lengths  # left padding of each row in the cache's slots
        self.requests: list[_Request] = []
        self.texts = StopStringWatch([], tokenizer and tokenizer.decode)
        self.results: dict[int, GenerationResult] = {}  # rows handed over as they finished
        self._new_rows(requests, self.pads, 0)

    def _new_rows(self, requests: list[_Request], pads: torch.Tensor, start: int) -> None:
        dev, n, first = self.device, len(requests), len(self.requests)
        params = [r.params for r in requests]
        uniforms = torch.zeros(n, self.steps, dtype=torch.float64)
        for row, request in enumerate(requests):
            if request.seed is not None and not request.params.greedy:  # each request's own draws, up front
                uniforms[row, : request.budget] = request_uniforms(request.seed, request.budget)
        stops = [r.stops for r in self.requests + requests]
        fresh = {
            "budgets": torch.tensor([r.budget for r in requests], device=dev),
            "start": torch.full((n,), start, dtype=torch.long, device=dev),
            "temperature": torch.tensor([p.temperature for p in params], dtype=torch.float32, device=dev),
            "top_k": torch.tensor([p.top_k for p in params], dtype=torch.long, device=dev),
            "top_p": torch.tensor([p.top_p for p in params], dtype=torch.float64, device=dev),
            "uniforms": uniforms.to(dev),
            "sampling_mode": torch.tensor([p.logprob_mode == "sampling" for p in params], device=dev),
            "tokens": torch.zeros(n, self.steps, dtype=torch.long, device=dev),
            "log_probs": torch.zeros(n, self.steps, dtype=torch.float32, device=dev),
            "produced": torch.zeros(n, dtype=torch.long, device=dev),  # tokens each row ended with
            "stopped": torch.zeros(n, dtype=torch.bool, device=dev),
            "aborted": torch.zeros(n, dtype=torch.bool),
        }
        for name, value in fresh.items():
            setattr(self, name, value if not first else torch.cat([getattr(self, name), value]))
        if first:
            self.pads = torch.cat([self.pads, pads])
        self.stop_ids = stop_table(stops, dev)
        self.requests += requests
        self.texts.add(first, [p.stop for p in params])

    def grow(self, steps: int) -> None:
        """Room for ``steps`` decode steps (a joining request whose response outlasts the wave's)."""
        extra = steps - self.steps
        if extra > 0:
            for name in ("tokens", "log_probs", "uniforms"):
                t = getattr(self, name)
                setattr(self, name, torch.cat([t, t.new_zeros(t.shape[0], extra)], dim=1))
            self.steps = steps

    def add(self, requests: list[_Request], pads: torch.Tensor, start: int) -> torch.Tensor:
        """Append rows joining at step ``start`` (their pads in the cache's slots); returns their rows."""
        first = len(self.requests)
        self._new_rows(requests, pads, start)
        return torch.arange(first, len(self.requests), device=self.device)


@dataclass
class EngineStats:
    requests: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0  # prefilled, whether computed or taken from the prefix cache
    cached_tokens: int = 0  # of those, taken from the prefix cache
    finished: Counter = field(default_factory=Counter)  # by finish reason
    rejected: Counter = field(default_factory=Counter)  # by cause

    def as_dict(self) -> dict:
        return {"requests": self.requests, "generated_tokens": self.generated_tokens,
                "prompt_tokens": self.prompt_tokens, "cached_tokens": self.cached_tokens,
                "finished": dict(self.finished), "rejected": dict(self.rejected)}


class InProcessEngine:
    """The ``Engine`` on a GLMForCausalLM held in this process (``orthon.engine.protocol``)."""

    takes_controls = True  # generate(..., controls=...): orthon.engine.control

    def __init__(self, model: GLMForCausalLM, config: EngineConfig | None = None, tokenizer=None):
        self.model = model
        self.config = config or EngineConfig()
        # Reads the responses' text for requests with stop strings (anything with ``decode(ids) -> str``).
        self.tokenizer = tokenizer
        limit = model.config.max_position_embeddings
        self.max_length = min(limit, self.config.max_length) if self.config.max_length else limit
        self.weight_version = 0
        self.stats = EngineStats()
        self._rng = torch.Generator().manual_seed(self.config.seed)
        self._fused: DecodeWeights | None = None  # built on first use, refreshed when the weights change
        self._prefixes = PrefixCache(self.config.prefix_cache_tokens)
        self._prefixes_of = None  # the weights (and attention mode) the prefix cache's entries are from
        # generate() and update_weights() never interleave: a wave runs on one set of weights.
        self._lock = threading.RLock()

    # ------------------------------------------------------------ weights
    @torch.no_grad()
    def update_weights(self, weights: WeightsSource, version: int | None = None, strict: bool = False) -> int:
        """The Engine's update_weights (``orthon.engine.protocol``): tensors are copied into the model's
        parameters and buffers in place (same storage). ``strict``: every tensor of the model must be
        given (a path always must: it is a whole checkpoint, tied lm_head weights excepted). Tensors may be
        named as the model's state dict or as the HF layout (routed experts one tensor each: what the
        streamed weight sync sends, and SGLang takes), or both."""
        version = None if version is None else _check_version(version)
        targets = self._targets()
        if isinstance(weights, WeightDelta):  # its row pieces (NAME[a:b]) as views of those rows
            targets.update(row_views(targets, getattr(weights, "names", ())))
        if isinstance(weights, (str, os.PathLike)):
            items = list(self._read_weights(Path(weights)).items())
        elif isinstance(weights, WeightDelta) and hasattr(weights, "apply_in_place"):
            return self._apply_delta_in_place(weights, version, targets)
        elif isinstance(weights, WeightDelta):
            self._check_delta_base(weights)
            with self._lock:
                produced = weights.apply_to(targets)
            items = list(produced.items() if isinstance(produced, Mapping) else produced)
        else:
            items = list(weights.items() if isinstance(weights, Mapping) else weights)
        for name, value in items:
            if name not in targets:
                raise KeyError(f"update_weights: {name!r} is not a tensor of the model")
            if tuple(value.shape) != tuple(targets[name].shape):
                raise ValueError(f"update_weights: {name!r} has shape {tuple(value.shape)}, "
                                 f"the model's is {tuple(targets[name].shape)}")
        if strict:
            given = {name for name, _ in items}
            missing = sorted(name for name in self.model.state_dict(keep_vars=True) if name not in given
                             and not (is_expert_stack(name) and set(stack_to_hf(name, targets[name])) <= given))
            if missing:
                raise KeyError(f"update_weights: strict update is missing {missing[:5]}{'...' if len(missing) > 5 else ''}")
        with self._lock:
            for name, value in items:
                targets[name].data.copy_(value)
            self._fused = None  # .data writes bump no version counter: rebuild the fused weights
            self._prefixes.clear()  # entries of the old weights
            self.weight_version = self.weight_version + 1 if version is None else version
        return self.weight_version

    def _targets(self) -> dict[str, torch.Tensor]:
        """The model's tensors (detached, same storage) by state-dict name, and each routed expert's slices of
        its stack by HF name: views (an expert's rows of a contiguous stack are contiguous), so a write to
        one lands in the stack."""
        state = {name: t.detach() for name, t in self.model.state_dict(keep_vars=True).items()}
        experts = experts_to_hf({name: t for name, t in state.items() if is_expert_stack(name)})
        assert all(t._base is not None for t in experts.values()), "expert views must share the stacks' storage"
        return {**state, **experts}

    def _check_delta_base(self, delta) -> None:
        base = getattr(delta, "base_version", None)
        if base is not None and base != self.weight_version:
            raise WrongBaseVersion(f"update_weights: the delta is from weight version {base}, the engine holds "
                                  f"{self.weight_version}; weights unchanged")

    def _apply_delta_in_place(self, delta, version: int | None, targets) -> int:
        """A delta that writes its bytes into the parameters' own storage (``orthon.engine.delta``): its
        base must be the engine's version; it checks itself (checksum, names, shapes, base hashes) before
        writing. The engine then holds ``delta.version``."""
        target_version = getattr(delta, "version", None)
        if version is not None and target_version is not None and version != target_version:
            raise ValueError(f"update_weights: version {version} given for a delta to version {target_version}")
        with self._lock:
            self._check_delta_base(delta)
            delta.apply_in_place(targets)
            self._fused = None
            self._prefixes.clear()
            if getattr(delta, "final", True):  # else more parts of the version follow: it holds the base still
                new = version if version is not None else target_version
                self.weight_version = self.weight_version + 1 if new is None else _check_version(new)
        return self.weight_version

    def _read_weights(self, path: Path) -> dict[str, torch.Tensor]:
        """The tensors of a weights directory or .safetensors file in the model's names (experts
        stacked), checked complete and of the model's shapes (``orthon.pretrain.hf_io.check_state``:
        layers past num_hidden_layers, a multi-token-prediction layer, are dropped)."""
        if path.is_dir():
            state = load_hf_state(path)
        elif path.is_file() and path.suffix == ".safetensors":
            state = experts_from_hf(load_file(str(path)))
        elif path.exists():
            raise CheckpointError(f"update_weights: {path} is neither a weights directory nor a .safetensors file")
        else:
            raise FileNotFoundError(f"update_weights: {path}: no such weights directory or file")
        return check_state(self.model, state)

    # ------------------------------------------------------------ state
    def flush(self) -> None:
        """Drop the packed decode weights (rebuilt on the next generate). And empty the prefix
        cache (SGLang's /flush_cache); results do not change beyond float round-off."""
        with self._lock:
            self._fused = None
            self._prefixes.clear()

    def _check_prefixes(self) -> None:
        """Empty the prefix cache if the weights or the attention mode changed since its entries were made
        (an update, or a colocated trainer's step on the same parameters)."""
        now = (weights_fingerprint(self.model), self.model.runtime.sparse_attention)
        if now != self._prefixes_of:
            self._prefixes.clear()
            self._prefixes_of = now

    def health(self) -> dict:
        weight = self.model.lm_head.weight
        return {"ok": True, "engine": "in_process", "weight_version": self.weight_version,
                "device": str(weight.device), "dtype": str(weight.dtype).replace("torch.", ""),
                "max_length": self.max_length, "max_batch_size": self.config.max_batch_size,
                "fused_decode": self._fused is not None, "prefix_cache": self._prefixes.stats(),
                "stats": self.stats.as_dict()}

    # ------------------------------------------------------------ requests
    def _admit(self, index: int, prompt, params: SamplingParams) -> _Request | GenerationResult:
        """A checked request, or the rejected result saying why not (counted)."""
        vocab = self.model.config.vocab_size
        try:
            raw = prompt.tolist() if isinstance(prompt, torch.Tensor) else list(prompt)
        except TypeError:
            raw = [None]
        ok_types = all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in raw)
        ids = [int(t) for t in raw] if ok_types else []
        cause, message = None, None
        if not ok_types:
            cause, message = "bad_token_type", f"prompt {index}: token ids must be integers"
        elif not ids:
            cause, message = "empty_prompt", f"prompt {index}: empty (no token ids to continue)"
        elif min(ids) < 0 or max(ids) >= vocab:
            bad = min(ids) if min(ids) < 0 else max(ids)
            cause, message = "token_out_of_vocab", f"prompt {index}: token id {bad} is outside the vocabulary (0..{vocab - 1})"
        elif len(ids) >= self.max_length:
            cause, message = "prompt_too_long", (f"prompt {index}: {len(ids)} tokens leave no room for a response "
                                                 f"in the context of {self.max_length}")
        elif params.stop and self.tokenizer is None:
            cause, message = "no_tokenizer", (f"prompt {index}: stop strings {list(params.stop)} need the engine's "
                                              "tokenizer to read text, and it has none")
        if cause is not None:
            self.stats.rejected[cause] += 1
            return GenerationResult(prompt=ids if ok_types else [], tokens=[], log_probs=torch.zeros(0),
                                    finish_reason="rejected", weight_version=self.weight_version, seed=params.seed,
                                    error=message)
        stops = params.stop_token_ids
        if stops is None:
            eos = self.model.config.eos_token_id
            stops = () if eos is None else (eos,)
        room = self.max_length - len(ids)
        seed = params.seed
        if seed is None and not params.greedy:
            seed = int(torch.randint(0, 2**62, (1,), generator=self._rng))
        return _Request(index, ids, params, seed, tuple(stops), min(params.max_new_tokens, room),
                        room < params.max_new_tokens)

    def generate(self, prompts: Sequence[Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 routing_keys: Sequence[str | None] | None = None,
                 controls: Sequence[RequestControl | None] | None = None, joins=None) -> list[GenerationResult]:
        """The Engine's generate; ``routing_keys`` are for routers (one engine in this process serves
        every session). ``controls``: one ``RequestControl`` or None per prompt (orthon.engine.control:
        cancel a request while it runs, watch its tokens). ``joins(room, fits)``: more requests to take
        into the last wave while it decodes, as rows free up (continuous batching): up to ``room``
        (prompt, SamplingParams, RequestControl) triples for which ``fits(prompt_len, max_new_tokens)``
        holds, each answered through its control's ``on_finish`` (their results are not in the list
        returned). Not under ``logprobs: rescore``, whose results wait for their wave."""
        per = per_request_params(sampling, len(prompts))
        controls = list(controls) if controls is not None else [None] * len(prompts)
        if len(controls) != len(prompts):
            raise ValueError(f"generate: {len(controls)} controls for {len(prompts)} prompts")
        with self._lock:
            self._check_prefixes()
            results: list[GenerationResult | None] = [None] * len(prompts)
            requests = []
            for i, (prompt, params, control) in enumerate(zip(prompts, per, controls)):
                admitted = self._admit(i, prompt, params)
                if isinstance(admitted, GenerationResult):
                    results[i] = admitted
                elif admitted.budget == 0:  # max_new_tokens = 0: nothing to run
                    results[i] = self._unrun(admitted, "length")
                elif control is not None and control.cancelled:
                    results[i] = self._unrun(admitted, "abort", control.reason)
                else:
                    admitted.control = control
                    requests.append(admitted)
            self.stats.requests += len(prompts)
            # Similar lengths together: less padding per wave.
            requests.sort(key=lambda r: len(r.prompt), reverse=True)
            size = self.config.max_batch_size
            was_training = self.model.training
            self.model.eval()
            try:
                joins = joins if self.config.logprobs == "decode" else None
                for start in range(0, len(requests), size):
                    wave = requests[start : start + size]
                    last = start + size >= len(requests)  # only the last wave takes newcomers: none overtake
                    for request, result in zip(wave, self._run_wave(wave, joins if last else None)):
                        results[request.index] = result
            finally:
                self.model.train(was_training)
        return results

    # ------------------------------------------------------------ the decode loop
    @torch.inference_mode()
    def _run_wave(self, wave: list[_Request], joins=None) -> list[GenerationResult]:
        out = _Wave(wave, self.model.lm_head.weight.device, self.tokenizer)
        self._decode(out, joins)
        if self.config.logprobs == "rescore":
            self._rescore(wave, out.tokens, out.log_probs, out.produced)
        return [out.results.get(row) or self._result(out, row) for row in range(len(wave))]

    def _result(self, out: "_Wave", row: int) -> GenerationResult:
        """The finished row's result (counted in ``stats``)."""
        request, n = out.requests[row], int(out.produced[row])
        reason = ("abort" if bool(out.aborted[row]) else "stop" if bool(out.stopped[row])
                  else "context" if request.context_bound else "length")
        self.stats.finished[reason] += 1
        self.stats.generated_tokens += n
        return GenerationResult(
            prompt=request.prompt, tokens=out.tokens[row, :n].tolist(), log_probs=out.log_probs[row, :n].cpu().clone(),
            finish_reason=reason, weight_version=self.weight_version, seed=request.seed,
            matched_stop=out.texts.matched.get(row), error=request.control.reason if reason == "abort" else None,
            cached_tokens=request.cached,
        )

    def _unrun(self, request: _Request, reason: str, error: str | None = None) -> GenerationResult:
        """The result of an admitted request that ends before it runs (counted in ``stats``)."""
        self.stats.finished[reason] += 1
        return GenerationResult(request.prompt, [], torch.zeros(0), reason, self.weight_version, request.seed,
                                error=error)

    def _deliver(self, out: "_Wave", rows: torch.Tensor) -> None:
        """Rows that finished this step whose control wants its result now (``on_finish``): built and handed
        over at once, so a short request is not held until the wave's longest ends. Under ``logprobs:
        rescore`` results wait for the wave's rescoring."""
        if self.config.logprobs == "rescore":
            return
        for row in rows.tolist():
            control = out.requests[row].control
            if control is not None and control.on_finish is not None:
                out.results[row] = self._result(out, row)
                control.on_finish(out.results[row])

    def _rescore(self, wave, out_tokens, out_logps, produced):
        """Replace the policy-mode log-probs of the wave by the trainer's recompute of them."""
        rows = [r for r, request in enumerate(wave) if request.params.logprob_mode == "policy" and int(produced[r]) > 0]
        if not rows:
            return
        counts = [int(produced[r]) for r in rows]
        sequences = [list(wave[r].prompt) + out_tokens[r, :n].tolist() for r, n in zip(rows, counts)]
        scored = sequence_log_probs(self.model, sequences, counts)
        for k, (r, n) in enumerate(zip(rows, counts)):
            out_logps[r, :n] = scored.log_probs[k, :n]

    def _join(self, out: "_Wave", cache, joins, step: int, n_live: int):
        """Requests that join the running wave at ``step`` (``joins(room, fits)`` hands over up to ``room``
        of those ``fits`` accepts: a prompt no longer than the tokens cached, so that it can end where the
        wave's rows do): checked, prefilled on a cache of their own, their entries copied into the wave's
        cache, which grows when a response outlasts the wave. Returns their rows and the logits of their
        first tokens, or None."""
        length = cache.length

        def fits(prompt_len: int, max_new_tokens: int) -> bool:
            return prompt_len <= length and min(max_new_tokens, self.max_length - prompt_len) > 0

        admitted = []
        for prompt, params, control in joins(self.config.max_batch_size - n_live, fits):
            self.stats.requests += 1
            request = self._admit(0, prompt, params)
            if isinstance(request, GenerationResult) or control.cancelled:  # answered at once, never run
                control.on_finish(request if isinstance(request, GenerationResult)
                                  else self._unrun(request, "abort", control.reason))
                continue
            request.control = control
            admitted.append(request)
        if not admitted:
            return None
        longest = max(r.budget for r in admitted)
        out.grow(step + longest)  # the wave's steps, and the cache's slots, for the longest joining response
        cache.grow(length + longest)
        sub, logits, pads = self._prefill(admitted, 0)
        cache.add_rows(sub, at=length - sub.length)
        rows = out.add(admitted, pads + (length - sub.length), start=step)
        return rows, logits

    def _prefill(self, requests: list[_Request], room: int):
        """The requests' prompts prefilled, left-padded to the longest, on a new cache with ``room`` more
        slots a row: identical prompts run once, and the longest prefix of each that the prefix cache
        holds is copied in instead of recomputed. A batch runs the last T tokens of each of its rows (T
        its longest part not held); where that would rerun many held tokens, the rows with the longest
        such parts run as a batch of their own (``_run_groups``). Records each request's ``cached``
        tokens and holds the prompts' entries. Returns the cache, the logits of each row's first
        response token, and each row's left padding."""
        device, held = self.model.lm_head.weight.device, self._prefixes
        if held.max_tokens:
            distinct: dict[tuple[int, ...], int] = {}
            inverse = [distinct.setdefault(tuple(r.prompt), len(distinct)) for r in requests]
            prompts = [list(p) for p in distinct]
        else:  # no reuse of any kind: every prompt runs in full
            inverse, prompts = list(range(len(requests))), [r.prompt for r in requests]
        width = max(map(len, prompts))
        ran_for = self._prefill_shared(prompts) if held.max_tokens else {}
        hits = [held.match(p, limit=len(p) - 1) if held.max_tokens else (0, None) for p in prompts]
        order, caches, logits, reused = [], [], [], [0] * len(prompts)
        for rows in _run_groups([len(p) - n for p, (n, _) in zip(prompts, hits)]):
            cache, first, taken = self._prefill_rows([prompts[r] for r in rows], [hits[r][1] for r in rows], width, room)
            order += rows
            caches.append(cache)
            logits.append(first)
            for r, n in zip(rows, taken):
                reused[r] = max(n - ran_for.get(r, 0), 0)
        cache = caches[0]
        for other in caches[1:]:
            cache.add_rows(other, at=0)
        if held.max_tokens:
            for i, row in enumerate(order):  # the cache's row i is the prompt order[i]
                self._hold_row(cache, i, width - len(prompts[row]), prompts[row])
        ran = set()
        for request, row in zip(requests, inverse):  # a prompt's repeats computed nothing of their own
            request.cached = len(request.prompt) if row in ran else reused[row]
            ran.add(row)
        self.stats.prompt_tokens += sum(len(r.prompt) for r in requests)
        self.stats.cached_tokens += sum(r.cached for r in requests)
        slot_of = {row: i for i, row in enumerate(order)}
        index = [slot_of[row] for row in inverse]
        logits = torch.cat(logits)
        if index != list(range(len(order))):
            index = torch.tensor(index, device=device)
            cache.select(index)
            logits = logits[index]
        pads = torch.tensor([width - len(r.prompt) for r in requests], device=device)
        return cache, logits, pads

    def _prefill_shared(self, prompts: list[list[int]], overhead: int = 64) -> dict[int, int]:
        """Run once, and hold, the long prefixes that several prompts of a batch share and the prefix
        cache does not hold yet (a system prompt every RL prompt starts with, after a weight update
        emptied the cache), where that saves ``overhead`` tokens or more. Returns, for the first prompt
        of each set, the tokens run here for the set (so that they are not counted as cached)."""
        held, todo = self._prefixes, []
        for prefix, members in _shared_prefixes(prompts):
            have = held.length(prefix)
            if (len(members) - 1) * (len(prefix) - have) >= overhead:
                todo.append((prefix, members))
        if not todo:
            return {}
        prefixes = [prefix for prefix, _ in todo]
        hits = [held.match(p, limit=len(p) - 1) for p in prefixes]
        width = max(map(len, prefixes))
        cache, _, _ = self._prefill_rows(prefixes, [entries for _, entries in hits], width, 0)
        for i, prefix in enumerate(prefixes):
            self._hold_row(cache, i, width - len(prefix), prefix)
        return {members[0]: len(prefix) - n for (prefix, members), (n, _) in zip(todo, hits)}

    def _prefill_rows(self, prompts: list[list[int]], held: list, width: int, room: int):
        """One prefill batch, ``width`` wide: ``held[i]`` the prefix cache's entries for the start of
        prompt i (or None). Returns the cache, the last position's logits and the tokens taken a row."""
        model, device = self.model, self.model.lm_head.weight.device
        ids, pads, docs, positions = _left_padded(prompts, device, width)
        run = max(len(p) - (0 if e is None else e[0].shape[0]) for p, e in zip(prompts, held))
        cache = model.new_cache(len(prompts), width + room)
        taken = [0] * len(prompts)
        if run < width:  # the first width - run slots of every row come from the prefix cache
            start = width - run
            for row, entries in enumerate(held):
                taken[row] = max(start - int(pads[row]), 0)  # at most what is held: run >= len - held
                if taken[row]:
                    cache.write_row_entries(row, int(pads[row]), tuple(e[: taken[row]] for e in entries))
            if docs is not None:
                cache.docs = torch.zeros(len(prompts), cache.capacity, dtype=torch.long, device=device)
                cache.docs[:, :start] = docs[:, :start]
                docs, positions = docs[:, start:], positions[:, start:]
            cache.advance(start)
            ids = ids[:, start:]
        hidden, _ = model.hidden_states(ids, cache, positions, doc_ids=docs)
        return cache, model.lm_head(hidden[:, -1]).float(), taken

    @staticmethod
    def _watch(out: "_Wave", live, counts, done) -> torch.Tensor:
        """After a step, for each controlled live row that goes on (a row that finished has its result):
        its tokens so far (``counts`` of them) to its listener; which of them were cancelled."""
        cancelled = torch.zeros(len(live), dtype=torch.bool)
        counts = _per_row(counts, len(live))
        for i, (row, count, finished) in enumerate(zip(live.tolist(), counts, done.tolist())):
            control = out.requests[row].control
            if control is None or finished:
                continue
            if control.on_tokens is not None:
                control.on_tokens(out.tokens[row, :count].tolist())
            cancelled[i] = control.cancelled
        return cancelled.to(live.device)

    def _hold(self, out: "_Wave", cache, live: torch.Tensor, done: torch.Tensor, counts) -> None:
        """Put the sequences of the rows that finished this step into the prefix cache: each row's prompt
        and response but its last token (sampled, never run: it has no entries)."""
        if not self._prefixes.max_tokens:
            return
        counts = _per_row(counts, len(live))
        for i in done.nonzero().squeeze(-1).tolist():
            row = int(live[i])
            tokens = out.requests[row].prompt + out.tokens[row, : counts[i] - 1].tolist()
            start = int(out.pads[row])
            if cache.length - start != len(tokens):
                raise AssertionError(f"row {row}: {cache.length - start} slots cached for {len(tokens)} tokens")
            self._hold_row(cache, i, start, tokens)

    def _hold_row(self, cache, i: int, start: int, tokens: list[int]) -> None:
        """Put ``tokens``, held from slot ``start`` of the cache's row ``i``, into the prefix cache (the
        entries are read only for the tokens it does not hold yet)."""
        self._prefixes.insert(tokens, lambda a, b: cache.row_entries(i, start + a, start + b))

    def _decode_weights(self) -> DecodeWeights | None:
        """The fused decode weights of the current parameters, or None where they do not apply."""
        if not self.config.fused_decode or self.model.config.attention_bias:
            return None
        if self._fused is None:
            self._fused = DecodeWeights(self.model)
        elif self._fused.stale():
            self._fused.refresh()
        return self._fused

    def _decode(self, out: "_Wave", joins=None):
        model = self.model
        fused = self._decode_weights()
        device, B = out.device, len(out.requests)
        padded = bool((out.pads > 0).any())
        any_sampling_mode = bool(out.sampling_mode.any())
        controlled = any(r.control is not None for r in out.requests)

        cache, logits, _ = self._prefill(out.requests, out.steps)  # only the last position is sampled from
        live = torch.arange(B, device=device)  # wave rows still decoding, in cache order
        staggered = False  # some row started after step 0
        join_at = max(1, math.ceil(self.config.join_free_share * self.config.max_batch_size))  # free rows
        step = -1
        while (step := step + 1) < out.steps:  # joining requests may add steps
            if joins is not None and self.config.max_batch_size - len(live) >= join_at:
                joined = self._join(out, cache, joins, step, len(live))
                if joined is not None:  # their first tokens come from their prefill's logits
                    live, logits = torch.cat([live, joined[0]]), torch.cat([logits, joined[1]])
                    padded, controlled, any_sampling_mode = True, True, bool(out.sampling_mode.any())
                    staggered = True
            # Tokens each live row made before this step: the step itself until a row joins late.
            made = step - out.start[live] if staggered else step
            tokens, sampled_lp = sample_step(logits, out.temperature[live], out.top_k[live], out.top_p[live],
                                             out.uniforms[live, made], want_sampling_log_probs=any_sampling_mode)
            logp = gather_log_probs(logits, tokens)
            if any_sampling_mode:
                logp = torch.where(out.sampling_mode[live], sampled_lp, logp)
            out.tokens[live, made] = tokens
            out.log_probs[live, made] = logp
            counts = made + 1
            hit_stop = (tokens[:, None] == out.stop_ids[live]).any(dim=-1)
            if out.texts:  # a row that sampled a stop token has ended: its text is not read
                hit_stop |= out.texts.check(live, out.tokens, counts, skip=hit_stop)
            done = hit_stop | (out.budgets[live] <= counts)
            if controlled:
                cancelled = self._watch(out, live, counts, done)
                done |= cancelled
            if bool(done.any()):
                finished = live[done]
                self._hold(out, cache, live, done, counts)
                out.produced[finished] = counts[done] if staggered else counts
                out.stopped[finished] = hit_stop[done]
                if controlled:
                    out.aborted[finished.cpu()] = cancelled[done].cpu()
                    self._deliver(out, finished)
                keep = (~done).nonzero().squeeze(-1)
                if keep.numel() == 0:
                    break
                cache.select(keep)
                live, tokens = live[keep], tokens[keep]
            if staggered:  # slots that are padding for every live row: dropped once they are many
                unused = int(out.pads[live].min())
                if unused >= max(64, cache.length // 4):
                    cache.drop_front(unused)
                    out.pads -= unused
            pos = (cache.length - out.pads[live])[:, None] if padded else None
            if fused is not None:
                logits = fused.logits(fused.step(tokens, cache, pos))
            else:
                hidden, _ = model.hidden_states(tokens[:, None], cache, pos)
                logits = model.lm_head(hidden[:, -1]).float()
