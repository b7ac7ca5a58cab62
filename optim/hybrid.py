"""One optimizer object over the Muon and AdamW groups, driven by one LR schedule.

Each group keeps its own peak LR (``peak_lr``); the schedule gives one
multiplier per token count and every group's LR becomes peak_lr x
multiplier, so Muon and AdamW decay together. ``state_dict`` holds both
optimizers' states and the token clock, and ``load_state_dict`` of a fresh
object built the same way continues bit-for-bit.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from orthon.optim.config import OptimConfig, ScheduleConfig
from orthon.optim.muon import Muon
from orthon.optim.routing import RoutingPlan, route_parameters
from orthon.optim.schedules import lr_multiplier


class HybridOptimizer:
    """Muon (may be None) + AdamW (may be None) behind step / zero_grad / state_dict."""

    def __init__(self, muon: Muon | None, adamw: torch.optim.Optimizer | None, schedule: ScheduleConfig | None = None):
        if muon is None and adamw is None:
            raise ValueError("HybridOptimizer needs at least one of muon, adamw")
        self.muon = muon
        self.adamw = adamw
        self.schedule = schedule
        self.tokens_consumed = 0
        for group in self.param_groups:
            group.setdefault("peak_lr", group["lr"])

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The underlying optimizers (e.g. for torch.distributed.checkpoint's optimizer state helpers)."""
        return [opt for opt in (self.muon, self.adamw) if opt is not None]

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [group for opt in self.optimizers for group in opt.param_groups]

    def set_tokens(self, tokens: int, step: int = 0) -> float:
        """Set every group's LR for ``tokens`` consumed (or 0-based ``step``, for a schedule that counts
        steps); returns the schedule multiplier."""
        multiplier = lr_multiplier(self.schedule, tokens, step) if self.schedule is not None else 1.0
        for group in self.param_groups:
            group["lr"] = group["peak_lr"] * multiplier
        self.tokens_consumed = int(tokens)
        return multiplier

    def step(self, closure: Callable[[], torch.Tensor] | None = None) -> torch.Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for opt in self.optimizers:
            opt.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {
            "muon": self.muon.state_dict() if self.muon is not None else None,
            "adamw": self.adamw.state_dict() if self.adamw is not None else None,
            "tokens_consumed": self.tokens_consumed,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for key, opt in (("muon", self.muon), ("adamw", self.adamw)):
            if (state.get(key) is None) != (opt is None):
                raise ValueError(
                    f"optimizer state has {'no ' if state.get(key) is None else ''}{key} part, "
                    f"this optimizer has {'none' if opt is None else 'one'}: built from a different routing?"
                )
            if opt is not None:
                opt.load_state_dict(state[key])
        self.tokens_consumed = int(state.get("tokens_consumed", 0))


def build_optimizer(
    plan: RoutingPlan,
    cfg: OptimConfig,
    schedule: ScheduleConfig,
    orthogonaliser: Callable | None = None,
) -> HybridOptimizer:
    """The HybridOptimizer for a routing plan: Muon groups by split, AdamW groups by decay.

    Its LRs start at the schedule's value for 0 tokens (0 under a warmup): call ``set_tokens`` with
    the tokens consumed before each step, as the trainers do, or the steps change nothing.

    ``orthogonaliser`` defaults to the distributed one when torch.distributed
    is initialised with more than one rank and ``cfg.distributed_muon``.
    """
    muon_lr = schedule.peak_lr if cfg.muon_lr is None else cfg.muon_lr
    adamw_lr = schedule.peak_lr if cfg.adamw_lr is None else cfg.adamw_lr

    muon_groups: dict[int, dict[str, Any]] = {}
    adamw_groups: dict[bool, dict[str, Any]] = {}
    for route in plan.routes:
        param = plan.params[route.name]
        if route.optimizer == "muon":
            group = muon_groups.setdefault(route.split_rows, {
                "params": [], "param_names": [], "split_rows": route.split_rows, "lr": muon_lr, "peak_lr": muon_lr,
            })
        else:
            decay = cfg.decay_norms_and_biases or route.kind not in ("norm", "bias")
            group = adamw_groups.setdefault(decay, {
                "params": [], "param_names": [], "lr": adamw_lr, "peak_lr": adamw_lr,
                "weight_decay": cfg.adamw_weight_decay if decay else 0.0,
            })
        group["params"].append(param)
        group["param_names"].append(route.name)

    muon = None
    if muon_groups:
        if orthogonaliser is None:
            orthogonaliser = _default_orthogonaliser(cfg, [p for g in muon_groups.values() for p in g["params"]])
        muon = Muon(
            list(muon_groups.values()),
            lr=muon_lr,
            weight_decay=cfg.weight_decay,
            momentum=cfg.momentum,
            nesterov=cfg.nesterov,
            ns_steps=cfg.ns_steps,
            ns_coefficients=cfg.ns_coefficients,
            eps=cfg.ns_eps,
            ns_dtype=cfg.ns_dtype,
            ns_method=cfg.ns_method,
            gram_dtype=cfg.gram_dtype,
            rms_scale=cfg.rms_scale,
            bf16_matmul=cfg.bf16_matmul,
            fused=cfg.fused,
            orthogonaliser=orthogonaliser,
        )
    adamw = None
    if adamw_groups:
        adamw = torch.optim.AdamW(
            list(adamw_groups.values()), lr=adamw_lr, betas=cfg.adamw_betas, eps=cfg.adamw_eps,
            weight_decay=cfg.adamw_weight_decay, fused=cfg.fused or None,
        )
    optimizer = HybridOptimizer(muon, adamw, schedule)
    optimizer.set_tokens(0)
    return optimizer


def build_for_model(model: nn.Module, cfg: OptimConfig, schedule: ScheduleConfig, **kwargs: Any) -> HybridOptimizer:
    """Route ``model``'s parameters by its ``param_specs()`` and build the HybridOptimizer."""
    return build_optimizer(plan_for_model(model, cfg), cfg, schedule, **kwargs)


def plan_for_model(model: nn.Module, cfg: OptimConfig) -> RoutingPlan:
    """The routing plan of ``model`` (which must provide ``param_specs()``) under ``cfg``."""
    return route_by_config(model.named_parameters(), model.param_specs(), cfg)


def route_by_config(named_parameters, specs, cfg: OptimConfig) -> RoutingPlan:
    """``route_parameters`` with ``cfg``'s routing options: every backend's plan goes through here."""
    return route_parameters(named_parameters, specs, head_to_muon=cfg.head_to_muon, muon_split=cfg.muon_split,
                            extra_splits=cfg.extra_splits, adamw_only=cfg.algorithm == "adamw")


def _default_orthogonaliser(cfg: OptimConfig, params) -> Callable | None:
    import torch.distributed as dist

    if cfg.distributed_muon and dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        from orthon.optim.distributed import DistributedOrthogonaliser, hybrid_shard_group

        return DistributedOrthogonaliser(hybrid_shard_group(params))
    return None
