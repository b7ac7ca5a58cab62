/* Kernels for Newton-Schulz's symmetric products (orthon.optim.symmetric_products).

   mirror_blocks_{2,4}: a product computed as row panels, each from its diagonal block on, has its blocks
   below the diagonal blocks filled with the transposes of those above. torch's strided copy of a
   transposed view runs at ~2 ns an element (one side read or written n elements apart); this transposes
   16 x 16 tiles, which stay in L1: 0.12 against 0.88 ms for a 1024^2 bf16 matrix in 4 panels (AMD EPYC,
   one thread). Elements move as 2- or 4-byte words (bf16 / fp16 / fp32): copies, so the result is exact.

   symmetric_gemm_bf16: C = alpha A B^T (+ beta D) in bf16 for a batch of n x n results known to be
   symmetric, on CPUs with AVX512-BF16: only the 8 x 32 tiles that reach the diagonal or lie above it are
   computed (0.56 of the products at n = 256, 0.52 at n = 1024), the rest mirrored. Products of bf16
   pairs accumulate in fp32 (VDPBF16PS), alpha and beta D are applied in fp32 and the result is rounded to
   bf16 once (round to nearest even), as oneDNN's bf16 GEMM does on the same CPU: a 256 x 256 x 256 or
   512 x 512 x 512 product here equals torch's bit for bit. B is read as rows (A B^T): for X X^T it is X,
   for a product of symmetric matrices the right factor itself. Each 32-row panel of B is packed into bf16
   pairs along k, and the lower triangle mirrored from the upper, by 16 x 16 transposes of 32-bit words in
   registers (element by element they took ~30% of a 256^2 product's time).

   symmetric_gemm_f32: the same product in fp32 with AVX2 + FMA, for CPUs whose fp32 GEMM (MKL's) is AVX2
   code: 6 x 16 tiles up to the diagonal, each output's products summed in chains of KCF then added up
   (as a blocked GEMM sums), B's 16-row panels packed and the lower triangle mirrored by 8 x 8 register
   transposes.

   OpenMP with the caller's thread count: the products over (matrix, column block) units, the mirrors
   over (matrix, row block). */
#include <immintrin.h>
#include <omp.h>
#include <stdint.h>
#include <string.h>

#define TILE 16

#define MIRROR(NAME, T)                                                                                   \
    void NAME(T* m, long ld, const long* starts, long panels, int threads) {                             \
        for (long p = 1; p < panels; p++) {                                                               \
            long lo = starts[p], hi = starts[p + 1];                                                      \
            /* m[lo:hi, 0:lo] = m[0:lo, lo:hi]^T, tile by tile */                                        \
            _Pragma("omp parallel for num_threads(threads) schedule(static)")                             \
            for (long j0 = 0; j0 < lo; j0 += TILE) {                                                      \
                long j1 = j0 + TILE < lo ? j0 + TILE : lo;                                                \
                for (long i0 = lo; i0 < hi; i0 += TILE) {                                                 \
                    long i1 = i0 + TILE < hi ? i0 + TILE : hi;                                            \
                    for (long i = i0; i < i1; i++) {                                                      \
                        T* dst = m + i * ld;                                                              \
                        for (long j = j0; j < j1; j++) dst[j] = m[j * ld + i];                            \
                    }                                                                                     \
                }                                                                                         \
            }                                                                                             \
        }                                                                                                 \
    }

MIRROR(mirror_blocks_2, uint16_t)
MIRROR(mirror_blocks_4, uint32_t)

#define MR 8   /* rows of a tile: 8 x 2 accumulators of 16 floats */
#define NR 32  /* columns of a tile and of a packed panel of B */
#define BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16")))

