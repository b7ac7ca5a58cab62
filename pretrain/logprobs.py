"""Log-probs of given tokens under the model: the one scoring function of generated responses.

``sequence_log_probs`` runs one full forward of orthon's model over prompt + response (right-padded
batch, positions from 0), then ``gather_log_probs`` on the response positions only. The engine's
"rescore" mode (orthon.engine.in_process) and the RL trainer's recompute (orthon.rl.logprobs) both
call it, and the engine records its decode-time log-probs with the same ``gather_log_probs``, so on
the same weights rollout and trainer agree to float32 round-off (exactly, with "rescore").
Gradients flow (the trainer's logp_train); wrap in torch.no_grad() for a no-gradient recompute.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F

from orthon.pretrain.model import GLMForCausalLM


def gather_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log softmax(logits)[token] in float32. logits: (..., V); tokens: (...) -> (...).

    The one formula the engine (at generation) and the trainer (recompute) both use.
    """
    logits = logits.float()
    picked = logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the next-token distribution at every position: [..., V] -> [...], in float32."""
    logp = F.log_softmax(logits.float(), dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)


@dataclass
class ResponseLogProbs:
    log_probs: torch.Tensor  # (B, R) fp32, log pi(token) per response position; 0 past each response
    mask: torch.Tensor  # (B, R) bool, True on the positions of a response token
    entropy: torch.Tensor | None = None  # (B, R) fp32 entropy of the next-token distribution, when asked
    logits: torch.Tensor | None = None  # (B, R, V) the logits each response token was predicted from, when asked


def response_positions(prompt_lengths: torch.Tensor, response_lengths: torch.Tensor):
    """Where each response token is predicted from: (B, R) hidden-state index (prompt_length - 1 + j,
    clamped into the sequence on padding) and the (B, R) mask of real response positions."""
    R = int(response_lengths.max()) if response_lengths.numel() else 0
    j = torch.arange(R, device=prompt_lengths.device)
    mask = j[None] < response_lengths[:, None]
    index = prompt_lengths[:, None] - 1 + j[None]
    total = prompt_lengths + response_lengths
    return torch.minimum(index, (total - 1)[:, None]).clamp(min=0), mask


def sequence_log_probs(
    model: GLMForCausalLM,
    sequences: Sequence[Sequence[int]],
    response_lengths: Sequence[int],
    with_entropy: bool = False,
    pad_id: int = 0,
    with_logits: bool = False,
) -> ResponseLogProbs:
    """Log-probs of the last ``response_lengths[b]`` tokens of each ``sequences[b]`` (prompt +
    response token ids) under ``model``, batched with right padding. Every prompt must be non-empty
    (the first response token is predicted from the last prompt token)."""
    if len(sequences) != len(response_lengths):
        raise ValueError(f"sequence_log_probs: {len(sequences)} sequences, {len(response_lengths)} response lengths")
    device = next(model.parameters()).device
    totals = torch.tensor([len(s) for s in sequences], dtype=torch.long)
    responses = torch.tensor(list(response_lengths), dtype=torch.long)
    for b, (total, n) in enumerate(zip(totals.tolist(), responses.tolist())):
        if not 0 <= n < total:
            raise ValueError(f"sequence_log_probs: sequence {b} has {total} tokens and response length {n}; "
                             "a response needs a non-empty prompt before it")
    B = len(sequences)
    L = int(totals.max()) if B else 0
    ids = torch.full((B, max(L, 1)), pad_id, dtype=torch.long)
    for b, seq in enumerate(sequences):
        ids[b, : len(seq)] = torch.as_tensor(list(seq), dtype=torch.long)
    ids = ids.to(device)
    index, mask = response_positions((totals - responses).to(device), responses.to(device))
    R = mask.shape[1]
    if R == 0:
        empty = torch.zeros(B, 0, device=device)
        return ResponseLogProbs(empty, mask, empty.clone() if with_entropy else None)
    # Right padding never reaches a real position (causal attention), so no document ids are needed.
    # Through forward (not hidden_states), so that a DDP / FSDP2 wrapper sees the call.
    logits = model(ids, logits_at=index).logits
    targets = ids.gather(1, torch.minimum(index + 1, (totals.to(device) - 1)[:, None]))
    log_probs = gather_log_probs(logits, targets).masked_fill(~mask, 0.0)
    entropy = token_entropy(logits).masked_fill(~mask, 0.0) if with_entropy else None
    return ResponseLogProbs(log_probs, mask, entropy, logits if with_logits else None)
