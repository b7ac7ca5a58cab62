/* orthon's CPU kernels for DSA sparse attention in a full forward and backward (training, prefill,
   evaluation); pretrain/sparse_kernels.py builds and loads this file. fp32, AVX2 + FMA, OpenMP over
   query rows with the caller's thread count. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MAX_KEYS 4096  /* index_topk at most this (GLM-5: 2048) */

#include "simd_math.h"

/* out[h * os] = scale * a[h] . x over n numbers (n % 8 == 0) for the H rows a[h] = a + h * lda, four
   rows per pass so that x is loaded once for them. */
static void dots(const float* a, long lda, long H, const float* x, long n, float scale, float* out, long os) {
    long h = 0;
    for (; h + 4 <= H; h += 4) {
        const float* a0 = a + h * lda;
        __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps(), s2 = _mm256_setzero_ps(), s3 = _mm256_setzero_ps();
        for (long i = 0; i < n; i += 8) {
            __m256 xv = _mm256_loadu_ps(x + i);
            s0 = _mm256_fmadd_ps(_mm256_loadu_ps(a0 + i), xv, s0);
            s1 = _mm256_fmadd_ps(_mm256_loadu_ps(a0 + lda + i), xv, s1);
            s2 = _mm256_fmadd_ps(_mm256_loadu_ps(a0 + 2 * lda + i), xv, s2);
            s3 = _mm256_fmadd_ps(_mm256_loadu_ps(a0 + 3 * lda + i), xv, s3);
        }
        /* the four sums at once: pairwise adds within lanes, then the two 128-bit halves */
        __m256 pairs = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3));
        __m128 four = _mm_mul_ps(_mm_add_ps(_mm256_castps256_ps128(pairs), _mm256_extractf128_ps(pairs, 1)),
                                 _mm_set1_ps(scale));
        float sums[4];
        _mm_storeu_ps(sums, four);
        for (int i = 0; i < 4; i++) out[(h + i) * os] = sums[i];
    }
    for (; h < H; h++) {
        __m256 s = _mm256_setzero_ps();
        for (long i = 0; i < n; i += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(a + h * lda + i), _mm256_loadu_ps(x + i), s);
        out[h * os] = scale * hsum(s);
    }
}

/* dots for two vectors x0, x1 at once (out0, out1 as out): each row of a is loaded once for both, and
   eight independent sums hide the FMA latency that four leave exposed. Every sum is added up in the
   same order as dots' (the same bits). */
static void dots2(const float* a, long lda, long H, const float* x0, const float* x1, long n, float scale,
                  float* out0, float* out1, long os) {
    long h = 0;
    for (; h + 4 <= H; h += 4) {
        const float* a0 = a + h * lda;
        __m256 s0 = _mm256_setzero_ps(), s1 = s0, s2 = s0, s3 = s0, t0 = s0, t1 = s0, t2 = s0, t3 = s0;
        for (long i = 0; i < n; i += 8) {
            __m256 u = _mm256_loadu_ps(x0 + i), v = _mm256_loadu_ps(x1 + i);
            __m256 r0 = _mm256_loadu_ps(a0 + i), r1 = _mm256_loadu_ps(a0 + lda + i);
            __m256 r2 = _mm256_loadu_ps(a0 + 2 * lda + i), r3 = _mm256_loadu_ps(a0 + 3 * lda + i);
            s0 = _mm256_fmadd_ps(r0, u, s0); t0 = _mm256_fmadd_ps(r0, v, t0);
            s1 = _mm256_fmadd_ps(r1, u, s1); t1 = _mm256_fmadd_ps(r1, v, t1);
            s2 = _mm256_fmadd_ps(r2, u, s2); t2 = _mm256_fmadd_ps(r2, v, t2);
            s3 = _mm256_fmadd_ps(r3, u, s3); t3 = _mm256_fmadd_ps(r3, v, t3);
        }
        /* the eight sums at once: dots' pairwise tree within each 128-bit half, then the halves added */
        __m256 ps = _mm256_hadd_ps(_mm256_hadd_ps(s0, s1), _mm256_hadd_ps(s2, s3));
        __m256 pt = _mm256_hadd_ps(_mm256_hadd_ps(t0, t1), _mm256_hadd_ps(t2, t3));
        __m256 both = _mm256_add_ps(_mm256_permute2f128_ps(ps, pt, 0x20), _mm256_permute2f128_ps(ps, pt, 0x31));
        float sums[8];
        _mm256_storeu_ps(sums, _mm256_mul_ps(both, _mm256_set1_ps(scale)));
        for (int i = 0; i < 4; i++) { out0[(h + i) * os] = sums[i]; out1[(h + i) * os] = sums[4 + i]; }
    }
    if (h < H) {
        dots(a + h * lda, lda, H - h, x0, n, scale, out0 + h * os, os);
        dots(a + h * lda, lda, H - h, x1, n, scale, out1 + h * os, os);
    }
}

