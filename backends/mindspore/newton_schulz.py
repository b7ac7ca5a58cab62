"""Newton-Schulz orthogonalisation in MindSpore: orthon.optim.newton_schulz's iteration, arithmetic and
bf16 rounding points, so Muon's updates agree across backends.

    X <- a X + b (X X^T) X + c (X X^T)^2 X      on the Frobenius-normalised (wide) matrix

In "bf16" the products are computed in fp32 and each result rounded to bf16, what a bf16 GEMM with
fp32 accumulation stores (the torch side's emulated path; MindSpore's CPU MatMul has no bf16 kernel,
and on Ascend the cube units accumulate bf16 products in fp32 the same way)."""
from __future__ import annotations

from orthon.backends.mindspore.runtime import ms
from orthon.optim.newton_schulz import DEFAULT_COEFFICIENTS, DEFAULT_EPS, DEFAULT_STEPS

ops = ms.ops


def round_bf16(x):
    """x (fp32) rounded to bf16 precision, kept in fp32."""
    return x.astype(ms.bfloat16).astype(ms.float32)


def newton_schulz(matrices, steps: int = DEFAULT_STEPS, coefficients=DEFAULT_COEFFICIENTS, dtype: str = "bf16",
                  eps: float = DEFAULT_EPS):
    """Orthogonalise each matrix of ``matrices`` (..., rows, cols); fp32 result of the same shape
    (bf16-valued when dtype is "bf16")."""
    if dtype not in ("bf16", "fp32"):
        raise ValueError(f"Newton-Schulz dtype must be 'bf16' or 'fp32', got {dtype!r}")
    a, b, c = (float(v) for v in coefficients)
    rnd = round_bf16 if dtype == "bf16" else (lambda t: t)
    shape = matrices.shape
    rows, cols = shape[-2], shape[-1]
    x = rnd(matrices.reshape(-1, rows, cols).astype(ms.float32))
    transposed = rows > cols
    if transposed:
        x = x.transpose(0, 2, 1)
    norm = ops.sqrt((x * x).sum((-2, -1), keepdims=True))
    x = rnd(x / ops.clamp(rnd(norm), min=eps))
    for _ in range(steps):
        gram = rnd(ops.bmm(x, x.transpose(0, 2, 1)))
        poly = rnd(b * gram + c * ops.bmm(gram, gram))
        x = rnd(a * x + ops.bmm(poly, x))
    if transposed:
        x = x.transpose(0, 2, 1)
    return x.reshape(shape)
