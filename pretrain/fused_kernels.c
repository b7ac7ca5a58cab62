/* orthon's fused elementwise kernels for the training step on CPU: RMSNorm and SwiGLU, forward and
   backward, each one pass over its rows where torch runs five to seven (a pass over a (2048, 768) fp32
   activation reads or writes 6 MB: memory, not arithmetic, sets their time). pretrain/fused_kernels.py
   builds and loads this file. fp32, AVX2 + FMA, OpenMP over rows with the caller's thread count; no
   result depends on the thread count. */
#include <immintrin.h>
#include <math.h>
#include <omp.h>
#include <string.h>

#include "simd_math.h"

static inline __m256 sigmoid_ps(__m256 x) {
    __m256 one = _mm256_set1_ps(1.0f);
    return _mm256_div_ps(one, _mm256_add_ps(one, exp_ps(_mm256_sub_ps(_mm256_setzero_ps(), x))));
}

static inline float sigmoid1(float x) { return 1.0f / (1.0f + expf(-x)); }

/* act[m, :] = silu(g[m, :]) * u[m, :] over I numbers a row; each operand with its own row stride (the
   routed experts keep gate and up side by side in one (M, 2I) buffer). */
void swiglu_forward(const float* g, long ldg, const float* u, long ldu, float* act, long lda, long M, long I,
                    int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long m = 0; m < M; m++) {
        const float* gm = g + m * ldg;
        const float* um = u + m * ldu;
        float* am = act + m * lda;
        long i = 0;
        for (; i + 8 <= I; i += 8) {
            __m256 x = _mm256_loadu_ps(gm + i);
            _mm256_storeu_ps(am + i, _mm256_mul_ps(_mm256_mul_ps(x, sigmoid_ps(x)), _mm256_loadu_ps(um + i)));
        }
        for (; i < I; i++) am[i] = gm[i] * sigmoid1(gm[i]) * um[i];
    }
}

/* Its backward given d act: dg = d act * u * silu'(g), du = d act * silu(g), silu'(x) = s (1 + x (1 - s)),
   s = sigmoid(x) (torch's silu_backward). dg and du may be the g and u buffers themselves. */
void swiglu_backward(const float* grad, long ldgr, const float* g, long ldg, const float* u, long ldu, float* dg,
                     long lddg, float* du, long lddu, long M, long I, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long m = 0; m < M; m++) {
        const float *gr = grad + m * ldgr, *gm = g + m * ldg, *um = u + m * ldu;
        float *dgm = dg + m * lddg, *dum = du + m * lddu;
        __m256 one = _mm256_set1_ps(1.0f);
        long i = 0;
        for (; i + 8 <= I; i += 8) {
            __m256 x = _mm256_loadu_ps(gm + i), s = sigmoid_ps(x), d = _mm256_loadu_ps(gr + i);
            __m256 uv = _mm256_loadu_ps(um + i);
            __m256 slope = _mm256_mul_ps(s, _mm256_fmadd_ps(x, _mm256_sub_ps(one, s), one));
            _mm256_storeu_ps(dum + i, _mm256_mul_ps(d, _mm256_mul_ps(x, s)));
            _mm256_storeu_ps(dgm + i, _mm256_mul_ps(_mm256_mul_ps(d, uv), slope));
        }
        for (; i < I; i++) {
            float x = gm[i], s = sigmoid1(x), d = gr[i], uv = um[i];
            dum[i] = d * (x * s);
            dgm[i] = d * uv * (s * (1.0f + x * (1.0f - s)));
        }
    }
}

/* The routed experts' backward between their two products, for the rows of one expert: given d act of the
   unweighted down product (M, I), the activations act (M, I), the rows' routing weights w (M) and the
   gate-up output h = [g, u] (M, 2I): dw[m] = d act[m] . act[m] (when dw is given), act[m] *= w[m] (what
   the down weight's gradient multiplies), and the SwiGLU gradient of d act * w written to dh = [dg, du]
   (M, 2I). One pass over each row where torch runs five. */
