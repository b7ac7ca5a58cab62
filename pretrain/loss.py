"""The LM loss: next-token cross-entropy, optionally over chunks of positions so that neither forward
nor backward holds the full (positions x vocab) logits (long-context training)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from orthon.data.loader import IGNORE_INDEX


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
    """Next-token cross-entropy in fp32 of (..., V) logits against (...) labels (-100 ignored)."""
    return F.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), ignore_index=IGNORE_INDEX,
                           reduction=reduction)


def _chunk_ce(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return cross_entropy(hidden @ weight.t(), labels, "sum")


def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, chunk: int) -> torch.Tensor:
    """Sum of next-token cross-entropies of ``hidden @ weight.T`` against ``labels`` (-100 ignored).

    hidden: (..., D) final hidden states; weight: (V, D) output head; labels: (...) targets. Positions
    are processed ``chunk`` at a time; each chunk is checkpointed (its logits recomputed in backward),
    so at most chunk x V logits exist at once. Equals F.cross_entropy(hidden @ weight.T, labels,
    reduction="sum") in value and gradient.
    """
    if chunk < 1:
        raise ValueError(f"chunk: must be positive, got {chunk}")
    flat_h, flat_y = hidden.reshape(-1, hidden.shape[-1]), labels.reshape(-1)
    total = hidden.new_zeros((), dtype=torch.float32)
    need_grad = torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad)
    for start in range(0, flat_h.shape[0], chunk):
        h, y = flat_h[start : start + chunk], flat_y[start : start + chunk]
        if need_grad:
            total = total + torch.utils.checkpoint.checkpoint(_chunk_ce, h, weight, y, use_reentrant=False)
        else:
            total = total + _chunk_ce(h, weight, y)
    return total


