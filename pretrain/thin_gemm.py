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
#include <math.h>
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
BLOCK(3) BLOCK(4) BLOCK(5) BLOCK(6)

/* One or two rows: too few independent FMA chains to hide the FMA latency, so each row's sum runs in
   KS interleaved sets over k (8 accumulators in all), added at the end. */
#define BLOCK_SPLIT_K(MB, KS) \
static inline void block##MB(const float* x, const float* panel, float* y, long K, long ldy, long ncols) { \
    __m256 a0[MB][KS], a1[MB][KS]; \
    for (int m = 0; m < MB; m++) \
        for (int s = 0; s < KS; s++) { a0[m][s] = _mm256_setzero_ps(); a1[m][s] = _mm256_setzero_ps(); } \
    long k = 0; \
    for (; k + KS <= K; k += KS) \
        for (int s = 0; s < KS; s++) { \
            __m256 w0 = _mm256_loadu_ps(panel + (k + s) * 16), w1 = _mm256_loadu_ps(panel + (k + s) * 16 + 8); \
            for (int m = 0; m < MB; m++) { \
                __m256 b = _mm256_broadcast_ss(x + m * K + k + s); \
                a0[m][s] = _mm256_fmadd_ps(b, w0, a0[m][s]); \
                a1[m][s] = _mm256_fmadd_ps(b, w1, a1[m][s]); \
            } \
        } \
    for (; k < K; k++) { \
        __m256 w0 = _mm256_loadu_ps(panel + k * 16), w1 = _mm256_loadu_ps(panel + k * 16 + 8); \
        for (int m = 0; m < MB; m++) { \
            __m256 b = _mm256_broadcast_ss(x + m * K + k); \
            a0[m][0] = _mm256_fmadd_ps(b, w0, a0[m][0]); \
            a1[m][0] = _mm256_fmadd_ps(b, w1, a1[m][0]); \
        } \
    } \
    for (int m = 0; m < MB; m++) { \
        for (int s = 1; s < KS; s++) { a0[m][0] = _mm256_add_ps(a0[m][0], a0[m][s]); a1[m][0] = _mm256_add_ps(a1[m][0], a1[m][s]); } \
        float tmp[16]; \
        _mm256_storeu_ps(tmp, a0[m][0]); _mm256_storeu_ps(tmp + 8, a1[m][0]); \
        memcpy(y + m * ldy, tmp, sizeof(float) * ncols); \
    } \
}
BLOCK_SPLIT_K(1, 4) BLOCK_SPLIT_K(2, 2)

/* AVX-512 (where the CPU has it): a panel's 16 columns are one register, so up to 8 rows go in one
   block, each row's sum in KS interleaved sets over k (KS * MB <= 16 accumulators). */
#define ZBLOCK(MB, KS) \
__attribute__((target("avx512f"))) \
static void zblock##MB(const float* x, const float* panel, float* y, long K, long ldy, long ncols) { \
    __m512 a[MB][KS]; \
    for (int m = 0; m < MB; m++) for (int s = 0; s < KS; s++) a[m][s] = _mm512_setzero_ps(); \
    long k = 0; \
    for (; k + KS <= K; k += KS) \
        for (int s = 0; s < KS; s++) { \
            __m512 w = _mm512_loadu_ps(panel + (k + s) * 16); \
            for (int m = 0; m < MB; m++) a[m][s] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + k + s]), w, a[m][s]); \
        } \
    for (; k < K; k++) { \
        __m512 w = _mm512_loadu_ps(panel + k * 16); \
        for (int m = 0; m < MB; m++) a[m][0] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + k]), w, a[m][0]); \
    } \
    for (int m = 0; m < MB; m++) { \
        for (int s = 1; s < KS; s++) a[m][0] = _mm512_add_ps(a[m][0], a[m][s]); \
        _mm512_mask_storeu_ps(y + m * ldy, (__mmask16)((1u << ncols) - 1), a[m][0]); \
    } \
}
ZBLOCK(1, 8) ZBLOCK(2, 4) ZBLOCK(3, 4) ZBLOCK(4, 4) ZBLOCK(5, 2) ZBLOCK(6, 2) ZBLOCK(7, 2) ZBLOCK(8, 2)

__attribute__((target("avx512f")))
static void thin_linear_avx512(const float* x, const float* p, float* y, long M, long N, long K) {
    for (long nb = 0; nb < (N + 15) / 16; nb++) {
        const float* panel = p + nb * K * 16;
        long n0 = nb * 16, ncols = N - n0 < 16 ? N - n0 : 16;
        for (long m0 = 0; m0 < M; m0 += 8) {
            const float* xs = x + m0 * K;
            float* ys = y + m0 * N + n0;
            switch (M - m0 < 8 ? M - m0 : 8) {
                case 1: zblock1(xs, panel, ys, K, N, ncols); break;
                case 2: zblock2(xs, panel, ys, K, N, ncols); break;
                case 3: zblock3(xs, panel, ys, K, N, ncols); break;
                case 4: zblock4(xs, panel, ys, K, N, ncols); break;
                case 5: zblock5(xs, panel, ys, K, N, ncols); break;
                case 6: zblock6(xs, panel, ys, K, N, ncols); break;
                case 7: zblock7(xs, panel, ys, K, N, ncols); break;
                default: zblock8(xs, panel, ys, K, N, ncols); break;
            }
        }
    }
}

