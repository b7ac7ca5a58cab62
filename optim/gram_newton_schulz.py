"""Gram Newton-Schulz: the quintic Newton-Schulz iteration run on the small Gram matrix.

Standard Newton-Schulz (orthon.optim.newton_schulz) updates the n x m matrix X
(n <= m) every step: X <- p(X X^T) X with p(R) = a I + b R + c R^2. Every
iterate is X_t = Q_t X_0 with Q_t a polynomial in R_0 = X_0 X_0^T, so the
iteration can run on n x n matrices only (Zhang, Amsel, Chen, Dao, "Gram
Newton-Schulz", 2026):

    R <- X X^T, Q <- I
    each step:  P = a I + b R + c R^2      (P commutes with R and Q)
                Q <- Q P,  R <- P R P      (R_t = X_t X_t^T, never formed from X)
    at the end: X <- Q X

Two n x m products (R_0 and the final Q X) replace the 2 per step, at the cost
of up to 4 n x n products per step; on a 1024 x 4096 block that is 60 n^3
instead of 90 n^3 FLOPs. ``gram_method_restarts`` says where it pays (aspect
ratio 2.5 and up with full products; from about 1.3-1.5 with the CPU kernels'
half-FLOP symmetric products, which Gram has more of); elsewhere the gram method
restarts before every step, which is standard Newton-Schulz's products (see
``orthogonalise_gram_or_standard``).

Half precision. Rounding errors in R are not corrected by the iteration (the
standard form recomputes X X^T from X every step): an eigenvalue of R pushed
slightly below 0 grows by ~a^2 per step and then explodes. A restart
(X <- Q X, R <- X X^T, Q <- I) discards the accumulated error; the publication
restarts once in 5 steps for fp16. bf16 has 3 fewer mantissa bits. Measured
against the exact (fp64) iteration on power-law spectra, restarting before step
3 keeps gram-bf16 within 2-7% of it (standard-bf16, torch.optim.Muon's numbers:
1.5-4%; both ~20% on steeper spectra, where the smallest singular values are
round-off either way), and inside the exact band of singular values;
restarting before step 2 leaves outputs with singular values up to 1.5, no
restart up to 25 on a near-low-rank input. Two restarts (before steps 2 and 3)
stay within 1.5x of standard's error everywhere, at 70 n^3 instead of 60 n^3
FLOPs on 1024 x 4096. fp32 needs no restart.

Symmetric products. R, P and Q are polynomials in R_0, so they commute and every
n x n product above (X X^T, R^2, R P, P (R P), Q P) is symmetric: on CPUs only the
part on and above the diagonal is computed, the rest mirrored
(orthon.optim.symmetric_products: C kernels in bf16 and fp32, torch's GEMMs in row
panels elsewhere).

The input is rounded to ``input_dtype`` first (bf16: what standard Newton-Schulz
and torch.optim.Muon see, and what distributed Muon sends) and Frobenius-
normalised: in the compute dtype where it is the input dtype (as standard
does), else in fp32 (no fp16 overflow or underflow) before the cast. A lone
matrix in bf16 or fp32 is not divided: its scale goes into the GEMMs that
read it (R_0 and the first Q X), which saves a pass over X.
"""
from __future__ import annotations

import torch
from torch import Tensor

import orthon.optim.symmetric_products as symmetric
from orthon.optim.newton_schulz import (
    DEFAULT_COEFFICIENTS,
    DEFAULT_EPS,
    DEFAULT_STEPS,
    bf16_gemm_is_native,
    check_arguments,
    newton_schulz_flops,
)
from orthon.optim.symmetric_products import scaled_product, symmetric_matmul, symmetric_panels, symmetric_product_flops