/* out[h * K + j] = scale * a[h] . (the first n numbers of key j's latent) over the H rows a[h] = a + h * lda,
   for each visible key j of the query's idx row ix (-1: hidden), two keys a pass; the value hidden at the
   hidden keys. Fills off[j] (the latent's offset in lat, -1 when hidden) and seen (the visible keys in
   order); returns their count. */
static long key_dots(const float* a, long lda, long H, const long* ix, long K, const float* lat, long D, long n,
                     float scale, float hidden, float* out, long* off, long* seen) {
    long m = 0;
    for (long j = 0; j < K; j++) {
        off[j] = ix[j] < 0 ? -1 : ix[j] * D;
        if (off[j] >= 0) seen[m++] = j;
        else for (long h = 0; h < H; h++) out[h * K + j] = hidden;
    }
    for (long i = 0; i + 1 < m; i += 2)
        dots2(a, lda, H, lat + off[seen[i]], lat + off[seen[i + 1]], n, scale, out + seen[i], out + seen[i + 1], K);
    if (m % 2) dots(a, lda, H, lat + off[seen[m - 1]], n, scale, out + seen[m - 1], K);
    return m;
}

/* e^x for x <= 0 (softmax's shifted logits): 0 below -87 (e^x under FLT_MIN). */
static inline __m256 exp_nonpositive(__m256 x) {
    return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(-87.0f), _CMP_LT_OQ), exp_ps(x));
}

/* p[0:K] <- the softmax of p, whose hidden keys hold -inf, 0 at those (all 0 if every key is hidden). */
static void softmax_keys(float* p, long K) {
    __m256 vmax = _mm256_set1_ps(-INFINITY);
    long j = 0;
    for (; j + 8 <= K; j += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(p + j));
    __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vmax), _mm256_extractf128_ps(vmax, 1));
    m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    float mx = _mm_cvtss_f32(_mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1)));
    for (; j < K; j++) if (p[j] > mx) mx = p[j];
    if (mx == -INFINITY) { memset(p, 0, sizeof(float) * K); return; }
    __m256 vmx = _mm256_set1_ps(mx), total = _mm256_setzero_ps();
    for (j = 0; j + 8 <= K; j += 8) {  /* a hidden key's e^(-inf) is 0 */
        __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(p + j), vmx));
        _mm256_storeu_ps(p + j, e);
        total = _mm256_add_ps(total, e);
    }
    float sum = hsum(total);
    for (; j < K; j++) { p[j] = p[j] == -INFINITY ? 0.0f : expf(p[j] - mx); sum += p[j]; }
    __m256 inv = _mm256_set1_ps(1.0f / sum);
    for (j = 0; j + 8 <= K; j += 8) _mm256_storeu_ps(p + j, _mm256_mul_ps(_mm256_loadu_ps(p + j), inv));
    for (; j < K; j++) p[j] *= 1.0f / sum;
}

/* y[0 : 8 NV] = sum_j c[j] * (base + off[j])[0 : 8 NV] over j < count with off[j] >= 0, the sums held in
   registers. */