void expert_act_backward(const float* dact, float* act, const float* w, const float* h, float* dh, float* dw,
                         long M, long I, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long m = 0; m < M; m++) {
        const float *da = dact + m * I, *g = h + m * 2 * I, *u = g + I;
        float *am = act + m * I, *dg = dh + m * 2 * I, *du = dg + I;
        __m256 one = _mm256_set1_ps(1.0f), wm = _mm256_set1_ps(w[m]), dot = _mm256_setzero_ps();
        long i = 0;
        for (; i + 8 <= I; i += 8) {
            __m256 d = _mm256_loadu_ps(da + i), a = _mm256_loadu_ps(am + i);
            dot = _mm256_fmadd_ps(d, a, dot);
            _mm256_storeu_ps(am + i, _mm256_mul_ps(a, wm));
            d = _mm256_mul_ps(d, wm);
            __m256 x = _mm256_loadu_ps(g + i), sg = sigmoid_ps(x);
            __m256 slope = _mm256_mul_ps(sg, _mm256_fmadd_ps(x, _mm256_sub_ps(one, sg), one));
            _mm256_storeu_ps(du + i, _mm256_mul_ps(d, _mm256_mul_ps(x, sg)));
            _mm256_storeu_ps(dg + i, _mm256_mul_ps(_mm256_mul_ps(d, _mm256_loadu_ps(u + i)), slope));
        }
        float total = hsum(dot);
        for (; i < I; i++) {
            total += da[i] * am[i];
            am[i] *= w[m];
            float d = da[i] * w[m], x = g[i], sg = sigmoid1(x);
            du[i] = d * (x * sg);
            dg[i] = d * u[i] * (sg * (1.0f + x * (1.0f - sg)));
        }
        if (dw) dw[m] = total;
    }
}

/* y[m] = w * (x[m] * rstd[m]), rstd[m] = 1 / sqrt(mean(x[m]^2) + eps), kept for the backward; x's rows ldx
   apart (a slice of a wider projection), y's and the gradients' contiguous. */
void rms_norm_forward(const float* x, long ldx, const float* w, float* y, float* rstd, long M, long K, float eps, int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long m = 0; m < M; m++) {
        const float* xm = x + m * ldx;
        float* ym = y + m * K;
        __m256 acc = _mm256_setzero_ps();
        long k = 0;
        for (; k + 8 <= K; k += 8) { __m256 v = _mm256_loadu_ps(xm + k); acc = _mm256_fmadd_ps(v, v, acc); }
        float ss = hsum(acc);
        for (; k < K; k++) ss += xm[k] * xm[k];
        float r = 1.0f / sqrtf(ss / (float)K + eps);
        rstd[m] = r;
        __m256 vr = _mm256_set1_ps(r);
        for (k = 0; k + 8 <= K; k += 8)
            _mm256_storeu_ps(ym + k, _mm256_mul_ps(_mm256_loadu_ps(w + k), _mm256_mul_ps(_mm256_loadu_ps(xm + k), vr)));
        for (; k < K; k++) ym[k] = w[k] * (xm[k] * r);
    }
}

#define NORM_BLOCK 64  /* rows per partial sum of the weight's gradient */

/* Its backward given dy: dx[m] = rstd (gw - n mean(gw . n)) with n = x[m] rstd, gw = dy[m] * w; and, when dw
   is given, dw = sum over rows of dy * n: each block of NORM_BLOCK rows sums its rows in order into
   partial[block] (scratch, ceil(M / NORM_BLOCK) x K), then the blocks are summed in order. */
