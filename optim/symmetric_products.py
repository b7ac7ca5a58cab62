"""Products known to be symmetric (n x n results of the form A B^T whose value is symmetric), computed as
their upper part and mirrored: Gram Newton-Schulz's X X^T, R^2, R P, P (R P), Q P (R, P and Q are
polynomials in X_0 X_0^T, so they commute), and X X^T and b R + c R^2 of standard Newton-Schulz's
emulated-bf16 form.

In bf16 on CPUs with AVX512-BF16 and no AMX, a C kernel (optim/symmetric_kernels.c) computes them for n a
multiple of 32: 8 x 32 tiles from row 0 to the diagonal tile, bf16 pairs accumulated in fp32 and rounded
once, as oneDNN's bf16 GEMM on the same CPU (equal to torch's products bit for bit at inner sizes up to 512
there); 0.56 of the FLOPs at n = 256, 0.52 at 1024. Measured on an AMD EPYC (Zen 4, one thread) against
torch's full bf16 products: 11 x 256^2 products 0.62 of the time, 256 x 512 0.60, 1024 x 4096 0.49 (the
256-row panels below took 0.65).

In fp32, where MKL's fp32 GEMM is AVX2 code (CPUs without AVX-512, and AMD's: the kind whose bf16 GEMM is
emulated, where Newton-Schulz computes in fp32), an AVX2 kernel does the same for n a multiple of 16: 6 x 16
tiles, each output's products summed in chains of 128 that are then added up (as a blocked GEMM sums: one
chain over all of k left fp32 Gram Newton-Schulz, which never restarts, up to 3.3x farther from the exact
iteration); on the Zen 4, one thread, against MKL's full products: 11 x 256^2 0.51 of the time, 8 x 256 x
512 0.51, 1024 x 4096 0.48, 2048 x 6144 0.49.

Elsewhere (fp32 on Intel CPUs with AVX-512 and no AMX, or without the kernels' library) for n >= 1024 each
product is computed by torch's GEMMs as n/256 row panels (at most 8), each panel's rows times the columns
from its diagonal block on, the blocks below the diagonal blocks mirrored (a C kernel): (k+1)/2k of the
FLOPs with k panels; at n = 512 (2 panels) that gained at one thread and lost at two, so smaller blocks
keep full products. On an AMX Xeon block-triangle products measured slower than one full bf16 GEMM, and a
hand-written AMX kernel of the upper 32 x 32 blocks (2 x 2 tiles, several blockings) took 0.65-0.95 of
oneDNN's full product's time at n = 1024 and more below: its tile products wait on tile loads from L2
and L3, whose traffic halving the FLOPs does not halve (docs/results/history.md). AMX CPUs and GPUs keep
the full products. ``ORTHON_SYMMETRIC_KERNELS=0`` turns the kernels off.
"""
from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
from torch import Tensor

from orthon.core.native import NativeLibrary, cpu_flags, cpu_has_avx512_bf16, cpu_vendor

log = logging.getLogger(__name__)

# By torch's GEMMs: from this n on, in panels of this many rows, at most this many.
SYMMETRIC_MIN_ROWS = 1024
SYMMETRIC_PANEL_ROWS = 256
SYMMETRIC_MAX_PANELS = 8
# By the C kernels: tiles of this many columns, for n a multiple of it (NR and NRF in symmetric_kernels.c).
KERNEL_TILES = {torch.bfloat16: 32, torch.float32: 16}


@functools.lru_cache(maxsize=None)
def cpu_has_amx() -> bool:
    """Whether the CPU has AMX tiles (oneDNN's bf16 GEMM then beats any vector code)."""
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
                                  "round-off, 1.2-2x the time)", log, _declare_kernels, openmp=True)


def _fp32_gemm_is_avx2() -> bool:
    """Whether MKL's fp32 GEMM runs AVX2 code here, as the fp32 kernel does: on CPUs without AVX-512, and
    on AMD's (MKL takes its AVX2 path there; Zen 4 executes AVX-512 at AVX2's rate anyway). Intel's AVX-512
    FMA units run MKL at up to twice that rate."""
    return "avx512f" not in cpu_flags() or cpu_vendor() == "AuthenticAMD"


def vector_kernel_cpu(dtype: torch.dtype) -> bool:
    """Whether a vector kernel beats torch's GEMM in ``dtype`` on this CPU at half the FLOPs: bf16 with
    AVX512-BF16 and no AMX (oneDNN's AMX tiles are faster than any vector code); fp32 where MKL's is AVX2."""
    if dtype == torch.bfloat16:
        return cpu_has_avx512_bf16() and not cpu_has_amx()
    return dtype == torch.float32 and _fp32_gemm_is_avx2()


def symmetric_kernel_applies(n: int, device: torch.device | str, dtype: torch.dtype) -> bool:
    """Whether a C kernel computes the symmetric n x n products in ``dtype``: on a CPU where it is faster
    (``vector_kernel_cpu``), n a multiple of its tile (``KERNEL_TILES``), the library built."""
    tile = KERNEL_TILES.get(dtype)
    return (tile is not None and torch.device(device).type == "cpu" and n % tile == 0 and vector_kernel_cpu(dtype)
            and symmetric_kernels.load() is not None)


def symmetric_panels(n: int, device: torch.device | str, dtype: torch.dtype) -> int:
    """Row panels of the symmetric n x n products in ``dtype`` on ``device``; 1 means full products. A
    kernel's column tiles count as panels of their width: the same triangle of FLOPs."""
    if symmetric_kernel_applies(n, device, dtype):
        return n // KERNEL_TILES[dtype]
    if torch.device(device).type != "cpu" or n < SYMMETRIC_MIN_ROWS or cpu_has_amx():
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


def scaled_product(u: Tensor, v: Tensor, scale: float | None) -> Tensor:
    """u @ v (batched), times ``scale`` inside the GEMM (its output scaling, before the one rounding)."""
    if scale is None:
        return torch.bmm(u, v)
    return torch.baddbmm(u.new_zeros(()), u, v, beta=0, alpha=scale)


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
        return scaled_product(u, v, None if alpha == 1.0 else alpha)
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
