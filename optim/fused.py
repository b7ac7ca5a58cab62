"""Muon's elementwise passes, each one loop over a parameter group: eager, or fused by torch.compile.

Around its Newton-Schulz GEMMs a Muon step makes these passes over every parameter:

    momentum:  B <- lerp(B, g, 1 - mu);  U <- lerp(g, B, mu) (Nesterov);  U in the Newton-Schulz dtype
    apply:     W <- W (1 - lr wd) - lr scale O

Eager torch runs them as five or six memory-bound sweeps (each op reads and writes whole tensors);
inductor fuses each pass into one sweep per tensor. On the tiny model's Muon set (6.5M elements, one
CPU thread) the eager sweeps and casts take about 20 ms of a ~95 ms step, the two fused ones about
9.5 ms (each near the memory bandwidth: the Newton-Schulz GEMMs in between evict the tensors).
Fused results differ from eager ones in the last bit (inductor's lerp and its contractions round
differently), so Muon's ``standard`` method is bit-identical to torch.optim.Muon only with
``fused=False``.

The first step of each parameter group compiles (a few seconds on CPU: a C++ compiler is needed, as
for any inductor code; triton on GPUs). Scalars that change every step (the learning rate) travel as
tensors so that no step recompiles. Where compiling fails the passes run eagerly, and the reason is
logged once.
"""
from __future__ import annotations

import logging

import torch
from torch import Tensor

log = logging.getLogger(__name__)


def momentum_updates(bufs: list[Tensor], grads: list[Tensor], momentum: float, nesterov: bool,
                     dtype: torch.dtype) -> list[Tensor]:
    """Update the momentum buffers in place; return the updates to orthogonalise, in ``dtype``."""
    torch._foreach_lerp_(bufs, grads, 1 - momentum)
    updates = torch._foreach_lerp(grads, bufs, momentum) if nesterov else bufs
    return [u.to(dtype) for u in updates]


def apply_updates(params: list[Tensor], updates: list[Tensor], decay: float, alphas: list[float]) -> None:
    """W <- W * decay + alpha * O per parameter (decay = 1 - lr wd; alpha = -lr * the block's scale)."""
    if decay != 1:
        torch._foreach_mul_(params, decay)
    by_alpha: dict[float, tuple[list[Tensor], list[Tensor]]] = {}
    for p, o, alpha in zip(params, updates, alphas):
        ps, os_ = by_alpha.setdefault(alpha, ([], []))
        ps.append(p)
        os_.append(o)
    for alpha, (ps, os_) in by_alpha.items():
        torch._foreach_add_(ps, os_, alpha=alpha)


def _fused_momentum(bufs: list[Tensor], grads: list[Tensor], momentum: float, nesterov: bool,
                    dtype: torch.dtype) -> list[Tensor]:
    updates = []
    for b, g in zip(bufs, grads):
        b.lerp_(g, 1 - momentum)
        updates.append((g.lerp(b, momentum) if nesterov else b).to(dtype))
    return updates


def _fused_apply(params: list[Tensor], updates: list[Tensor], decay: Tensor, alphas: Tensor) -> None:
    for i, (p, o) in enumerate(zip(params, updates)):
        p.mul_(decay).add_(o.to(p.dtype) * alphas[i])


class EagerPasses:
    """The passes as torch's foreach ops: torch.optim.Muon's arithmetic, to the bit."""

    momentum_updates = staticmethod(momentum_updates)
    apply_updates = staticmethod(apply_updates)


class FusedPasses:
    """The two passes, compiled on first use; eager (``momentum_updates`` / ``apply_updates``) after a
    failure to compile."""

    def __init__(self) -> None:
        self._momentum = torch.compile(_fused_momentum, dynamic=False)
        self._apply = torch.compile(_fused_apply, dynamic=False)
        self.failed: str | None = None

    def momentum_updates(self, bufs, grads, momentum, nesterov, dtype) -> list[Tensor]:
        if self.failed is None:
            try:
                return self._momentum(bufs, grads, momentum, nesterov, dtype)
            except Exception as error:  # noqa: BLE001 - any compile failure: run eagerly, say why once
                self._fail(error)
        return momentum_updates(bufs, grads, momentum, nesterov, dtype)

    def apply_updates(self, params, updates, decay: float, alphas: list[float]) -> None:
        if self.failed is None and params:
            device = params[0].device
            try:
                return self._apply(params, updates, torch.tensor(decay, device=device),
                                   torch.tensor(alphas, device=device))
            except Exception as error:  # noqa: BLE001
                self._fail(error)
        apply_updates(params, updates, decay, alphas)

    def _fail(self, error: Exception) -> None:
        self.failed = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
        log.warning("Muon fused passes: torch.compile failed (%s); running them eagerly", self.failed)
