/* Matrix products y[M, N] = x[M, K] @ W[N, K]^T (+ bias) on the CPU, float32 activations in and out.
 *
 *   float32 weights (gemm_f32): the weight rows are walked once, four output columns at a time
 *     (split across OpenMP threads), a register-tiled micro-kernel multiplying them by every
 *     activation row, three at a time;
 *   int8 / int4 weights (linear_i8q8 / linear_i4q8): activations rounded to int8 per block of 32,
 *     integer dot products, see "integer kernels" below. The weights:
 *       int8: w[n, k] = q[n, k] * scale[n]                       (q int8)
 *       int4: w[n, k] = q[n, k] * scale[n, g] + minimum[n, g]    (q 0..15, groups g of 32 along k;
 *             packed as GGUF's Q4_1 blocks: byte j of a group holds element j in its low nibble
 *             and element j + 16 in its high nibble)
 * Every output row is computed alone, in an order of operations that does not depend on M.
 * Compiled into the operator library once per instruction-set variant (cpu_kernels_<isa>.c): with
 * AVX2/FMA intrinsics in the avx2 variant, plain C in the generic one.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define HAVE_AVX2 1
#endif

#define NR 4         /* output columns per micro-kernel call */

static inline int min_int(int a, int b) { return a < b ? a : b; }

#ifdef HAVE_AVX2
static inline float hsum(__m256 v) {
    __m128 lo = _mm256_castps256_ps128(v), hi = _mm256_extractf128_ps(v, 1);
    lo = _mm_add_ps(lo, hi);
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}
#endif

/* out[r][i] = dot(w[r], x[i]) for NR weight rows (stride ldw) and MT activation rows (stride K). */
#ifdef HAVE_AVX2
#define DEFINE_MICRO(MT)                                                                             \
    static inline void micro_##MT(const float *w, int64_t ldw, int nr, const float *x, int K,         \
                                  float out[NR][3]) {                                                \
        __m256 acc[NR][MT];                                                                          \
        for (int r = 0; r < NR; r++)                                                                 \
            for (int i = 0; i < MT; i++) acc[r][i] = _mm256_setzero_ps();                            \
        const float *w0 = w, *w1 = w + (nr > 1 ? ldw : 0), *w2 = w + (nr > 2 ? 2 * ldw : 0),          \
                    *w3 = w + (nr > 3 ? 3 * ldw : 0);                                                \
        int k = 0;                                                                                   \
        for (; k + 8 <= K; k += 8) {                                                                 \
            const __m256 a = _mm256_loadu_ps(w0 + k), b = _mm256_loadu_ps(w1 + k),                   \
                         c = _mm256_loadu_ps(w2 + k), d = _mm256_loadu_ps(w3 + k);                   \
            for (int i = 0; i < MT; i++) {                                                           \
                const __m256 xv = _mm256_loadu_ps(x + (int64_t)i * K + k);                           \
                acc[0][i] = _mm256_fmadd_ps(a, xv, acc[0][i]);                                       \
                acc[1][i] = _mm256_fmadd_ps(b, xv, acc[1][i]);                                       \
                acc[2][i] = _mm256_fmadd_ps(c, xv, acc[2][i]);                                       \
                acc[3][i] = _mm256_fmadd_ps(d, xv, acc[3][i]);                                       \
            }                                                                                        \
        }                                                                                            \
        const float *ws[NR] = {w0, w1, w2, w3};                                                      \
        for (int r = 0; r < NR; r++)                                                                 \
            for (int i = 0; i < MT; i++) {                                                           \
                float s = hsum(acc[r][i]);                                                           \
                for (int kk = k; kk < K; kk++) s += ws[r][kk] * x[(int64_t)i * K + kk];              \
                out[r][i] = s;                                                                       \
            }                                                                                        \
    }
