/* Small CPU operations around attention, so a decode step is a few native calls per layer
 * instead of a dozen tensor operations: writing new K/V into the paged cache, and the rotary
 * embedding in place. Rows of k/v/x are `ld` floats apart (they may be views of fused q/k/v).
 * Compiled into the operator library once per instruction-set variant (cpu_kernels_<isa>.c). */
#include <math.h>
#include <omp.h>
#include <stdint.h>
#include <stdlib.h>
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

/* ---- each row's largest values ---------------------------------------------------------------- */

/* Put (v, i) into the list of the row's `*count` largest so far (vals/ids, largest first, at most k):
 * after the equal values already there, so that the lower index comes first among equals. */
static inline void topk_insert(float *vals, int64_t *ids, int *count, int k, float v, int64_t i) {
    int p = *count < k ? *count : k - 1;
    if (*count == k && !(v > vals[k - 1])) return;
    while (p > 0 && vals[p - 1] < v) {
        vals[p] = vals[p - 1];
        ids[p] = ids[p - 1];
        p--;
    }
    vals[p] = v;
    ids[p] = i;
    if (*count < k) (*count)++;
}

/* Each row's k largest values' indices (x [T, n], rows ld floats apart; out [T, k]), largest first,
 * the lower index first among equal values; NaN ranks below every number. One pass over a row: a
 * value is looked at one by one only when it beats the k-th largest so far (compared a vector at a
 * time against it), so the pass costs about a read of the row, where torch's topk (or a chunked
 * max, then a top-k of the candidates) took several passes and a dozen operator calls. */
static void row_topk(const float *x, int T, int n, int64_t ld, int k, int64_t *out) {
    for (int t = 0; t < T; t++) {
        const float *r = x + (int64_t)t * ld;
        float vals[SPECSERVE_ROW_TOPK_MAX];
        int64_t *ids = out + (int64_t)t * k;
        int count = 0, j = 0;
        for (; j < k; j++) topk_insert(vals, ids, &count, k, isnan(r[j]) ? -INFINITY : r[j], j);
#if defined(__AVX512F__)
        for (; j + 16 <= n; j += 16) {
            __mmask16 m = _mm512_cmp_ps_mask(_mm512_loadu_ps(r + j), _mm512_set1_ps(vals[k - 1]), _CMP_GT_OQ);
            while (m) {
                const int b = __builtin_ctz(m);
                m &= m - 1;
                topk_insert(vals, ids, &count, k, r[j + b], j + b);
            }
        }
#elif defined(__AVX2__)
        for (; j + 8 <= n; j += 8) {
            int m = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(r + j), _mm256_set1_ps(vals[k - 1]), _CMP_GT_OQ));
            while (m) {
                const int b = __builtin_ctz(m);
                m &= m - 1;
                topk_insert(vals, ids, &count, k, r[j + b], j + b);
            }
        }
#endif
        for (; j < n; j++)
            if (r[j] > vals[k - 1]) topk_insert(vals, ids, &count, k, r[j], j);
    }
}

/* The index of the largest of r[j0..j1) (the first where several tie; the first NaN if any: NaN counts
 * as largest, as numpy's argmax), and that value. A vector pass for the maximum (and whether a NaN
 * is there), then one for its first index. */
static int64_t argmax_range(const float *r, int64_t j0, int64_t j1, float *value) {
    int64_t j = j0;
    float m = -INFINITY;
    int nan = 0;
#if defined(__AVX512F__)
    __m512 vm = _mm512_set1_ps(-INFINITY);
    for (; j + 16 <= j1; j += 16) {
        const __m512 x = _mm512_loadu_ps(r + j);
        nan |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q) != 0;
        vm = _mm512_max_ps(vm, x);
    }
    m = _mm512_reduce_max_ps(vm);
#elif defined(__AVX2__)
    __m256 vm = _mm256_set1_ps(-INFINITY);
    for (; j + 8 <= j1; j += 8) {
        const __m256 x = _mm256_loadu_ps(r + j);
        nan |= _mm256_movemask_ps(_mm256_cmp_ps(x, x, _CMP_UNORD_Q)) != 0;
        vm = _mm256_max_ps(vm, x);
    }
    float lanes[8];
    _mm256_storeu_ps(lanes, vm);
    for (int i = 0; i < 8; i++) m = lanes[i] > m ? lanes[i] : m;
#endif
    for (; j < j1; j++) {
        nan |= isnan(r[j]);
        m = r[j] > m ? r[j] : m;
    }
    j = j0;
    if (!nan) { /* the first index holding the maximum, a vector at a time */
#if defined(__AVX512F__)
        const __m512 vmax = _mm512_set1_ps(m);
        for (; j + 16 <= j1; j += 16) {
            const __mmask16 hit = _mm512_cmp_ps_mask(_mm512_loadu_ps(r + j), vmax, _CMP_EQ_OQ);
            if (hit) return *value = m, j + __builtin_ctz(hit);
        }
#elif defined(__AVX2__)
        const __m256 vmax = _mm256_set1_ps(m);
        for (; j + 8 <= j1; j += 8) {
            const int hit = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(r + j), vmax, _CMP_EQ_OQ));
            if (hit) return *value = m, j + __builtin_ctz(hit);
        }
#endif
    }
    for (; j < j1; j++)
        if (nan ? isnan(r[j]) : r[j] == m) break;
    if (j == j1) j = j0; /* every value -inf: the first */
    *value = r[j];
    return j;
}

/* Each row's argmax (x [T, n], rows ld floats apart; out [2, T]: the indices, then 1 where the value
 * there is finite), as numpy's: the first index of the largest value, NaN counting as largest. The
 * columns are split among the threads (as a projection's output columns are: each thread mostly
 * reads what it wrote), then each row's parts are compared in column order: the same index whatever
 * the split. */
static void row_argmax(const float *x, int T, int n, int64_t ld, int64_t *out) {
    if (T <= 0) return;
    const int parts = n >= 4096 ? omp_get_max_threads() : 1;
    float *vals = (float *)malloc(sizeof(float) * (size_t)T * parts);
    int64_t *ids = (int64_t *)malloc(sizeof(int64_t) * (size_t)T * parts);
    if (!vals || !ids) {
        free(vals), free(ids);
        for (int t = 0; t < T; t++) {
            float v;
            out[t] = argmax_range(x + (int64_t)t * ld, 0, n, &v);
            out[T + t] = isfinite(v) != 0;
        }
        return;
    }
#pragma omp parallel for schedule(static) num_threads(parts) if (parts > 1)
    for (int c = 0; c < parts; c++) {
        const int64_t j0 = (int64_t)n * c / parts, j1 = (int64_t)n * (c + 1) / parts;
        for (int t = 0; t < T; t++) ids[t * parts + c] = argmax_range(x + (int64_t)t * ld, j0, j1, &vals[t * parts + c]);
    }
    for (int t = 0; t < T; t++) {
        int best = 0;
        for (int c = 1; c < parts; c++) {
            const float v = vals[t * parts + c], b = vals[t * parts + best];
            if (!isnan(b) && (isnan(v) || v > b)) best = c;
        }
        out[t] = ids[t * parts + best];
        out[T + t] = isfinite(vals[t * parts + best]) != 0;
    }
    free(vals);
    free(ids);
}
