"""The mid-training objectives as pure functions (tensors in, tensors out).

- DSA indexer, phase 1 (dense warm-up): target = the main attention's distribution over the causal
  keys, summed over heads and L1-normalised; prediction = softmax of the index scores over the same
  keys; loss = KL(target || prediction) per query.
- DSA indexer, phase 2 (sparse training): the same KL restricted to the selected keys: the target is
  the sparse attention's distribution (per-head softmax over the selected keys, summed, normalised),
  the prediction the softmax of the index scores over those keys.
- Recall: the share of the target mass on the selected keys (how much of dense attention top-k keeps).
- Per-position NLL for perplexity by position (the chunked LM loss itself is orthon.pretrain.loss).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from orthon.pretrain.loss import IGNORE_INDEX


def attention_distribution(logits: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """Per-head softmax over the visible keys, summed over heads and L1-normalised.

    logits: (B, C, H, S) scaled attention logits of C queries over S keys; visible: (B or 1, C, S) bool.
    Returns (B, C, S) fp32, zero on invisible keys, each row summing to 1 (rows need a visible key).
    """
    masked = logits.float().masked_fill(~visible[:, :, None, :], float("-inf"))
    summed = torch.softmax(masked, dim=-1).sum(dim=2)
    return summed / summed.sum(dim=-1, keepdim=True)


def indexer_kl(target: torch.Tensor, scores: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """KL(target || softmax(scores over visible keys)) per query.

    target: (B, C, S) distributions over the visible keys (zero elsewhere); scores: (B, C, S) index
    scores; visible: (B or 1, C, S) bool. Returns (B, C) fp32, differentiable in ``scores``.
    """
    log_pred = torch.log_softmax(scores.float().masked_fill(~visible, float("-inf")), dim=-1)
    log_pred = log_pred.masked_fill(~visible, 0.0)  # target is 0 there; avoid 0 * -inf
    target = target.float()
    return (torch.xlogy(target, target) - target * log_pred).sum(dim=-1)


def topk_recall(target: torch.Tensor, indices: torch.Tensor, selected_visible: torch.Tensor) -> torch.Tensor:
    """Share of each query's target mass on its selected keys.

    target: (B, C, S); indices: (B, C, k) selected key positions; selected_visible: (B, C, k) bool,
    False for selected slots that are not real keys (rows with fewer than k visible keys). -> (B, C).
    """
    return target.gather(-1, indices).masked_fill(~selected_visible, 0.0).sum(dim=-1)


@torch.no_grad()
def token_nll(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """Per-position next-token NLL (same shape as labels; 0 where ignored), chunked like
    orthon.pretrain.loss.chunked_cross_entropy. For perplexity by position."""
    flat_h, flat_y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    out = []
    for start in range(0, flat_h.shape[0], chunk):
        logits = (flat_h[start : start + chunk] @ weight.t()).float()
        out.append(F.cross_entropy(logits, flat_y[start : start + chunk], ignore_index=IGNORE_INDEX, reduction="none"))
    return torch.cat(out).view(labels.shape)
