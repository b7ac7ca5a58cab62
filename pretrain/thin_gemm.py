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

/* rstd[m] = 1 / sqrt(mean(x[m, :K]^2) + eps), rows ldx apart, summed in double. */
static void row_rstd(const float* x, float* rstd, long M, long K, long ldx, float eps) {
    for (long m = 0; m < M; m++) {
        const float* r = x + m * ldx;
        double s = 0.0;
        for (long k = 0; k < K; k++) s += (double)r[k] * r[k];
        rstd[m] = (float)(1.0 / __builtin_sqrt(s / K + eps));
    }
}

/* y (M x K) = x * rstd(x) * w: RMSNorm of rows ldx apart. */
void thin_rms_norm(const float* x, const float* w, float* y, long M, long K, long ldx, float eps) {
    float rstd[64];
    for (long m0 = 0; m0 < M; m0 += 64) {
        long mb = M - m0 < 64 ? M - m0 : 64;
        row_rstd(x + m0 * ldx, rstd, mb, K, ldx, eps);
        for (long m = 0; m < mb; m++)
            for (long k = 0; k < K; k++) y[(m0 + m) * K + k] = x[(m0 + m) * ldx + k] * rstd[m] * w[k];
    }
}

/* y = rms_norm(x) @ w^T for a weight packed with the norm's scale folded in: the linear map of x,
   each row's output times that row's rstd (M <= 64). */
void thin_norm_linear(const float* x, const float* p, float* y, long M, long N, long K, float eps) {
    float rstd[64];
    row_rstd(x, rstd, M, K, K, eps);
    thin_linear(x, p, y, M, N, K);
    for (long m = 0; m < M; m++)
        for (long n = 0; n < N; n++) y[m * N + n] *= rstd[m];
}

/* Routed experts of a few rows: y (M x H) += sum over each row's top-k choices of
   weight * down_e(silu(gate_e x) * up_e x), the rows grouped by expert so each chosen expert's
   packed weights are read once. chosen / weights: (M x topk); gate_up[e]: (2I x H) packed,
   down[e]: (H x I) packed; scratch: M * (H + 3 I + H) floats. */
#include <math.h>
void thin_moe(const float* x, const long* chosen, const float* weights, float* y, long M, long topk, long H,
              long I, long E, const float* const* gate_up, const float* const* down, float* scratch) {
    float* xb = scratch;            /* n x H */
    float* h = xb + M * H;          /* n x 2I */
    float* act = h + M * 2 * I;     /* n x I */
    float* out = act + M * I;       /* n x H */
    long rows[64]; float w[64];
    for (long e = 0; e < E; e++) {
        long n = 0;
        for (long m = 0; m < M; m++)
            for (long j = 0; j < topk; j++)
                if (chosen[m * topk + j] == e) { rows[n] = m; w[n] = weights[m * topk + j]; n++; }
        if (n == 0) continue;
        for (long r = 0; r < n; r++) memcpy(xb + r * H, x + rows[r] * H, sizeof(float) * H);
        thin_linear(xb, gate_up[e], h, n, 2 * I, H);
        for (long r = 0; r < n; r++)
            for (long i = 0; i < I; i++) {
                float g = h[r * 2 * I + i];
                act[r * I + i] = g / (1.0f + expf(-g)) * h[r * 2 * I + I + i];
            }
        thin_linear(act, down[e], out, n, H, I);
        for (long r = 0; r < n; r++)
            for (long k = 0; k < H; k++) y[rows[r] * H + k] += w[r] * out[r * H + k];
    }
}

static inline float dot(const float* a, const float* b, long n) {
    __m256 acc = _mm256_setzero_ps();
    long i = 0;
    for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
    __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    half = _mm_add_ps(half, _mm_movehl_ps(half, half));
    float s = _mm_cvtss_f32(_mm_add_ss(half, _mm_shuffle_ps(half, half, 1)));
    for (; i < n; i++) s += a[i] * b[i];
    return s;
}