NS_METHODS = ("standard", "gram")  # Muon's ns_method: which Newton-Schulz form runs
GRAM_DTYPES: dict[str, torch.dtype] = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": torch.float32}
GRAM_DTYPE_NAMES = ("auto", *GRAM_DTYPES)
# Gram runs where it needs at most this fraction of standard's FLOPs. Its n x n products run at a lower
# GEMM rate than standard's n x m ones and it makes more calls: at 0.88 (24 blocks of 512 x 256, bf16,
# one CPU thread) it measured 12% slower than standard on the AMX Xeon, at 0.74 (768 x 256) 20% faster.
GRAM_MAX_FLOP_FRACTION = 0.8
# On CPUs without AMX the n x n products keep the wide ones' rate. In bf16 (AVX512-BF16), on the AMD EPYC
# (Zen 4, one thread), before the kernel: the same 512 x 256 blocks (0.88) took 0.81-0.87 of standard's
# time, 1024 x 512 0.83, but 384 x 256 (0.97) 1.02. With the kernels (the fractions then of the
# every-step form's FLOPs, both with half-FLOP symmetric products), fp32: 384 x 256 (0.80) 0.84 of its
# time, 512 x 256 (0.68) 0.70, 256^2 (1.02) 1.04; bf16: 384 x 256 (0.85) 0.91, 256^2 (1.02) 1.06.
# (fp32 with full products, MKL's AVX2 code: 512 x 256 without restarts, 0.84, 1.07.)
GRAM_MAX_FLOP_FRACTION_VECTOR = 0.9
# Largest Frobenius norm whose normalisation is folded into the GEMMs (X X^T of the raw matrix is formed,
# so bound its entries far below bf16's and fp32's range); larger inputs are divided first.
FOLD_MAX_NORM = 1e12
# Steps between restarts in half precision (see the module docstring for how it was chosen).
HALF_PRECISION_RESTART_EVERY = 3


def gram_compute_dtype(name: str, device: torch.device | str) -> torch.dtype:
    """The compute dtype for ``name`` ("auto", "fp16", "bf16", "fp32") on ``device``.

    auto: fp16 on GPUs (native GEMM, 3 more mantissa bits than bf16); on CPUs bf16
    where its GEMM is native (AVX512-BF16 / AMX: there fp16 GEMM runs at the fp32
    rate, no faster), fp32 otherwise (half-precision GEMMs are emulated and slow).
    """
    if name != "auto":
        if name not in GRAM_DTYPES:
            raise ValueError(f"gram Newton-Schulz dtype must be one of {list(GRAM_DTYPE_NAMES)}, got {name!r}")
        return GRAM_DTYPES[name]
    device = torch.device(device)
    if device.type != "cpu":
        return torch.float16
    return torch.bfloat16 if bf16_gemm_is_native(device) else torch.float32


def default_restarts(steps: int, dtype: torch.dtype) -> tuple[int, ...]:
    """Steps before which the iteration restarts from X: none in fp32, every 3 in half precision."""
    if dtype == torch.float32:
        return ()
    return tuple(range(HALF_PRECISION_RESTART_EVERY, steps, HALF_PRECISION_RESTART_EVERY))


def _check_restarts(restarts: tuple[int, ...], steps: int) -> tuple[int, ...]:
    restarts = tuple(sorted(set(int(r) for r in restarts)))
    if any(not 0 < r < steps for r in restarts):
        raise ValueError(f"gram Newton-Schulz restarts must lie in [1, {steps - 1}], got {list(restarts)}")
    return restarts


def _updates_r_after(step: int, steps: int, restarts: tuple[int, ...]) -> bool:
    """Whether R must be carried past ``step`` (not after the last step, nor before a restart)."""
    return step + 1 < steps and step + 1 not in restarts


def gram_newton_schulz_flops(rows: int, cols: int, steps: int = DEFAULT_STEPS,
                             restarts: tuple[int, ...] = (), panels: int = 1) -> int:
    """Matmul FLOPs of Gram Newton-Schulz on one rows x cols matrix (2 per multiply-add); ``panels``: the
    symmetric products' row panels (``symmetric_panels``; 1: full products)."""
    n, m = min(rows, cols), max(rows, cols)
    if steps == 0:
        return 0
    restarts = _check_restarts(restarts, steps)
    grams = 1 + len(restarts)  # X X^T at the start and at each restart
    square = 0
    for step in range(steps):
        square += 1  # R^2
        if step != 0 and step not in restarts:
            square += 1  # Q <- Q P
        if _updates_r_after(step, steps, restarts):
            square += 2  # R P, P (R P)
    # Q X at each restart and at the end, the rest symmetric.
    return (grams * symmetric_product_flops(n, m, panels) + grams * 2 * n * n * m
            + square * symmetric_product_flops(n, n, panels))