#else
#define DEFINE_MICRO(MT)                                                                             \
    static inline void micro_##MT(const float *w, int64_t ldw, int nr, const float *x, int K,         \
                                  float out[NR][3]) {                                                \
        for (int r = 0; r < nr; r++)                                                                 \
            for (int i = 0; i < MT; i++) {                                                           \
                float s = 0.0f;                                                                      \
                for (int k = 0; k < K; k++) s += w[r * ldw + k] * x[(int64_t)i * K + k];             \
                out[r][i] = s;                                                                       \
            }                                                                                        \
    }
#endif
DEFINE_MICRO(1)
DEFINE_MICRO(2)
DEFINE_MICRO(3)

/* All M activation rows against nr (<= NR) float32 weight rows; results into columns n..n+nr. */
static void rows_times_block(const float *x, int M, int K, const float *w, int64_t ldw, int nr, float *y,
                             int N, int n, const float *bias) {
    float out[NR][3];
    for (int i0 = 0; i0 < M; i0 += 3) {
        const int mt = min_int(3, M - i0);
        const float *xi = x + (int64_t)i0 * K;
        if (mt == 3) micro_3(w, ldw, nr, xi, K, out);
        else if (mt == 2) micro_2(w, ldw, nr, xi, K, out);
        else micro_1(w, ldw, nr, xi, K, out);
        for (int r = 0; r < nr; r++)
            for (int i = 0; i < mt; i++) {
                y[(int64_t)(i0 + i) * N + n + r] = out[r][i] + (bias ? bias[n + r] : 0.0f);
            }
    }
}

/* ---- entry points -------------------------------------------------------------------------- */

static int gemm_f32(const float *x, int M, int K, const float *W, int N, float *y, const float *bias) {
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n += NR)
        rows_times_block(x, M, K, W + (int64_t)n * K, K, min_int(NR, N - n), y, N, n, bias);
    return 0;
}

/* ---- integer kernels: activations quantized to int8 per block of 32 (GGUF's Q8_0 rule) ------
 *
 * llama.cpp's way: x[i, block g] ~ xs[i, g] * xq[i, g, :] (xq int8, xs = max |x| / 127), so a
 * block's dot product is integer arithmetic (AVX2 maddubs) times one float:
 *   int4: sum_j w_j x_j ~ xs * (scale * sum_j q_j xq_j + minimum * sum_j xq_j)
 *   int8: sum_j w_j x_j ~ xs * scale[n] * sum_j q_j xq_j
 * Lossier than the float kernels above (the activations lose precision too), and faster. */

static int quantize_rows_q8(const float *x, int M, int K, int8_t *xq, float *xs, float *xsum) {
    if (K % 32) return -1;
    const int G = K / 32;
#pragma omp parallel for schedule(static) if (M >= 16)
    for (int i = 0; i < M; i++)
        for (int g = 0; g < G; g++) {
            const float *src = x + (int64_t)i * K + g * 32;
            float amax = 0.0f;
            for (int j = 0; j < 32; j++) {
                const float a = src[j] < 0 ? -src[j] : src[j];
                amax = a > amax ? a : amax;
            }
            const float d = amax / 127.0f, inv = d > 0 ? 1.0f / d : 0.0f;
            int8_t *dst = xq + (int64_t)i * K + g * 32;
            int sum = 0;
            for (int j = 0; j < 32; j++) {
                const float v = src[j] * inv;
                const int r = (int)(v + (v >= 0 ? 0.5f : -0.5f));
                dst[j] = (int8_t)r;
                sum += r;
            }
            xs[(int64_t)i * G + g] = d;
            xsum[(int64_t)i * G + g] = d * (float)sum;
        }
    return 0;
}

#define MQ 8 /* activation rows per pass of the integer kernels */

#ifdef HAVE_AVX2
static inline __m256 block_dot_u8s8(__m256i u, __m256i s) {
    const __m256i ones = _mm256_set1_epi16(1);
    return _mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_maddubs_epi16(u, s), ones));
}
#endif