#define COMBINE(NV) \
static void combine##NV(const float* c, const float* base, const long* off, long count, float* y) { \
    __m256 acc[NV]; \
    for (int v = 0; v < NV; v++) acc[v] = _mm256_setzero_ps(); \
    for (long j = 0; j < count; j++) { \
        if (off[j] < 0) continue; \
        const float* x = base + off[j]; \
        __m256 cj = _mm256_set1_ps(c[j]); \
        for (int v = 0; v < NV; v++) acc[v] = _mm256_fmadd_ps(cj, _mm256_loadu_ps(x + 8 * v), acc[v]); \
    } \
    for (int v = 0; v < NV; v++) _mm256_storeu_ps(y + 8 * v, acc[v]); \
}
COMBINE(1) COMBINE(2) COMBINE(3) COMBINE(4) COMBINE(5) COMBINE(6) COMBINE(7) COMBINE(8)
/* The same over w numbers (w % 8 == 0), 64 at a time (a switch, so that each block's function is inlined). */
static void combine(const float* c, const float* base, const long* off, long count, long w, float* y) {
    for (long d = 0; d < w; d += 64)
        switch ((w - d < 64 ? w - d : 64) / 8) {
            case 1: combine1(c, base + d, off, count, y + d); break;
            case 2: combine2(c, base + d, off, count, y + d); break;
            case 3: combine3(c, base + d, off, count, y + d); break;
            case 4: combine4(c, base + d, off, count, y + d); break;
            case 5: combine5(c, base + d, off, count, y + d); break;
            case 6: combine6(c, base + d, off, count, y + d); break;
            case 7: combine7(c, base + d, off, count, y + d); break;
            default: combine8(c, base + d, off, count, y + d);
        }
}

/* combine for four heads at once: y[h * ys : h * ys + w] = sum over the visible keys j = seen[0 : m] of
   c[h * K + j] * (base + off[j])[0 : w], h < 4, 16 numbers at a time (w % 16 == 0): each latent row is
   loaded once for the four heads, and eight independent sums hide the FMA latency. Every sum runs in key
   order, as combine's (the same bits). */
static void combine_heads4(const float* c, long K, const float* base, const long* off, const long* seen, long m,
                           long w, float* y, long ys) {
    for (long d = 0; d < w; d += 16) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, b0 = a0, b1 = a0, e0 = a0, e1 = a0, f0 = a0, f1 = a0;
        for (long i = 0; i < m; i++) {
            long j = seen[i];
            const float* x = base + off[j] + d;
            __m256 x0 = _mm256_loadu_ps(x), x1 = _mm256_loadu_ps(x + 8);
            __m256 ca = _mm256_broadcast_ss(c + j), cb = _mm256_broadcast_ss(c + K + j);
            __m256 ce = _mm256_broadcast_ss(c + 2 * K + j), cf = _mm256_broadcast_ss(c + 3 * K + j);
            a0 = _mm256_fmadd_ps(ca, x0, a0); a1 = _mm256_fmadd_ps(ca, x1, a1);
            b0 = _mm256_fmadd_ps(cb, x0, b0); b1 = _mm256_fmadd_ps(cb, x1, b1);
            e0 = _mm256_fmadd_ps(ce, x0, e0); e1 = _mm256_fmadd_ps(ce, x1, e1);
            f0 = _mm256_fmadd_ps(cf, x0, f0); f1 = _mm256_fmadd_ps(cf, x1, f1);
        }
        float* yd = y + d;
        _mm256_storeu_ps(yd, a0); _mm256_storeu_ps(yd + 8, a1);
        _mm256_storeu_ps(yd + ys, b0); _mm256_storeu_ps(yd + ys + 8, b1);
        _mm256_storeu_ps(yd + 2 * ys, e0); _mm256_storeu_ps(yd + 2 * ys + 8, e1);
        _mm256_storeu_ps(yd + 3 * ys, f0); _mm256_storeu_ps(yd + 3 * ys + 8, f1);
    }
}

/* Every head's combine of one query: c (H, K) coefficients, y (H, w) (head stride w). */
static void combine_heads(const float* c, long H, long K, const float* base, const long* off, const long* seen,
                          long m, long w, float* y) {
    long h = 0;
    if (w % 16 == 0)
        for (; h + 4 <= H; h += 4) combine_heads4(c + h * K, K, base, off, seen, m, w, y + h * w, w);
    for (; h < H; h++) combine(c + h * K, base, off, K, w, y + h * w);
}

/* One key's gradient, added to g[0 : D]: sum_h ds[h K] q[h D :] (its scores' share) and, over its first
   R numbers (its value), sum_h p[h K] dout[h R :]; one read and one write of g per 8 NV numbers. */
