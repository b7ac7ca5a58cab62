"""Sampling parameters and the pure functions of one sampling step: temperature, top-k, top-p,
inverse-CDF draws from per-request uniforms.

Order of the transforms (as transformers and vLLM apply them): temperature, then top-k, then top-p
on the distribution renormalised after top-k. Both filters are thresholds on values (ties at the
boundary are kept), found with torch.topk rather than a full sort of the vocabulary: sorting
64 x 4096 logits costs about as much as a decode step on a CPU. A row with temperature 0 is greedy
(argmax of the raw logits, ties to the lower token id).

Randomness: every request owns its draws. The engine gives each request a torch.Generator seeded
from its seed and takes all its uniforms up front (one per new token), so what a request samples
depends only on its seed and its logits, never on which other requests share the batch.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

import torch

from orthon.core.errors import ConfigError
from orthon.pretrain.logprobs import gather_log_probs  # the formula the trainer's recompute uses too

Tensor = torch.Tensor


@dataclass
class SamplingParams:
    """How one request is sampled."""

    max_new_tokens: int = 256
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # 1: off
    top_k: int = 0  # 0: off
    # Generation ends after any of these (the stop token is part of the response, with its log-prob).
    # None: the model's eos_token_id; () : never stop early.
    stop_token_ids: tuple[int, ...] | None = None
    # Generation also ends once the response's text contains any of these (orthon.engine.stop_strings;
    # the engine needs a tokenizer to read text). The token completing the string ends the response.
    stop: tuple[str, ...] = ()
    seed: int | None = None  # None: drawn from the engine's generator (and reported in the result)
    # "policy": log-prob of each sampled token under the unmodified policy (temperature 1, no top-k /
    # top-p), what the trainer recomputes, so IcePop's rho is 1 when weights match (the default).
    # "sampling": under the distribution actually sampled from (after temperature and filtering;
    # 0 for greedy rows). "none": the caller reads none (evaluation): the decode's policy log-probs,
    # never rescored (an engine in ``logprobs: rescore`` mode saves that forward).
    logprob_mode: Literal["policy", "sampling", "none"] = "policy"

    def __post_init__(self):
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            raise ConfigError(f"max_new_tokens: must be an int >= 0, got {self.max_new_tokens!r}")
        if not self.temperature >= 0.0:
            raise ConfigError(f"temperature: must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ConfigError(f"top_p: must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ConfigError(f"top_k: must be an int >= 0 (0 = off), got {self.top_k!r}")
        if self.stop_token_ids is not None:
            ids = tuple(self.stop_token_ids)
            if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
                raise ConfigError(f"stop_token_ids: must be non-negative ints, got {self.stop_token_ids!r}")
            self.stop_token_ids = ids
        stops = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        if not all(isinstance(t, str) and t for t in stops):
            raise ConfigError(f"stop: must be non-empty strings, got {self.stop!r}")
        self.stop = stops
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            raise ConfigError(f"seed: must be an int or None, got {self.seed!r}")
        if self.logprob_mode not in ("policy", "sampling", "none"):
            raise ConfigError(f"logprob_mode: must be 'policy', 'sampling' or 'none', got {self.logprob_mode!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def per_request_params(sampling: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    """One SamplingParams per request of an engine's ``generate(prompts, sampling)``: ``sampling`` is
    one for all (None: the defaults) or one per request. One shared SamplingParams with seed s gives
    request i the seed s + i, so the requests draw differently and reproducibly."""
    sampling = SamplingParams() if sampling is None else sampling
    if isinstance(sampling, SamplingParams):
        if sampling.seed is None:
            return [sampling] * n
        return [SamplingParams(**{**vars(sampling), "seed": sampling.seed + i}) for i in range(n)]
    out = list(sampling)
    if len(out) != n:
        raise ValueError(f"generate: {len(out)} SamplingParams for {n} prompts")
    return out


# ---------------------------------------------------------------- pure functions
def top_p_threshold(probs: Tensor, top_p: Tensor | float, first: int = 64) -> Tensor:
    """(B, 1) probability threshold of the nucleus: the smallest probability in the shortest
    largest-first prefix whose mass reaches p. Looks at the top ``first`` entries and widens (x4)
    only while some row's prefix is longer, so peaked rows never pay for a full sort."""
    B, V = probs.shape
    p = torch.as_tensor(top_p, dtype=probs.dtype, device=probs.device).reshape(-1).expand(B)
    width = min(first, V)
    while True:
        values = probs.topk(width, dim=-1).values
        above = values.cumsum(dim=-1) - values  # mass ranked strictly before each entry
        length = (above < p[:, None]).sum(dim=-1)  # >= 1: the first entry always stays
        if width == V or bool((length < width).all()):
            return values.gather(1, (length - 1)[:, None])
        width = min(width * 4, V)


