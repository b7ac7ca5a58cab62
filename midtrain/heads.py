"""Attention-head diagnostics: does a model use its context at all?

A long-context evaluation of a model whose attention is near uniform measures nothing about length:
such a model cannot retrieve at any length, and no top-k of its attention holds most of the mass.
These pure measurements say where a model stands:

- previous-token score: the attention a head puts on position t - 1 (on held-out text). Uniform
  causal attention gives the mean of 1 / (t + 1); a previous-token head, the first half of an
  induction circuit, gives close to 1.
- induction score: on a random sequence followed by its repeat, the attention from each repeated
  token to the token after its earlier occurrence (what an induction head attends to). Uniform
  attention gives about 1 / t; an induction head close to 1.
- top-k mass: the share of each query's head-summed attention on its k heaviest keys, the best
  recall a DSA indexer of top-k can reach on this model (the "oracle" of DSA adaptation).
"""
from __future__ import annotations

import torch

from orthon.midtrain.indexer_fit import AttentionInputs, absorbed_queries
from orthon.pretrain.attention import MLAttention


@torch.no_grad()
def attention_probs(attn: MLAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(B, H, T, T) dense causal attention probabilities of one MLA layer for its input ``x``
    (after input_layernorm), in fp32."""
    q_abs, latent, _ = absorbed_queries(attn, x, cos, sin)
    logits = torch.einsum("bthd,bsd->bhts", q_abs.float(), latent.float()) * attn.scale
    T = x.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    return torch.softmax(logits.masked_fill(~causal, float("-inf")), dim=-1)


@torch.no_grad()
def layer_attention(model, ids: torch.Tensor) -> list[torch.Tensor]:
    """Per layer, (B, H, T, T) attention probabilities of ``model`` on ``ids`` (dense, causal)."""
    recorder = AttentionInputs(model)
    try:
        with recorder.recording():
            model(ids)
        records = recorder.take()
    finally:
        recorder.remove()
    layers = [m for m in model.modules() if isinstance(m, MLAttention)]
    return [attention_probs(layers[r.layer], r.x, r.cos, r.sin) for r in records]


def previous_token_score(probs: torch.Tensor) -> torch.Tensor:
    """(H,) mean attention on position t - 1 over queries t >= 1 and the batch. probs: (B, H, T, T)."""
    return probs.diagonal(offset=-1, dim1=-2, dim2=-1).mean(dim=(0, 2))


def induction_score(probs: torch.Tensor, half: int) -> torch.Tensor:
    """(H,) mean attention from each token of the repeat (after its first) to the token after its
    earlier occurrence. probs: (B, H, 2 * half, 2 * half) over a random half and its repeat."""
    queries = torch.arange(half + 1, 2 * half, device=probs.device)
    return probs[:, :, queries, queries - half + 1].mean(dim=(0, 2))


def topk_mass(probs: torch.Tensor, k: int) -> float:
    """Mean over queries with more than k visible keys of the head-summed, normalised attention's top-k
    mass. probs: (B, H, T, T) causal."""
    summed = probs.sum(dim=1) / probs.shape[1]
    T = probs.shape[-1]
    if T <= k:
        return 1.0
    return float(summed[:, k:].topk(k, dim=-1).values.sum(-1).mean())


def uniform_previous_token_score(T: int) -> float:
    """The previous-token score of uniform causal attention over T positions."""
    return sum(1.0 / (t + 1) for t in range(1, T)) / (T - 1)


def uniform_induction_score(half: int) -> float:
    """The induction score of uniform causal attention over a half and its repeat."""
    return sum(1.0 / (t + 1) for t in range(half + 1, 2 * half)) / (half - 1)
