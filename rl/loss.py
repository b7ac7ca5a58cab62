"""GRPO advantages, the IcePop policy loss, loss aggregation and OPD advantages.

Pure functions, tensors in and tensors out (the GLM-5 recipe (README, "The recipe")). Shapes:
B sequences, T response positions (padded), V vocabulary. ``loss_mask`` [B, T]
is 1 on model-generated tokens and 0 on padding, prompt and tool observations;
values at mask-0 positions are never read into the result or its gradient, so
padding may hold anything (even -inf).

The IcePop loss per token (the GLM-5 recipe (README, "The recipe")):

    rho_t  = exp(logp_train_t - logp_rollout_t)
    m_t    = 1[1/beta <= rho_t <= beta]            (on detached rho; beta = 2)
    loss_t = -m_t * min(rho_t * A, clip(rho_t, 1 - eps_low, 1 + eps_high) * A)

The band test is made on rho in float32 after exp, so a ratio that rounds to
exactly 0.5 or 2 is kept.
"""
from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F

from orthon.pretrain.logprobs import token_entropy

Tensor = torch.Tensor


def grpo_advantages(
    rewards: Tensor,
    group_size: int | None = None,
    *,
    unbiased: bool = True,
    eps: float = 1e-6,
) -> Tensor:
    """A_i = (r_i - mean_G(r)) / std_G(r) within each group of G samples of one prompt.

    rewards: [num_groups, G], or flat [num_groups * G] with ``group_size`` given (groups are
    consecutive). Returns float32 advantages of the input's shape, one per sample (the same for
    every token of it). A group whose std is <= eps (all rewards equal, or G = 1) gets A = 0: it
    carries no signal about which sample was better. ``unbiased``: std divides by G-1, else by G.
    """
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    shape = rewards.shape
    if rewards.dim() == 1:
        if group_size is None or group_size <= 0 or rewards.numel() % group_size:
            raise ValueError(f"grpo_advantages: {rewards.numel()} rewards do not split into groups of {group_size}")
        rewards = rewards.view(-1, group_size)
    elif rewards.dim() != 2:
        raise ValueError(f"grpo_advantages: rewards must be [groups, G] or flat, got shape {tuple(shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError("grpo_advantages: rewards must be finite")
    g = rewards.shape[-1]
    centered = rewards - rewards.mean(dim=-1, keepdim=True)
    if g == 1:
        return torch.zeros(shape, device=rewards.device)
    std = rewards.std(dim=-1, keepdim=True, correction=1 if unbiased else 0)
    flat = std <= eps
    adv = torch.where(flat, torch.zeros_like(centered), centered / torch.where(flat, torch.ones_like(std), std))
    return adv.view(shape)


def _per_token(advantages: Tensor, like: Tensor) -> Tensor:
    advantages = torch.as_tensor(advantages, dtype=torch.float32, device=like.device).detach()
    if advantages.dim() == 1:
        advantages = advantages[:, None]
    if advantages.shape[0] != like.shape[0]:
        raise ValueError(f"advantages: {advantages.shape[0]} rows for {like.shape[0]} sequences")
    return advantages.expand_as(like)


def _masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    return (values * mask).sum() / mask.sum().clamp(min=1)


def icepop_token_loss(
    logp_train: Tensor,
    logp_rollout: Tensor,
    advantages: Tensor,
    loss_mask: Tensor,
    *,
    beta: float = 2.0,
    eps_low: float = 0.2,
    eps_high: float = 0.28,
    keep_weight: Literal["one", "rho"] = "one",
    logp_old: Tensor | None = None,
    kl_coef: float = 0.0,
    logp_ref: Tensor | None = None,
    entropy: Tensor | None = None,
    logits: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Per-token IcePop + asymmetric-clip policy loss and its metrics.

    logp_train [B, T]: log pi_train(a_t) with gradient. logp_rollout [B, T]: the fp32 log-probs the
    engine recorded. advantages: [B] (one per sample, broadcast over tokens) or [B, T] (e.g. OPD).
    loss_mask [B, T]: 1 where the token is trained.

    keep_weight="one" (default, the GLM-5 recipe): the formula in the module docstring.
    keep_weight="rho" (peers' IcePop, not the default): the band test and the weight of a kept
    token are the mismatch ratio k_t = exp(logp_old - logp_rollout) (pop(k) = k inside the band,
    0 outside), and the clipped PPO ratio is r_t = exp(logp_train - logp_old):
    loss_t = -pop(k_t) * min(r_t * A, clip(r_t) * A). ``logp_old`` (the trainer's log-probs before
    this update) defaults to logp_train detached, so r_t = 1 on the first update of a rollout.

    kl_coef > 0 adds kl_coef * KL_k3(pi_train || pi_ref) per trained token (needs logp_ref);
    kl_coef = 0 (GLM-5) adds nothing and logp_ref is not read.

    Returns (token_loss [B, T], zero wherever loss_mask = 0 or IcePop drops the token, and
    metrics): masked_fraction (share of trained tokens IcePop dropped), logp_abs_diff (mean
    |logp_train - logp_rollout| over trained tokens), clip_fraction (share of trained tokens
    whose gradient the clip removes), kept_tokens, trained_tokens, entropy (mean over trained
    tokens) when ``entropy`` [B, T] or ``logits`` [B, T, V] is given, and kl (the mean k3 estimate over
    trained tokens) when kl_coef != 0. Metrics are detached.
    """
    if logp_train.shape != logp_rollout.shape or logp_train.shape != loss_mask.shape:
        raise ValueError(
            f"icepop_token_loss: logp_train {tuple(logp_train.shape)}, logp_rollout {tuple(logp_rollout.shape)} "
            f"and loss_mask {tuple(loss_mask.shape)} must have the same shape"
        )
    if not beta > 1.0:
        raise ValueError(f"icepop_token_loss: beta must be > 1, got {beta}")
    if keep_weight not in ("one", "rho"):
        raise ValueError(f"icepop_token_loss: keep_weight must be 'one' or 'rho', got {keep_weight!r}")
    logp_train = logp_train.float()
    logp_rollout = logp_rollout.detach().float()
    trained = loss_mask.bool()
    adv = _per_token(advantages, logp_train)
    zero = torch.zeros_like(logp_train)

    if keep_weight == "one":
        anchor = logp_rollout  # rho = pi_train / pi_rollout, both gate and PPO ratio
        gate_log = logp_train.detach() - logp_rollout
    else:
        anchor = logp_train.detach() if logp_old is None else logp_old.detach().float()
        gate_log = anchor - logp_rollout
    # where() before exp: values at untrained positions (padding, -inf) never reach exp or the gradient.
    gate = torch.exp(torch.where(trained, gate_log, zero))
    keep = trained & (gate >= 1.0 / beta) & (gate <= beta)
    ratio = torch.exp(torch.where(keep, logp_train - anchor, zero))
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1.0 - eps_low, 1.0 + eps_high) * adv)
    weight = keep.float() if keep_weight == "one" else torch.where(keep, gate, zero)
    token_loss = torch.where(keep, -weight * surrogate, zero)

    if kl_coef != 0.0:
        if logp_ref is None:
            raise ValueError("icepop_token_loss: kl_coef > 0 needs logp_ref")
        # k3 estimator of KL(pi_train || pi_ref): exp(d) - d - 1 with d = logp_ref - logp_train; >= 0.
        d = torch.where(trained, logp_ref.detach().float() - logp_train, zero)
        kl = torch.where(trained, torch.exp(d) - d - 1.0, zero)
        token_loss = token_loss + kl_coef * kl

    with torch.no_grad():
        t = trained.float()
        n_trained = t.sum()
        clipped = keep & (((adv > 0) & (ratio > 1.0 + eps_high)) | ((adv < 0) & (ratio < 1.0 - eps_low)))
        diff = torch.where(trained, (logp_train.detach() - logp_rollout).abs(), zero)
        metrics = {
            "masked_fraction": (trained & ~keep).float().sum() / n_trained.clamp(min=1),
            "logp_abs_diff": _masked_mean(diff, t),
            "clip_fraction": clipped.float().sum() / n_trained.clamp(min=1),
            "kept_tokens": keep.float().sum(),
            "trained_tokens": n_trained,
        }
        if kl_coef != 0.0:
            metrics["kl"] = _masked_mean(kl.detach(), t)
        if entropy is None and logits is not None:
            entropy = token_entropy(logits.detach())
        if entropy is not None:
            metrics["entropy"] = _masked_mean(torch.where(trained, entropy.detach().float(), zero), t)
    return token_loss, metrics


def aggregate_loss(
    token_loss: Tensor,
    loss_mask: Tensor,
    mode: Literal["token", "sequence"] = "token",
    *,
    denominator: float | None = None,
) -> Tensor:
    """Reduce a per-token loss [B, T] to a scalar.

    "token": sum over trained tokens / number of trained tokens (every token weighs the same, so
    long responses weigh more). "sequence": mean over sequences of each one's per-token mean (every
    sample weighs the same); sequences without trained tokens are left out. ``denominator``
    replaces the count (trained tokens, or sequences) so that micro-batches of one step can be
    normalised by the step's global count. IcePop-dropped tokens stay in the count: dropping a
    token removes its gradient without up-weighting the others.
    """
    if token_loss.shape != loss_mask.shape:
        raise ValueError(f"aggregate_loss: token_loss {tuple(token_loss.shape)} vs loss_mask {tuple(loss_mask.shape)}")
    mask = loss_mask.to(token_loss.dtype)
    masked = torch.where(loss_mask.bool(), token_loss, torch.zeros_like(token_loss))
    if mode == "token":
        count = mask.sum() if denominator is None else mask.new_tensor(float(denominator))
        return masked.sum() / count.clamp(min=1)
    if mode == "sequence":
        per_seq_count = mask.sum(dim=-1)
        per_seq = masked.sum(dim=-1) / per_seq_count.clamp(min=1)
        count = (per_seq_count > 0).sum().to(mask.dtype) if denominator is None else mask.new_tensor(float(denominator))
        return per_seq.sum() / count.clamp(min=1)
    raise ValueError(f"aggregate_loss: mode must be 'token' or 'sequence', got {mode!r}")


def full_vocab_kl(p_logits: Tensor, q_logits: Tensor) -> Tensor:
    """Exact KL(p || q) = sum_v p(v) (log p(v) - log q(v)) per position: [..., V] x 2 -> [...], float32.

    Terms with p(v) = 0 contribute 0 (their log is -inf and would otherwise give NaN).
    """
    if p_logits.shape != q_logits.shape:
        raise ValueError(f"full_vocab_kl: shapes {tuple(p_logits.shape)} and {tuple(q_logits.shape)} differ")
    log_p = F.log_softmax(p_logits.float(), dim=-1)
    log_q = F.log_softmax(q_logits.float(), dim=-1)
    p = log_p.exp()
    terms = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p))
    return terms.sum(dim=-1)


def opd_kl_penalty_advantages(
    advantages: Tensor | None,
    teacher_logits: Tensor,
    student_logits: Tensor,
    loss_mask: Tensor,
    *,
    coef: float = 1.0,
    direction: Literal["teacher_student", "student_teacher"] = "teacher_student",
) -> Tensor:
    """OPD form 1: A'_t = A_t - coef * KL(pi_teacher || pi_student)_t, exact over the vocabulary.

    advantages: [B] or [B, T] outcome advantages, or None for 0. teacher_logits, student_logits:
    [B, T, V] at the response positions. ``direction="student_teacher"`` uses KL(student || teacher)
    instead. Returns [B, T] float32, detached (an advantage is a constant of the policy gradient),
    0 where loss_mask = 0.
    """
    with torch.no_grad():
        if direction == "teacher_student":
            kl = full_vocab_kl(teacher_logits, student_logits)
        elif direction == "student_teacher":
            kl = full_vocab_kl(student_logits, teacher_logits)
        else:
            raise ValueError(f"opd_kl_penalty_advantages: unknown direction {direction!r}")
        if kl.shape != loss_mask.shape:
            raise ValueError(f"opd_kl_penalty_advantages: logits give {tuple(kl.shape)}, loss_mask is {tuple(loss_mask.shape)}")
        base = torch.zeros_like(kl) if advantages is None else _per_token(advantages, kl)
        return torch.where(loss_mask.bool(), base - coef * kl, torch.zeros_like(kl))


def opd_sampled_advantages(
    teacher_log_probs: Tensor,
    student_log_probs: Tensor,
    loss_mask: Tensor,
    *,
    coef: float = 1.0,
    advantages: Tensor | None = None,
) -> Tensor:
    """OPD form 2 (GLM-5): A'_t = sg[log pi_teacher(a_t|s) - log pi_student(a_t|s)] (times coef).

    Only the sampled token's log-probs [B, T] are needed. Under the policy gradient with a_t drawn
    from the student this is a reverse-KL (mode-seeking) objective. ``advantages`` ([B] or
    [B, T]) are added if given; the recipe's form 2 uses none (no outcome reward). Returns [B, T]
    float32 with no gradient, 0 where loss_mask = 0.
    """
    if teacher_log_probs.shape != student_log_probs.shape or teacher_log_probs.shape != loss_mask.shape:
        raise ValueError(
            f"opd_sampled_advantages: teacher {tuple(teacher_log_probs.shape)}, student "
            f"{tuple(student_log_probs.shape)} and loss_mask {tuple(loss_mask.shape)} must match"
        )
    with torch.no_grad():
        trained = loss_mask.bool()
        zero = torch.zeros_like(teacher_log_probs, dtype=torch.float32)
        gap = torch.where(trained, teacher_log_probs.float() - student_log_probs.float(), zero)
        out = coef * gap
        if advantages is not None:
            out = torch.where(trained, out + _per_token(advantages, out), zero)
        return out.detach()