def filter_logits(logits: Tensor, top_k: Tensor | int = 0, top_p: Tensor | float = 1.0) -> Tensor:
    """Top-k then top-p on (B, V) logits: filtered-out entries become -inf, the rest are unchanged.

    top_k (B,) or int: keep logits >= the k-th largest (0 = off). top_p (B,) or float: then keep the
    tokens whose probability (renormalised over what top-k kept) is at least that of the last token of
    the shortest largest-first prefix reaching mass p (1 = off). Ties at either boundary are all kept
    (as transformers' top-k keeps them): the result depends on values only, never on token order. The
    largest logit always survives."""
    B, V = logits.shape
    out = logits.clone()
    k = torch.as_tensor(top_k, device=logits.device).reshape(-1).expand(B).clamp(max=V)
    if bool((k > 0).any()):
        values = logits.topk(int(k.max()), dim=-1).values  # sorted, largest first
        kth = values.gather(1, (k - 1).clamp(min=0)[:, None])
        out.masked_fill_((logits < kth) & (k > 0)[:, None], float("-inf"))
    p = torch.as_tensor(top_p, dtype=torch.float64, device=logits.device).reshape(-1).expand(B)
    rows = (p < 1.0).nonzero().squeeze(-1)
    if rows.numel():
        kept = out.index_select(0, rows)
        probs = torch.softmax(kept.double(), dim=-1)
        out[rows] = kept.masked_fill(probs < top_p_threshold(probs, p.index_select(0, rows)), float("-inf"))
    return out


def inverse_cdf_sample(logits: Tensor, uniforms: Tensor) -> Tensor:
    """One token per row from softmax(logits), by the row's uniform u in [0, 1): the first index
    whose cumulative probability exceeds u * total. Entries at -inf (probability 0) are never picked.
    logits: (B, V); uniforms: (B,) -> (B,) int64."""
    probs = torch.softmax(logits.float(), dim=-1)  # exactly 0 at -inf
    cdf = probs.cumsum(dim=-1, dtype=torch.float64)
    target = uniforms.double().reshape(-1, 1) * cdf[:, -1:]
    idx = torch.searchsorted(cdf, target, right=True).squeeze(-1)
    # u * total < total, so idx < V; the clamp guards against round-off only.
    return idx.clamp(max=logits.shape[-1] - 1)


def sample_step(
    logits: Tensor,
    temperature: Tensor,
    top_k: Tensor,
    top_p: Tensor,
    uniforms: Tensor,
    want_sampling_log_probs: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """One sampling step for a batch of requests with per-row settings.

    logits (B, V) of the policy; temperature (B,) float (0 = greedy); top_k (B,) int (0 = off);
    top_p (B,) float (1 = off); uniforms (B,) in [0, 1) (ignored on greedy rows).
    Returns the tokens (B,) and, when asked, each token's log-prob under the distribution it was drawn
    from (0 on greedy rows).
    """
    greedy = temperature <= 0
    tokens = logits.argmax(dim=-1)
    sampling_lp = torch.zeros(logits.shape[0], device=logits.device) if want_sampling_log_probs else None
    if bool(greedy.all()):
        return tokens, sampling_lp
    rows = (~greedy).nonzero().squeeze(-1)
    t = temperature.index_select(0, rows).to(logits.device, torch.float32)
    scaled = logits.index_select(0, rows).float() / t[:, None]
    k, p = top_k.index_select(0, rows), top_p.index_select(0, rows)
    if bool(((k > 0) | (p < 1.0)).any()):
        scaled = filter_logits(scaled, k, p)
    drawn = inverse_cdf_sample(scaled, uniforms.index_select(0, rows))
    if want_sampling_log_probs:
        sampling_lp[rows] = gather_log_probs(scaled, drawn)
    tokens[rows] = drawn
    return tokens, sampling_lp


def request_uniforms(seed: int, count: int) -> Tensor:
    """The ``count`` uniforms of one request (one per new token), from its own generator."""
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(count, generator=generator, dtype=torch.float64)


def stop_table(stop_sets: Sequence[Sequence[int]], device=None) -> Tensor:
    """(B, S) int64 table of each request's stop ids, padded with -1 (matches no token)."""
    width = max((len(s) for s in stop_sets), default=0)
    table = torch.full((len(stop_sets), max(width, 1)), -1, dtype=torch.long)
    for row, ids in enumerate(stop_sets):
        if ids:
            table[row, : len(ids)] = torch.tensor(list(ids), dtype=torch.long)
    return table.to(device)
