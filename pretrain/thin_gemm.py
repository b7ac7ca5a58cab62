"""A CPU matmul for thin fp32 batches (a few rows times a weight), the shape of every decode step.

At 1 to 8 rows a GEMM library spends its time packing the weight on every call: MKL reads a
streamed weight at 5 to 9 GB/s here, while the memory system delivers over 20. This kernel takes
the weight packed once (panels of 16 output columns, contiguous along K) and keeps the rows'
accumulators in AVX2 registers, so a weight is read once per call at close to memory speed: about
3x MKL at one row, 1.3x at eight (where the FMA units, not memory, become the limit).

Built on first use from the C source below with the system C compiler into a per-user cache
(keyed by the source's hash), loaded with ctypes. Where it cannot be built or run (no compiler, a
CPU without AVX2 / FMA, ORTHON_THIN_GEMM=0) every call falls back to ``F.linear``: same values up
to float summation order. The fallback is logged once per process with its reason (logger
``orthon.pretrain.thin_gemm``; a warning, or info when ORTHON_THIN_GEMM=0 asked for it).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

MAX_ROWS = 8  # above this MKL's blocked GEMM is as fast or faster
PANEL = 16

_SOURCE = r"""
#include <immintrin.h>
#include <string.h>

/* p[(n / 16) * K * 16 + k * 16 + n % 16] = w[n * K + k]; columns padded with zeros to a multiple of 16. */
void thin_pack(const float* w, float* p, long N, long K) {
    long NB = (N + 15) / 16;
    memset(p, 0, sizeof(float) * NB * K * 16);
    for (long n = 0; n < N; n++)
        for (long k = 0; k < K; k++)
            p[(n / 16) * K * 16 + k * 16 + (n % 16)] = w[n * K + k];
}

/* MB rows of y, 16 columns: y[m, c] = sum_k x[m, k] * panel[k, c]. */
#define BLOCK(MB) \
static inline void block##MB(const float* x, const float* panel, float* y, long K, long ldy, long ncols) { \
    __m256 a0[MB], a1[MB]; \
    for (int m = 0; m < MB; m++) { a0[m] = _mm256_setzero_ps(); a1[m] = _mm256_setzero_ps(); } \
    for (long k = 0; k < K; k++) { \
        __m256 w0 = _mm256_loadu_ps(panel + k * 16), w1 = _mm256_loadu_ps(panel + k * 16 + 8); \
        for (int m = 0; m < MB; m++) { \
            __m256 b = _mm256_broadcast_ss(x + m * K + k); \
            a0[m] = _mm256_fmadd_ps(b, w0, a0[m]); \
            a1[m] = _mm256_fmadd_ps(b, w1, a1[m]); \
        } \
    } \
    for (int m = 0; m < MB; m++) { \
        float tmp[16]; \
        _mm256_storeu_ps(tmp, a0[m]); _mm256_storeu_ps(tmp + 8, a1[m]); \
        memcpy(y + m * ldy, tmp, sizeof(float) * ncols); \
    } \
}
BLOCK(1) BLOCK(2) BLOCK(3) BLOCK(4) BLOCK(5) BLOCK(6)

/* y (M x N) = x (M x K) @ w^T, w packed by thin_pack; rows in blocks of up to 6 (12 accumulators). */
void thin_linear(const float* x, const float* p, float* y, long M, long N, long K) {
    for (long nb = 0; nb < (N + 15) / 16; nb++) {
        const float* panel = p + nb * K * 16;
        long n0 = nb * 16, ncols = N - n0 < 16 ? N - n0 : 16;
        for (long m0 = 0; m0 < M; m0 += 6) {
            const float* xs = x + m0 * K;
            float* ys = y + m0 * N + n0;
            switch (M - m0 < 6 ? M - m0 : 6) {
                case 1: block1(xs, panel, ys, K, N, ncols); break;
                case 2: block2(xs, panel, ys, K, N, ncols); break;
                case 3: block3(xs, panel, ys, K, N, ncols); break;
                case 4: block4(xs, panel, ys, K, N, ncols); break;
                case 5: block5(xs, panel, ys, K, N, ncols); break;
                default: block6(xs, panel, ys, K, N, ncols); break;
            }
        }
    }
}
"""

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
why_unavailable: str | None = None


def _cpu_has_avx2_fma() -> bool:
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def _build() -> ctypes.CDLL:
    digest = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("ORTHON_CACHE", Path.home() / ".cache" / "orthon"))
    target = cache / f"thin_gemm_{digest}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            src, out = Path(tmp) / "thin_gemm.c", Path(tmp) / "thin_gemm.so"
            src.write_text(_SOURCE)
            cc = os.environ.get("CC", "cc")
            subprocess.run([cc, "-O3", "-mavx2", "-mfma", "-shared", "-fPIC", str(src), "-o", str(out)],
                           check=True, capture_output=True, timeout=120)
            os.replace(out, target)  # atomic: a concurrent build or a crash never leaves half a library
    lib = ctypes.CDLL(str(target))
    lib.thin_pack.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_long, ctypes.c_long]
    lib.thin_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3
    return lib


def library() -> ctypes.CDLL | None:
    """The built kernel, or None (``why_unavailable`` says why)."""
    global _lib, _tried, why_unavailable
    with _lock:
        if not _tried:
            _tried = True
            if os.environ.get("ORTHON_THIN_GEMM", "1") == "0":
                why_unavailable = "disabled by ORTHON_THIN_GEMM=0"
            elif not _cpu_has_avx2_fma():
                why_unavailable = "the CPU lacks AVX2 / FMA (or is not x86-64)"
            else:
                try:
                    _lib = _build()
                except (OSError, subprocess.SubprocessError) as exc:
                    detail = getattr(exc, "stderr", None)
                    detail = detail.decode(errors="replace").strip().splitlines()[-1:] if detail else []
                    why_unavailable = f"could not build the kernel: {exc}" + (f" ({detail[0]})" if detail else "")
            if why_unavailable is not None:
                level = logging.INFO if os.environ.get("ORTHON_THIN_GEMM") == "0" else logging.WARNING
                log.log(level, "orthon: thin-GEMM decode kernel unavailable, %s; decoding uses F.linear "
                               "(same values, slower at small batches)", why_unavailable)
        return _lib


class PackedLinear:
    """A weight (N, K) as ``F.linear`` takes it, plus its panel-packed copy when the kernel applies."""

    def __init__(self, weight: torch.Tensor):
        self.weight = weight.detach().contiguous()
        self.out_features, self.in_features = self.weight.shape
        self.panels = None
        lib = library()
        if lib is not None and self.weight.dtype == torch.float32 and self.weight.device.type == "cpu":
            N, K = self.weight.shape
            self.panels = torch.empty((N + PANEL - 1) // PANEL * K * PANEL, dtype=torch.float32)
            lib.thin_pack(self.weight.data_ptr(), self.panels.data_ptr(), N, K)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> (..., N) = x @ weight^T."""
        rows = x.numel() // self.in_features if x.numel() else 0
        if self.panels is None or not 0 < rows <= MAX_ROWS or x.dtype != torch.float32 or x.requires_grad:
            return F.linear(x, self.weight)
        flat = x.reshape(rows, self.in_features).contiguous()
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        _lib.thin_linear(flat.data_ptr(), self.panels.data_ptr(), y.data_ptr(), rows, self.out_features,
                         self.in_features)
        return y.view(*x.shape[:-1], self.out_features)
