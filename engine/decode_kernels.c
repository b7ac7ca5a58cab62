/* orthon's decode-step kernels (engine/decode_kernels.py builds and loads this file). */
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

/* One row's 16 columns (lo, hi) into y; a panel's last columns may be fewer. */
static inline void store16(float* y, __m256 lo, __m256 hi, long ncols) {
    if (ncols == 16) {
        _mm256_storeu_ps(y, lo);
        _mm256_storeu_ps(y + 8, hi);
    } else {
        float tmp[16];
        _mm256_storeu_ps(tmp, lo); _mm256_storeu_ps(tmp + 8, hi);
        memcpy(y, tmp, sizeof(float) * ncols);
    }
}

/* The loops over a block's rows and k-sets run fully unrolled, so that every accumulator is a register
   of its own: GCC left a rolled loop indexing them as an array in memory, and stored every accumulator
   to the stack every k (the kernel ran at a third of the FMA units' rate). */
#define UNROLL _Pragma("GCC unroll 16")

/* MB rows of y, 16 columns: y[m, c] = sum_k x[m, k] * panel[k, c]. */
#define BLOCK(MB) \
static inline void block##MB(const float* x, const float* panel, float* y, long K, long ldy, long ncols) { \
    __m256 a0[MB], a1[MB]; \
    UNROLL for (int m = 0; m < MB; m++) { a0[m] = _mm256_setzero_ps(); a1[m] = _mm256_setzero_ps(); } \
    for (long k = 0; k < K; k++) { \
        __m256 w0 = _mm256_loadu_ps(panel + k * 16), w1 = _mm256_loadu_ps(panel + k * 16 + 8); \
        UNROLL for (int m = 0; m < MB; m++) { \
            __m256 b = _mm256_broadcast_ss(x + m * K + k); \
            a0[m] = _mm256_fmadd_ps(b, w0, a0[m]); \
            a1[m] = _mm256_fmadd_ps(b, w1, a1[m]); \
        } \
    } \
    UNROLL for (int m = 0; m < MB; m++) store16(y + m * ldy, a0[m], a1[m], ncols); \
}
BLOCK(3) BLOCK(4) BLOCK(5) BLOCK(6)

/* One or two rows: too few independent FMA chains to hide the FMA latency, so each row's sum runs in
   KS interleaved sets over k (8 accumulators in all), added at the end. */
#define BLOCK_SPLIT_K(MB, KS) \
static inline void block##MB(const float* x, const float* panel, float* y, long K, long ldy, long ncols) { \
    __m256 a0[MB][KS], a1[MB][KS]; \
    UNROLL for (int m = 0; m < MB; m++) \
        UNROLL for (int s = 0; s < KS; s++) { a0[m][s] = _mm256_setzero_ps(); a1[m][s] = _mm256_setzero_ps(); } \
    long k = 0; \
    for (; k + KS <= K; k += KS) \
        UNROLL for (int s = 0; s < KS; s++) { \
            __m256 w0 = _mm256_loadu_ps(panel + (k + s) * 16), w1 = _mm256_loadu_ps(panel + (k + s) * 16 + 8); \
            UNROLL for (int m = 0; m < MB; m++) { \
                __m256 b = _mm256_broadcast_ss(x + m * K + k + s); \
                a0[m][s] = _mm256_fmadd_ps(b, w0, a0[m][s]); \
                a1[m][s] = _mm256_fmadd_ps(b, w1, a1[m][s]); \
            } \
        } \
    for (; k < K; k++) { \
        __m256 w0 = _mm256_loadu_ps(panel + k * 16), w1 = _mm256_loadu_ps(panel + k * 16 + 8); \
        UNROLL for (int m = 0; m < MB; m++) { \
            __m256 b = _mm256_broadcast_ss(x + m * K + k); \
            a0[m][0] = _mm256_fmadd_ps(b, w0, a0[m][0]); \
            a1[m][0] = _mm256_fmadd_ps(b, w1, a1[m][0]); \
        } \
    } \
    UNROLL for (int m = 0; m < MB; m++) { \
        UNROLL for (int s = 1; s < KS; s++) { a0[m][0] = _mm256_add_ps(a0[m][0], a0[m][s]); a1[m][0] = _mm256_add_ps(a1[m][0], a1[m][s]); } \
        store16(y + m * ldy, a0[m][0], a1[m][0], ncols); \
    } \
}
BLOCK_SPLIT_K(1, 4) BLOCK_SPLIT_K(2, 2)