def gram_max_flop_fraction(dtype: torch.dtype, device: torch.device | str) -> float:
    """The largest fraction of the every-step form's FLOPs at which Gram runs, for ``dtype`` on ``device``
    (``gram_pays``): more on CPUs without AMX in bf16, and in fp32 where its kernel computes the symmetric
    products."""
    if torch.device(device).type == "cpu":
        if dtype == torch.bfloat16 and not symmetric.cpu_has_amx():
            return GRAM_MAX_FLOP_FRACTION_VECTOR
        kernel = symmetric.vector_kernel_cpu(dtype) and symmetric.symmetric_kernels.load() is not None
        if dtype == torch.float32 and kernel:
            return GRAM_MAX_FLOP_FRACTION_VECTOR
    return GRAM_MAX_FLOP_FRACTION


def gram_pays(rows: int, cols: int, steps: int = DEFAULT_STEPS, restarts: tuple[int, ...] = (),
              max_fraction: float = GRAM_MAX_FLOP_FRACTION, panels: int = 1) -> bool:
    """Whether Gram Newton-Schulz is worth running on a rows x cols block: at most ``max_fraction`` of the
    FLOPs of what the gram method runs otherwise (restarts before every step: standard's products), both
    with the symmetric products in ``panels`` (``symmetric_panels``). With full products (1) that is
    standard's FLOPs: at 0.8 Gram pays from aspect ratio 2.5 with one restart in 5 steps, at 0.9 from 2.
    Half-FLOP symmetric products favour Gram, which has more of them: the ratio-2 expert stacks in fp32."""
    gram = gram_newton_schulz_flops(rows, cols, steps, restarts, panels)
    return gram <= max_fraction * gram_newton_schulz_flops(rows, cols, steps, tuple(range(1, steps)), panels)


def gram_method_restarts(rows: int, cols: int, steps: int, compute: torch.dtype,
                         device: torch.device | str) -> tuple[int, ...]:
    """The restarts Muon's gram method runs a rows x cols block with in ``compute`` on ``device``: the
    dtype's (``default_restarts``) where Gram pays, else before every step (standard's products)."""
    restarts = default_restarts(steps, compute)
    panels = symmetric_panels(min(rows, cols), device, compute)
    if gram_pays(rows, cols, steps, restarts, gram_max_flop_fraction(compute, device), panels):
        return restarts
    return tuple(range(1, steps))


def block_flops(rows: int, cols: int, steps: int = DEFAULT_STEPS, ns_method: str = "standard",
                gram_dtype: str = "auto", device: torch.device | str = "cpu") -> int:
    """FLOPs Muon computes orthogonalising one rows x cols block under ``ns_method`` on ``device``. standard:
    torch.optim.Muon's count, also where its fp32 and emulated-bf16 forms compute X X^T and b R + c R^2 by
    halves (0.69-0.76 of it, by aspect ratio: distributed Muon's rank balancing barely notices)."""
    if ns_method != "gram":
        return newton_schulz_flops(rows, cols, steps)
    compute = gram_compute_dtype(gram_dtype, device)
    restarts = gram_method_restarts(rows, cols, steps, compute, device)
    return gram_newton_schulz_flops(rows, cols, steps, restarts, symmetric_panels(min(rows, cols), device, compute))


def gram_newton_schulz(
    matrices: Tensor,
    steps: int = DEFAULT_STEPS,
    coefficients: tuple[float, float, float] = DEFAULT_COEFFICIENTS,
    dtype: torch.dtype | str = torch.bfloat16,
    eps: float = DEFAULT_EPS,
    restarts: tuple[int, ...] | None = None,
    input_dtype: torch.dtype | None = torch.bfloat16,
) -> Tensor:
    """Orthogonalise each matrix of ``matrices`` (``(..., rows, cols)``) by Gram Newton-Schulz.

    Same map as ``newton_schulz`` with the same (steps, coefficients, eps) up to
    rounding. ``dtype``: the compute dtype (a torch dtype or "fp16"/"bf16"/"fp32");
    ``restarts``: the steps before which to restart (None: ``default_restarts``);
    ``input_dtype``: round the input to it first (None: keep it). Returns a tensor
    of the same shape in ``dtype``; the input is never modified.
    """
    check_arguments("gram_newton_schulz", matrices, steps, coefficients)
    if isinstance(dtype, str):
        dtype = gram_compute_dtype(dtype, matrices.device)
    if dtype not in GRAM_DTYPES.values():
        raise ValueError(f"gram Newton-Schulz dtype must be fp16, bf16 or fp32, got {dtype}")
    restarts = _check_restarts(default_restarts(steps, dtype) if restarts is None else restarts, max(steps, 1))
    a, b, c = (float(v) for v in coefficients)
    shape = matrices.shape
    rows, cols = shape[-2], shape[-1]
    x = matrices.reshape(-1, rows, cols)
    transposed = rows > cols
    if transposed:
        x = x.mT  # the Gram matrix is min(rows, cols) square
    # Rounded to the input dtype in one contiguous (n, m) copy: CPU GEMMs on a transposed view run up to
    # 2x slower, and the kernel reads rows. (Tensor.to returns a transposed view as it is when the dtype
    # already matches: contiguous() copies it.)
    x = x.to(input_dtype or x.dtype, memory_format=torch.contiguous_format).contiguous()
    scale = None
    if x.dtype == dtype:
        # The norm in the compute dtype, as standard Newton-Schulz normalises (bf16 norm).
        norm = x.norm(dim=(-2, -1), keepdim=True).clamp(min=eps)
        if steps and x.shape[0] == 1 and dtype != torch.float16 and float(norm) <= FOLD_MAX_NORM:
            scale = 1.0 / float(norm)  # folded into the products that read X: see scaled_product
        else:
            x = x / norm
    else:
        # fp32 division first: no fp16 overflow or underflow.
        norm = torch.linalg.vector_norm(x, dim=(-2, -1), keepdim=True, dtype=torch.float32).clamp(min=eps)
        x = (x.float() / norm).to(dtype)
    if steps:
        x = _iterate(x, steps, a, b, c, restarts, scale)
    if transposed:
        x = x.mT
    return x.reshape(shape)


