"""orthon.optim: Muon + Muon Split, parameter routing, the hybrid optimizer, schedules, distributed Muon."""
from orthon.optim.config import BatchRampConfig, OptimConfig, ScheduleConfig, midtrain_schedule
from orthon.optim.hybrid import HybridOptimizer, build_for_model, build_optimizer, plan_for_model
from orthon.optim.muon import Muon, update_scale
from orthon.optim.newton_schulz import newton_schulz
from orthon.optim.routing import ParamRoute, RoutingError, RoutingPlan, format_plan, route_parameters
from orthon.optim.schedules import (
    batch_size_at,
    batch_size_tokens,
    linear_decay_lr,
    lr_at,
    lr_multiplier,
    micro_batches_per_rank,
    warmup_cosine_lr,
)

__all__ = [
    "BatchRampConfig", "OptimConfig", "ScheduleConfig", "midtrain_schedule",
    "HybridOptimizer", "build_for_model", "build_optimizer", "plan_for_model",
    "Muon", "update_scale", "newton_schulz",
    "ParamRoute", "RoutingError", "RoutingPlan", "format_plan", "route_parameters",
    "batch_size_at", "batch_size_tokens", "linear_decay_lr", "lr_at", "lr_multiplier",
    "micro_batches_per_rank", "warmup_cosine_lr",
]