/* Transposes 16 x 16 32-bit words in registers: r[i] holds row i, then column i. */
BF16 static inline void transpose_16x16(__m512i* r) {
    __m512i t[16], u[16];
    for (int i = 0; i < 16; i += 2) {
        t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
        t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int i = 0; i < 16; i += 4) {  /* u[i + q], lane L: column 4L + q of rows i .. i + 3 */
        u[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
        u[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
        u[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
        u[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
    }
    for (int q = 0; q < 4; q++) {
        /* 0x88: 128-bit lanes 0 and 2 of each operand; 0xdd: lanes 1 and 3 */
        __m512i a = _mm512_shuffle_i32x4(u[q], u[4 + q], 0x88), b = _mm512_shuffle_i32x4(u[q], u[4 + q], 0xdd);
        __m512i c = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], 0x88);
        __m512i d = _mm512_shuffle_i32x4(u[8 + q], u[12 + q], 0xdd);
        r[q] = _mm512_shuffle_i32x4(a, c, 0x88);       /* column q */
        r[8 + q] = _mm512_shuffle_i32x4(a, c, 0xdd);   /* column 8 + q */
        r[4 + q] = _mm512_shuffle_i32x4(b, d, 0x88);   /* column 4 + q */
        r[12 + q] = _mm512_shuffle_i32x4(b, d, 0xdd);  /* column 12 + q */
    }
}

/* Rows j0 .. j0 + NR - 1 of B as ceil(k/2) x NR 32-bit words, each a bf16 pair (B[j][2p], B[j][2p + 1]);
   for odd k the last pair is (B[j][k - 1], 0). 16 x 16 word squares are transposed in registers. */
BF16 static void pack_panel(const uint16_t* b, long ldb, long k, uint32_t* out) {
    long pairs = k / 2, whole = pairs / 16 * 16;
    for (long j16 = 0; j16 < NR; j16 += 16)
        for (long p0 = 0; p0 < whole; p0 += 16) {
            __m512i r[16];
            for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(b + (j16 + i) * ldb + 2 * p0);
            transpose_16x16(r);
            for (int c = 0; c < 16; c++) _mm512_storeu_si512(out + (p0 + c) * NR + j16, r[c]);
        }
    for (long jj = 0; jj < NR; jj++) {
        const uint16_t* row = b + jj * ldb;
        for (long p = whole; p < pairs; p++) out[p * NR + jj] = (uint32_t)row[2 * p] | (uint32_t)row[2 * p + 1] << 16;
        if (k % 2) out[pairs * NR + jj] = row[k - 1];
    }
}

/* One MR x NR tile of C from MR rows of A and a packed panel of B. */
BF16 static void tile(const uint16_t* a, long lda, const uint32_t* panel, long k, float alpha,
                      const uint16_t* d, long ldd, float beta, uint16_t* c, long ldc) {
    __m512 acc[MR][2];
    for (int r = 0; r < MR; r++) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
    long pairs = k / 2;
    for (long p = 0; p <= pairs; p++) {
        if (p == pairs && k % 2 == 0) break;  /* p == pairs: odd k's last element, paired with 0 */
        __m512bh b0 = (__m512bh)_mm512_loadu_si512(panel + p * NR);
        __m512bh b1 = (__m512bh)_mm512_loadu_si512(panel + p * NR + 16);
        for (int r = 0; r < MR; r++) {
            const uint16_t* at = a + r * lda + 2 * p;
            int32_t word = at[0];
            if (p < pairs) memcpy(&word, at, sizeof word);  /* the pair as one word (no aliasing) */
            __m512bh pair = (__m512bh)_mm512_set1_epi32(word);
            acc[r][0] = _mm512_dpbf16_ps(acc[r][0], pair, b0);
            acc[r][1] = _mm512_dpbf16_ps(acc[r][1], pair, b1);
        }
    }
    __m512 va = _mm512_set1_ps(alpha), vb = _mm512_set1_ps(beta);
    for (int r = 0; r < MR; r++)
        for (int h = 0; h < 2; h++) {
            __m512 v = _mm512_mul_ps(acc[r][h], va);
            if (d) {  /* bf16 -> fp32 is a 16-bit shift */
                __m256i raw = _mm256_loadu_si256((const __m256i*)(d + r * ldd + h * 16));
                v = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16)), vb, v);
            }
            _mm256_storeu_si256((__m256i*)(c + r * ldc + h * 16), (__m256i)_mm512_cvtneps_pbh(v));
        }
}

