"""Building blocks as MindSpore cells, parameter names as the torch model's (``weight``, ``bias``):
Linear, Embedding, RMSNorm, LayerNorm, the SwiGLU MLP, interleaved RoPE. Parameters are created
empty (zeros); weights come from ``orthon.backends.mindspore.weights`` (a checkpoint, or the torch
model's initialisation)."""
from __future__ import annotations

import numpy as np

from orthon.backends.mindspore.runtime import ms

ops, nn, Parameter = ms.ops, ms.nn, ms.Parameter


def zeros_param(*shape: int, requires_grad: bool = True):
    return Parameter(ms.Tensor(np.zeros(shape, np.float32)), requires_grad=requires_grad)


def linear(x, weight):
    """x (..., in) @ weight (out, in)^T, as torch's F.linear."""
    y = ops.matmul(x.reshape(-1, x.shape[-1]), weight.T)
    return y.reshape(x.shape[:-1] + (weight.shape[0],))


class Linear(nn.Cell):
    def __init__(self, in_features: int, out_features: int, bias: bool = False):
        super().__init__()
        self.weight = zeros_param(out_features, in_features)
        self.bias = zeros_param(out_features) if bias else None

    def construct(self, x):
        y = linear(x, self.weight)
        return y if self.bias is None else y + self.bias


class Embedding(nn.Cell):
    def __init__(self, num: int, dim: int):
        super().__init__()
        self.weight = zeros_param(num, dim)

    def construct(self, ids):
        return ops.gather(self.weight, ids, 0)


class RMSNorm(nn.Cell):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = zeros_param(dim)
        self.eps = eps

    def construct(self, x):
        return self.weight * (x * ops.rsqrt((x * x).mean(-1, keep_dims=True) + self.eps))


class LayerNorm(nn.Cell):
    """torch.nn.LayerNorm over the last dim (biased variance), with ``weight`` and ``bias``."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = zeros_param(dim)
        self.bias = zeros_param(dim)
        self.eps = eps

    def construct(self, x):
        centred = x - x.mean(-1, keep_dims=True)
        var = (centred * centred).mean(-1, keep_dims=True)
        return centred * ops.rsqrt(var + self.eps) * self.weight + self.bias


class MLP(nn.Cell):
    """SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_proj = Linear(hidden, intermediate)
        self.up_proj = Linear(hidden, intermediate)
        self.down_proj = Linear(intermediate, hidden)

    def construct(self, x):
        return self.down_proj(ops.silu(self.gate_proj(x)) * self.up_proj(x))


def rope_cos_sin(positions: np.ndarray, dim: int, theta: float):
    """cos/sin (1, T, dim // 2) float32 of integer positions (T,): the torch model's own table
    (orthon.pretrain.layers.rope_cos_sin, a host-side constant), so both backends rotate by the same
    angles to the last bit."""
    import torch

    from orthon.pretrain.layers import rope_cos_sin as torch_rope

    cos, sin = torch_rope(torch.from_numpy(np.asarray(positions, np.int64)), dim, theta, torch.float32)
    return ms.Tensor(cos.numpy()), ms.Tensor(sin.numpy())


def apply_rope(x, cos, sin):
    """Rotate interleaved pairs of the last dim, each pair in place (orthon.pretrain.layers.apply_rope's
    layout). x: (B, T, d) or (B, T, heads, d)."""
    if x.ndim == 4:
        cos, sin = cos.expand_dims(-2), sin.expand_dims(-2)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    rotated = ops.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), -1)
    return rotated.reshape(*rotated.shape[:-2], -1)
