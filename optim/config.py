"""Typed configs of the optimizer, the LR schedule and the batch-size ramp.

Defaults are the numbers of the GLM-5 recipe (README, "The recipe"). Values the recipe
does not give (AdamW's betas and eps, the warmup length) are marked as
orthon's choice where they are set.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from orthon.core.errors import ConfigError
from orthon.optim.gram_newton_schulz import GRAM_DTYPE_NAMES, NS_METHODS
from orthon.optim.newton_schulz import DEFAULT_COEFFICIENTS, DEFAULT_EPS, DEFAULT_STEPS

# "16M" and "64M" tokens: 4096 and 16384 sequences of the 4K pretraining context.
MIB = 2**20


@dataclass
class OptimConfig:
    """Muon + Muon Split for hidden matrices, AdamW for the rest (or AdamW for all).

    muon_lr / adamw_lr: peak learning rates; None takes the schedule's peak
    (GLM-5: 2e-4 for both). The schedule scales both by the same multiplier.
    """

    algorithm: Literal["muon", "adamw"] = "muon"  # "adamw": everything on AdamW (ablation baseline)
    muon_lr: float | None = None
    adamw_lr: float | None = None
    # Muon (GLM-4.5 hyperparameters)
    momentum: float = 0.95
    nesterov: bool = True
    ns_steps: int = DEFAULT_STEPS
    ns_coefficients: tuple[float, float, float] = DEFAULT_COEFFICIENTS
    ns_eps: float = DEFAULT_EPS
    ns_dtype: Literal["bf16", "fp32"] = "bf16"
    # "gram": Gram Newton-Schulz where a block's aspect ratio makes it cheaper (standard elsewhere),
    # in gram_dtype ("auto": fp16 on GPUs, bf16 on CPUs with a native bf16 GEMM, fp32 otherwise).
    ns_method: Literal["standard", "gram"] = "standard"
    gram_dtype: Literal["auto", "fp16", "bf16", "fp32"] = "auto"
    bf16_matmul: Literal["auto", "native", "emulated"] = "auto"
    # Fused elementwise passes: Muon's momentum and update each compiled into one sweep (torch.compile;
    # the first step compiles, a few seconds) and AdamW's fused kernel. 10-20% off a Muon step of the
    # tiny model on CPU; results then differ from torch.optim.Muon's / AdamW's foreach ones in the last
    # bit (see orthon.optim.fused).
    fused: bool = False
    rms_scale: float = 0.2
    weight_decay: float = 0.1
    # Muon Split and routing
    muon_split: bool = True
    head_to_muon: bool = False
    extra_splits: dict[str, int] = field(default_factory=dict)
    # AdamW (not given by the recipe; orthon's choice, the usual LLM values)
    adamw_betas: tuple[float, float] = (0.9, 0.95)
    adamw_eps: float = 1e-8
    adamw_weight_decay: float = 0.1
    decay_norms_and_biases: bool = False
    # Data parallelism: share Newton-Schulz among ranks when world size > 1
    distributed_muon: bool = True

    def __post_init__(self) -> None:
        for name in ("muon_lr", "adamw_lr"):
            value = getattr(self, name)
            if value is not None and value < 0:
                raise ConfigError(f"{name}: must be >= 0, got {value}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"momentum: must be in [0, 1), got {self.momentum}")
        if not 0 <= self.ns_steps < 100:
            raise ConfigError(f"ns_steps: must be in [0, 100), got {self.ns_steps}")
        for name, allowed in (("ns_method", NS_METHODS), ("gram_dtype", GRAM_DTYPE_NAMES)):
            if getattr(self, name) not in allowed:
                raise ConfigError(f"{name}: must be one of {list(allowed)}, got {getattr(self, name)!r}")
        if len(self.ns_coefficients) != 3:
            raise ConfigError(f"ns_coefficients: need 3 numbers (a, b, c), got {list(self.ns_coefficients)}")
        self.ns_coefficients = tuple(float(x) for x in self.ns_coefficients)
        if len(self.adamw_betas) != 2 or not all(0 <= b < 1 for b in self.adamw_betas):
            raise ConfigError(f"adamw_betas: need two numbers in [0, 1), got {list(self.adamw_betas)}")
        self.adamw_betas = tuple(float(b) for b in self.adamw_betas)
        for name in ("rms_scale", "ns_eps", "adamw_eps"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"{name}: must be > 0, got {getattr(self, name)}")
        for name in ("weight_decay", "adamw_weight_decay"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}: must be >= 0, got {getattr(self, name)}")
        for pattern, blocks in self.extra_splits.items():
            if blocks < 1:
                raise ConfigError(f"extra_splits.{pattern}: must be a positive integer, got {blocks}")


@dataclass
class ScheduleConfig:
    """LR schedule over tokens consumed.

    warmup_cosine (main pretraining): linear 0 -> peak_lr over warmup_tokens,
    then cosine to floor_lr at total_tokens, floor_lr after.
    linear (mid-training): peak_lr -> floor_lr linearly over total_tokens
    (after warmup_tokens of linear warmup if any), floor_lr after.
    total_steps > 0 counts optimizer steps instead of tokens (warmup_steps, total_steps): RL, whose
    steps consume however many tokens the rollouts produced. Step s (0-based) runs at the schedule's
    value for s + 1, so a warmup reaches peak_lr on step warmup_steps - 1 and the decay ends on the
    last step.
    """

    kind: Literal["warmup_cosine", "linear"] = "warmup_cosine"
    peak_lr: float = 2e-4
    floor_lr: float = 4e-5
    # Not given by the recipe; orthon's choice: 2000 steps of the initial 16M-token batch.
    warmup_tokens: int = 2000 * 16 * MIB
    total_tokens: int = 27 * 10**12
    warmup_steps: int = 0
    total_steps: int = 0  # > 0: the schedule counts optimizer steps, not tokens

    @property
    def by_steps(self) -> bool:
        return self.total_steps > 0

    def __post_init__(self) -> None:
        if self.warmup_steps < 0 or self.total_steps < 0:
            raise ConfigError(f"warmup_steps, total_steps: must be >= 0, got {self.warmup_steps}, {self.total_steps}")
        if self.total_steps and self.warmup_steps >= self.total_steps:
            raise ConfigError(f"warmup_steps: {self.warmup_steps} needs total_steps above it, got {self.total_steps}")
        if self.peak_lr < 0:
            raise ConfigError(f"peak_lr: must be >= 0, got {self.peak_lr}")
        if self.floor_lr < 0:
            raise ConfigError(f"floor_lr: must be >= 0, got {self.floor_lr}")
        if self.floor_lr > self.peak_lr:
            raise ConfigError(f"floor_lr: {self.floor_lr} exceeds peak_lr {self.peak_lr}")
        if self.warmup_tokens < 0:
            raise ConfigError(f"warmup_tokens: must be >= 0, got {self.warmup_tokens}")
        if self.total_tokens <= self.warmup_tokens:
            raise ConfigError(f"total_tokens: {self.total_tokens} must exceed warmup_tokens {self.warmup_tokens}")


def midtrain_schedule() -> ScheduleConfig:
    """GLM-5's mid-training LR: one linear decay 4e-5 -> 1e-5 across the three stages (1T + 500B + 50B tokens)."""
    return ScheduleConfig(kind="linear", peak_lr=4e-5, floor_lr=1e-5, warmup_tokens=0,
                          total_tokens=1_000 * 10**9 + 500 * 10**9 + 50 * 10**9)


@dataclass
class BatchRampConfig:
    """Global batch size in tokens: start -> end linearly over ramp_tokens consumed, then end.

    The batch is rounded down to whole (micro-batch tokens x data-parallel
    ranks) increments, known only at run time (see schedules.batch_size_tokens).
    """

    start_batch_tokens: int = 16 * MIB
    end_batch_tokens: int = 64 * MIB
    ramp_tokens: int = 500 * 10**9

    def __post_init__(self) -> None:
        if self.start_batch_tokens <= 0:
            raise ConfigError(f"start_batch_tokens: must be > 0, got {self.start_batch_tokens}")
        if self.end_batch_tokens < self.start_batch_tokens:
            raise ConfigError(
                f"end_batch_tokens: {self.end_batch_tokens} is below start_batch_tokens {self.start_batch_tokens}"
            )
        if self.ramp_tokens < 0:
            raise ConfigError(f"ramp_tokens: must be >= 0, got {self.ramp_tokens}")