#define KEY_GRAD(NV) \
static void key_grad##NV(const float* ds, const float* p, long K, const float* q, const float* dout, long H, long D, \
                         long R, long d0, float* g) { \
    __m256 acc[NV]; \
    for (int v = 0; v < NV; v++) acc[v] = _mm256_loadu_ps(g + d0 + 8 * v); \
    for (long h = 0; h < H; h++) { \
        __m256 c = _mm256_set1_ps(ds[h * K]); \
        for (int v = 0; v < NV; v++) acc[v] = _mm256_fmadd_ps(c, _mm256_loadu_ps(q + h * D + d0 + 8 * v), acc[v]); \
    } \
    if (d0 < R) \
        for (long h = 0; h < H; h++) { \
            __m256 c = _mm256_set1_ps(p[h * K]); \
            for (int v = 0; v < NV; v++) acc[v] = _mm256_fmadd_ps(c, _mm256_loadu_ps(dout + h * R + d0 + 8 * v), acc[v]); \
        } \
    for (int v = 0; v < NV; v++) _mm256_storeu_ps(g + d0 + 8 * v, acc[v]); \
}
KEY_GRAD(1) KEY_GRAD(2) KEY_GRAD(3) KEY_GRAD(4) KEY_GRAD(5) KEY_GRAD(6) KEY_GRAD(7) KEY_GRAD(8)
static void key_grad(const float* ds, const float* p, long K, const float* q, const float* dout, long H, long D, long R,
                     float* g) {
    /* blocks of up to 64 numbers, each inside or outside the value part (the first R); a switch, not a
       table of pointers, so that each block's function is inlined */
    for (long d0 = 0; d0 < D;) {
        long end = d0 < R ? R : D;
        long w = end - d0 < 64 ? end - d0 : 64;
        switch (w / 8) {
            case 1: key_grad1(ds, p, K, q, dout, H, D, R, d0, g); break;
            case 2: key_grad2(ds, p, K, q, dout, H, D, R, d0, g); break;
            case 3: key_grad3(ds, p, K, q, dout, H, D, R, d0, g); break;
            case 4: key_grad4(ds, p, K, q, dout, H, D, R, d0, g); break;
            case 5: key_grad5(ds, p, K, q, dout, H, D, R, d0, g); break;
            case 6: key_grad6(ds, p, K, q, dout, H, D, R, d0, g); break;
            case 7: key_grad7(ds, p, K, q, dout, H, D, R, d0, g); break;
            default: key_grad8(ds, p, K, q, dout, H, D, R, d0, g);
        }
        d0 += w;
    }
}

/* Absorbed-MLA attention of N queries over their own K latents each.
   q (N, H, D) absorbed queries; lat (rows, D) latents [c_kv; k_rope]; idx (N, K) each query's latent rows,
   -1 for a key it may not see. out (N, H, R): sum_j p[h, j] lat[idx[j], :R]; probs (N, H, K): the softmax
   of scale * q[h] . lat[idx[j]] over the visible j (0 elsewhere), kept for the backward. */
void sparse_attention_forward(const float* q, const float* lat, const long* idx, long N, long H, long K, long D,
                              long R, float scale, float* out, float* probs, int threads) {
    #pragma omp parallel num_threads(threads)
    {
        long off[MAX_KEYS];
        #pragma omp for schedule(static)
        for (long n = 0; n < N; n++) {
            const long* ix = idx + n * K;
            float* p = probs + n * H * K;
            long seen[MAX_KEYS];  /* the logits; a hidden key's -inf makes its probability 0 */
            long m = key_dots(q + n * H * D, D, H, ix, K, lat, D, D, scale, -INFINITY, p, off, seen);
            for (long h = 0; h < H; h++) softmax_keys(p + h * K, K);
            combine_heads(p, H, K, lat, off, seen, m, R, out + n * H * R);
        }
    }
}

/* Its backward, given dout (N, H, R): dq (N, H, D) and dlat (rows, D) written. The queries and rows come
   in ``groups`` equal blocks (the batch rows), a group's queries reading only its own rows. The latents'
   gradient is pushed query by query: each query's gradient rows are added into the rows it read while its
   q and dout sit in L1 (a pull, row by row, would fetch them from a random query per read). Every row
   receives its additions in query order whatever the thread count (per-thread partial sums would make DDP
   ranks and one process differ): threads split the groups, and each group's rows into ranges when there
   are fewer groups than threads (each range scanning the group's reads for its own rows).
   Scratch from the caller: ds_all (N, H, K) floats, the logits' gradient, kept for the second pass. */