/* AVX-512 (where the CPU has it): a panel's 16 columns are one register, so up to 8 rows go in one
   block, each row's sum in KS interleaved sets over k (KS * MB <= 16 accumulators). */
#define ZBLOCK(MB, KS) \
__attribute__((target("avx512f"))) \
static void zblock##MB(const float* x, const float* panel, float* y, long K, long ldy, long ncols) { \
    __m512 a[MB][KS]; \
    UNROLL for (int m = 0; m < MB; m++) UNROLL for (int s = 0; s < KS; s++) a[m][s] = _mm512_setzero_ps(); \
    long k = 0; \
    for (; k + KS <= K; k += KS) \
        UNROLL for (int s = 0; s < KS; s++) { \
            __m512 w = _mm512_loadu_ps(panel + (k + s) * 16); \
            UNROLL for (int m = 0; m < MB; m++) a[m][s] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + k + s]), w, a[m][s]); \
        } \
    for (; k < K; k++) { \
        __m512 w = _mm512_loadu_ps(panel + k * 16); \
        UNROLL for (int m = 0; m < MB; m++) a[m][0] = _mm512_fmadd_ps(_mm512_set1_ps(x[m * K + k]), w, a[m][0]); \
    } \
    UNROLL for (int m = 0; m < MB; m++) { \
        UNROLL for (int s = 1; s < KS; s++) a[m][0] = _mm512_add_ps(a[m][0], a[m][s]); \
        _mm512_mask_storeu_ps(y + m * ldy, (__mmask16)((1u << ncols) - 1), a[m][0]); \
    } \
}
ZBLOCK(1, 8) ZBLOCK(2, 4) ZBLOCK(3, 4) ZBLOCK(4, 4) ZBLOCK(5, 2) ZBLOCK(6, 2) ZBLOCK(7, 2) ZBLOCK(8, 2)

/* A block kernel: MB rows of y, one 16-column panel (MB fixed per kernel). */
typedef void (*block_fn)(const float* x, const float* panel, float* y, long K, long ldy, long ncols);

/* Index r - 1: the kernel for r rows. */
static const block_fn zblocks[8] = {zblock1, zblock2, zblock3, zblock4, zblock5, zblock6, zblock7, zblock8};
static const block_fn blocks[6] = {block1, block2, block3, block4, block5, block6};

/* Below this many FLOPs a product runs on one thread: a parallel region's fork and join (a few us)
   would cost more than the second core gains. */
#define PARALLEL_FLOPS (1L << 21)

/* y (M x N) = x (M x K) @ w^T over the packed panels, rows in blocks of at most `rows`; the panels
   split across `threads` threads where the product is large enough (every thread reads all of x). */
static void panel_loop(const float* x, const float* p, float* y, long M, long N, long K, long rows,
                       const block_fn* kernels, int threads) {
    long NB = (N + 15) / 16;
    #pragma omp parallel for num_threads(threads) schedule(static) if (threads > 1 && NB > 1 && 2 * M * N * K >= PARALLEL_FLOPS)
    for (long nb = 0; nb < NB; nb++) {
        const float* panel = p + nb * K * 16;
        long n0 = nb * 16, ncols = N - n0 < 16 ? N - n0 : 16;
        for (long m0 = 0; m0 < M; m0 += rows)
            kernels[(M - m0 < rows ? M - m0 : rows) - 1](x + m0 * K, panel, y + m0 * N + n0, K, N, ncols);
    }
}

static int avx512 = -1;

/* 1: the AVX-512 kernel where the CPU has it (the default); 0: AVX2 (tests compare the two). */
void thin_use_avx512(int on) { avx512 = on && __builtin_cpu_supports("avx512f"); }

/* y (M x N) = x (M x K) @ w^T, w packed by thin_pack. AVX-512 where the CPU has it: 8 rows a block.
   AVX2: rows in equal blocks of up to 6 (12 accumulators: 8 rows go 4 + 4, not 6 + 2, whose 2-row
   block would use a third of the FMA units' width). */