static void thin_linear_avx2(const float* x, const float* p, float* y, long M, long N, long K);

/* y (M x N) = x (M x K) @ w^T, w packed by thin_pack: the AVX-512 kernel where the CPU has it. */
static int avx512 = -1;

/* 1: the AVX-512 kernel where the CPU has it (the default); 0: AVX2 (tests compare the two). */
void thin_use_avx512(int on) { avx512 = on && __builtin_cpu_supports("avx512f"); }

void thin_linear(const float* x, const float* p, float* y, long M, long N, long K) {
    if (avx512 < 0) thin_use_avx512(1);
    if (avx512) thin_linear_avx512(x, p, y, M, N, K);
    else thin_linear_avx2(x, p, y, M, N, K);
}

/* AVX2: rows in equal blocks of up to 6 (12 accumulators: 8 rows go 4 + 4, not 6 + 2, whose 2-row
   block would use a third of the FMA units' width). */
static void thin_linear_avx2(const float* x, const float* p, float* y, long M, long N, long K) {
    long blocks = (M + 5) / 6, rows = blocks ? (M + blocks - 1) / blocks : 0;
    for (long nb = 0; nb < (N + 15) / 16; nb++) {
        const float* panel = p + nb * K * 16;
        long n0 = nb * 16, ncols = N - n0 < 16 ? N - n0 : 16;
        for (long m0 = 0; m0 < M; m0 += rows) {
            const float* xs = x + m0 * K;
            float* ys = y + m0 * N + n0;
            switch (M - m0 < rows ? M - m0 : rows) {
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

/* The noaux_tc routing of one row (orthon.pretrain.moe.route): sigmoid scores, chosen by score + bias
   among the topk_group best groups (a group scores the sum of its two best), the chosen experts'
   scores (normalised to sum 1 if norm_topk) times scaling; ties to the lower index. */
static void route_row(const float* logits, const float* bias, long E, long topk, long n_group, long topk_group,
                      int norm_topk, float scaling, long* chosen, float* weights) {
    float score[256], choice[256];
    for (long e = 0; e < E; e++) {
        score[e] = 1.0f / (1.0f + expf(-logits[e]));
        choice[e] = score[e] + bias[e];
    }
    if (n_group > 1) {
        long size = E / n_group;
        float group[256];
        for (long g = 0; g < n_group; g++) {
            float a = -INFINITY, b = -INFINITY;
            for (long e = g * size; e < (g + 1) * size; e++) {
                if (choice[e] > a) { b = a; a = choice[e]; } else if (choice[e] > b) b = choice[e];
            }
            group[g] = a + b;
        }
        for (long kept = 0; kept < n_group; kept++) {  /* drop all but the topk_group best groups */
            long rank = 0;
            for (long g = 0; g < n_group; g++)
                if (group[g] > group[kept] || (group[g] == group[kept] && g < kept)) rank++;
            if (rank >= topk_group)
                for (long e = kept * size; e < (kept + 1) * size; e++) choice[e] = -INFINITY;
        }
    }
    float total = 0.0f;
    for (long j = 0; j < topk; j++) {
        long best = -1;
        for (long e = 0; e < E; e++) {
            int taken = 0;
            for (long i = 0; i < j; i++) taken |= chosen[i] == e;
            if (!taken && (best < 0 || choice[e] > choice[best])) best = e;
        }
        chosen[j] = best;
        weights[j] = score[best];
        total += score[best];
    }
    for (long j = 0; j < topk; j++)
        weights[j] = (norm_topk ? weights[j] / (total + 1e-20f) : weights[j]) * scaling;
}

/* The MoE block of a few rows (M <= 64, E <= 256): routing (route_row on logits, ld_logits apart), then
   y (M x H) = sum over each row's choices of weight * down_e(silu(gate_e x) * up_e x), the rows grouped by
   expert so each chosen expert's packed weights are read once, plus the shared expert's
   shared_down(silu(g) * u) of shared_in = [g, u] (M x 2 Is, ld_shared apart; skipped when shared_down is
   NULL). gate_up[e]: (2I x H) packed, down[e]: (H x I) packed. chosen / weights: (M x topk) out.
   scratch: M * (2 H + 3 I + Is) floats. */
void thin_moe(const float* x, long M, long H, long I, long E, const float* logits, long ld_logits,
              const float* bias, long topk, long n_group, long topk_group, long norm_topk, float scaling,
              const float* const* gate_up, const float* const* down, const float* shared_in, long ld_shared,
              long Is, const float* shared_down, float* y, long* chosen, float* weights, float* scratch) {
    float* xb = scratch;            /* n x H */
    float* h = xb + M * H;          /* n x 2I */
    float* act = h + M * 2 * I;     /* n x I, then M x Is */
    float* out = act + M * (I > Is ? I : Is);  /* n x H */
    long rows[64]; float w[64];
    for (long m = 0; m < M; m++)
        route_row(logits + m * ld_logits, bias, E, topk, n_group, topk_group, (int)norm_topk, scaling,
                  chosen + m * topk, weights + m * topk);
    memset(y, 0, sizeof(float) * M * H);
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
    if (shared_down) {
        for (long m = 0; m < M; m++)
            for (long i = 0; i < Is; i++) {
                float g = shared_in[m * ld_shared + i];
                act[m * Is + i] = g / (1.0f + expf(-g)) * shared_in[m * ld_shared + Is + i];
            }
        thin_linear(act, shared_down, out, M, H, Is);
        for (long k = 0; k < M * H; k++) y[k] += out[k];
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
    lib.thin_use_avx512.argtypes = [ctypes.c_int]
    lib.thin_rms_norm.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_float]
    lib.thin_norm_linear.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_long] * 3 + [ctypes.c_float]
    lib.thin_moe.argtypes = ([ctypes.c_void_p] + [ctypes.c_long] * 4 + [ctypes.c_void_p, ctypes.c_long, ctypes.c_void_p]
                             + [ctypes.c_long] * 4 + [ctypes.c_float] + [ctypes.c_void_p] * 3 + [ctypes.c_long] * 2
                             + [ctypes.c_void_p] * 5)
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


class PackedMoE:
    """An MoE block's routed experts (gate_up (E, 2I, H), down (E, H, I)) and shared expert's down
    projection packed for ``thin_moe``: a decode step's routing, routed experts and shared expert in one
    kernel call. ``gate_up`` / ``down`` keep each routed expert's PackedLinear for callers that run the
    experts themselves; ``available`` is False where the kernel is not."""

    def __init__(self, gate_up: torch.Tensor, down: torch.Tensor, shared_down: PackedLinear | None, routing: dict):
        self.gate_up = [PackedLinear(w) for w in gate_up.unbind(0)]
        self.down = [PackedLinear(w) for w in down.unbind(0)]
        self.shared_down = shared_down
        self.num_experts, self.hidden, self.intermediate = gate_up.shape[0], gate_up.shape[2], down.shape[2]
        self.routing = routing  # top_k, n_group, topk_group, norm_topk_prob, scaling
        packed = self.gate_up + self.down + ([self.shared_down] if self.shared_down is not None else [])
        self.available = self.num_experts <= 256 and all(p.panels is not None for p in packed)
        if self.available:
            pointers = ctypes.c_void_p * self.num_experts
            self._gate_up_ptrs = pointers(*(p.panels.data_ptr() for p in self.gate_up))
            self._down_ptrs = pointers(*(p.panels.data_ptr() for p in self.down))

    def applies(self, x: torch.Tensor) -> bool:
        return self.available and x.dim() == 2 and 0 < x.shape[0] <= MAX_ROWS and x.dtype == torch.float32

    def __call__(self, x: torch.Tensor, logits: torch.Tensor, bias: torch.Tensor,
                 shared_in: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x (M, H) the normed rows (``applies(x)``), logits (M, E) their router logits and bias (E,) the
        router's score-correction bias, fp32, rows contiguous; shared_in (M, 2 Is) the shared expert's
        gate/up outputs (None without one). Returns the block's output (M, H) and the routing:
        chosen experts (M, k) and their weights (M, k)."""
        r = self.routing
        M, k = x.shape[0], r["top_k"]
        x, bias = x.contiguous(), bias.float().contiguous()
        y = torch.empty(M, self.hidden, dtype=torch.float32)
        chosen = torch.empty(M, k, dtype=torch.long)
        weights = torch.empty(M, k, dtype=torch.float32)
        Is = 0 if self.shared_down is None else self.shared_down.in_features
        scratch = torch.empty(M * (2 * self.hidden + 3 * self.intermediate + Is), dtype=torch.float32)
        _lib.thin_moe(x.data_ptr(), M, self.hidden, self.intermediate, self.num_experts, logits.data_ptr(),
                      logits.stride(0), bias.data_ptr(), k, r["n_group"], r["topk_group"], int(r["norm_topk_prob"]),
                      float(r["scaling"]), self._gate_up_ptrs, self._down_ptrs,
                      None if shared_in is None else shared_in.data_ptr(), 0 if shared_in is None else shared_in.stride(0),
                      Is, None if self.shared_down is None else self.shared_down.panels.data_ptr(),
                      y.data_ptr(), chosen.data_ptr(), weights.data_ptr(), scratch.data_ptr())
        return y, chosen, weights


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