void sparse_attention_backward(const float* q, const float* lat, const long* idx, const float* probs,
                               const float* dout, long N, long H, long K, long D, long R, float scale,
                               float* dq, float* dlat, long rows, long groups, float* ds_all, int threads) {
    long per_group = (threads + groups - 1) / groups;  /* row ranges per group */
    long queries = N / groups, group_rows = rows / groups;
    #pragma omp parallel num_threads(threads)
    {
        long off[MAX_KEYS];
        #pragma omp for schedule(static)
        for (long n = 0; n < N; n++) {
            const long* ix = idx + n * K;
            const float* p = probs + n * H * K;
            const float* dn = dout + n * H * R;
            float* ds = ds_all + n * H * K;
            long seen[MAX_KEYS];  /* d probs = dout . value (0 for a hidden key, whose prob is 0) */
            long m = key_dots(dn, R, H, ix, K, lat, D, R, 1.0f, 0.0f, ds, off, seen);
            for (long h = 0; h < H; h++) {  /* softmax backward, times the logits' scale */
                float* dh = ds + h * K;
                const float* ph = p + h * K;
                __m256 acc = _mm256_setzero_ps();
                long j = 0;
                for (; j + 8 <= K; j += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(ph + j), _mm256_loadu_ps(dh + j), acc);
                float inner = hsum(acc);
                for (; j < K; j++) inner += ph[j] * dh[j];
                __m256 vin = _mm256_set1_ps(inner), vscale = _mm256_set1_ps(scale);
                for (j = 0; j + 8 <= K; j += 8)
                    _mm256_storeu_ps(dh + j, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(ph + j),
                                                                         _mm256_sub_ps(_mm256_loadu_ps(dh + j), vin)), vscale));
                for (; j < K; j++) dh[j] = ph[j] * (dh[j] - inner) * scale;
            }
            combine_heads(ds, H, K, lat, off, seen, m, D, dq + n * H * D);
        }
        /* (the loop's implicit barrier: every ds is written before any is read below) */
        #pragma omp for schedule(dynamic, 1)
        for (long piece = 0; piece < groups * per_group; piece++) {
            long g = piece / per_group, part = piece % per_group;
            long lo = g * group_rows + group_rows * part / per_group;
            long hi = g * group_rows + group_rows * (part + 1) / per_group;
            memset(dlat + lo * D, 0, sizeof(float) * (hi - lo) * D);
            for (long n = g * queries; n < (g + 1) * queries; n++) {
                const long* ix = idx + n * K;
                for (long j = 0; j < K; j++)
                    if (ix[j] >= lo && ix[j] < hi)
                        key_grad(ds_all + n * H * K + j, probs + n * H * K + j, K, q + n * H * D, dout + n * H * R,
                                 H, D, R, dlat + ix[j] * D);
            }
        }
    }
}

/* A (score, position) pair as one integer that orders as the pair does: the larger score first, ties to
   the lower position (orthon.pretrain.topk's total order). -0.0 is taken as +0.0, as they compare equal. */
static inline uint64_t rank_key(float score, long pos) {
    union { float f; uint32_t u; } v = {score + 0.0f};
    uint32_t ordered = (v.u & 0x80000000u) ? ~v.u : (v.u | 0x80000000u);
    return ((uint64_t)ordered << 32) | (uint32_t)(0xFFFFFFFFu - (uint32_t)pos);
}
static inline long key_position(uint64_t key) { return (long)(0xFFFFFFFFu - (uint32_t)key); }

/* Reorder a[0:n] (distinct keys) so that a[0:k] are its k largest, in any order: quickselect with a
   branch-free partition (the keys' order is random, so a branching one mispredicts every other key). */
static void select_largest(uint64_t* a, long n, long k) {
    long lo = 0, hi = n - 1;
    while (lo < hi) {
        long mid = lo + (hi - lo) / 2;  /* the median of three, moved to a[hi], is the pivot */
        uint64_t x = a[lo], y = a[mid], z = a[hi];
        long m = x > y ? (y > z ? mid : (x > z ? hi : lo)) : (x > z ? lo : (y > z ? hi : mid));
        { uint64_t t = a[m]; a[m] = a[hi]; a[hi] = t; }
        uint64_t pivot = a[hi];
        long store = lo;  /* a[lo:store] > pivot */
        for (long i = lo; i < hi; i++) {
            uint64_t v = a[i];
            a[i] = a[store];
            a[store] = v;
            store += v > pivot;
        }
        a[hi] = a[store];
        a[store] = pivot;
        if (k - 1 < store) hi = store - 1;
        else if (k - 1 > store) lo = store + 1;
        else return;
    }
}

