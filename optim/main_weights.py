"""fp32 main weights for parameters kept in bf16 or fp16 (megatron-core's bf16 mode): the optimizer steps an
fp32 copy of each and writes it back rounded, as Megatron's mixed-precision optimizer does.

Stepping bf16 parameters in place loses every update smaller than half a unit in their last place: bf16
keeps 8 significant bits, so a change under 2^-9 (0.2%) of a weight rounds away. Muon's updates have an
RMS of lr x 0.2 (match_rms_adamw): 4e-5 at lr 2e-4, which is 0.2% of a weight of 0.02 (GLM-5's init
scale), so most of them would vanish. The copies cost 4 bytes a parameter beside the optimizer's own
state, as in Megatron."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

LOW_PRECISION = (torch.bfloat16, torch.float16)


def main_copies(named_parameters) -> tuple[list[tuple[str, nn.Parameter]], list[tuple[nn.Parameter, nn.Parameter]]]:
    """(name, the tensor the optimizer steps) for every parameter, an fp32 copy where the parameter is bf16
    or fp16 (with its attributes: the tensor-parallel marks an orthogonaliser reads), else the parameter;
    and the (parameter, copy) pairs."""
    named, pairs = [], []
    for name, param in named_parameters:
        if param.dtype in LOW_PRECISION:
            main = nn.Parameter(param.detach().float(), requires_grad=param.requires_grad)
            main.__dict__.update(vars(param))
            pairs.append((param, main))
            param = main
        named.append((name, param))
    return named, pairs


def _grad(param: nn.Parameter) -> Tensor | None:
    # megatron-core's DistributedDataParallel accumulates into main_grad (fp32) and leaves grad None.
    grad = getattr(param, "main_grad", None)
    return param.grad if grad is None else grad


class MainWeightsOptimizer:
    """``inner`` (built over ``main_copies``' tensors) behind the parameters of ``pairs``: each step copies
    the parameters' gradients into the fp32 copies, steps them and writes them back into the parameters.
    Everything else (set_tokens, param_groups, muon, ...) is the inner optimizer's."""

    def __init__(self, inner, pairs: list[tuple[nn.Parameter, nn.Parameter]]):
        self.inner = inner
        self.pairs = pairs

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def step(self, closure: Callable[[], Tensor] | None = None) -> Tensor | None:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with torch.no_grad():
            for param, main in self.pairs:
                grad = _grad(param)
                main.grad = None if grad is None else grad.float()
            self.inner.step()
            for param, main in self.pairs:
                param.copy_(main)
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        for param, _ in self.pairs:
            if param.grad is not None:
                if set_to_none:
                    param.grad = None
                else:
                    param.grad.zero_()
        self.inner.zero_grad(set_to_none=set_to_none)

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "main_weights": [main.detach().clone() for _, main in self.pairs]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mains = state["main_weights"]
        if len(mains) != len(self.pairs):
            raise ValueError(f"optimizer state has {len(mains)} main weights, this optimizer {len(self.pairs)}: "
                             f"built for another model?")
        self.inner.load_state_dict(state["inner"])
        with torch.no_grad():
            for (param, main), saved in zip(self.pairs, mains):
                main.copy_(saved)
                param.copy_(main)


def with_main_weights(named_parameters, build: Callable[[list[tuple[str, nn.Parameter]]], Any]):
    """``build(named)`` over fp32 copies of the low-precision parameters, wrapped to step them (the
    optimizer itself where every parameter is fp32 already)."""
    named, pairs = main_copies(named_parameters)
    inner = build(named)
    return MainWeightsOptimizer(inner, pairs) if pairs else inner
