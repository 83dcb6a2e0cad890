/* Small CPU operations around attention, so a decode step is a few native calls per layer
 * instead of a dozen tensor operations: writing new K/V into the paged cache, and the rotary
 * embedding in place. Rows of k/v/x are `ld` floats apart (they may be views of fused q/k/v).
 * Compiled into the operator library once per instruction-set variant (cpu_kernels_<isa>.c). */
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec_exp.h"

/* Store new K/V (float32 [T, KVH, D]) at their cache slots, in the cache's dtype. */
static inline uint16_t f32_to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((u >> 16) | 0x40); /* NaN stays NaN */
    u += 0x7fffu + ((u >> 16) & 1u); /* round to nearest even */
    return (uint16_t)(u >> 16);
}

static void write_kv_f32(const float *k, const float *v, int64_t ld, float *k_cache, float *v_cache, const int64_t *slots,
                  int T, int row) {
    for (int t = 0; t < T; t++) {
        memcpy(k_cache + slots[t] * row, k + (int64_t)t * ld, sizeof(float) * row);
        memcpy(v_cache + slots[t] * row, v + (int64_t)t * ld, sizeof(float) * row);
    }
}

static void write_kv_bf16(const float *k, const float *v, int64_t ld, uint16_t *k_cache, uint16_t *v_cache,
                   const int64_t *slots, int T, int row) {
    for (int t = 0; t < T; t++)
        for (int j = 0; j < row; j++) {
            k_cache[slots[t] * row + j] = f32_to_bf16(k[(int64_t)t * ld + j]);
            v_cache[slots[t] * row + j] = f32_to_bf16(v[(int64_t)t * ld + j]);
        }
}

/* Rotary embedding in place on the first n_heads heads of each row of x ([T, row_stride]
 * floats; head h at offset h * D), rotate-half layout: (a, b) -> (a cos - b sin, b cos + a sin)
 * with cos/sin [T, D] (the table rows for each token's position; both halves equal). */
static void rope_inplace(float *x, int T, int row_stride, int n_heads, int D, const float *cos, const float *sin) {
    const int half = D / 2;
    for (int t = 0; t < T; t++) {
        const float *c = cos + (int64_t)t * D, *s = sin + (int64_t)t * D;
        for (int h = 0; h < n_heads; h++) {
            float *a = x + (int64_t)t * row_stride + h * D, *b = a + half;
            for (int j = 0; j < half; j++) {
                const float x0 = a[j], x1 = b[j];
                a[j] = x0 * c[j] - x1 * s[j];
                b[j] = x1 * c[j + half] + x0 * s[j + half];
            }
        }
    }
}

/* y[t] = x[t] / sqrt(mean(x[t]^2) + eps) * w, rows of D floats (x and y may be the same). */
static void rms_norm(const float *x, const float *w, float *y, int T, int D, float eps) {
    for (int t = 0; t < T; t++) {
        const float *xr = x + (int64_t)t * D;
        float *yr = y + (int64_t)t * D;
        float ss = 0.0f;
        for (int j = 0; j < D; j++) ss += xr[j] * xr[j];
        const float inv = 1.0f / sqrtf(ss / (float)D + eps);
        for (int j = 0; j < D; j++) yr[j] = xr[j] * inv * w[j];
    }
}

/* out[t, j] = silu(gu[t, j]) * gu[t, I + j]: the gated activation on a fused gate/up output. */
static void silu_mul(const float *gu, float *out, int T, int I) {
    /* rows split across threads for a prefill (each element's value is the same either way) */
#pragma omp parallel for schedule(static) if ((int64_t)T * I >= 65536)
    for (int t = 0; t < T; t++) {
        const float *g = gu + (int64_t)t * 2 * I, *u = g + I;
        float *o = out + (int64_t)t * I;
        int j = 0;
#if defined(__AVX2__) && defined(__FMA__)
        /* sigmoid(g) = 1 / (1 + e) for g >= 0 and e / (1 + e) below, with e = exp(-|g|) <= 1 */
        const __m256 one = _mm256_set1_ps(1.0f), sign = _mm256_set1_ps(-0.0f);
        for (; j + 8 <= I; j += 8) {
            const __m256 gv = _mm256_loadu_ps(g + j);
            const __m256 e = exp_nonpositive_avx2(_mm256_or_ps(gv, sign));
            const __m256 r = _mm256_div_ps(_mm256_blendv_ps(one, e, gv), _mm256_add_ps(one, e));
            _mm256_storeu_ps(o + j, _mm256_mul_ps(_mm256_mul_ps(gv, r), _mm256_loadu_ps(u + j)));
        }
#endif
        for (; j < I; j++) o[j] = g[j] / (1.0f + expf(-g[j])) * u[j];
    }
}
