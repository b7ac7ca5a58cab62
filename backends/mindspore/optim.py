"""Muon + Muon Split and AdamW for the MindSpore backend, routed by the same rule as the torch backend.

The routing is orthon.optim.routing's (``route_parameters`` over the cell's parameters and the torch
model's ``param_specs``), the LR and weight-decay scaling orthon.optim.muon's ``update_scale`` and the
schedule orthon.optim.schedules'; what is MindSpore here is the update arithmetic, which follows the
torch optimizers step for step:

    Muon (torch.optim.Muon conventions, Nesterov):  B <- mu B + (1 - mu) g;  U <- (1 - mu) g + mu B
        O <- NewtonSchulz(U) per block (Split: W_QB / W_KVB cut into one row block per head; an expert
        stack: one matrix per expert);  W <- W (1 - lr wd) - lr * 0.2 sqrt(max(rows, cols)) O
    AdamW (torch.optim.AdamW):  W <- W (1 - lr wd);  m <- lerp(m, g, 1 - b1);  v <- b2 v + (1 - b2) g^2
        W <- W - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from orthon.backends.mindspore.newton_schulz import newton_schulz
from orthon.backends.mindspore.runtime import ms
from orthon.core.errors import ConfigError
from orthon.optim.config import OptimConfig, ScheduleConfig
from orthon.optim.hybrid import route_by_config
from orthon.optim.muon import update_scale
from orthon.optim.routing import RoutingPlan
from orthon.optim.schedules import lr_multiplier

ops = ms.ops


@dataclass
class Group:
    """Parameters sharing one optimizer and its settings; ``lr`` is peak_lr x the schedule's multiplier."""

    optimizer: str  # "muon" | "adamw"
    peak_lr: float
    weight_decay: float
    split_rows: int = 1
    names: list[str] = field(default_factory=list)
    params: list = field(default_factory=list)
    lr: float = 0.0


def plan_for_cell(cell, cfg: OptimConfig) -> RoutingPlan:
    """The routing plan of a MindSpore cell under ``cfg`` (the torch backend's plan_for_model)."""
    specs = cell.param_specs()
    return route_by_config(((p.name, p) for p in cell.get_parameters() if p.name in specs), specs, cfg)


def build_groups(plan: RoutingPlan, cfg: OptimConfig, schedule: ScheduleConfig) -> list[Group]:
    """Muon groups by split, AdamW groups by decay (orthon.optim.hybrid.build_optimizer's grouping)."""
    muon_lr = schedule.peak_lr if cfg.muon_lr is None else cfg.muon_lr
    adamw_lr = schedule.peak_lr if cfg.adamw_lr is None else cfg.adamw_lr
    groups: dict[tuple, Group] = {}
    for route in plan.routes:
        if route.optimizer == "muon":
            group = groups.setdefault(("muon", route.split_rows),
                                      Group("muon", muon_lr, cfg.weight_decay, route.split_rows))
        else:
            decay = cfg.decay_norms_and_biases or route.kind not in ("norm", "bias")
            group = groups.setdefault(("adamw", decay),
                                      Group("adamw", adamw_lr, cfg.adamw_weight_decay if decay else 0.0))
        group.names.append(route.name)
        group.params.append(plan.params[route.name])
    return list(groups.values())


def _zeros_like(p):
    return ms.Tensor(np.zeros(p.shape, np.float32))


def _scalar(value: float):
    # Values that change every step enter the compiled functions as tensors (a Python float would be
    # a compile-time constant: one compilation per learning rate).
    return ms.Tensor(value, ms.float32)


# The update arithmetic, compiled once per shape (ms.jit); run op by op it would cost more in
# PyNative dispatch than in arithmetic at the tiny model's sizes.
@ms.jit
def muon_momentum(g, buf, mu: float, nesterov: bool):
    """(new buffer, the update Newton-Schulz sees): B <- B + (1 - mu)(g - B); U = g + mu (B - g)."""
    buf = buf + (1 - mu) * (g - buf)
    return buf, (g + mu * (buf - g) if nesterov else buf)


@ms.jit
def muon_apply(p, orth, decay, step):
    """W (1 - lr wd) - lr scale O, with decay = 1 - lr wd and step = lr scale."""
    return p * decay - step * orth


@ms.jit
def adamw_update(p, g, m, v, decay, step_size, bc2_sqrt, b1: float, b2: float, eps: float):
    """torch.optim.AdamW's step: (new p, new m, new v)."""
    m = m + (1 - b1) * (g - m)
    v = v * b2 + (1 - b2) * g * g
    return p * decay - step_size * m / (ops.sqrt(v) / bc2_sqrt + eps), m, v


compiled_newton_schulz = ms.jit(newton_schulz)


