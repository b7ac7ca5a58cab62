"""CPU kernels for the training step's elementwise work (fused_kernels.c): RMSNorm and SwiGLU, forward
and backward, and the output head's cross-entropy with its logits' gradient, one pass over their rows
each where torch runs three to seven passes over the activations.

Each function returns None where its kernel does not apply (no library, not CPU, not fp32: autocast's
bf16 takes the torch path) and the caller runs its torch ops; results equal those ops up to float
rounding (tests/test_fused_kernels.py), and no result depends on the thread count. Built like the other
kernels (orthon.core.native); ``ORTHON_FUSED_KERNELS=0`` turns them off.
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path

import torch
from torch.autograd.function import once_differentiable

from orthon.core.native import NativeLibrary

log = logging.getLogger(__name__)

NORM_BLOCK = 64  # as fused_kernels.c


def _declare(lib: ctypes.CDLL) -> None:
    P, L, F, I = ctypes.c_void_p, ctypes.c_long, ctypes.c_float, ctypes.c_int
    lib.swiglu_forward.argtypes = [P, L, P, L, P, L, L, L, I]
    lib.swiglu_backward.argtypes = [P, L, P, L, P, L, P, L, P, L, L, L, I]
    lib.rms_norm_forward.argtypes = [P, L, P, P, P, L, L, F, I]
    lib.rms_norm_backward.argtypes = [P, L, P, P, P, P, P, P, L, L, I]
    lib.cross_entropy_rows.argtypes = [P, P, P, L, L, L, I]
    lib.expert_act_backward.argtypes = [P, P, P, P, P, P, L, L, I]


native = NativeLibrary(Path(__file__).with_name("fused_kernels.c"), "ORTHON_FUSED_KERNELS", "fused elementwise kernels",
                       "RMSNorm, SwiGLU and the loss run in torch ops (same values, slower on CPU)", log, _declare,
                       openmp=True)


def _rows(t: torch.Tensor) -> int | None:
    """The row stride of t seen as (rows, t.shape[-1]) fp32 CPU rows, or None where it cannot be (not fp32
    on CPU, or rows that are not evenly spaced)."""
    if t.device.type != "cpu" or t.dtype != torch.float32 or t.dim() < 2 or t.stride(-1) != 1:
        return None
    ld = t.stride(-2)
    expected = ld
    for size, stride in zip(reversed(t.shape[:-1]), reversed(t.stride()[:-1])):
        if size > 1 and stride != expected:
            return None
        expected *= size
    return ld


def applies(*tensors: torch.Tensor) -> bool:
    return all(_rows(t) is not None for t in tensors) and native.load() is not None


# ---------------------------------------------------------------- SwiGLU
def swiglu_into(g: torch.Tensor, u: torch.Tensor, act: torch.Tensor) -> None:
    """act = silu(g) * u for 2-D fp32 row buffers (any row strides)."""
    M, n = g.shape
    native.lib.swiglu_forward(g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0), act.data_ptr(), act.stride(0),
                              M, n, torch.get_num_threads())


def swiglu_grads_into(grad: torch.Tensor, g: torch.Tensor, u: torch.Tensor, dg: torch.Tensor, du: torch.Tensor) -> None:
    """dg = grad * u * silu'(g), du = grad * silu(g), for 2-D fp32 row buffers (any row strides)."""
    M, n = g.shape
    native.lib.swiglu_backward(grad.data_ptr(), grad.stride(0), g.data_ptr(), g.stride(0), u.data_ptr(), u.stride(0),
                               dg.data_ptr(), dg.stride(0), du.data_ptr(), du.stride(0), M, n,
                               torch.get_num_threads())


