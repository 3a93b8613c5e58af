/* A linear layer for inputs of a few rows: y = act(x @ w.T + b), float32.
 *
 * Why fastlazy carries its own: at batch 1 a linear layer is a matrix-vector
 * product, and the BLAS path torch takes for it (sgemm with one row and a
 * transposed weight) runs at about half the speed the same product reaches
 * when it reads the weight in its natural row-major order, eight rows at a
 * time.  The activation is applied while the result is still in registers,
 * so linear + relu is one pass.  Sums are accumulated in a different order
 * than the BLAS's, so results agree with eager to rounding, not bit for bit.
 *
 * Inputs: x (M, K), w (N, K) and y (M, N) contiguous; b (N) contiguous or
 * NULL.  act: FL_ACT_NONE or FL_ACT_RELU (NaN stays NaN, as torch.relu).
 */
#ifndef FASTLAZY_SMALL_LINEAR_H
#define FASTLAZY_SMALL_LINEAR_H

#include <stddef.h>

#define FL_ACT_NONE 0
#define FL_ACT_RELU 1

static inline float fl_act(float v, int act) {
    return (act == FL_ACT_RELU && v < 0.0f) ? 0.0f : v;
}

/* Portable version: also the tail of the vector one. */
static void fl_linear_rows_generic(const float *x, const float *w, const float *b,
                                   float *y, ptrdiff_t n0, ptrdiff_t N, ptrdiff_t K,
                                   int act) {
    for (ptrdiff_t n = n0; n < N; n++) {
        const float *wn = w + n * K;
        float s = 0.0f;
        for (ptrdiff_t k = 0; k < K; k++)
            s += wn[k] * x[k];
        y[n] = fl_act(b ? s + b[n] : s, act);
    }
}

#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__))
#include <immintrin.h>
#define FL_HAVE_AVX2_PATH 1

/* Eight weight rows per pass: eight independent FMA chains hide the FMA
 * latency, and the eight sums leave through one transpose-and-add. */
__attribute__((target("avx2,fma")))
static void fl_linear_row_avx2(const float *x, const float *w, const float *b, float *y,
                               ptrdiff_t N, ptrdiff_t K, int act) {
    ptrdiff_t n = 0, kv = K & ~(ptrdiff_t)7;
    for (; n + 8 <= N; n += 8) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0,
               a4 = a0, a5 = a0, a6 = a0, a7 = a0;
        const float *w0 = w + n * K;
        for (ptrdiff_t k = 0; k < kv; k += 8) {
            __m256 xv = _mm256_loadu_ps(x + k);
            a0 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + k), xv, a0);
            a1 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + K + k), xv, a1);
            a2 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + 2 * K + k), xv, a2);
            a3 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + 3 * K + k), xv, a3);
            a4 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + 4 * K + k), xv, a4);
            a5 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + 5 * K + k), xv, a5);
            a6 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + 6 * K + k), xv, a6);
            a7 = _mm256_fmadd_ps(_mm256_loadu_ps(w0 + 7 * K + k), xv, a7);
        }
        /* a<r> holds 8 partial sums of row n+r: add them pairwise so that
         * lane r of `sums` ends up with row n+r's total */
        __m256 s01 = _mm256_hadd_ps(a0, a1);
        __m256 s23 = _mm256_hadd_ps(a2, a3);
        __m256 s45 = _mm256_hadd_ps(a4, a5);
        __m256 s67 = _mm256_hadd_ps(a6, a7);
        __m256 s0123 = _mm256_hadd_ps(s01, s23);
        __m256 s4567 = _mm256_hadd_ps(s45, s67);
        __m256 lo = _mm256_permute2f128_ps(s0123, s4567, 0x20);
        __m256 hi = _mm256_permute2f128_ps(s0123, s4567, 0x31);
        float sums[8];
        _mm256_storeu_ps(sums, _mm256_add_ps(lo, hi));
        for (int r = 0; r < 8; r++) {
            const float *wr = w + (n + r) * K;
            float s = sums[r];
            for (ptrdiff_t k = kv; k < K; k++)
                s += wr[k] * x[k];
            y[n + r] = fl_act(b ? s + b[n + r] : s, act);
        }
    }
    fl_linear_rows_generic(x, w, b, y, n, N, K, act);
}

static int fl_avx2 = -1;          /* -1: not checked yet */

static int fl_cpu_has_avx2(void) {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
}

static inline int fl_use_avx2(void) {
    if (fl_avx2 < 0)
        fl_avx2 = fl_cpu_has_avx2();
    return fl_avx2;
}
#else
#define FL_HAVE_AVX2_PATH 0
static int fl_avx2 = 0;
static inline int fl_use_avx2(void) { return 0; }
static int fl_cpu_has_avx2(void) { return 0; }
#endif

static void fl_linear_f32(const float *x, const float *w, const float *b, float *y,
                          ptrdiff_t M, ptrdiff_t N, ptrdiff_t K, int act) {
    for (ptrdiff_t m = 0; m < M; m++) {
#if FL_HAVE_AVX2_PATH
        if (fl_use_avx2()) {
            fl_linear_row_avx2(x + m * K, w, b, y + m * N, N, K, act);
            continue;
        }
#endif
        fl_linear_rows_generic(x + m * K, w, b, y + m * N, 0, N, K, act);
    }
}

#endif