#ifdef HAVE_AVX2
/* MT activation rows against one int4 weight row, two groups per iteration (independent chains). */
#define DEFINE_I4Q8(MT)                                                                              \
    static void i4q8_row_##MT(const uint8_t *p, const float *sc, const float *mn, int K, const int8_t *xq, \
                              const float *xs, const float *xsum, float *out) {                       \
        const int G = K / 32;                                                                        \
        __m256 a0[MT], a1[MT];                                                                       \
        float e0[MT], e1[MT];                                                                        \
        for (int i = 0; i < MT; i++) {                                                               \
            a0[i] = a1[i] = _mm256_setzero_ps();                                                     \
            e0[i] = e1[i] = 0.0f;                                                                    \
        }                                                                                            \
        const __m128i lo_mask = _mm_set1_epi8(0x0F);                                                 \
        int g = 0;                                                                                   \
        for (; g + 2 <= G; g += 2) {                                                                 \
            const __m128i b0 = _mm_loadu_si128((const __m128i *)(p + g * 16));                       \
            const __m128i b1 = _mm_loadu_si128((const __m128i *)(p + g * 16 + 16));                  \
            const __m256i q0 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b0, 4), lo_mask), _mm_and_si128(b0, lo_mask)); \
            const __m256i q1 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b1, 4), lo_mask), _mm_and_si128(b1, lo_mask)); \
            for (int i = 0; i < MT; i++) {                                                           \
                const int8_t *xi = xq + (int64_t)i * K + g * 32;                                      \
                const float *xsi = xs + i * G + g, *xui = xsum + i * G + g;                           \
                a0[i] = _mm256_fmadd_ps(block_dot_u8s8(q0, _mm256_loadu_si256((const __m256i *)xi)),    \
                                        _mm256_set1_ps(sc[g] * xsi[0]), a0[i]);                       \
                a1[i] = _mm256_fmadd_ps(block_dot_u8s8(q1, _mm256_loadu_si256((const __m256i *)(xi + 32))), \
                                        _mm256_set1_ps(sc[g + 1] * xsi[1]), a1[i]);                   \
                e0[i] += mn[g] * xui[0];                                                             \
                e1[i] += mn[g + 1] * xui[1];                                                         \
            }                                                                                        \
        }                                                                                            \
        for (; g < G; g++) {                                                                         \
            const __m128i b0 = _mm_loadu_si128((const __m128i *)(p + g * 16));                       \
            const __m256i q0 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b0, 4), lo_mask), _mm_and_si128(b0, lo_mask)); \
            for (int i = 0; i < MT; i++) {                                                           \
                const int8_t *xi = xq + (int64_t)i * K + g * 32;                                      \
                a0[i] = _mm256_fmadd_ps(block_dot_u8s8(q0, _mm256_loadu_si256((const __m256i *)xi)),    \
                                        _mm256_set1_ps(sc[g] * xs[i * G + g]), a0[i]);                \
                e0[i] += mn[g] * xsum[i * G + g];                                                    \
            }                                                                                        \
        }                                                                                            \
        for (int i = 0; i < MT; i++) out[i] = hsum(_mm256_add_ps(a0[i], a1[i])) + e0[i] + e1[i];     \
    }
DEFINE_I4Q8(1)
DEFINE_I4Q8(2)
DEFINE_I4Q8(3)
DEFINE_I4Q8(4)

/* 5..8 rows in one pass (the weights are unpacked once for all of them). The sums are those of
 * the 1..4-row kernels bit for bit (even groups in one chain, odd groups in another, added at the
 * end): a row's result must not depend on how many rows share its pass, because the next layer
 * rounds it to int8 and a last-bit difference can move a whole quantization step. Two passes, one
 * per chain, keep the accumulators in registers. */
