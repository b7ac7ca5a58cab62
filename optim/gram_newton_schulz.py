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
ratio 2.5 and up with full products; from about 1.3 with the CPU kernels' half-FLOP
symmetric products, which Gram has more of); elsewhere the gram method restarts before every step, which is
standard Newton-Schulz's products (see ``orthogonalise_gram_or_standard``).

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
n x n product above (X X^T, R^2, R P, P (R P), Q P) is symmetric: only the part
on and above the diagonal needs computing, the rest is mirrored. In bf16 on CPUs
with AVX512-BF16 and no AMX, a C kernel (optim/symmetric_kernels.c) computes them
for n a multiple of 32: 8 x 32 tiles from row 0 to the diagonal tile, bf16 pairs
accumulated in fp32 and rounded once, as oneDNN's bf16 GEMM on the same CPU (equal
to torch's products bit for bit at inner sizes up to 512 there); 0.56 of the
FLOPs at n = 256, 0.52 at 1024. Measured on an AMD EPYC (Zen 4, one thread)
against torch's full bf16 products: 11 x 256^2 products 0.62 of the time,
256 x 512 0.60, 1024 x 4096 0.49 (the 256-row panels below took 0.65). In fp32,
where MKL's fp32 GEMM is AVX2 code (CPUs without AVX-512, and AMD's: where bf16 is
emulated and Gram computes in fp32), an AVX2 kernel does the same for n a multiple
of 16: 6 x 16 tiles of fp32 sums; on the Zen 4, one thread, against MKL's full
products: 11 x 256^2 0.53 of the time, 8 x 256 x 512 0.50, 1024 x 4096 0.48.
Elsewhere (fp32 on Intel CPUs with AVX-512 and no AMX, or without the kernels'
library) for n >= 1024 each product is computed by torch's GEMMs as n/256 row panels (at most 8), each panel's rows times the columns from
its diagonal block on, the blocks below the diagonal blocks mirrored (a C
kernel): (k+1)/2k of the FLOPs with k panels; at n = 512 (2 panels) that gained
at one thread and lost at two, so smaller blocks keep full products. On an AMX
Xeon block-triangle products measured slower than one full bf16 GEMM: AMX CPUs
and GPUs keep the full products.

The input is rounded to ``input_dtype`` first (bf16: what standard Newton-Schulz
and torch.optim.Muon see, and what distributed Muon sends) and Frobenius-
normalised: in the compute dtype where it is the input dtype (as standard
does), else in fp32 (no fp16 overflow or underflow) before the cast. A lone
matrix in bf16 or fp32 is not divided: its scale goes into the GEMMs that
read it (R_0 and the first Q X), which saves a pass over X.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
from torch import Tensor

from orthon.core.native import NativeLibrary, cpu_flags, cpu_has_avx512_bf16, cpu_vendor
from orthon.optim.newton_schulz import (
    DEFAULT_COEFFICIENTS,
    DEFAULT_EPS,
    DEFAULT_STEPS,
    bf16_gemm_is_native,
    check_arguments,
    newton_schulz_flops,
)

log = logging.getLogger(__name__)

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


# Symmetric products (see the module docstring), by torch's GEMMs: from this n on, in panels of this many
# rows, at most this many.
SYMMETRIC_MIN_ROWS = 1024
SYMMETRIC_PANEL_ROWS = 256
SYMMETRIC_MAX_PANELS = 8
# By the C kernels: tiles of this many columns, for n a multiple of it (NR and NRF in symmetric_kernels.c).
KERNEL_TILES = {torch.bfloat16: 32, torch.float32: 16}


@functools.lru_cache(maxsize=None)
def _cpu_has_amx() -> bool:
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    return bool(probe()) if probe is not None else False


def _declare_kernels(lib: ctypes.CDLL) -> None:
    pointer, long = ctypes.c_void_p, ctypes.c_long
    lib.mirror_blocks_2.argtypes = lib.mirror_blocks_4.argtypes = [pointer, long, pointer, long, ctypes.c_int]
    lib.symmetric_gemm_bf16.argtypes = lib.symmetric_gemm_f32.argtypes = (
        [pointer, long, long] * 2 + [long, long, long, ctypes.c_float, pointer, long, long, ctypes.c_float, pointer,
                                     long, long, pointer, ctypes.c_int])


