"""Mid-training's optimizers: the pretraining routing (Muon + Muon Split, AdamW), split in two.

The indexers learn from their own KL and the rest of the model from the LM loss; the two get separate
hybrid optimizers so phase 1 can step the indexers alone (at their own LR) while the main model's
optimizer state waits untouched. Every parameter has optimizer state from the start (zeros, exactly
what a first step would create), so checkpoints always hold the same keys whatever the phase.
"""
from __future__ import annotations

import torch

from orthon.optim.hybrid import HybridOptimizer, build_optimizer, route_by_config

INDEXER_MARK = ".indexer."


def is_indexer_param(name: str) -> bool:
    return INDEXER_MARK in name


def _plan(model, cfg, keep):
    named = [(n, p) for n, p in model.named_parameters() if keep(n)]
    specs = {n: s for n, s in model.param_specs().items() if keep(n)}
    return route_by_config(named, specs, cfg)


def fill_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the state a first step would (zeros) for every parameter that has none."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if optimizer.state.get(p):
                continue
            if isinstance(optimizer, torch.optim.AdamW):
                state = {"step": torch.tensor(0.0), "exp_avg": torch.zeros_like(p), "exp_avg_sq": torch.zeros_like(p)}
                if group.get("amsgrad"):
                    state["max_exp_avg_sq"] = torch.zeros_like(p)
            else:  # Muon
                state = {"momentum_buffer": torch.zeros_like(p)}
            optimizer.state[p] = state


class StageOptimizer:
    """``main`` (everything but the indexers) and ``indexer`` (may be None when the model has none).
    ``phase`` (set by the stage's step plug-in) says which part steps."""

    def __init__(self, model, cfg, schedule):
        self.main = build_optimizer(_plan(model, cfg, lambda n: not is_indexer_param(n)), cfg, schedule)
        has_indexers = any(is_indexer_param(n) for n, _ in model.named_parameters())
        self.indexer = build_optimizer(_plan(model, cfg, is_indexer_param), cfg, schedule) if has_indexers else None
        for opt in self.optimizers:
            fill_state(opt)
        self.phase = "dense"

    @property
    def parts(self) -> list[HybridOptimizer]:
        return [o for o in (self.main, self.indexer) if o is not None]

    @property
    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The underlying torch optimizers, in a fixed order (for checkpoints)."""
        return [opt for part in self.parts for opt in part.optimizers]

    def set_tokens(self, tokens: int, step: int = 0) -> float:
        """Both parts follow the stage's schedule (see set_indexer_lr for phase 1's own LR)."""
        multipliers = [part.set_tokens(tokens, step) for part in self.parts]
        return multipliers[0]

    def set_indexer_lr(self, lr: float) -> None:
        if self.indexer is not None:
            for group in self.indexer.param_groups:
                group["lr"] = lr

    @property
    def indexer_lr(self) -> float | None:
        return self.indexer.param_groups[0]["lr"] if self.indexer is not None else None

    def step(self) -> None:
        """dense: the main model; indexer_only: the indexers; sparse: both."""
        if self.phase in ("dense", "sparse"):
            self.main.step()
        if self.phase in ("indexer_only", "sparse") and self.indexer is not None:
            self.indexer.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for part in self.parts:
            part.zero_grad(set_to_none=set_to_none)