void rms_norm_backward(const float* x, long ldx, const float* w, const float* rstd, const float* dy, float* dx, float* dw,
                       float* partial, long M, long K, int threads) {
    long blocks = (M + NORM_BLOCK - 1) / NORM_BLOCK;
    #pragma omp parallel num_threads(threads)
    {
        #pragma omp for schedule(static)
        for (long b = 0; b < blocks; b++) {
            float* pb = partial + b * K;
            if (dw) memset(pb, 0, sizeof(float) * K);
            long end = (b + 1) * NORM_BLOCK < M ? (b + 1) * NORM_BLOCK : M;
            for (long m = b * NORM_BLOCK; m < end; m++) {
                const float *xm = x + m * ldx, *dym = dy + m * K;
                float* dxm = dx + m * K;
                __m256 vr = _mm256_set1_ps(rstd[m]), acc = _mm256_setzero_ps();
                long k = 0;
                for (; k + 8 <= K; k += 8) {
                    __m256 n = _mm256_mul_ps(_mm256_loadu_ps(xm + k), vr), d = _mm256_loadu_ps(dym + k);
                    acc = _mm256_fmadd_ps(_mm256_mul_ps(d, _mm256_loadu_ps(w + k)), n, acc);
                    if (dw) _mm256_storeu_ps(pb + k, _mm256_fmadd_ps(d, n, _mm256_loadu_ps(pb + k)));
                }
                float dot = hsum(acc);
                for (; k < K; k++) {
                    float n = xm[k] * rstd[m];
                    dot += dym[k] * w[k] * n;
                    if (dw) pb[k] += dym[k] * n;
                }
                dot /= (float)K;
                __m256 vdot = _mm256_set1_ps(dot);
                for (k = 0; k + 8 <= K; k += 8) {
                    __m256 n = _mm256_mul_ps(_mm256_loadu_ps(xm + k), vr);
                    __m256 gw = _mm256_mul_ps(_mm256_loadu_ps(dym + k), _mm256_loadu_ps(w + k));
                    _mm256_storeu_ps(dxm + k, _mm256_mul_ps(_mm256_fnmadd_ps(n, vdot, gw), vr));
                }
                for (; k < K; k++) {
                    float n = xm[k] * rstd[m];
                    dxm[k] = (dym[k] * w[k] - n * dot) * rstd[m];
                }
            }
        }
        if (dw) {
            #pragma omp for schedule(static)
            for (long k = 0; k < K; k++) {
                float s = 0.0f;
                for (long b = 0; b < blocks; b++) s += partial[b * K + k];
                dw[k] = s;
            }
        }
    }
}

/* Cross-entropy of each row of logits (M, V) against its label, and in place of the logits its gradient
   softmax - onehot: loss[m] = logsumexp(x[m]) - x[m, label]; a row whose label is ignore_index gets loss 0
   and a zero gradient. A row (V floats) stays in L1 across its three passes (max; exp and sum; scale). */
void cross_entropy_rows(float* logits, const long* labels, float* loss, long M, long V, long ignore_index,
                        int threads) {
    #pragma omp parallel for num_threads(threads) schedule(static)
    for (long m = 0; m < M; m++) {
        float* x = logits + m * V;
        long label = labels[m];
        if (label == ignore_index) {
            memset(x, 0, sizeof(float) * V);
            loss[m] = 0.0f;
            continue;
        }
        __m256 vmax = _mm256_set1_ps(-INFINITY);
        long v = 0;
        for (; v + 8 <= V; v += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(x + v));
        float buf[8], mx = -INFINITY;
        _mm256_storeu_ps(buf, vmax);
        for (int i = 0; i < 8; i++) mx = buf[i] > mx ? buf[i] : mx;
        for (; v < V; v++) mx = x[v] > mx ? x[v] : mx;
        float target = x[label];
        __m256 shift = _mm256_set1_ps(mx), total = _mm256_setzero_ps();
        for (v = 0; v + 8 <= V; v += 8) {
            __m256 e = exp_ps(_mm256_sub_ps(_mm256_loadu_ps(x + v), shift));
            _mm256_storeu_ps(x + v, e);
            total = _mm256_add_ps(total, e);
        }
        float sum = hsum(total);
        for (; v < V; v++) { x[v] = expf(x[v] - mx); sum += x[v]; }
        loss[m] = mx + logf(sum) - target;
        __m256 inv = _mm256_set1_ps(1.0f / sum);
        for (v = 0; v + 8 <= V; v += 8) _mm256_storeu_ps(x + v, _mm256_mul_ps(_mm256_loadu_ps(x + v), inv));
        for (; v < V; v++) x[v] *= 1.0f / sum;
        x[label] -= 1.0f;
    }
}