/* RoPE on the interleaved pairs of B x Hn vectors of dim numbers (row b, vector h at x + b*ldb + h*ldh):
   the first `pairs` pairs rotated by (cos, sin)[b * cs_stride + i], the rest copied; y (B, Hn, dim). */
void thin_rope(const float* x, long B, long Hn, long ldb, long ldh, long dim, long pairs, const float* cos,
               const float* sin, long cs_stride, float* y) {
    for (long b = 0; b < B; b++) {
        const float* c = cos + b * cs_stride;
        const float* sn = sin + b * cs_stride;
        for (long h = 0; h < Hn; h++) {
            const float* v = x + b * ldb + h * ldh;
            float* o = y + (b * Hn + h) * dim;
            for (long i = 0; i < pairs; i++) {
                float x0 = v[2 * i], x1 = v[2 * i + 1];
                o[2 * i] = x0 * c[i] - x1 * sn[i];
                o[2 * i + 1] = x1 * c[i] + x0 * sn[i];
            }
            for (long i = 2 * pairs; i < dim; i++) o[i] = v[i];
        }
    }
}

/* (score, position) a before b: the larger score, ties to the lower position (orthon.pretrain.topk). */
static inline int before(float sa, long pa, float sb, long pb) { return sa > sb || (sa == sb && pa < pb); }

/* The DSA indexer's top-k of one decode step, per row b: score[s] = sum_h w[b, h] * relu(scale *
   keys[b, s] . q[b, h]) over the S cached keys (rows key_stride apart per b, d numbers each), -inf where
   visible[b, s] is 0 (visible may be NULL); out[b, :k] the k best positions, best first.
   scratch: S floats + k longs. */
void thin_index_topk(const float* keys, long key_stride, const float* q, const float* w,
                     const unsigned char* visible, long B, long S, long n, long d, float scale, long k,
                     long* out, float* scores, long* heap) {
    for (long b = 0; b < B; b++) {
        const float* kb = keys + b * key_stride;
        for (long s = 0; s < S; s++) {
            float acc = 0.0f;
            for (long h = 0; h < n; h++) {
                float l = scale * dot(kb + s * d, q + (b * n + h) * d, d);
                acc += (l > 0.0f ? l : 0.0f) * w[b * n + h];
            }
            scores[s] = (visible && !visible[b * S + s]) ? -INFINITY : acc + 0.0f;
        }
        /* A heap of the k best so far, its root the worst of them. */
        long size = 0;
        for (long s = 0; s < S; s++) {
            if (size < k) {
                long i = size++;
                heap[i] = s;
                while (i > 0) {
                    long parent = (i - 1) / 2;
                    if (!before(scores[heap[parent]], heap[parent], scores[heap[i]], heap[i])) break;
                    long t = heap[parent]; heap[parent] = heap[i]; heap[i] = t; i = parent;
                }
            } else if (before(scores[s], s, scores[heap[0]], heap[0])) {
                heap[0] = s;
                long i = 0;
                for (;;) {
                    long l = 2 * i + 1, r = l + 1, worst = i;
                    if (l < size && before(scores[heap[worst]], heap[worst], scores[heap[l]], heap[l])) worst = l;
                    if (r < size && before(scores[heap[worst]], heap[worst], scores[heap[r]], heap[r])) worst = r;
                    if (worst == i) break;
                    long t = heap[worst]; heap[worst] = heap[i]; heap[i] = t; i = worst;
                }
            }
        }
        /* Best first: pop the worst into the back. */
        for (long end = size - 1; end >= 0; end--) {
            out[b * k + end] = heap[0];
            heap[0] = heap[end];
            long i = 0, sz = end;
            for (;;) {
                long l = 2 * i + 1, r = l + 1, worst = i;
                if (l < sz && before(scores[heap[worst]], heap[worst], scores[heap[l]], heap[l])) worst = l;
                if (r < sz && before(scores[heap[worst]], heap[worst], scores[heap[r]], heap[r])) worst = r;
                if (worst == i) break;
                long t = heap[worst]; heap[worst] = heap[i]; heap[i] = t; i = worst;
            }
        }
    }
}