def expert_act_backward_(grad_act: torch.Tensor, act: torch.Tensor, weights: torch.Tensor, h: torch.Tensor,
                         grad_h: torch.Tensor, grad_w: torch.Tensor | None) -> None:
    """One expert's rows between its two products in backward (contiguous fp32 (M, I) grad_act and act,
    (M,) weights, (M, 2I) h = [g, u] and grad_h): grad_w = rowwise grad_act . act (if given), act *= weights,
    grad_h = the SwiGLU gradient of grad_act * weights."""
    M, n = act.shape
    native.lib.expert_act_backward(grad_act.data_ptr(), act.data_ptr(), weights.data_ptr(), h.data_ptr(),
                                   grad_h.data_ptr(), None if grad_w is None else grad_w.data_ptr(), M, n,
                                   torch.get_num_threads())


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g, u):
        act = torch.empty(g.shape, dtype=g.dtype)
        swiglu_into(g.reshape(-1, g.shape[-1]), u.reshape(-1, u.shape[-1]), act.view(-1, g.shape[-1]))
        ctx.save_for_backward(g, u)
        return act

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        g, u = ctx.saved_tensors
        n = g.shape[-1]
        dg, du = torch.empty(g.shape, dtype=g.dtype), torch.empty(u.shape, dtype=u.dtype)
        swiglu_grads_into(grad.contiguous().view(-1, n), g.reshape(-1, n), u.reshape(-1, n), dg.view(-1, n),
                          du.view(-1, n))
        return dg, du


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor | None:
    """silu(g) * u, differentiable, or None where the kernel does not apply (g and u must be contiguous)."""
    if not (applies(g, u) and g.is_contiguous() and u.is_contiguous() and g.shape == u.shape):
        return None
    return _SwiGLU.apply(g, u)


# ---------------------------------------------------------------- RMSNorm
class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        rows, ld = x.numel() // x.shape[-1], _rows(x)
        y = torch.empty(x.shape, dtype=x.dtype)
        rstd = torch.empty(rows, dtype=torch.float32)
        native.lib.rms_norm_forward(x.data_ptr(), ld, weight.data_ptr(), y.data_ptr(), rstd.data_ptr(), rows,
                                    x.shape[-1], float(eps), torch.get_num_threads())
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    @once_differentiable
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        rows, K = rstd.shape[0], x.shape[-1]
        grad = grad.contiguous()
        dx = torch.empty(x.shape, dtype=x.dtype)
        dw = partial = None
        if ctx.needs_input_grad[1]:
            dw, partial = torch.empty_like(weight), torch.empty(-(-rows // NORM_BLOCK), K, dtype=torch.float32)
        native.lib.rms_norm_backward(x.data_ptr(), _rows(x), weight.data_ptr(), rstd.data_ptr(), grad.data_ptr(),
                                     dx.data_ptr(), None if dw is None else dw.data_ptr(),
                                     None if partial is None else partial.data_ptr(), rows, K, torch.get_num_threads())
        return dx, dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor | None:
    """weight * (x * rsqrt(mean(x^2) + eps)) over the last dim, differentiable in x and weight, or None where
    the kernel does not apply."""
    if not (applies(x) and weight.dtype == torch.float32 and weight.is_contiguous()):
        return None
    return _RMSNorm.apply(x, weight, eps)


# ---------------------------------------------------------------- cross-entropy
def cross_entropy_grad_(logits: torch.Tensor, labels: torch.Tensor, ignore_index: int) -> torch.Tensor | None:
    """The summed cross-entropy of fp32 logits (M, V) against labels (M,) (``ignore_index`` rows count 0),
    with the logits overwritten by its gradient, softmax - onehot (zero on ignored rows); None where the
    kernel does not apply (the logits untouched)."""
    if not (applies(logits) and logits.is_contiguous() and logits.dim() == 2):
        return None
    labels = labels.to(torch.long).contiguous()
    outside = (labels != ignore_index) & ((labels < 0) | (labels >= logits.shape[1]))
    if outside.any():  # the kernel would read past its row
        raise ValueError(f"labels: {int(labels[outside][0])} is outside the vocabulary (0..{logits.shape[1] - 1}) "
                         f"and is not the ignored label {ignore_index}")
    loss = torch.empty(logits.shape[0], dtype=torch.float32)
    native.lib.cross_entropy_rows(logits.data_ptr(), labels.data_ptr(), loss.data_ptr(), logits.shape[0], logits.shape[1],
                                  ignore_index, torch.get_num_threads())
    return loss.sum()