class HybridOptimizer:
    """Muon (+ Split) and AdamW over a cell's parameters, one schedule; ``step(grads)`` takes the
    gradients by parameter name. A parameter without a gradient (frozen: the indexers during
    pretraining) is left alone, weight decay included, as torch's optimizers skip a grad of None."""

    def __init__(self, cell, cfg: OptimConfig, schedule: ScheduleConfig | None):
        if cfg.ns_method != "standard":
            raise ConfigError(f"optim.ns_method: {cfg.ns_method!r} is not implemented on the MindSpore backend "
                              "(only standard Newton-Schulz)")
        self.cfg, self.schedule = cfg, schedule
        self.plan = plan_for_cell(cell, cfg)
        self.groups = build_groups(self.plan, cfg, schedule or ScheduleConfig())
        self.momentum: dict[str, ms.Tensor] = {}
        self.exp_avg: dict[str, ms.Tensor] = {}
        self.exp_avg_sq: dict[str, ms.Tensor] = {}
        self.steps: dict[str, int] = {}
        self.tokens_consumed = 0
        self.set_tokens(0)

    def set_tokens(self, tokens: int, step: int = 0) -> float:
        multiplier = lr_multiplier(self.schedule, tokens, step) if self.schedule is not None else 1.0
        for group in self.groups:
            group.lr = group.peak_lr * multiplier
        self.tokens_consumed = int(tokens)
        return multiplier

    def step(self, grads: dict[str, ms.Tensor]) -> None:
        muon = [g for g in self.groups if g.optimizer == "muon"]
        if muon:
            self._muon_step(muon, grads)
        for group in self.groups:
            if group.optimizer == "adamw":
                self._adamw_step(group, grads)

    # ------------------------------------------------------------ Muon
    def _muon_step(self, groups: list[Group], grads) -> None:
        cfg, mu = self.cfg, self.cfg.momentum
        work = []  # (group, param, update, block shape)
        for group in groups:
            for name, p in zip(group.names, group.params):
                g = grads.get(name)
                if g is None:
                    continue
                buf = self.momentum.get(name)
                buf, update = muon_momentum(g, _zeros_like(p) if buf is None else buf, mu, cfg.nesterov)
                self.momentum[name] = buf
                work.append((group, p, update, (p.shape[-2] // group.split_rows, p.shape[-1])))
        # One Newton-Schulz call per block shape, every block of every parameter of that shape stacked.
        by_shape: dict[tuple, list[int]] = {}
        for i, item in enumerate(work):
            by_shape.setdefault(item[3], []).append(i)
        results = [None] * len(work)
        for (rows, cols), indices in by_shape.items():
            stack = ops.cat([work[i][2].reshape(-1, rows, cols) for i in indices], 0)
            out = compiled_newton_schulz(stack, cfg.ns_steps, tuple(cfg.ns_coefficients), cfg.ns_dtype, cfg.ns_eps)
            start = 0
            for i in indices:
                n = int(np.prod(work[i][2].shape)) // (rows * cols)
                results[i] = out[start : start + n].reshape(work[i][2].shape)
                start += n
        for (group, p, _, (rows, cols)), orth in zip(work, results):
            scale = update_scale(rows, cols, "match_rms_adamw", cfg.rms_scale)
            ops.assign(p, muon_apply(p, orth, _scalar(1 - group.lr * group.weight_decay), _scalar(group.lr * scale)))

    # ------------------------------------------------------------ AdamW
    def _adamw_step(self, group: Group, grads) -> None:
        b1, b2 = self.cfg.adamw_betas
        eps, lr = self.cfg.adamw_eps, group.lr
        for name, p in zip(group.names, group.params):
            g = grads.get(name)
            if g is None:
                continue
            t = self.steps.get(name, 0) + 1
            m = self.exp_avg.get(name)
            v = self.exp_avg_sq.get(name)
            new, m, v = adamw_update(p, g, _zeros_like(p) if m is None else m, _zeros_like(p) if v is None else v,
                                     _scalar(1 - lr * group.weight_decay), _scalar(lr / (1 - b1**t)),
                                     _scalar((1 - b2**t) ** 0.5), b1, b2, eps)
            self.exp_avg[name], self.exp_avg_sq[name], self.steps[name] = m, v, t
            ops.assign(p, new)

    # ------------------------------------------------------------ state
    def state_dict(self) -> dict:
        """NumPy arrays and numbers only (what a checkpoint stores)."""
        arrays = lambda d: {k: v.asnumpy() for k, v in d.items()}  # noqa: E731
        return {"momentum": arrays(self.momentum), "exp_avg": arrays(self.exp_avg),
                "exp_avg_sq": arrays(self.exp_avg_sq), "steps": dict(self.steps),
                "tokens_consumed": self.tokens_consumed}

    def load_state_dict(self, state: dict) -> None:
        known = set(self.plan.params)
        unknown = sorted((set(state["momentum"]) | set(state["exp_avg"])) - known)
        if unknown:
            raise ValueError(f"optimizer state names parameters this model lacks: {unknown[:6]}")
        tensors = lambda d: {k: ms.Tensor(np.asarray(v, np.float32)) for k, v in d.items()}  # noqa: E731
        self.momentum, self.exp_avg = tensors(state["momentum"]), tensors(state["exp_avg"])
        self.exp_avg_sq, self.steps = tensors(state["exp_avg_sq"]), {k: int(v) for k, v in state["steps"].items()}
        self.tokens_consumed = int(state.get("tokens_consumed", 0))