/* Rows i0 .. i0 + NR - 1 of m below the diagonal from the columns above it: each 16 x 32 block of rows
   j0 .. j0 + 15 (j0 < i0) transposed as 16 x 16 words in registers, a word's halves going to two rows;
   the diagonal block's lower triangle element by element. */
BF16 static void mirror_row_block(uint16_t* m, long ldc, long i0) {
    for (long j0 = 0; j0 < i0; j0 += 16) {
        __m512i r[16];
        for (int i = 0; i < 16; i++) r[i] = _mm512_loadu_si512(m + (j0 + i) * ldc + i0);
        transpose_16x16(r);  /* r[w]: the pairs (m[j][i0 + 2w], m[j][i0 + 2w + 1]) for j = j0 .. j0 + 15 */
        for (int w = 0; w < 16; w++) {
            _mm256_storeu_si256((__m256i*)(m + (i0 + 2 * w) * ldc + j0), _mm512_cvtepi32_epi16(r[w]));
            _mm256_storeu_si256((__m256i*)(m + (i0 + 2 * w + 1) * ldc + j0),
                                _mm512_cvtepi32_epi16(_mm512_srli_epi32(r[w], 16)));
        }
    }
    for (long i = i0; i < i0 + NR; i++)
        for (long j = i0; j < i; j++) m[i * ldc + j] = m[j * ldc + i];
}

/* c[t] = alpha a[t] b[t]^T + beta d[t] (d may be NULL) for t < batch; a[t], b[t]: n x k, c[t], d[t]: n x n,
   row-major with the given row strides (ld*) and matrix strides (*_batch), in elements. Needs n % 32 == 0
   (the caller checks) and a workspace of threads x ceil(k/2) x NR words (one packed panel a thread). */
BF16 void symmetric_gemm_bf16(const uint16_t* a, long a_batch, long lda, const uint16_t* b, long b_batch,
                              long ldb, long batch, long n, long k, float alpha, const uint16_t* d,
                              long d_batch, long ldd, float beta, uint16_t* c, long c_batch, long ldc,
                              uint32_t* workspace, int threads) {
    long blocks = n / NR;
    #pragma omp parallel num_threads(threads)
    {
        uint32_t* panel = workspace + (size_t)omp_get_thread_num() * ((k + 1) / 2) * NR;
        /* dynamic: the column blocks near n hold the most tiles */
        #pragma omp for schedule(dynamic, 1)
        for (long unit = 0; unit < batch * blocks; unit++) {
            long t = unit / blocks, j0 = (blocks - 1 - unit % blocks) * NR;  /* the largest first */
            pack_panel(b + t * b_batch + j0 * ldb, ldb, k, panel);
            for (long i0 = 0; i0 < j0 + NR; i0 += MR)
                tile(a + t * a_batch + i0 * lda, lda, panel, k, alpha,
                     d ? d + t * d_batch + i0 * ldd + j0 : NULL, ldd, beta, c + t * c_batch + i0 * ldc + j0, ldc);
        }
        /* below the diagonal: c[i][j] = c[j][i] for j < i, a row block of NR at a time */
        #pragma omp for schedule(dynamic, 1)
        for (long unit = 0; unit < batch * blocks; unit++)
            mirror_row_block(c + (unit / blocks) * c_batch, ldc, (unit % blocks) * NR);
    }
}

/* ---- fp32 (AVX2 + FMA): for CPUs whose bf16 GEMM is emulated, where Newton-Schulz computes in fp32. */