static int descending(const void* a, const void* b) {
    uint64_t x = *(const uint64_t*)a, y = *(const uint64_t*)b;
    return (x < y) - (x > y);
}

/* The DSA indexer's top-k of every query of a causal sequence (query t at slot t; keys the same T
   tokens): score[s] = sum_h w[t, h] * relu(scale * q[t, h] . key[s]) for s <= t (and, with docs, in the
   query's document), -inf elsewhere; out[t, :k] the k best positions (k <= T), ties to the lower
   position as orthon.pretrain.topk orders them, best first if ordered (rows with fewer than k visible
   keys end with the lowest-positioned invisible ones). q (B, T, n, d); w (B, T, n); keys_t
   (B, ld / 32, d, 32) the keys in
   tiles of 32 transposed (each tile contiguous: a (d, ld) transpose would put the rows a tile reads
   4 KB apart at T = 1024, all in one set of the L1 cache), ld >= T a multiple of 32, zero past T;
   docs (B, T) or NULL. */
void causal_index_topk(const float* q, const float* w, const float* keys_t, long ld, const long* docs, long B,
                       long T, long n, long d, float scale, long k, int ordered, long* out, int threads) {
    #pragma omp parallel num_threads(threads)
    {
        float* s = malloc(sizeof(float) * ld);
        uint64_t* keys = malloc(sizeof(uint64_t) * ld);
        __m256 zero = _mm256_setzero_ps(), vscale = _mm256_set1_ps(scale);
        #pragma omp for schedule(dynamic, 16)
        for (long row = 0; row < B * T; row++) {
            long b = row / T, t = row % T;
            long width = t + 1 > k ? t + 1 : k;  /* past it every key is invisible and ranks below these */
            if (width > T) width = T;
            for (long s0 = 0; s0 < width; s0 += 32) {  /* 32 keys at a time: four independent FMA chains */
                const float* tile = keys_t + (b * ld + s0) * d;  /* the 32 keys' (d, 32) tile */
                __m256 t0 = zero, t1 = zero, t2 = zero, t3 = zero;
                for (long h = 0; h < n; h++) {
                    const float* qh = q + (row * n + h) * d;
                    __m256 a0 = zero, a1 = zero, a2 = zero, a3 = zero;
                    for (long j = 0; j < d; j++) {
                        __m256 qv = _mm256_broadcast_ss(qh + j);
                        const float* kj = tile + j * 32;
                        a0 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kj), a0);
                        a1 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kj + 8), a1);
                        a2 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kj + 16), a2);
                        a3 = _mm256_fmadd_ps(qv, _mm256_loadu_ps(kj + 24), a3);
                    }
                    __m256 wh = _mm256_broadcast_ss(w + row * n + h);
                    t0 = _mm256_fmadd_ps(_mm256_max_ps(_mm256_mul_ps(a0, vscale), zero), wh, t0);
                    t1 = _mm256_fmadd_ps(_mm256_max_ps(_mm256_mul_ps(a1, vscale), zero), wh, t1);
                    t2 = _mm256_fmadd_ps(_mm256_max_ps(_mm256_mul_ps(a2, vscale), zero), wh, t2);
                    t3 = _mm256_fmadd_ps(_mm256_max_ps(_mm256_mul_ps(a3, vscale), zero), wh, t3);
                }
                _mm256_storeu_ps(s + s0, t0); _mm256_storeu_ps(s + s0 + 8, t1);
                _mm256_storeu_ps(s + s0 + 16, t2); _mm256_storeu_ps(s + s0 + 24, t3);
            }
            for (long j = 0; j < width; j++) {
                int seen = j <= t && !(docs && docs[b * T + j] != docs[row]);
                keys[j] = rank_key(seen ? s[j] : -INFINITY, j);
            }
            if (k < width) select_largest(keys, width, k);  /* else every key is among the k */
            if (ordered) qsort(keys, k, sizeof(uint64_t), descending);
            for (long i = 0; i < k; i++) out[row * k + i] = key_position(keys[i]);
        }
        free(s);
        free(keys);
    }
}
