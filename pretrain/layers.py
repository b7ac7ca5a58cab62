"""Small building blocks: RMSNorm, interleaved RoPE, the SwiGLU MLP."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import orthon.pretrain.fused_kernels as fused_kernels


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # fp32 on CPU: the fused kernel, with gradients or without, so that a scoring pass (no grad)
        # and the trainer's recompute (grad) give the same bits (RL's "rescore" log-probs rely on it).
        fused = fused_kernels.rms_norm(x, self.weight, self.eps)
        if fused is not None:
            return fused
        if x.dtype == self.weight.dtype == torch.float32 and not (
                torch.is_grad_enabled() and (x.requires_grad or self.weight.requires_grad)):
            # Inference in fp32 elsewhere: torch's own kernel gives the same bits in half the time of
            # the five ops below.
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return _RMSNorm.apply(x, self.weight, self.eps)


class _RMSNorm(torch.autograd.Function):
    """weight * (x * rsqrt(mean(x^2) + eps)), normalised in fp32 whatever the activation dtype and scaled
    in the input dtype (transformers' arithmetic, the same values). Written out because autograd's
    version of these five ops keeps three intermediates and runs about ten elementwise passes in
    backward; this keeps x and the per-row scale and runs five (about 1.6x faster on CPU)."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        xf = x.float()
        rstd = torch.rsqrt(xf.square().mean(-1, keepdim=True).add_(eps))
        ctx.save_for_backward(x, weight, rstd)
        return weight * (xf * rstd).to(x.dtype)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        normed = x.float() * rstd
        g = grad.float()
        grad_w = (g * normed).flatten(0, -2).sum(0).to(weight.dtype) if ctx.needs_input_grad[1] else None
        g_normed = g * weight.float()
        # d/dx of x * rstd(x): rstd * (g - normed * mean(g * normed))
        dot = (g_normed * normed).mean(-1, keepdim=True)
        grad_x = torch.addcmul(g_normed, normed, dot, value=-1).mul_(rstd).to(x.dtype)
        return grad_x, grad_w, None


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """The dtype a matmul on t runs in: autocast's for t's device when it is on, else t's own (for the
    hand-written kernels that must match what F.linear would do)."""
    device = t.device.type
    if torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return t.dtype


def rope_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))


def rope_cos_sin(positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype):
    """cos/sin of shape (B or 1, T, dim // 2) for positions (T,) or (B, T): one angle per rotated pair."""
    if positions.dim() == 1:
        positions = positions[None]
    inv_freq = rope_inv_freq(dim, theta).to(positions.device)
    angles = positions.float()[..., None] * inv_freq
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate interleaved pairs (x0, x1), (x2, x3), ... of the last dim (GLM-5 / DeepSeek layout), in place
    of each pair: (x0 cos - x1 sin, x1 cos + x0 sin, ...). Attention only takes dot products of tensors
    rotated alike, so this equals transformers' de-interleave-then-rotate-half up to the order of the
    rotated numbers.

    x: (B, T, dim) or (B, T, heads, dim); cos/sin: (B or 1, T, dim // 2).
    In fp32 / fp64 the pairs are viewed as complex numbers and multiplied by cos + i sin: one op forward
    and one backward, where the strided evens and odds cost ten (training-step time: about 2% less).
    """
    if x.dim() == 4:
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
    if _complex_viewable(x):
        return rotate(x, torch.complex(cos.to(x.dtype), sin.to(x.dtype)))
    return _rotate_real(x, cos, sin)


_COMPLEX = {torch.float32: torch.complex64, torch.float64: torch.complex128}


def rotate(x: torch.Tensor, rotation: torch.Tensor) -> torch.Tensor:
    """apply_rope with the rotation cos + i sin made once (a decode step rotates about a dozen tensors
    by the same angles); rotation: complex, broadcasting against x's pairs (..., dim // 2)."""
    if _complex_viewable(x) and rotation.dtype == _COMPLEX[x.dtype]:
        return torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * rotation).flatten(-2)
    return _rotate_real(x, rotation.real.to(x.dtype), rotation.imag.to(x.dtype))


def _rotate_real(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)


def _complex_viewable(x: torch.Tensor) -> bool:
    """Whether view_as_complex takes x's pairs as they lie (fp32/fp64, pairs adjacent, even strides and
    offset). bf16 / fp16 have no complex dtype to multiply in, so they take the real form."""
    return (x.dtype in (torch.float32, torch.float64) and x.stride(-1) == 1 and x.storage_offset() % 2 == 0
            and all(s % 2 == 0 for s in x.stride()[:-1]))


class MLP(nn.Module):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu(self.gate_proj(x), self.up_proj(x)))


def swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u: one pass forward and one backward by the fused CPU kernel where it applies."""
    fused = fused_kernels.swiglu(g, u)
    return fused if fused is not None else F.silu(g) * u