#define MRF 6   /* rows of an fp32 tile: 6 x 2 accumulators of 8 floats */
#define NRF 16  /* columns of an fp32 tile and of a packed panel of B */
#define KCF 128  /* products summed in one chain before they join the total */

/* Transposes 8 x 8 floats in registers: r[i] holds row i, then column i. */
static inline void transpose_8x8(__m256* r) {
    __m256 t[8], u[8];
    for (int i = 0; i < 8; i += 2) {
        t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
        t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
    }
    for (int i = 0; i < 8; i += 4) {  /* u[i + q]: columns q (low half) and q + 4 (high) of rows i .. i + 3 */
        u[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
        u[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xee);
        u[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
        u[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xee);
    }
    for (int q = 0; q < 4; q++) {
        r[q] = _mm256_permute2f128_ps(u[q], u[4 + q], 0x20);
        r[4 + q] = _mm256_permute2f128_ps(u[q], u[4 + q], 0x31);
    }
}

/* Rows j0 .. j0 + NRF - 1 of B as k x NRF floats (B's panel transposed), by 8 x 8 register transposes. */
static void pack_panel_f32(const float* b, long ldb, long k, float* out) {
    long whole = k / 8 * 8;
    for (long j8 = 0; j8 < NRF; j8 += 8) {
        for (long p0 = 0; p0 < whole; p0 += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(b + (j8 + i) * ldb + p0);
            transpose_8x8(r);
            for (int c = 0; c < 8; c++) _mm256_storeu_ps(out + (p0 + c) * NRF + j8, r[c]);
        }
        for (long jj = j8; jj < j8 + 8; jj++)
            for (long p = whole; p < k; p++) out[p * NRF + jj] = b[jj * ldb + p];
    }
}

/* One rows x NRF tile of C (rows <= MRF, a constant where it is inlined) from rows of A and a packed panel. */
static inline __attribute__((always_inline)) void tile_rows_f32(
        int rows, const float* a, long lda, const float* panel, long k, float alpha, const float* d, long ldd,
        float beta, float* c, long ldc) {
    __m256 acc[MRF][2], sum[MRF][2];
    for (int r = 0; r < rows; r++) sum[r][0] = sum[r][1] = _mm256_setzero_ps();
    for (long p0 = 0; p0 < k; p0 += KCF) {  /* sums of KCF products added up: MKL's rounding, not one long chain's */
        long p1 = p0 + KCF < k ? p0 + KCF : k;
        for (int r = 0; r < rows; r++) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
        for (long p = p0; p < p1; p++) {
            __m256 b0 = _mm256_loadu_ps(panel + p * NRF), b1 = _mm256_loadu_ps(panel + p * NRF + 8);
            for (int r = 0; r < rows; r++) {
                __m256 x = _mm256_broadcast_ss(a + r * lda + p);
                acc[r][0] = _mm256_fmadd_ps(x, b0, acc[r][0]);
                acc[r][1] = _mm256_fmadd_ps(x, b1, acc[r][1]);
            }
        }
        for (int r = 0; r < rows; r++) {
            sum[r][0] = _mm256_add_ps(sum[r][0], acc[r][0]);
            sum[r][1] = _mm256_add_ps(sum[r][1], acc[r][1]);
        }
    }
    for (int r = 0; r < rows; r++) acc[r][0] = sum[r][0], acc[r][1] = sum[r][1];
    __m256 va = _mm256_set1_ps(alpha), vb = _mm256_set1_ps(beta);
    for (int r = 0; r < rows; r++)
        for (int h = 0; h < 2; h++) {
            __m256 v = _mm256_mul_ps(acc[r][h], va);
            if (d) v = _mm256_fmadd_ps(_mm256_loadu_ps(d + r * ldd + h * 8), vb, v);
            _mm256_storeu_ps(c + r * ldc + h * 8, v);
        }
}

static void tile_f32_6(const float* a, long lda, const float* panel, long k, float alpha, const float* d, long ldd,
                       float beta, float* c, long ldc) {
    tile_rows_f32(6, a, lda, panel, k, alpha, d, ldd, beta, c, ldc);
}
static void tile_f32_4(const float* a, long lda, const float* panel, long k, float alpha, const float* d, long ldd,
                       float beta, float* c, long ldc) {
    tile_rows_f32(4, a, lda, panel, k, alpha, d, ldd, beta, c, ldc);
}
static void tile_f32_2(const float* a, long lda, const float* panel, long k, float alpha, const float* d, long ldd,
                       float beta, float* c, long ldc) {
    tile_rows_f32(2, a, lda, panel, k, alpha, d, ldd, beta, c, ldc);
}

/* Rows i0 .. i0 + NRF - 1 of m below the diagonal from the columns above it, 8 x 8 blocks transposed in
   registers; the diagonal block's lower triangle element by element. */
static void mirror_row_block_f32(float* m, long ldc, long i0) {
    for (long j0 = 0; j0 < i0; j0 += 8)
        for (long h = 0; h < NRF; h += 8) {
            __m256 r[8];
            for (int i = 0; i < 8; i++) r[i] = _mm256_loadu_ps(m + (j0 + i) * ldc + i0 + h);
            transpose_8x8(r);
            for (int w = 0; w < 8; w++) _mm256_storeu_ps(m + (i0 + h + w) * ldc + j0, r[w]);
        }
    for (long i = i0; i < i0 + NRF; i++)
        for (long j = i0; j < i; j++) m[i * ldc + j] = m[j * ldc + i];
}

/* symmetric_gemm_bf16's product in fp32: c[t] = alpha a[t] b[t]^T + beta d[t], each 16-column block's rows
   from 0 to its diagonal in 6-row tiles (the last one 4 or 2 rows), the rest mirrored. Needs n % 16 == 0
   and a workspace of threads x k x NRF floats. */
void symmetric_gemm_f32(const float* a, long a_batch, long lda, const float* b, long b_batch, long ldb, long batch,
                        long n, long k, float alpha, const float* d, long d_batch, long ldd, float beta, float* c,
                        long c_batch, long ldc, float* workspace, int threads) {
    long blocks = n / NRF;
    #pragma omp parallel num_threads(threads)
    {
        float* panel = workspace + (size_t)omp_get_thread_num() * k * NRF;
        #pragma omp for schedule(dynamic, 1)
        for (long unit = 0; unit < batch * blocks; unit++) {
            long t = unit / blocks, j0 = (blocks - 1 - unit % blocks) * NRF;  /* the largest first */
            const float* at = a + t * a_batch;
            const float* dt = d ? d + t * d_batch + j0 : NULL;
            float* ct = c + t * c_batch + j0;
            pack_panel_f32(b + t * b_batch + j0 * ldb, ldb, k, panel);
            long i0 = 0, end = j0 + NRF;
            for (; i0 + MRF <= end; i0 += MRF)
                tile_f32_6(at + i0 * lda, lda, panel, k, alpha, dt ? dt + i0 * ldd : NULL, ldd, beta, ct + i0 * ldc, ldc);
            if (end - i0 == 4)
                tile_f32_4(at + i0 * lda, lda, panel, k, alpha, dt ? dt + i0 * ldd : NULL, ldd, beta, ct + i0 * ldc, ldc);
            else if (end - i0 == 2)
                tile_f32_2(at + i0 * lda, lda, panel, k, alpha, dt ? dt + i0 * ldd : NULL, ldd, beta, ct + i0 * ldc, ldc);
        }
        #pragma omp for schedule(dynamic, 1)
        for (long unit = 0; unit < batch * blocks; unit++)
            mirror_row_block_f32(c + (unit / blocks) * c_batch, ldc, (unit % blocks) * NRF);
    }
}
