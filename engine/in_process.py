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
tokens), prefilled in one forward, then decoded one token per step through the absorbed-attention
cache path (the fused runner of orthon.engine.fused_decode by default). A row leaves the batch
(``KVCache.select``) the step it finishes (or the step after its ``RequestControl`` was cancelled:
``orthon.engine.control``), so the cost follows the live rows. Bad requests (empty
prompt, token id outside the vocabulary, prompt that leaves no room in the context) come back as
"rejected" results with the reason, counted in ``stats``; the rest of the batch runs.

``update_weights`` copies new tensors (a state dict, a weights directory or file, a delta) into the
existing parameters (same storage, no re-allocation: a colocated trainer or a delta sync can rely on
the addresses) and changes ``weight_version``.
"""
from __future__ import annotations

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
from orthon.engine.fused_decode import DecodeWeights
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

    def __post_init__(self):
        if self.max_length is not None and (isinstance(self.max_length, bool) or self.max_length < 2):
            raise ConfigError(f"max_length: must be >= 2 or None, got {self.max_length!r}")
        if isinstance(self.max_batch_size, bool) or self.max_batch_size < 1:
            raise ConfigError(f"max_batch_size: must be >= 1, got {self.max_batch_size!r}")
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


class _Wave:
    """A wave's requests and what its decode writes: each row's tokens and log-probs, how many it made,
    whether a stop (token or string) or a cancel ended it, and the results already handed over."""

    def __init__(self, requests: list[_Request], device, tokenizer):
        B = len(requests)
        self.requests = requests
        self.lengths = torch.tensor([len(r.prompt) for r in requests], device=device)
        self.width = int(self.lengths.max())
        self.budgets = torch.tensor([r.budget for r in requests], device=device)
        self.steps = int(self.budgets.max())
        self.tokens = torch.zeros(B, self.steps, dtype=torch.long, device=device)
        self.log_probs = torch.zeros(B, self.steps, dtype=torch.float32, device=device)
        self.produced = torch.zeros(B, dtype=torch.long, device=device)  # tokens each row ended with
        self.stopped = torch.zeros(B, dtype=torch.bool, device=device)
        self.aborted = torch.zeros(B, dtype=torch.bool)
        self.texts = StopStringWatch([r.params.stop for r in requests], tokenizer and tokenizer.decode)
        self.results: dict[int, GenerationResult] = {}  # rows handed over as they finished


@dataclass
class EngineStats:
    requests: int = 0
    generated_tokens: int = 0
    finished: Counter = field(default_factory=Counter)  # by finish reason
    rejected: Counter = field(default_factory=Counter)  # by cause

    def as_dict(self) -> dict:
        return {"requests": self.requests, "generated_tokens": self.generated_tokens,
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
        """Drop the packed decode weights (rebuilt on the next generate). The engine keeps no KV or
        prefix cache between calls, so nothing else is held; results do not change."""
        with self._lock:
            self._fused = None

    def health(self) -> dict:
        weight = self.model.lm_head.weight
        return {"ok": True, "engine": "in_process", "weight_version": self.weight_version,
                "device": str(weight.device), "dtype": str(weight.dtype).replace("torch.", ""),
                "max_length": self.max_length, "max_batch_size": self.config.max_batch_size,
                "fused_decode": self._fused is not None, "stats": self.stats.as_dict()}

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
                 controls: Sequence[RequestControl | None] | None = None) -> list[GenerationResult]:
        """The Engine's generate; ``routing_keys`` are for routers (one engine in this process serves
        every session). ``controls``: one ``RequestControl`` or None per prompt (orthon.engine.control:
        cancel a request while it runs, watch its tokens)."""
        per = per_request_params(sampling, len(prompts))
        controls = list(controls) if controls is not None else [None] * len(prompts)
        if len(controls) != len(prompts):
            raise ValueError(f"generate: {len(controls)} controls for {len(prompts)} prompts")
        with self._lock:
            results: list[GenerationResult | None] = [None] * len(prompts)
            requests = []
            for i, (prompt, params, control) in enumerate(zip(prompts, per, controls)):
                admitted = self._admit(i, prompt, params)
                if isinstance(admitted, GenerationResult):
                    results[i] = admitted
                elif admitted.budget == 0 or (control is not None and control.cancelled):  # nothing to run
                    reason = "length" if admitted.budget == 0 else "abort"
                    self.stats.finished[reason] += 1
                    results[i] = GenerationResult(admitted.prompt, [], torch.zeros(0), reason, self.weight_version,
                                                  admitted.seed, error=control.reason if reason == "abort" else None)
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
                for start in range(0, len(requests), size):
                    wave = requests[start : start + size]
                    for request, result in zip(wave, self._run_wave(wave)):
                        results[request.index] = result
            finally:
                self.model.train(was_training)
        return results

    # ------------------------------------------------------------ the decode loop
    @torch.inference_mode()
    def _run_wave(self, wave: list[_Request]) -> list[GenerationResult]:
        out = _Wave(wave, self.model.lm_head.weight.device, self.tokenizer)
        self._decode(out)
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
        )

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

    @staticmethod
    def _watch(controls, live, out_tokens, step, done) -> torch.Tensor:
        """After a step, for each controlled live row that goes on (a row that finished has its result):
        its tokens so far to its listener; which of them were cancelled."""
        cancelled = torch.zeros(len(live), dtype=torch.bool)
        for i, (row, finished) in enumerate(zip(live.tolist(), done.tolist())):
            control = controls[row]
            if control is None or finished:
                continue
            if control.on_tokens is not None:
                control.on_tokens(out_tokens[row, : step + 1].tolist())
            cancelled[i] = control.cancelled
        return cancelled.to(live.device)

    def _decode_weights(self) -> DecodeWeights | None:
        """The fused decode weights of the current parameters, or None where they do not apply."""
        if not self.config.fused_decode or self.model.config.attention_bias:
            return None
        if self._fused is None:
            self._fused = DecodeWeights(self.model)
        elif self._fused.stale():
            self._fused.refresh()
        return self._fused

    def _decode(self, out: "_Wave"):
        model = self.model
        fused = self._decode_weights()
        wave, lengths, width, budgets, steps = out.requests, out.lengths, out.width, out.budgets, out.steps
        out_tokens, out_logps, texts = out.tokens, out.log_probs, out.texts
        device = lengths.device
        B = len(wave)
        pads = width - lengths
        ids = torch.zeros(B, width, dtype=torch.long, device=device)
        for row, request in enumerate(wave):
            ids[row, int(pads[row]):] = torch.tensor(request.prompt, device=device)
        padded = bool((pads > 0).any())
        docs = positions = None
        if padded:
            slots = torch.arange(width, device=device)
            docs = torch.where(slots[None] < pads[:, None], -1, 0)
            positions = (slots[None] - pads[:, None]).clamp(min=0)

        # Per-row sampling settings, uniforms drawn up front from each request's own generator.
        params = [r.params for r in wave]
        temperature = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=device)
        top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=device)
        top_p = torch.tensor([p.top_p for p in params], dtype=torch.float64, device=device)
        uniforms = torch.zeros(B, steps, dtype=torch.float64)
        for row, request in enumerate(wave):
            if request.seed is not None and not request.params.greedy:
                uniforms[row, : request.budget] = request_uniforms(request.seed, request.budget)
        uniforms = uniforms.to(device)
        sampling_mode = torch.tensor([p.logprob_mode == "sampling" for p in params], device=device)
        any_sampling_mode = bool(sampling_mode.any())
        stops = stop_table([r.stops for r in wave], device)
        controls = [r.control for r in wave]
        controlled = any(c is not None for c in controls)

        cache = model.new_cache(B, width + steps)
        hidden, _ = model.hidden_states(ids, cache, positions, doc_ids=docs)
        logits = model.lm_head(hidden[:, -1]).float()  # only the last position is sampled from
        live = torch.arange(B, device=device)  # wave rows still decoding, in cache order
        for step in range(steps):
            tokens, sampled_lp = sample_step(logits, temperature[live], top_k[live], top_p[live],
                                             uniforms[live, step], want_sampling_log_probs=any_sampling_mode)
            logp = gather_log_probs(logits, tokens)
            if any_sampling_mode:
                logp = torch.where(sampling_mode[live], sampled_lp, logp)
            out_tokens[live, step] = tokens
            out_logps[live, step] = logp
            hit_stop = (tokens[:, None] == stops[live]).any(dim=-1)
            if texts:  # a row that sampled a stop token has ended: its text is not read
                hit_stop |= texts.check(live, out_tokens, step, skip=hit_stop)
            done = hit_stop | (budgets[live] <= step + 1)
            if controlled:
                cancelled = self._watch(controls, live, out_tokens, step, done)
                done |= cancelled
            if bool(done.any()):
                finished = live[done]
                out.produced[finished] = step + 1
                out.stopped[finished] = hit_stop[done]
                if controlled:
                    out.aborted[finished.cpu()] = cancelled[done].cpu()
                    self._deliver(out, finished)
                keep = (~done).nonzero().squeeze(-1)
                if keep.numel() == 0:
                    break
                cache.select(keep)
                live, tokens = live[keep], tokens[keep]
            pos = (width + step - pads[live])[:, None] if padded else None
            if fused is not None:
                logits = fused.logits(fused.step(tokens, cache, pos))
            else:
                hidden, _ = model.hidden_states(tokens[:, None], cache, pos)
                logits = model.lm_head(hidden[:, -1]).float()