#define DEFINE_I4Q8_WIDE(MT)                                                                         \
    static void i4q8_row_##MT(const uint8_t *p, const float *sc, const float *mn, int K, const int8_t *xq, \
                              const float *xs, const float *xsum, float *out) {                       \
        const int G = K / 32;                                                                        \
        __m256 a[MT], even[MT];                                                                      \
        float e[2][MT];                                                                              \
        const __m128i lo_mask = _mm_set1_epi8(0x0F);                                                 \
        for (int chain = 0; chain < 2; chain++) {                                                    \
            for (int i = 0; i < MT; i++) {                                                           \
                a[i] = _mm256_setzero_ps();                                                          \
                e[chain][i] = 0.0f;                                                                  \
            }                                                                                        \
            for (int g = chain; g < G; g += 2) {                                                     \
                const __m128i b0 = _mm_loadu_si128((const __m128i *)(p + g * 16));                   \
                const __m256i q0 = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b0, 4), lo_mask), _mm_and_si128(b0, lo_mask)); \
                const float s = sc[g], m = mn[g];                                                    \
                for (int i = 0; i < MT; i++) {                                                       \
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + (int64_t)i * K + g * 32)); \
                    a[i] = _mm256_fmadd_ps(block_dot_u8s8(q0, xv), _mm256_set1_ps(s * xs[i * G + g]), a[i]); \
                    e[chain][i] += m * xsum[i * G + g];                                              \
                }                                                                                    \
            }                                                                                        \
            if (chain == 0)                                                                          \
                for (int i = 0; i < MT; i++) even[i] = a[i];                                         \
        }                                                                                            \
        for (int i = 0; i < MT; i++) out[i] = hsum(_mm256_add_ps(even[i], a[i])) + e[0][i] + e[1][i]; \
    }
DEFINE_I4Q8_WIDE(5)
DEFINE_I4Q8_WIDE(6)
DEFINE_I4Q8_WIDE(7)
DEFINE_I4Q8_WIDE(8)
#endif

static void i4q8_row(const uint8_t *p, const float *sc, const float *mn, int K, const int8_t *xq,
                     const float *xs, const float *xsum, int mt, float *out) {
#ifdef HAVE_AVX2
    switch (mt) {
        case 1: i4q8_row_1(p, sc, mn, K, xq, xs, xsum, out); return;
        case 2: i4q8_row_2(p, sc, mn, K, xq, xs, xsum, out); return;
        case 3: i4q8_row_3(p, sc, mn, K, xq, xs, xsum, out); return;
        case 4: i4q8_row_4(p, sc, mn, K, xq, xs, xsum, out); return;
        case 5: i4q8_row_5(p, sc, mn, K, xq, xs, xsum, out); return;
        case 6: i4q8_row_6(p, sc, mn, K, xq, xs, xsum, out); return;
        case 7: i4q8_row_7(p, sc, mn, K, xq, xs, xsum, out); return;
        default: i4q8_row_8(p, sc, mn, K, xq, xs, xsum, out); return;
    }
#else
    const int G = K / 32;
    for (int i = 0; i < mt; i++) {
        float s = 0.0f;
        for (int g = 0; g < G; g++) {
            int isum = 0;
            for (int j = 0; j < 16; j++) {
                isum += (p[g * 16 + j] & 0x0F) * xq[(int64_t)i * K + g * 32 + j];
                isum += (p[g * 16 + j] >> 4) * xq[(int64_t)i * K + g * 32 + j + 16];
            }
            s += sc[g] * xs[i * G + g] * (float)isum + mn[g] * xsum[i * G + g];
        }
        out[i] = s;
    }
#endif
}

static void i8q8_row(const int8_t *q, int K, const int8_t *xq, const float *xs, int mt, float *out) {
    const int G = K / 32;
#ifdef HAVE_AVX2
    __m256 acc[MQ][2];
    for (int i = 0; i < mt; i++) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
    for (int g = 0; g < G; g++) {
        const __m256i w = _mm256_loadu_si256((const __m256i *)(q + g * 32));
        const __m256i wabs = _mm256_sign_epi8(w, w);
        for (int i = 0; i < mt; i++) {
            const __m256i xv = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i *)(xq + (int64_t)i * K + g * 32)), w);
            acc[i][g & 1] = _mm256_fmadd_ps(block_dot_u8s8(wabs, xv), _mm256_set1_ps(xs[i * G + g]), acc[i][g & 1]);
        }
    }
    for (int i = 0; i < mt; i++) out[i] = hsum(_mm256_add_ps(acc[i][0], acc[i][1]));