symmetric_kernels = NativeLibrary(Path(__file__).with_name("symmetric_kernels.c"), "ORTHON_SYMMETRIC_KERNELS",
                                  "the symmetric products' kernels",
                                  "torch's GEMMs and strided copies compute them (the same values up to "
                                  "round-off, 1.2-1.4x the time in bf16)", log, _declare_kernels, openmp=True)


def _fp32_gemm_is_avx2() -> bool:
    """Whether MKL's fp32 GEMM runs AVX2 code here, as the fp32 kernel does: on CPUs without AVX-512, and
    on AMD's (MKL takes its AVX2 path there; Zen 4 executes AVX-512 at AVX2's rate anyway). Intel's AVX-512
    FMA units run MKL at up to twice that rate."""
    return "avx512f" not in cpu_flags() or cpu_vendor() == "AuthenticAMD"


def _vector_gemm_cpu(dtype: torch.dtype) -> bool:
    """Whether a vector kernel beats torch's GEMM in ``dtype`` on this CPU at half the FLOPs: bf16 with
    AVX512-BF16 and no AMX (oneDNN's AMX tiles are faster than any vector code); fp32 where MKL's is AVX2."""
    if dtype == torch.bfloat16:
        return cpu_has_avx512_bf16() and not _cpu_has_amx()
    return dtype == torch.float32 and _fp32_gemm_is_avx2()