void thin_linear(const float* x, const float* p, float* y, long M, long N, long K, int threads) {
    if (M <= 0) return;
    if (avx512 < 0) thin_use_avx512(1);
    if (avx512) {
        panel_loop(x, p, y, M, N, K, 8, zblocks, threads);
    } else {
        long parts = (M + 5) / 6;
        panel_loop(x, p, y, M, N, K, (M + parts - 1) / parts, blocks, threads);
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
    float rstd[M];
    row_rstd(x, rstd, M, K, ldx, eps);
    for (long m = 0; m < M; m++)
        for (long k = 0; k < K; k++) y[m * K + k] = x[m * ldx + k] * rstd[m] * w[k];
}

/* y = rms_norm(x) @ w^T for a weight packed with the norm's scale folded in: the linear map of x,
   each row's output times that row's rstd. */
void thin_norm_linear(const float* x, const float* p, float* y, long M, long N, long K, float eps, int threads) {
    float rstd[M];
    row_rstd(x, rstd, M, K, K, eps);
    thin_linear(x, p, y, M, N, K, threads);
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

/* The MoE block of a few rows (E <= 256): routing (route_row on logits, ld_logits apart), then
   y (M x H) = sum over each row's choices of weight * down_e(silu(gate_e x) * up_e x), the rows grouped by
   expert so each chosen expert's packed weights are read once, plus the shared expert's
   shared_down(silu(g) * u) of shared_in = [g, u] (M x 2 Is, ld_shared apart; skipped when shared_down is
   NULL). gate_up[e]: (2I x H) packed, down[e]: (H x I) packed. chosen / weights: (M x topk) out.
   scratch: M * (2 H + 3 I + Is) floats. */
void thin_moe(const float* x, long M, long H, long I, long E, const float* logits, long ld_logits,
              const float* bias, long topk, long n_group, long topk_group, long norm_topk, float scaling,
              const float* const* gate_up, const float* const* down, const float* shared_in, long ld_shared,
              long Is, const float* shared_down, float* y, long* chosen, float* weights, float* scratch, int threads) {
    float* xb = scratch;            /* n x H */
    float* h = xb + M * H;          /* n x 2I */
    float* act = h + M * 2 * I;     /* n x I, then M x Is */
    float* out = act + M * (I > Is ? I : Is);  /* n x H */
    long rows[M]; float w[M];  /* an expert's rows: each row picks an expert at most once */
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
        thin_linear(xb, gate_up[e], h, n, 2 * I, H, threads);
        for (long r = 0; r < n; r++)
            for (long i = 0; i < I; i++) {
                float g = h[r * 2 * I + i];
                act[r * I + i] = g / (1.0f + expf(-g)) * h[r * 2 * I + I + i];
            }
        thin_linear(act, down[e], out, n, H, I, threads);
        for (long r = 0; r < n; r++)
            for (long k = 0; k < H; k++) y[rows[r] * H + k] += w[r] * out[r * H + k];
    }
    if (shared_down) {
        for (long m = 0; m < M; m++)
            for (long i = 0; i < Is; i++) {
                float g = shared_in[m * ld_shared + i];
                act[m * Is + i] = g / (1.0f + expf(-g)) * shared_in[m * ld_shared + Is + i];
            }
        thin_linear(act, shared_down, out, M, H, Is, threads);
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

/* Restore a heap (root: the worst of the kept positions) after heap[i] got better-ranked children. */
static void sift_down(long* heap, long size, long i, const float* scores) {
    for (;;) {
        long l = 2 * i + 1, r = l + 1, worst = i;
        if (l < size && before(scores[heap[worst]], heap[worst], scores[heap[l]], heap[l])) worst = l;
        if (r < size && before(scores[heap[worst]], heap[worst], scores[heap[r]], heap[r])) worst = r;
        if (worst == i) return;
        long t = heap[worst]; heap[worst] = heap[i]; heap[i] = t; i = worst;
    }
}

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
            scores[s] = (visible && !visible[b * S + s]) ? -INFINITY : acc;
        }
        /* A heap of the k best so far, its root the worst of them: built from the first k, then each
           better position replaces the root. */
        long size = k < S ? k : S;
        for (long i = 0; i < size; i++) heap[i] = i;
        for (long i = size / 2 - 1; i >= 0; i--) sift_down(heap, size, i, scores);
        for (long s = size; s < S; s++)
            if (before(scores[s], s, scores[heap[0]], heap[0])) { heap[0] = s; sift_down(heap, size, 0, scores); }
        /* Best first: pop the worst into the back. */
        for (long end = size - 1; end >= 0; end--) {
            out[b * k + end] = heap[0];
            heap[0] = heap[end];
            sift_down(heap, end, 0, scores);
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