def _iterate(x: Tensor, steps: int, a: float, b: float, c: float, restarts: tuple[int, ...],
             scale: float | None = None) -> Tensor:
    """``scale``: X's normalisation when it is not applied yet (one matrix): R = s^2 X X^T and the first
    Q X are scaled inside their GEMMs, so no pass divides X (an n x m sweep, ~4% of a 1024 x 4096 step)
    and X X^T is rounded once, not after the division too. The n x n products are symmetric
    (``symmetric_matmul``)."""
    panels = symmetric_panels(x.shape[-2], x.device, x.dtype)
    r = symmetric_matmul(x, x.mT, panels, alpha=1.0 if scale is None else scale * scale)
    q = None
    for step in range(steps):
        if step in restarts:
            x = scaled_product(q, x, scale)
            scale = None
            r = symmetric_matmul(x, x.mT, panels)
            q = None
        # R, P, R P and Q are symmetric: their rows are their columns (the kernel reads the right factor's).
        p = symmetric_matmul(r, r, panels, alpha=c, addend=r, beta=b, v_symmetric=True)
        # P = a I + b R + c R^2 in one tensor: then plain products, no copy of an addend per product
        # (~10-30% faster than baddbmm's "+ a * X" forms, at one more bf16 rounding of P's diagonal).
        p.diagonal(dim1=-2, dim2=-1).add_(a)
        if _updates_r_after(step, steps, restarts):
            r = symmetric_matmul(p, symmetric_matmul(r, p, panels, v_symmetric=True), panels, v_symmetric=True)
        q = p if q is None else symmetric_matmul(q, p, panels, v_symmetric=True)
    return scaled_product(q, x, scale)


def orthogonalise_gram_or_standard(
    stack: Tensor,
    steps: int = DEFAULT_STEPS,
    coefficients: tuple[float, float, float] = DEFAULT_COEFFICIENTS,
    eps: float = DEFAULT_EPS,
    ns_dtype: torch.dtype = torch.bfloat16,
    gram_dtype: str = "auto",
) -> Tensor:
    """Muon's ``ns_method: gram`` on a stack of same-shaped blocks ``(n, rows, cols)``, in the device's
    compute dtype (``gram_compute_dtype``).

    Gram Newton-Schulz where it pays for this block shape and device (``gram_method_restarts``). Elsewhere
    the same iteration restarted before every step, which is standard Newton-Schulz's products (X X^T, R^2,
    P X) with P = a I + b R + c R^2 formed as one matrix: no product copies an addend as baddbmm's
    "a X + ..." does (one pass over X a step less; one more rounding of P's diagonal). Both round the input
    to ``ns_dtype`` first, so distributed Muon, which sends updates in it, computes what one rank does.
    """
    rows, cols = stack.shape[-2:]
    compute = gram_compute_dtype(gram_dtype, stack.device)
    restarts = gram_method_restarts(rows, cols, steps, compute, stack.device)
    return gram_newton_schulz(stack, steps, coefficients, compute, eps, restarts, input_dtype=ns_dtype)
