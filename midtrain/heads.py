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

Memory: each layer is scored while the forward runs (nothing is kept but per-query values), one chunk
of queries at a time, the chunk sized so that its B x H x chunk x T probabilities fit a fixed budget.
"""
from __future__ import annotations

import torch

from orthon.midtrain.indexer_fit import AttentionInputs, LayerInput
from orthon.pretrain.attention import MLAttention, causal_mask, latent_scores

ROWS_BUDGET_BYTES = 1 << 28  # fp32 probabilities per query chunk (256 MiB)


@torch.no_grad()
def attention_rows(attn: MLAttention, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   budget_bytes: int = ROWS_BUDGET_BYTES):
    """Yields (q0, rows): rows (B, H, C, q0 + C) are the dense causal attention probabilities (fp32) of
    queries q0 .. q0 + C - 1 of one MLA layer over the keys they see, for its input ``x`` (after
    input_layernorm); C is as large as ``budget_bytes`` allows for the longest chunk."""
    q_abs, latent, _ = attn.absorbed_queries(x, cos, sin)
    B, T, H, _ = q_abs.shape
    chunk = max(1, min(T, budget_bytes // (4 * B * H * T)))
    for q0 in range(0, T, chunk):
        q1 = min(T, q0 + chunk)
        logits = latent_scores(q_abs[:, q0:q1].float(), latent[:, :q1].float(), attn.scale).transpose(1, 2)
        visible = causal_mask(torch.arange(q0, q1, device=x.device), q1)
        yield q0, torch.softmax(logits.masked_fill(~visible, float("-inf")), dim=-1)


def previous_token_probs(rows: torch.Tensor, q0: int = 0) -> torch.Tensor:
    """(B, H, n): each query t >= 1's attention on position t - 1. rows: (B, H, C, S) for queries q0.."""
    t = torch.arange(max(q0, 1), q0 + rows.shape[2], device=rows.device)
    return rows[:, :, t - q0, t - 1]


def induction_probs(rows: torch.Tensor, half: int, q0: int = 0) -> torch.Tensor:
    """(B, H, n): on a random half and its repeat, the attention from each token of the repeat (after its
    first) to the token after its earlier occurrence. rows: (B, H, C, S) for queries q0.."""
    first = max(q0, half + 1)
    t = torch.arange(first, max(first, min(q0 + rows.shape[2], 2 * half)), device=rows.device)
    return rows[:, :, t - q0, t - half + 1]


def topk_masses(rows: torch.Tensor, k: int, q0: int = 0) -> torch.Tensor:
    """(B, n): for each query with more than k visible keys, the top-k mass of the head-averaged
    attention. rows: (B, H, C, S) for queries q0.."""
    start = max(k - q0, 0)
    summed = rows[:, :, start:].mean(dim=1)
    return summed.topk(k, dim=-1).values.sum(-1) if summed.shape[1] else summed[..., 0]


def best_head(values: list[torch.Tensor]) -> float:
    """The largest per-head mean of per-query values [(B, H, n), ...] (chunks of one layer)."""
    return float(torch.cat(values, dim=-1).mean(dim=(0, 2)).max())


@torch.no_grad()
def layer_scores(model, ids: torch.Tensor, k: int | None = None, half: int | None = None,
                 budget_bytes: int = ROWS_BUDGET_BYTES) -> list[dict[str, float]]:
    """Per attention layer of ``model`` on ``ids``: the best head's previous-token score, with ``k`` the
    top-k mass, with ``half`` (ids being a random half and its repeat) the best head's induction score."""
    layers = [m for m in model.modules() if isinstance(m, MLAttention)]
    out: list[dict[str, float]] = []

    def score(r: LayerInput) -> None:
        prev, induction, mass = [], [], []
        for q0, rows in attention_rows(layers[r.layer], r.x, r.cos, r.sin, budget_bytes):
            prev.append(previous_token_probs(rows, q0))
            if half is not None:
                induction.append(induction_probs(rows, half, q0))
            if k is not None:
                mass.append(topk_masses(rows, k, q0))
        scores = {"previous_token": best_head(prev)}
        if half is not None:
            scores["induction"] = best_head(induction)
        if k is not None:
            counted = torch.cat(mass, dim=-1)
            scores["topk_mass"] = float(counted.mean()) if counted.numel() else 1.0
        out.append(scores)

    recorder = AttentionInputs(model, on_record=score)
    try:
        with recorder.recording():
            model(ids)
    finally:
        recorder.remove()
    return out


def uniform_previous_token_score(T: int) -> float:
    """The previous-token score of uniform causal attention over T positions."""
    return sum(1.0 / (t + 1) for t in range(1, T)) / (T - 1)


def uniform_induction_score(half: int) -> float:
    """The induction score of uniform causal attention over a half and its repeat."""
    return sum(1.0 / (t + 1) for t in range(half + 1, 2 * half)) / (half - 1)
