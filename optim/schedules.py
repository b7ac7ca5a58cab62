"""LR and batch-size schedules as pure functions of tokens consumed.

Tokens (not steps) are the clock, so a run resumed with a different
data-parallel size, or after the batch ramp changed the step size, lands on
the same LR and batch size. The GLM-5 recipe (README, "The recipe"):

- pretraining LR: linear warmup 0 -> 2e-4, cosine decay to 4e-5;
- mid-training LR: linear 4e-5 -> 1e-5 across the three stages;
- batch size: 16M -> 64M tokens over the first 500B tokens, then 64M, in
  whole (micro-batch tokens x data-parallel ranks) increments.
"""
from __future__ import annotations

import math

from orthon.optim.config import BatchRampConfig, ScheduleConfig


def _check_lrs(peak: float, floor: float) -> None:
    if peak < 0 or floor < 0:
        raise ValueError(f"learning rates must be >= 0, got peak {peak}, floor {floor}")
    if floor > peak:
        raise ValueError(f"LR schedule floor {floor} exceeds its peak {peak}")


def _decay_progress(tokens: int, warmup_tokens: int, total_tokens: int) -> float | None:
    """How far past the warmup ``tokens`` lies, in [0, 1] of the decay (1 from total_tokens on); None
    inside the warmup."""
    if tokens < 0:
        raise ValueError(f"tokens consumed must be >= 0, got {tokens}")
    if total_tokens <= warmup_tokens:
        raise ValueError(f"total_tokens {total_tokens} must exceed warmup_tokens {warmup_tokens}")
    if tokens < warmup_tokens:
        return None
    return min(1.0, (tokens - warmup_tokens) / (total_tokens - warmup_tokens))


def warmup_cosine_lr(tokens: int, peak: float, floor: float, warmup_tokens: int, total_tokens: int) -> float:
    """Linear 0 -> peak over warmup_tokens, cosine peak -> floor until total_tokens, then floor."""
    _check_lrs(peak, floor)
    progress = _decay_progress(tokens, warmup_tokens, total_tokens)
    if progress is None:
        return peak * tokens / warmup_tokens
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def linear_decay_lr(tokens: int, start: float, end: float, total_tokens: int, warmup_tokens: int = 0) -> float:
    """Optional linear warmup 0 -> start, then start -> end linearly until total_tokens, then end."""
    _check_lrs(start, end)
    progress = _decay_progress(tokens, warmup_tokens, total_tokens)
    if progress is None:
        return start * tokens / warmup_tokens
    return start + (end - start) * progress


def lr_at(cfg: ScheduleConfig, tokens: int, step: int = 0) -> float:
    """The learning rate of ``cfg`` after ``tokens`` tokens, or for 0-based optimizer step ``step``
    when the schedule counts steps (it then runs at the value for step + 1)."""
    at, warmup, total = tokens, cfg.warmup_tokens, cfg.total_tokens
    if cfg.by_steps:
        at, warmup, total = step + 1, cfg.warmup_steps, cfg.total_steps
    if cfg.kind == "warmup_cosine":
        return warmup_cosine_lr(at, cfg.peak_lr, cfg.floor_lr, warmup, total)
    if cfg.kind == "linear":
        return linear_decay_lr(at, cfg.peak_lr, cfg.floor_lr, total, warmup)
    raise ValueError(f"unknown LR schedule kind {cfg.kind!r}")


def lr_multiplier(cfg: ScheduleConfig, tokens: int, step: int = 0) -> float:
    """lr_at / peak_lr: the factor every optimizer group applies to its own peak LR."""
    return lr_at(cfg, tokens, step) / cfg.peak_lr if cfg.peak_lr > 0 else 0.0


def batch_size_tokens(tokens: int, start: int, end: int, ramp_tokens: int, increment: int) -> int:
    """Global batch in tokens after ``tokens`` consumed: start -> end linearly over ramp_tokens, then end.

    Rounded down to a whole number of increments (micro-batch tokens x data
    parallel ranks), and never below one increment. Integer arithmetic, so
    every rank and every resume computes the same value.
    """
    if increment <= 0:
        raise ValueError(f"batch increment must be > 0 tokens, got {increment}")
    if tokens < 0:
        raise ValueError(f"tokens consumed must be >= 0, got {tokens}")
    if start <= 0 or end < start:
        raise ValueError(f"batch ramp needs 0 < start <= end, got start {start}, end {end}")
    if ramp_tokens <= 0 or tokens >= ramp_tokens:
        target = end
    else:
        target = start + (end - start) * tokens // ramp_tokens
    return max(increment, target // increment * increment)


def batch_size_at(cfg: BatchRampConfig, tokens: int, micro_batch_tokens: int, dp: int) -> int:
    """batch_size_tokens for a BatchRampConfig, with increment micro_batch_tokens x dp."""
    if micro_batch_tokens <= 0 or dp <= 0:
        raise ValueError(f"micro_batch_tokens and dp must be > 0, got {micro_batch_tokens}, {dp}")
    return batch_size_tokens(tokens, cfg.start_batch_tokens, cfg.end_batch_tokens, cfg.ramp_tokens,
                             micro_batch_tokens * dp)


def micro_batches_per_rank(cfg: BatchRampConfig, tokens: int, micro_batch_tokens: int, dp: int) -> int:
    """Gradient-accumulation micro-batches each rank runs for the step that starts at ``tokens``."""
    return batch_size_at(cfg, tokens, micro_batch_tokens, dp) // (micro_batch_tokens * dp)


def tokens_after_steps(cfg: BatchRampConfig, steps: int, micro_batch_tokens: int, dp: int) -> int:
    """Tokens consumed after ``steps`` optimizer steps that follow the ramp from zero."""
    tokens = 0
    for _ in range(steps):
        tokens += batch_size_at(cfg, tokens, micro_batch_tokens, dp)
    return tokens
