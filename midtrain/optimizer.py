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


def copy_training_state(src_model, src_optimizers, dst_model, dst_optimizers, log=print) -> None:
    """Weights, buffers and per-parameter optimizer state from one build of the model to another, by
    parameter name. Parameters the destination lacks (indexers of layers IndexShare turned "shared")
    are dropped and reported; a destination parameter the source lacks is an error."""
    src_state, dst_state = src_model.state_dict(), dst_model.state_dict()
    missing = sorted(set(dst_state) - set(src_state))
    if missing:
        raise ValueError(f"the source model has no {missing[0]!r} (and {len(missing) - 1} more missing)")
    dropped = sorted(set(src_state) - set(dst_state))
    if dropped:
        log(f"dropping {len(dropped)} tensors the new stage's model does not have (e.g. {dropped[0]})")
    dst_model.load_state_dict({k: src_state[k] for k in dst_state}, strict=True)

    src_names = {id(p): n for n, p in src_model.named_parameters()}
    by_name = {}
    for opt in src_optimizers:
        for p, state in opt.state.items():
            if state:
                by_name[src_names[id(p)]] = (type(opt), state)
    dst_names = {id(p): n for n, p in dst_model.named_parameters()}
    carried, untrained, other_optimizer = 0, [], []
    for opt in dst_optimizers:
        for group in opt.param_groups:
            for p in group["params"]:
                name = dst_names[id(p)]
                found = by_name.get(name)
                if found is None or found[0] is not type(opt):
                    (untrained if found is None else other_optimizer).append(name)
                    continue
                opt.state[p] = {k: v.detach().clone() if torch.is_tensor(v) else v for k, v in found[1].items()}
                carried += 1
    fresh = [f"{len(names)} {why} (e.g. {names[0]})" for names, why in
             ((untrained, "the source never trained"), (other_optimizer, "the source updated with another optimizer"))
             if names]
    log(f"carried optimizer state for {carried} of {carried + len(untrained) + len(other_optimizer)} parameters"
        + (f"; fresh state for {', '.join(fresh)}" if fresh else ""))