/* Absorbed-MLA attention of one decode step: per row b and head h, softmax over keys j of
   scale * q[b, h] . key_j, out[b, h] = sum_j p_j key_j[:rank]. Keys: the first S rows of the row's
   cache (key_stride floats apart per b, D each), or with idx the rows idx[b, :S]; visible[b, pos]
   (row length vis_len, may be NULL) masks positions out. scratch: S floats. */
void thin_latent_attention(const float* q, const float* cache, long key_stride, const long* idx,
                           const unsigned char* visible, long vis_len, long B, long H, long D, long rank,
                           long S, float scale, float* out, float* p) {
    for (long b = 0; b < B; b++) {
        const float* cb = cache + b * key_stride;
        for (long h = 0; h < H; h++) {
            const float* qh = q + (b * H + h) * D;
            float* o = out + (b * H + h) * rank;
            float mx = -INFINITY;
            for (long j = 0; j < S; j++) {
                long pos = idx ? idx[b * S + j] : j;
                p[j] = (visible && !visible[b * vis_len + pos]) ? -INFINITY : scale * dot(qh, cb + pos * D, D);
                if (p[j] > mx) mx = p[j];
            }
            float total = 0.0f;
            for (long j = 0; j < S; j++) { p[j] = p[j] == -INFINITY ? 0.0f : expf(p[j] - mx); total += p[j]; }
            for (long r = 0; r < rank; r++) o[r] = 0.0f;
            for (long j = 0; j < S; j++) {
                if (p[j] == 0.0f) continue;
                const float* key = cb + (idx ? idx[b * S + j] : j) * D;
                float pj = p[j] / total;
                for (long r = 0; r < rank; r++) o[r] += pj * key[r];
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
    lib.thin_rms_norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_float]
    lib.thin_norm_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_float]
    lib.thin_moe.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_long] * 5 + [ctypes.c_void_p] * 3
    lib.thin_rope.argtypes = [ctypes.c_void_p] + [ctypes.c_long] * 6 + [ctypes.c_void_p] * 2 + [ctypes.c_long, ctypes.c_void_p]
    lib.thin_index_topk.argtypes = ([ctypes.c_void_p, ctypes.c_long] + [ctypes.c_void_p] * 3 + [ctypes.c_long] * 4
                                    + [ctypes.c_float, ctypes.c_long] + [ctypes.c_void_p] * 3)
    lib.thin_latent_attention.argtypes = ([ctypes.c_void_p] * 2 + [ctypes.c_long] + [ctypes.c_void_p] * 2
                                          + [ctypes.c_long] * 6 + [ctypes.c_float] + [ctypes.c_void_p] * 2)
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
    """A weight (N, K) as ``F.linear`` takes it, plus its panel-packed copy when the kernel applies.

    ``norm``: the RMSNorm whose output this linear reads (its ``weight`` and ``eps``). Its scale is
    folded into the weight's columns, and the call normalises x itself: ``W (w * x * rstd(x))`` is
    ``(W diag(w)) x`` times each row's rstd, so the norm costs one pass over x inside the kernel call.
    """

    def __init__(self, weight: torch.Tensor, norm: torch.nn.Module | None = None):
        weight = weight.detach()
        self.eps = None
        if norm is not None:
            weight = weight * norm.weight.detach()[None, :]
            self.eps = float(norm.eps)
        self.weight = weight.contiguous()
        self.out_features, self.in_features = self.weight.shape
        self.panels = None
        lib = library()
        if lib is not None and self.weight.dtype == torch.float32 and self.weight.device.type == "cpu":
            N, K = self.weight.shape
            self.panels = torch.empty((N + PANEL - 1) // PANEL * K * PANEL, dtype=torch.float32)
            lib.thin_pack(self.weight.data_ptr(), self.panels.data_ptr(), N, K)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., K) -> (..., N) = x @ weight^T (of rms_norm(x) without its scale, with ``norm``)."""
        rows = x.numel() // self.in_features if x.numel() else 0
        if self.panels is None or not 0 < rows <= MAX_ROWS or x.dtype != torch.float32 or x.requires_grad:
            if self.eps is not None:
                x = F.rms_norm(x, (self.in_features,), None, self.eps)
            return F.linear(x, self.weight)
        flat = x.reshape(rows, self.in_features).contiguous()
        y = torch.empty(rows, self.out_features, dtype=torch.float32)
        if self.eps is None:
            _lib.thin_linear(flat.data_ptr(), self.panels.data_ptr(), y.data_ptr(), rows, self.out_features,
                             self.in_features)
        else:
            _lib.thin_norm_linear(flat.data_ptr(), self.panels.data_ptr(), y.data_ptr(), rows, self.out_features,
                                  self.in_features, self.eps)
        return y.view(*x.shape[:-1], self.out_features)


def rms_norm(x: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """``norm(x)`` for an RMSNorm module in inference: one kernel call for the few fp32 rows of a decode
    step (torch's CPU rms_norm runs about ten ops), torch's kernel otherwise. Rows of x may lie apart
    (a split of a wider tensor), as long as each row is contiguous."""
    K = x.shape[-1]
    rows = x.numel() // K if x.numel() else 0
    strided_rows = x.dim() == 2 and x.stride(-1) == 1
    lib = _lib if _tried else library()
    if (lib is None or not 0 < rows <= MAX_ROWS or x.dtype != torch.float32 or x.device.type != "cpu"
            or norm.weight.dtype != torch.float32 or torch.is_grad_enabled()
            or not (strided_rows or x.is_contiguous())):
        return F.rms_norm(x, (K,), norm.weight, norm.eps)
    y = torch.empty(x.shape, dtype=torch.float32)
    lib.thin_rms_norm(x.data_ptr(), norm.weight.data_ptr(), y.data_ptr(), rows, K,
                       x.stride(0) if strided_rows else K, float(norm.eps))
    return y


class PackedExperts:
    """A stack of SwiGLU experts (gate_up (E, 2I, H), down (E, H, I)) packed for ``thin_moe``: the routed
    experts of a decode step's few rows in one kernel call. ``available`` is False where the kernel is
    not (the caller then runs the experts itself)."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor):
        self.gate_up = [PackedLinear(w) for w in gate_up.unbind(0)]
        self.down = [PackedLinear(w) for w in down.unbind(0)]
        self.num_experts, self.hidden, self.intermediate = gate_up.shape[0], gate_up.shape[2], down.shape[2]
        self.available = all(p.panels is not None for p in self.gate_up + self.down)
        if self.available:
            pointers = ctypes.c_void_p * self.num_experts
            self._gate_up_ptrs = pointers(*(p.panels.data_ptr() for p in self.gate_up))
            self._down_ptrs = pointers(*(p.panels.data_ptr() for p in self.down))

    def applies(self, x: torch.Tensor) -> bool:
        return self.available and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype == torch.float32

    def __call__(self, x: torch.Tensor, chosen: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """(M, H): each row's routed-expert sum. x (M, H) fp32 with ``applies(x)``; chosen (M, k) expert
        indices; weights (M, k) their routing weights."""
        M, k = chosen.shape
        x = x.contiguous()
        chosen = chosen.to(torch.long).contiguous()
        weights = weights.to(torch.float32).contiguous()
        y = torch.zeros(M, self.hidden, dtype=torch.float32)
        scratch = torch.empty(M * (2 * self.hidden + 3 * self.intermediate), dtype=torch.float32)
        _lib.thin_moe(x.data_ptr(), chosen.data_ptr(), weights.data_ptr(), y.data_ptr(), M, k, self.hidden,
                      self.intermediate, self.num_experts, self._gate_up_ptrs, self._down_ptrs, scratch.data_ptr())
        return y


def _decode_kernel_applies(*tensors: torch.Tensor) -> bool:
    lib = _lib if _tried else library()
    return (lib is not None and not torch.is_grad_enabled()
            and all(t.dtype == torch.float32 and t.device.type == "cpu" for t in tensors))


def index_topk(keys: torch.Tensor, length: int, q: torch.Tensor, w: torch.Tensor, scale: float, k: int,
               visible: torch.Tensor | None) -> torch.Tensor | None:
    """The DSA indexer's top-k positions (B, k), best first, ties to the lower position (as
    ``deterministic_topk`` orders them) of one decode step: keys (B, capacity, d) the cache's index-key
    buffer, of which the first ``length`` rows are live; q (B, n, d) the step's index queries; w (B, n)
    their head weights; visible (B, length) bool or None. None where the kernel does not apply."""
    B, n, d = q.shape
    if not (_decode_kernel_applies(keys, q, w) and keys.is_contiguous() and 0 < k <= length <= keys.shape[1]):
        return None
    q, w = q.contiguous(), w.contiguous()
    if visible is not None:
        visible = visible.contiguous()
    out = torch.empty(B, k, dtype=torch.long)
    scores, heap = torch.empty(length, dtype=torch.float32), torch.empty(k, dtype=torch.long)
    _lib.thin_index_topk(keys.data_ptr(), keys.stride(0), q.data_ptr(), w.data_ptr(),
                         None if visible is None else visible.data_ptr(), B, length, n, d, float(scale), k,
                         out.data_ptr(), scores.data_ptr(), heap.data_ptr())
    return out


def latent_attention_step(q: torch.Tensor, cache: torch.Tensor, length: int, scale: float, rank: int,
                          chosen: torch.Tensor | None, visible: torch.Tensor | None) -> torch.Tensor | None:
    """Absorbed-MLA attention of one decode step (``orthon.pretrain.attention.latent_attention`` over the
    cached latents): q (B, H, D); cache (B, capacity, D) the layer's latent buffer, the first ``length``
    rows live; chosen (B, K) the positions to attend (None: all ``length``); visible (B, length) bool or
    None. Returns (B, H, rank), or None where the kernel does not apply."""
    B, H, D = q.shape
    if not (_decode_kernel_applies(q, cache) and cache.is_contiguous() and length <= cache.shape[1]):
        return None
    q = q.contiguous()
    if chosen is not None:
        chosen = chosen.to(torch.long).contiguous()
    if visible is not None:
        visible = visible.contiguous()
    keys = length if chosen is None else chosen.shape[1]
    out = torch.empty(B, H, rank, dtype=torch.float32)
    p = torch.empty(keys, dtype=torch.float32)
    _lib.thin_latent_attention(q.data_ptr(), cache.data_ptr(), cache.stride(0),
                               None if chosen is None else chosen.data_ptr(),
                               None if visible is None else visible.data_ptr(), length, B, H, D, rank, keys,
                               float(scale), out.data_ptr(), p.data_ptr())
    return out


def rope_rows(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rope_dim: int | None = None) -> torch.Tensor | None:
    """``apply_rope`` of a decode step's vectors in one kernel call: x (B, dim) or (B, n, dim), each vector
    contiguous (a split or a head view of a wider tensor will do); cos / sin (B or 1, rope_dim // 2)
    contiguous. rope_dim (default dim): rotate only the first rope_dim numbers and pass the rest (the
    indexer's layout). Returns a new contiguous tensor, or None where the kernel does not apply."""
    if not (_decode_kernel_applies(x, cos, sin) and x.dim() in (2, 3) and x.stride(-1) == 1
            and cos.is_contiguous() and sin.is_contiguous()):
        return None
    squeeze = x.dim() == 2
    x3 = x[:, None] if squeeze else x
    B, n, dim = x3.shape
    pairs = (dim if rope_dim is None else rope_dim) // 2
    y = torch.empty(B, n, dim, dtype=torch.float32)
    _lib.thin_rope(x3.data_ptr(), B, n, x3.stride(0), x3.stride(1), dim, pairs, cos.data_ptr(), sin.data_ptr(),
                   pairs if cos.shape[0] > 1 else 0, y.data_ptr())
    return y[:, 0] if squeeze else y