#else
    for (int i = 0; i < mt; i++) {
        float s = 0.0f;
        for (int g = 0; g < G; g++) {
            int isum = 0;
            for (int j = 0; j < 32; j++) isum += q[g * 32 + j] * xq[(int64_t)i * K + g * 32 + j];
            s += xs[i * G + g] * (float)isum;
        }
        out[i] = s;
    }
#endif
}

static int gemm_i4q8(const int8_t *xq, const float *xs, const float *xsum, int M, int K, const uint8_t *P,
              const float *scale, const float *minimum, int N, float *y, const float *bias) {
    if (K % 32) return -1;
    const int G = K / 32;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        float out[MQ];
        for (int i0 = 0; i0 < M; i0 += MQ) {
            const int mt = min_int(MQ, M - i0);
            i4q8_row(P + (int64_t)n * (K / 2), scale + (int64_t)n * G, minimum + (int64_t)n * G, K,
                     xq + (int64_t)i0 * K, xs + (int64_t)i0 * G, xsum + (int64_t)i0 * G, mt, out);
            for (int i = 0; i < mt; i++) y[(int64_t)(i0 + i) * N + n] = out[i] + (bias ? bias[n] : 0.0f);
        }
    }
    return 0;
}

static int gemm_i8q8(const int8_t *xq, const float *xs, int M, int K, const int8_t *Q, const float *scale, int N,
              float *y, const float *bias) {
    if (K % 32) return -1;
    const int G = K / 32;
#pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        float out[MQ];
        for (int i0 = 0; i0 < M; i0 += MQ) {
            const int mt = min_int(MQ, M - i0);
            i8q8_row(Q + (int64_t)n * K, K, xq + (int64_t)i0 * K, xs + (int64_t)i0 * G, mt, out);
            for (int i = 0; i < mt; i++) y[(int64_t)(i0 + i) * N + n] = out[i] * scale[n] + (bias ? bias[n] : 0.0f);
        }
    }
    return 0;
}

/* float32 activations in, quantized here (one call per projection instead of two) */
typedef struct {
    int8_t *xq;
    float *xs, *xsum;
} q8_rows_t;

static int q8_rows(const float *x, int M, int K, q8_rows_t *r) {
    r->xq = NULL;
    if (K % 32) return -1;
    const size_t G = (size_t)K / 32;
    r->xq = (int8_t *)malloc((size_t)M * K + 2 * sizeof(float) * (size_t)M * G);
    if (!r->xq) return -2;
    r->xs = (float *)(r->xq + (size_t)M * K);
    r->xsum = r->xs + (size_t)M * G;
    return quantize_rows_q8(x, M, K, r->xq, r->xs, r->xsum);
}

static int linear_i4q8(const float *x, int M, int K, const uint8_t *P, const float *scale, const float *minimum, int N,
                float *y, const float *bias) {
    q8_rows_t r;
    int rc = q8_rows(x, M, K, &r);
    if (rc == 0) rc = gemm_i4q8(r.xq, r.xs, r.xsum, M, K, P, scale, minimum, N, y, bias);
    free(r.xq);
    return rc;
}

static int linear_i8q8(const float *x, int M, int K, const int8_t *Q, const float *scale, int N, float *y,
                const float *bias) {
    q8_rows_t r;
    int rc = q8_rows(x, M, K, &r);
    if (rc == 0) rc = gemm_i8q8(r.xq, r.xs, M, K, Q, scale, N, y, bias);
    free(r.xq);
    return rc;
}

/* ---- the rounding the integer kernels apply, as floats (x -> xs * xq): tests compare the kernels
 * with a float product of the dequantized weights and these activations. */

static void fake_quant_q8(const float *x, int M, int K, float *out) {
    q8_rows_t r;
    if (q8_rows(x, M, K, &r) == 0)
        for (int64_t i = 0; i < (int64_t)M * K; i++) out[i] = (float)r.xq[i] * r.xs[i / 32];  /* K % 32 == 0 */
    free(r.xq);
}