def symmetric_kernel_applies(n: int, device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether a C kernel computes the symmetric n x n products in ``dtype``: on a CPU where it is faster
    (``_vector_gemm_cpu``), n a multiple of its tile (``KERNEL_TILES``), the library built."""
    tile = KERNEL_TILES.get(dtype)
    return (tile is not None and torch.device(device).type == "cpu" and n % tile == 0 and _vector_gemm_cpu(dtype)
            and symmetric_kernels.load() is not None)


def symmetric_panels(n: int, device: torch.device | str, dtype: torch.dtype) -> int:
    """Row panels of the symmetric n x n products in ``dtype`` on ``device``; 1 means full products. A
    kernel's column tiles count as panels of their width: the same triangle of FLOPs."""
    if symmetric_kernel_applies(n, device, dtype):
        return n // KERNEL_TILES[dtype]
    if torch.device(device).type != "cpu" or n < SYMMETRIC_MIN_ROWS or _cpu_has_amx():
        return 1
    return min(SYMMETRIC_MAX_PANELS, n // SYMMETRIC_PANEL_ROWS)


def _mirror(out: Tensor, starts: list[int]) -> None:
    """Fill the blocks of ``out`` (b, n, n) below its diagonal blocks (bounds ``starts``) from those above."""
    cpu_words = out.device.type == "cpu" and out.is_contiguous() and out.element_size() in (2, 4)
    lib = symmetric_kernels.load() if cpu_words else None
    if lib is None:
        for lo, hi in zip(starts[1:], starts[2:]):
            out[:, lo:hi, :lo].copy_(out[:, :lo, lo:hi].mT)
        return
    kernel = lib.mirror_blocks_2 if out.element_size() == 2 else lib.mirror_blocks_4
    bounds = (ctypes.c_long * len(starts))(*starts)
    for matrix in out:
        kernel(matrix.data_ptr(), out.shape[-1], bounds, len(starts) - 1, torch.get_num_threads())


def _panel_starts(n: int, panels: int) -> list[int]:
    return [n * i // panels for i in range(panels + 1)]


def symmetric_product_flops(n: int, inner: int, panels: int = 1) -> int:
    """FLOPs of an n x n product over ``inner`` computed in ``panels`` row panels (1: the full 2 n^2 inner)."""
    starts = _panel_starts(n, panels)
    return 2 * inner * sum((starts[i + 1] - starts[i]) * (n - starts[i]) for i in range(panels))


def symmetric_matmul(u: Tensor, v: Tensor, panels: int, alpha: float = 1.0, addend: Tensor | None = None,
                     beta: float = 0.0, v_symmetric: bool = False) -> Tensor:
    """alpha u @ v (+ beta addend) for stacks ``(b, n, k)`` x ``(b, k, n)`` whose result is known to be
    symmetric. ``panels`` 1: one batched GEMM (bmm, or baddbmm with the scalars). ``n // KERNEL_TILES[dtype]``
    where ``symmetric_kernel_applies``: the dtype's C kernel, which reads v's columns as rows: those of v^T
    (v = X^T), or, with ``v_symmetric`` (v exactly symmetric, as the kernel's results are), v's own
    rows. Other counts: per matrix, each row panel times the columns from its diagonal block on, written
    in place; the blocks below the diagonal ones mirrored from above."""
    if panels == 1:
        if addend is not None:
            return torch.baddbmm(addend, u, v, beta=beta, alpha=alpha)
        return torch.bmm(u, v) if alpha == 1.0 else torch.baddbmm(u.new_zeros(()), u, v, beta=0, alpha=alpha)
    n = u.shape[-2]
    if symmetric_kernel_applies(n, u.device, u.dtype) and panels == n // KERNEL_TILES[u.dtype]:
        return _kernel_product(u, v if v_symmetric and v.stride(-1) == 1 else v.mT, alpha, addend, beta)
    out = u.new_empty(u.shape[0], n, n)
    starts = _panel_starts(n, panels)
    for j in range(u.shape[0]):
        for lo, hi in zip(starts, starts[1:]):
            block = out[j, lo:hi, lo:]
            if addend is None and alpha == 1.0:
                torch.mm(u[j, lo:hi], v[j, :, lo:], out=block)
            else:  # beta 0 ignores the (uninitialised) input
                source = block if addend is None else addend[j, lo:hi, lo:]
                torch.addmm(source, u[j, lo:hi], v[j, :, lo:], beta=beta, alpha=alpha, out=block)
    _mirror(out, starts)
    return out


def _rows(t: Tensor) -> Tensor:
    """``t`` with unit stride along its rows (the kernel's layout), copied only if it has not."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _kernel_product(u: Tensor, w: Tensor, alpha: float, addend: Tensor | None, beta: float) -> Tensor:
    """alpha u @ w^T (+ beta addend), known to be symmetric, by the dtype's kernel: u, w ``(b, n, k)``."""
    u, w = _rows(u), _rows(w)
    b, n, k = u.shape
    out = u.new_empty(b, n, n)
    d = None if addend is None else _rows(addend)
    threads = torch.get_num_threads()
    lib = symmetric_kernels.load()
    # A packed panel of w a thread: bf16 pairs as 32-bit words, or fp32.
    tile = KERNEL_TILES[u.dtype]
    if u.dtype == torch.bfloat16:
        kernel, workspace = lib.symmetric_gemm_bf16, torch.empty(threads, (k + 1) // 2 * tile, dtype=torch.int32)
    else:
        kernel, workspace = lib.symmetric_gemm_f32, torch.empty(threads, k * tile, dtype=torch.float32)
    kernel(
        u.data_ptr(), u.stride(0), u.stride(1), w.data_ptr(), w.stride(0), w.stride(1), b, n, k, alpha,
        None if d is None else d.data_ptr(), 0 if d is None else d.stride(0), 0 if d is None else d.stride(1),
        beta, out.data_ptr(), out.stride(0), out.stride(1), workspace.data_ptr(), threads)
    return out


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
        if dtype == torch.bfloat16 and not _cpu_has_amx():
            return GRAM_MAX_FLOP_FRACTION_VECTOR
        if dtype == torch.float32 and _vector_gemm_cpu(dtype) and symmetric_kernels.load() is not None:
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
    """FLOPs Muon computes orthogonalising one rows x cols block under ``ns_method`` on ``device``."""
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
            scale = 1.0 / float(norm)  # folded into the products that read X: see _scaled_product
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


def _scaled_product(u: Tensor, v: Tensor, scale: float | None) -> Tensor:
    """u @ v (batched), times ``scale`` inside the GEMM (its output scaling, before the one rounding)."""
    if scale is None:
        return torch.bmm(u, v)
    return torch.baddbmm(u.new_zeros(()), u, v, beta=0, alpha=scale)


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
            x = _scaled_product(q, x, scale)
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
    return _scaled_product(q, x, scale)


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
