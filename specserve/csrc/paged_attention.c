/* Paged attention on the CPU, reading K/V blocks where they lie in the cache (no gathered copy).
 *
 * One call attends every item of a forward: decodes (one query row), draft trees (a few rows
 * with an ancestor mask) and prefill chunks (many rows, causal), each over its own cached prefix
 * plus its new tokens. Work is split into tasks of (item, kv head, tile of query rows), run in
 * parallel with OpenMP. Within a task, three passes: every score (keys read a block at a time)
 * and each row's maximum; the softmax weights and their sum key by key in position order; the
 * weighted values in the same order. No online rescaling: a row's result is the same sequence of
 * float operations whatever the cache's block boundaries, the tile it shares, or whether its keys
 * came in this step (a tree's accepted path, a chunk) or an earlier one. The query heads that share
 * a KV head are done together, so each key and value is read once per tile.
 *
 * With AVX2 and a head dim that is a multiple of 8 (every Llama-family model), the three passes are
 * vectorised: scores eight keys at a time (each key's dot product the same eight-lane sum and the same
 * reduction tree wherever it falls), exp by a polynomial (the same function of each score), and the
 * weighted values eight dims at a time with every key of the pass added in position order (a masked
 * key adds an exact zero). Row results stay independent of the batch, the tile and the block layout.
 *
 * Layouts (row-major, contiguous):
 *   q:                  [T, H, D] float32, rows ldq floats apart (q may be a view of fused q/k/v)
 *   out:                [T, H, D] float32
 *   k_cache, v_cache:   [num_blocks, block_size, KVH, D] float32 or bfloat16
 *   per item i:         q_start[i], q_len[i], ctx_len[i], table_off[i] (into tables),
 *                       mask_off[i] (into masks, a [q_len, q_len] uint8 matrix; -1 = causal)
 *   lanes:              8: the eight-lane task even where a sixteen-lane one is compiled; else the
 *                       widest this variant has for the head dim (which is faster is measured per
 *                       machine: specserve.model.tuning.attention_lanes)
 * Compiled into the operator library once per instruction-set variant (cpu_kernels_<isa>.c).
 */
#include <float.h>
#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define PA_AVX2 1
#endif
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "vec_exp.h"

#define TILE_Q 8     /* query rows per task */
#define MAX_REP 16   /* query heads per KV head */
#define MAX_D 256    /* head dim */
#define MAX_BS 64    /* block size */

static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = ((uint32_t)h) << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

typedef struct {
    int32_t item, group, row0, rows;
} task_t;

/* What a vector task's rows see: its item's cached keys, causal order or tree mask, blocks, and
 * the keys any row of the tile may see (kend). */
typedef struct {
    int rep, nq, cached, kend, nblocks, nv;
    int64_t moff;
    const int32_t *table;
    const uint8_t *masks;
} pa_span_t;

static inline pa_span_t pa_span(const task_t *t, const int32_t *q_len, const int32_t *ctx_len, const int32_t *tables,
                                const int32_t *table_off, const uint8_t *masks, const int64_t *mask_off, int H,
                                int KVH, int BS) {
    pa_span_t sp;
    const int it = t->item, ctx = ctx_len[it];
    sp.rep = H / KVH;
    sp.nq = q_len[it];
    sp.cached = ctx - sp.nq;
    sp.moff = mask_off[it];
    sp.table = tables + table_off[it];
    sp.masks = masks;
    sp.kend = sp.moff < 0 ? sp.cached + t->row0 + t->rows : ctx;
    sp.nblocks = (sp.kend + BS - 1) / BS;
    sp.nv = t->rows * sp.rep; /* query vectors: row r, head j at r * rep + j */
    return sp;
}

/* Bit x set where key p + x (x < valid) is visible to the item's new row `row`: a cached key, or a
 * new one its causal order or tree mask lets it see. */
static inline uint32_t pa_visible(const pa_span_t *sp, int row, int p, int valid) {
    uint32_t bits = 0;
    for (int x = 0; x < valid; x++) {
        const int pp = p + x;
        int vis = 1;
        if (pp >= sp->cached) {
            const int jj = pp - sp->cached;
            vis = sp->moff < 0 ? (jj <= row) : (sp->masks[sp->moff + (int64_t)row * sp->nq + jj] != 0);
        }
        bits |= (uint32_t)vis << x;
    }
    return bits;
}

#ifdef PA_AVX2
/* nk keys (or values) of one KV head from one cache block as float32 rows of D, then zero rows up to
 * a multiple of 8 (a padded key's score is computed and then masked); and the next block's `next_nk`
 * rows (at `next`; none if next_nk is 0) asked of memory meanwhile: blocks lie anywhere in the cache,
 * so the hardware's prefetcher cannot run ahead into the next one, and each block began with a miss. */
typedef void (*pa_load_fn)(const void *cache, int64_t base, int nk, int KVH, int D, float *dst, int64_t next, int next_nk);

static inline void pa_prefetch(const void *cache, int64_t next, int next_nk, int KVH, int D, int elem) {
    const char *c = (const char *)cache;
    for (int tk = 0; tk < next_nk; tk++) {
        const char *row = c + (next + (int64_t)tk * KVH) * D * elem;
        for (int off = 0; off < D * elem; off += 64) _mm_prefetch(row + off, _MM_HINT_T0);
    }
}

/* Block b of a task's keys (or values) of KV head g, up to key kend, into kf as `load` lays them out,
 * the next block's asked of memory meanwhile; returns how many keys it holds. */
static inline int pa_read_block(pa_load_fn load, const void *cache, const int32_t *table, int b, int nblocks, int kend,
                                int BS, int KVH, int g, int D, float *kf) {
    const int p0 = b * BS, nk = (kend - p0) < BS ? (kend - p0) : BS;
    const int64_t next = b + 1 < nblocks ? ((int64_t)table[b + 1] * BS) * KVH + g : 0;
    const int next_nk = b + 1 < nblocks ? ((kend - p0 - BS) < BS ? (kend - p0 - BS) : BS) : 0;
    load(cache, ((int64_t)table[b] * BS) * KVH + g, nk, KVH, D, kf, next, next_nk);
    return nk;
}

static void pa_load_f32(const void *cache, int64_t base, int nk, int KVH, int D, float *dst, int64_t next,
                        int next_nk) {
    pa_prefetch(cache, next, next_nk, KVH, D, 4);
    const float *c = (const float *)cache;
    for (int tk = 0; tk < nk; tk++) memcpy(dst + (int64_t)tk * D, c + (base + (int64_t)tk * KVH) * D, sizeof(float) * D);
    for (int tk = nk; tk % 8; tk++) memset(dst + (int64_t)tk * D, 0, sizeof(float) * D);
}

static void pa_load_bf16(const void *cache, int64_t base, int nk, int KVH, int D, float *dst, int64_t next,
                         int next_nk) {
    pa_prefetch(cache, next, next_nk, KVH, D, 2);
    const uint16_t *c = (const uint16_t *)cache;
    for (int tk = 0; tk < nk; tk++) {
        const uint16_t *src = c + (base + (int64_t)tk * KVH) * D;
        float *o = dst + (int64_t)tk * D;
        for (int d = 0; d < D; d += 8) {
            const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(src + d)));
            _mm256_storeu_ps(o + d, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
        }
    }
    for (int tk = nk; tk % 8; tk++) memset(dst + (int64_t)tk * D, 0, sizeof(float) * D);
}

/* Eight keys' eight-lane sums to one score each, always by the same reduction tree. */
static inline __m256 pa_reduce8(__m256 a0, __m256 a1, __m256 a2, __m256 a3, __m256 a4, __m256 a5, __m256 a6, __m256 a7) {
    const __m256 s01 = _mm256_hadd_ps(a0, a1), s23 = _mm256_hadd_ps(a2, a3);
    const __m256 s45 = _mm256_hadd_ps(a4, a5), s67 = _mm256_hadd_ps(a6, a7);
    const __m256 s0123 = _mm256_hadd_ps(s01, s23), s4567 = _mm256_hadd_ps(s45, s67);
    /* s0123 = [k0 k1 k2 k3 | k0 k1 k2 k3] (low and high halves of each key's lanes), s4567 likewise */
    return _mm256_add_ps(_mm256_permute2f128_ps(s0123, s4567, 0x20), _mm256_permute2f128_ps(s0123, s4567, 0x31));
}

/* The dot products of one query vector with 8 keys (rows of kf, D floats apart): per key, eight lanes
 * over D in order, then the same reduction tree. */
static inline __m256 pa_dots8(const float *qv, const float *kf, int D) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    for (int d = 0; d < D; d += 8) {
        const __m256 x = _mm256_loadu_ps(qv + d);
        a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kf + 0 * D + d), a0);
        a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kf + 1 * D + d), a1);
        a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kf + 2 * D + d), a2);
        a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kf + 3 * D + d), a3);
        a4 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kf + 4 * D + d), a4);
        a5 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kf + 5 * D + d), a5);
        a6 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kf + 6 * D + d), a6);
        a7 = _mm256_fmadd_ps(x, _mm256_loadu_ps(kf + 7 * D + d), a7);
    }
    return pa_reduce8(a0, a1, a2, a3, a4, a5, a6, a7);
}

#if defined(__AVX512VL__)
/* Two query vectors against the same 8 keys, each key chunk loaded once for both: every score is
 * the same sequence of operations as pa_dots8's (its sixteen sums fit AVX-512's 32 registers; with
 * AVX2's 16 they would spill). */
static inline void pa_dots8x2(const float *qa, const float *qb, const float *kf, int D, __m256 *da, __m256 *db) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
    __m256 b0 = a0, b1 = a0, b2 = a0, b3 = a0, b4 = a0, b5 = a0, b6 = a0, b7 = a0;
    for (int d = 0; d < D; d += 8) {
        const __m256 x = _mm256_loadu_ps(qa + d), y = _mm256_loadu_ps(qb + d);
        __m256 k;
        k = _mm256_loadu_ps(kf + 0 * D + d), a0 = _mm256_fmadd_ps(x, k, a0), b0 = _mm256_fmadd_ps(y, k, b0);
        k = _mm256_loadu_ps(kf + 1 * D + d), a1 = _mm256_fmadd_ps(x, k, a1), b1 = _mm256_fmadd_ps(y, k, b1);
        k = _mm256_loadu_ps(kf + 2 * D + d), a2 = _mm256_fmadd_ps(x, k, a2), b2 = _mm256_fmadd_ps(y, k, b2);
        k = _mm256_loadu_ps(kf + 3 * D + d), a3 = _mm256_fmadd_ps(x, k, a3), b3 = _mm256_fmadd_ps(y, k, b3);
        k = _mm256_loadu_ps(kf + 4 * D + d), a4 = _mm256_fmadd_ps(x, k, a4), b4 = _mm256_fmadd_ps(y, k, b4);
        k = _mm256_loadu_ps(kf + 5 * D + d), a5 = _mm256_fmadd_ps(x, k, a5), b5 = _mm256_fmadd_ps(y, k, b5);
        k = _mm256_loadu_ps(kf + 6 * D + d), a6 = _mm256_fmadd_ps(x, k, a6), b6 = _mm256_fmadd_ps(y, k, b6);
        k = _mm256_loadu_ps(kf + 7 * D + d), a7 = _mm256_fmadd_ps(x, k, a7), b7 = _mm256_fmadd_ps(y, k, b7);
    }
    *da = pa_reduce8(a0, a1, a2, a3, a4, a5, a6, a7);
    *db = pa_reduce8(b0, b1, b2, b3, b4, b5, b6, b7);
}
#endif

static inline float pa_hmax(__m256 v) {
    __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_movehdup_ps(m));
    return _mm_cvtss_f32(m);
}

/* acc[x * D + 8 y] += sum over keys tk in order of w[x * ld + tk] * vf[tk * D + 8 y], for x < NI query
 * vectors and y < ND (1 or 2) vectors of dims, all in registers where it is inlined with constants;
 * with LS, also lsum[x] += each w[x * ld + tk] in the same order (the softmax's denominator, key by
 * key in position order, as the values are). Eight independent FMA chains at four vectors by two. */
static inline __attribute__((always_inline)) void pa_values8(const int NI, const int ND, const int LS, const float *w,
                                                             int64_t ld, const float *vf, int D, int nk, float *acc,
                                                             float *lsum) {
    __m256 c[4][2], ls[4];
    for (int x = 0; x < NI; x++) {
        for (int y = 0; y < ND; y++) c[x][y] = _mm256_loadu_ps(acc + (int64_t)x * D + 8 * y);
        if (LS) ls[x] = _mm256_set1_ps(lsum[x]);
    }
    for (int tk = 0; tk < nk; tk++) {
        __m256 v[2];
        for (int y = 0; y < ND; y++) v[y] = _mm256_loadu_ps(vf + (int64_t)tk * D + 8 * y);
        for (int x = 0; x < NI; x++) {
            const __m256 wx = _mm256_broadcast_ss(w + (int64_t)x * ld + tk);
            for (int y = 0; y < ND; y++) c[x][y] = _mm256_fmadd_ps(wx, v[y], c[x][y]);
            if (LS) ls[x] = _mm256_add_ps(ls[x], wx);
        }
    }
    for (int x = 0; x < NI; x++) {
        for (int y = 0; y < ND; y++) _mm256_storeu_ps(acc + (int64_t)x * D + 8 * y, c[x][y]);
        if (LS) lsum[x] = _mm256_cvtss_f32(ls[x]);
    }
}

/* Every dim of up to four query vectors (NI) for one block's keys: sixteen dims at a time, then eight
 * (the weights' sum with the first), inlined for each NI so that one call covers the block. */
static inline __attribute__((always_inline)) void pa_values8_all(const int NI, const float *w, int64_t ld,
                                                                 const float *vf, int D, int nk, float *acc, float *lsum) {
    int d = 0;
    for (; d + 16 <= D; d += 16) {
        if (d == 0 && lsum) pa_values8(NI, 2, 1, w, ld, vf, D, nk, acc, lsum);
        else pa_values8(NI, 2, 0, w, ld, vf + d, D, nk, acc + d, lsum);
    }
    if (d < D) {
        if (d == 0 && lsum) pa_values8(NI, 1, 1, w, ld, vf, D, nk, acc, lsum);
        else pa_values8(NI, 1, 0, w, ld, vf + d, D, nk, acc + d, lsum);
    }
}

static void pa_values8_any(int ni, const float *w, int64_t ld, const float *vf, int D, int nk, float *acc, float *lsum) {
    switch (ni) {
        case 1: pa_values8_all(1, w, ld, vf, D, nk, acc, lsum); break;
        case 2: pa_values8_all(2, w, ld, vf, D, nk, acc, lsum); break;
        case 3: pa_values8_all(3, w, ld, vf, D, nk, acc, lsum); break;
        default: pa_values8_all(4, w, ld, vf, D, nk, acc, lsum); break;
    }
}

static int pa_task_avx2(const float *q, const void *k_cache, const void *v_cache, pa_load_fn load, float *out,
                        const int32_t *q_start, const int32_t *q_len, const int32_t *ctx_len, const int32_t *tables,
                        const int32_t *table_off, const uint8_t *masks, const int64_t *mask_off, int H, int KVH,
                        int D, int BS, float scale, int64_t ldq, const task_t *t) {
    const pa_span_t span = pa_span(t, q_len, ctx_len, tables, table_off, masks, mask_off, H, KVH, BS);
    const int rep = span.rep, it = t->item, g = t->group, cached = span.cached, kend = span.kend;
    const int nblocks = span.nblocks, nv = span.nv;
    const int32_t *table = span.table;
    const int64_t ld = (int64_t)kend + 8 + BS; /* room for a padded group's stores past the end */
    float *buf = (float *)malloc(sizeof(float) * (size_t)(nv * (ld + 2 * D) + (BS + 8) * D));
    if (!buf) return -2;
    float *s = buf, *qv = s + nv * ld, *acc = qv + (int64_t)nv * D, *kf = acc + (int64_t)nv * D;
    float m[TILE_Q * MAX_REP], l[TILE_Q * MAX_REP];
    const __m256 vscale = _mm256_set1_ps(scale), ninf = _mm256_set1_ps(-INFINITY);
    for (int r = 0; r < t->rows; r++)
        for (int j = 0; j < rep; j++) {
            const float *src = q + (int64_t)(q_start[it] + t->row0 + r) * ldq + (g * rep + j) * D;
            float *dst = qv + (int64_t)(r * rep + j) * D;
            for (int d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(src + d), vscale));
        }
    memset(acc, 0, sizeof(float) * (size_t)nv * D);
    __m256 vmax[TILE_Q * MAX_REP];
    for (int i = 0; i < nv; i++) vmax[i] = ninf;
    /* pass 1: every score, masked ones -inf, and each vector's maximum */
    for (int b = 0; b < nblocks; b++) {
        const int p0 = b * BS, nk = pa_read_block(load, k_cache, table, b, nblocks, kend, BS, KVH, g, D, kf);
        for (int k0 = 0; k0 < nk; k0 += 8) {
            const int p = p0 + k0, valid = nk - k0 < 8 ? nk - k0 : 8;
            const int plain = valid == 8 && p + 8 <= cached; /* all 8 keys are cached ones: all visible */
            for (int r = 0; r < t->rows; r++) {
                __m256 keep = _mm256_castsi256_ps(_mm256_set1_epi32(-1));
                if (!plain) { /* lane x all ones where bit x is set */
                    const __m256i bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
                    const __m256i vis = _mm256_set1_epi32((int)pa_visible(&span, t->row0 + r, p, valid));
                    keep = _mm256_castsi256_ps(_mm256_cmpeq_epi32(_mm256_and_si256(vis, bit), bit));
                }
                int j = 0;
#if defined(__AVX512VL__)
                for (; j + 2 <= rep; j += 2) {
                    const int i = r * rep + j;
                    __m256 da, db;
                    pa_dots8x2(qv + (int64_t)i * D, qv + (int64_t)(i + 1) * D, kf + (int64_t)k0 * D, D, &da, &db);
                    da = _mm256_blendv_ps(ninf, da, keep);
                    db = _mm256_blendv_ps(ninf, db, keep);
                    _mm256_storeu_ps(s + i * ld + p, da);
                    _mm256_storeu_ps(s + (i + 1) * ld + p, db);
                    vmax[i] = _mm256_max_ps(vmax[i], da);
                    vmax[i + 1] = _mm256_max_ps(vmax[i + 1], db);
                }
#endif
                for (; j < rep; j++) {
                    const int i = r * rep + j;
                    const __m256 dots = _mm256_blendv_ps(ninf, pa_dots8(qv + (int64_t)i * D, kf + (int64_t)k0 * D, D), keep);
                    _mm256_storeu_ps(s + i * ld + p, dots);
                    vmax[i] = _mm256_max_ps(vmax[i], dots);
                }
            }
        }
    }
    /* pass 2: weights (0 where masked) */
    for (int i = 0; i < nv; i++) {
        m[i] = pa_hmax(vmax[i]);
        l[i] = 0.0f;
        if (m[i] == -INFINITY) { /* nothing visible: every weight 0 */
            memset(s + i * ld, 0, sizeof(float) * (size_t)(kend + 8));
            continue;
        }
        const __m256 vm = _mm256_set1_ps(m[i]);
        float *sp = s + i * ld;
        for (int p = 0; p < kend; p += 8) {
            const __m256 x = _mm256_loadu_ps(sp + p);
            const __m256 w = _mm256_and_ps(_mm256_cmp_ps(x, ninf, _CMP_NEQ_OQ), exp_nonpositive_avx2(_mm256_sub_ps(x, vm)));
            _mm256_storeu_ps(sp + p, w);
        }
    }
    /* pass 3: the weighted values and the weights' sum, key by key in position order, sixteen dims (two
       vectors) of up to four query vectors at a time */
    for (int b = 0; b < nblocks; b++) {
        const int p0 = b * BS, nk = pa_read_block(load, v_cache, table, b, nblocks, kend, BS, KVH, g, D, kf);
        for (int i0 = 0; i0 < nv; i0 += 4)
            pa_values8_any(nv - i0 < 4 ? nv - i0 : 4, s + (int64_t)i0 * ld + p0, ld, kf, D, nk, acc + (int64_t)i0 * D,
                           l + i0);
    }
    for (int r = 0; r < t->rows; r++)
        for (int j = 0; j < rep; j++) {
            const int i = r * rep + j;
            float *dst = out + ((int64_t)(q_start[it] + t->row0 + r) * H + g * rep + j) * D;
            const __m256 inv = _mm256_set1_ps(l[i] > 0.0f ? 1.0f / l[i] : 0.0f);
            for (int d = 0; d < D; d += 8) _mm256_storeu_ps(dst + d, _mm256_mul_ps(_mm256_loadu_ps(acc + (int64_t)i * D + d), inv));
        }
    free(buf);
    return 0;
}
#endif

#if defined(PA_AVX2) && defined(__AVX512F__) && defined(__AVX512BW__)
#define PA_AVX512 1
/* The AVX-512 task, for a head dim that is a multiple of 16: the same three passes, each over
 * sixteen lanes, with no horizontal sum per key. Scores sixteen keys at a time: per query vector,
 * sixteen accumulators (one per key, over D in order), then one fixed tree sums each key's sixteen
 * lanes (lanes l and l+8, then l and l+4, then pairs) for all sixteen at once: every key's score
 * the same sequence of operations wherever it falls. The weights' sum in sixteen lanes over the
 * keys in order, then one fixed tree; the weighted values sixteen dims at a time, up to four query
 * vectors by four vectors of dims in registers, every key added in position order. A row's result
 * depends only on its own query and the keys it sees, as in the eight-lane task (which runs where
 * the head dim is a multiple of 8 only). */

/* nk keys (or values) of one KV head from one cache block as float32 rows of D, then zero rows up to
 * a multiple of 16 (a padded key's score is computed and then masked). */
static void pa_load16_f32(const void *cache, int64_t base, int nk, int KVH, int D, float *dst, int64_t next,
                          int next_nk) {
    pa_prefetch(cache, next, next_nk, KVH, D, 4);
    const float *c = (const float *)cache;
    for (int tk = 0; tk < nk; tk++) memcpy(dst + (int64_t)tk * D, c + (base + (int64_t)tk * KVH) * D, sizeof(float) * D);
    for (int tk = nk; tk % 16; tk++) memset(dst + (int64_t)tk * D, 0, sizeof(float) * D);
}

static void pa_load16_bf16(const void *cache, int64_t base, int nk, int KVH, int D, float *dst, int64_t next,
                           int next_nk) {
    pa_prefetch(cache, next, next_nk, KVH, D, 2);
    const uint16_t *c = (const uint16_t *)cache;
    for (int tk = 0; tk < nk; tk++) {
        const uint16_t *src = c + (base + (int64_t)tk * KVH) * D;
        float *o = dst + (int64_t)tk * D;
        for (int d = 0; d < D; d += 16) {
            const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(src + d)));
            _mm512_storeu_ps(o + d, _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)));
        }
    }
    for (int tk = nk; tk % 16; tk++) memset(dst + (int64_t)tk * D, 0, sizeof(float) * D);
}

/* [a's low half + its high half | b's likewise]: two keys' sixteen lanes to eight each */
static inline __m512 pa_halves16(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(1, 0, 1, 0)), _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 2, 3, 2)));
}
/* four keys' eight lanes (two per argument) to four each, one key per 128-bit lane */
static inline __m512 pa_quarters16(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_f32x4(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}
/* within each 128-bit lane, adjacent pairs: [a0 + a1, a2 + a3, b0 + b1, b2 + b3] */
static inline __m512 pa_pairs16(__m512 a, __m512 b) {
    return _mm512_add_ps(_mm512_shuffle_ps(a, b, _MM_SHUFFLE(2, 0, 2, 0)), _mm512_shuffle_ps(a, b, _MM_SHUFFLE(3, 1, 3, 1)));
}

/* Sixteen keys' sixteen-lane sums (a[t]: key t's) to one score each, key t in lane t, every key's
 * lanes summed by the same tree. */
static inline __m512 pa_reduce16(const __m512 *a) {
    const __m512 r0 = pa_quarters16(pa_halves16(a[0], a[1]), pa_halves16(a[2], a[3]));    /* keys 0-3, one per 128-bit lane */
    const __m512 r1 = pa_quarters16(pa_halves16(a[4], a[5]), pa_halves16(a[6], a[7]));    /* keys 4-7 */
    const __m512 r2 = pa_quarters16(pa_halves16(a[8], a[9]), pa_halves16(a[10], a[11]));  /* keys 8-11 */
    const __m512 r3 = pa_quarters16(pa_halves16(a[12], a[13]), pa_halves16(a[14], a[15])); /* keys 12-15 */
    /* element 4j + m holds key 4m + j */
    const __m512 z = pa_pairs16(pa_pairs16(r0, r1), pa_pairs16(r2, r3));
    return _mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), z);
}

/* One query vector's scores against 16 keys (rows of kf, D floats apart). */
static inline __m512 pa_dots16(const float *qv, const float *kf, int D) {
    __m512 a[16];
#pragma GCC unroll 16
    for (int t = 0; t < 16; t++) a[t] = _mm512_setzero_ps();
    for (int d = 0; d < D; d += 16) {
        const __m512 x = _mm512_loadu_ps(qv + d);
#pragma GCC unroll 16
        for (int t = 0; t < 16; t++) a[t] = _mm512_fmadd_ps(x, _mm512_loadu_ps(kf + (int64_t)t * D + d), a[t]);
    }
    return pa_reduce16(a);
}

/* acc[x * D + d + 16 y] += sum over keys tk in order of w[x * ld + tk] * vf[tk * D + d + 16 y], for x < NI
 * query vectors and y < ND vectors of dims (constants where it is inlined: all in registers); with LS,
 * also lsum[x] += each w[x * ld + tk] in the same order (the softmax's denominator, key by key in
 * position order as the values are: a lane-wise sum would tie it to where the keys lie). */
static inline __attribute__((always_inline)) void pa_values16(const int NI, const int ND, const int LS, const float *w,
                                                              int64_t ld, const float *vf, int D, int nk, float *acc,
                                                              float *lsum) {
    __m512 c[4][4], ls[4];
    for (int x = 0; x < NI; x++) {
        for (int y = 0; y < ND; y++) c[x][y] = _mm512_loadu_ps(acc + (int64_t)x * D + 16 * y);
        if (LS) ls[x] = _mm512_set1_ps(lsum[x]);
    }
    for (int tk = 0; tk < nk; tk++) {
        __m512 v[4];
        for (int y = 0; y < ND; y++) v[y] = _mm512_loadu_ps(vf + (int64_t)tk * D + 16 * y);
        for (int x = 0; x < NI; x++) {
            const __m512 wx = _mm512_set1_ps(w[(int64_t)x * ld + tk]);
            for (int y = 0; y < ND; y++) c[x][y] = _mm512_fmadd_ps(wx, v[y], c[x][y]);
            if (LS) ls[x] = _mm512_add_ps(ls[x], wx);
        }
    }
    for (int x = 0; x < NI; x++) {
        for (int y = 0; y < ND; y++) _mm512_storeu_ps(acc + (int64_t)x * D + 16 * y, c[x][y]);
        if (LS) lsum[x] = _mm512_cvtss_f32(ls[x]);
    }
}

/* Every dim of up to four query vectors (NI) for one block's keys: sixty-four dims at a time, then the
 * rest (the weights' sum with the first), inlined for each NI so that one call covers the block. */
static inline __attribute__((always_inline)) void pa_values16_all(const int NI, const float *w, int64_t ld,
                                                                  const float *vf, int D, int nk, float *acc, float *lsum) {
    int d = 0;
    for (; d + 64 <= D; d += 64) {
        if (d == 0 && lsum) pa_values16(NI, 4, 1, w, ld, vf, D, nk, acc, lsum);
        else pa_values16(NI, 4, 0, w, ld, vf + d, D, nk, acc + d, lsum);
    }
    const int nd = (D - d) / 16;
    if (nd) {
        const int ls = d == 0 && lsum;
        switch (nd * 2 + ls) {
            case 2: pa_values16(NI, 1, 0, w, ld, vf + d, D, nk, acc + d, lsum); break;
            case 3: pa_values16(NI, 1, 1, w, ld, vf + d, D, nk, acc + d, lsum); break;
            case 4: pa_values16(NI, 2, 0, w, ld, vf + d, D, nk, acc + d, lsum); break;
            case 5: pa_values16(NI, 2, 1, w, ld, vf + d, D, nk, acc + d, lsum); break;
            case 6: pa_values16(NI, 3, 0, w, ld, vf + d, D, nk, acc + d, lsum); break;
            default: pa_values16(NI, 3, 1, w, ld, vf + d, D, nk, acc + d, lsum); break;
        }
    }
}

static void pa_values16_any(int ni, const float *w, int64_t ld, const float *vf, int D, int nk, float *acc,
                            float *lsum) {
    switch (ni) {
        case 1: pa_values16_all(1, w, ld, vf, D, nk, acc, lsum); break;
        case 2: pa_values16_all(2, w, ld, vf, D, nk, acc, lsum); break;
        case 3: pa_values16_all(3, w, ld, vf, D, nk, acc, lsum); break;
        default: pa_values16_all(4, w, ld, vf, D, nk, acc, lsum); break;
    }
}

static int pa_task_avx512(const float *q, const void *k_cache, const void *v_cache, pa_load_fn load, float *out,
                          const int32_t *q_start, const int32_t *q_len, const int32_t *ctx_len, const int32_t *tables,
                          const int32_t *table_off, const uint8_t *masks, const int64_t *mask_off, int H, int KVH,
                          int D, int BS, float scale, int64_t ldq, const task_t *t) {
    const pa_span_t span = pa_span(t, q_len, ctx_len, tables, table_off, masks, mask_off, H, KVH, BS);
    const int rep = span.rep, it = t->item, g = t->group, cached = span.cached, kend = span.kend;
    const int nblocks = span.nblocks, nv = span.nv;
    const int32_t *table = span.table;
    const int64_t ld = (int64_t)kend + 16 + BS; /* room for a padded chunk's stores past the end */
    float *buf = (float *)malloc(sizeof(float) * (size_t)(nv * (ld + 2 * D) + (BS + 16) * D));
    if (!buf) return -2;
    float *s = buf, *qv = s + nv * ld, *acc = qv + (int64_t)nv * D, *kf = acc + (int64_t)nv * D;
    float m[TILE_Q * MAX_REP], l[TILE_Q * MAX_REP];
    const __m512 vscale = _mm512_set1_ps(scale), ninf = _mm512_set1_ps(-INFINITY);
    for (int r = 0; r < t->rows; r++)
        for (int j = 0; j < rep; j++) {
            const float *src = q + (int64_t)(q_start[it] + t->row0 + r) * ldq + (g * rep + j) * D;
            float *dst = qv + (int64_t)(r * rep + j) * D;
            for (int d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_loadu_ps(src + d), vscale));
        }
    memset(acc, 0, sizeof(float) * (size_t)nv * D);
    __m512 vmax[TILE_Q * MAX_REP];
    for (int i = 0; i < nv; i++) vmax[i] = ninf;
    /* pass 1: every score, masked ones -inf, and each vector's maximum */
    for (int b = 0; b < nblocks; b++) {
        const int p0 = b * BS, nk = pa_read_block(load, k_cache, table, b, nblocks, kend, BS, KVH, g, D, kf);
        for (int k0 = 0; k0 < nk; k0 += 16) {
            const int p = p0 + k0, valid = nk - k0 < 16 ? nk - k0 : 16;
            const int plain = valid == 16 && p + 16 <= cached; /* all 16 keys are cached ones: all visible */
            for (int r = 0; r < t->rows; r++) {
                const __mmask16 keep = plain ? (__mmask16)0xFFFF : (__mmask16)pa_visible(&span, t->row0 + r, p, valid);
                for (int j = 0; j < rep; j++) {
                    const int i = r * rep + j;
                    const __m512 dots = _mm512_mask_blend_ps(keep, ninf, pa_dots16(qv + (int64_t)i * D, kf + (int64_t)k0 * D, D));
                    _mm512_storeu_ps(s + i * ld + p, dots);
                    vmax[i] = _mm512_max_ps(vmax[i], dots);
                }
            }
        }
    }
    /* pass 2: weights (0 where masked) */
    for (int i = 0; i < nv; i++) {
        m[i] = _mm512_reduce_max_ps(vmax[i]);
        l[i] = 0.0f;
        float *sp = s + i * ld;
        if (m[i] == -INFINITY) { /* nothing visible: every weight 0 */
            memset(sp, 0, sizeof(float) * (size_t)(kend + 16));
            continue;
        }
        const __m512 vm = _mm512_set1_ps(m[i]);
        for (int p = 0; p < kend; p += 16) {
            const __mmask16 in = kend - p >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (kend - p)) - 1u);
            const __m512 x = _mm512_mask_loadu_ps(ninf, in, sp + p);
            _mm512_storeu_ps(sp + p, _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(x, ninf, _CMP_NEQ_OQ),
                                                         exp_nonpositive_avx512(_mm512_sub_ps(x, vm))));
        }
    }
    /* pass 3: the weighted values and the weights' sum, key by key in position order, up to four
       query vectors by sixty-four dims at a time */
    for (int b = 0; b < nblocks; b++) {
        const int p0 = b * BS, nk = pa_read_block(load, v_cache, table, b, nblocks, kend, BS, KVH, g, D, kf);
        for (int i0 = 0; i0 < nv; i0 += 4)
            pa_values16_any(nv - i0 < 4 ? nv - i0 : 4, s + (int64_t)i0 * ld + p0, ld, kf, D, nk, acc + (int64_t)i0 * D,
                            l + i0);
    }
    for (int r = 0; r < t->rows; r++)
        for (int j = 0; j < rep; j++) {
            const int i = r * rep + j;
            float *dst = out + ((int64_t)(q_start[it] + t->row0 + r) * H + g * rep + j) * D;
            const __m512 inv = _mm512_set1_ps(l[i] > 0.0f ? 1.0f / l[i] : 0.0f);
            for (int d = 0; d < D; d += 16) _mm512_storeu_ps(dst + d, _mm512_mul_ps(_mm512_loadu_ps(acc + (int64_t)i * D + d), inv));
        }
    free(buf);
    return 0;
}
#endif

#define DEFINE_KERNEL(NAME, KV_T, LOAD)                                                             \
    /* nk keys (or values) of one KV head from one cache block, as float32 */                          \
    static void NAME##_load(const KV_T *cache, int64_t base, int nk, int KVH, int D, float kf[][D]) {    \
        for (int tk = 0; tk < nk; tk++) {                                                             \
            const KV_T *src = cache + (base + (int64_t)tk * KVH) * D;                                 \
            for (int d = 0; d < D; d++) kf[tk][d] = LOAD(src[d]);                                     \
        }                                                                                             \
    }                                                                                                 \
                                                                                                      \
    static int NAME##_task_scalar(const float *q, const KV_T *k_cache, const KV_T *v_cache, float *out,       \
                           const int32_t *q_start, const int32_t *q_len, const int32_t *ctx_len,       \
                           const int32_t *tables, const int32_t *table_off, const uint8_t *masks,      \
                           const int64_t *mask_off, int H, int KVH, int D, int BS, float scale,        \
                           int64_t ldq, const task_t *t) {                                              \
        const int rep = H / KVH, it = t->item, g = t->group;                                           \
        const int nq = q_len[it], ctx = ctx_len[it], cached = ctx - nq;                               \
        const int64_t moff = mask_off[it];                                                            \
        const int32_t *table = tables + table_off[it];                                                \
        /* the last key any row of this tile may see */                                               \
        const int last_row = t->row0 + t->rows - 1;                                                   \
        const int kend = moff < 0 ? cached + last_row + 1 : ctx;                                     \
        const int nblocks = (kend + BS - 1) / BS;                                                     \
        float qv[TILE_Q][rep][D];                                                                     \
        float acc[TILE_Q][rep][D];                                                                    \
        float m[TILE_Q][rep], l[TILE_Q][rep];                                                         \
        float kf[BS][D];                                                                              \
        float *s = (float *)malloc(sizeof(float) * (size_t)t->rows * rep * (kend > 0 ? kend : 1));   \
        if (!s) return -2;                                                                            \
        for (int r = 0; r < t->rows; r++)                                                             \
            for (int j = 0; j < rep; j++) {                                                           \
                const float *src = q + (int64_t)(q_start[it] + t->row0 + r) * ldq + (g * rep + j) * D; \
                for (int d = 0; d < D; d++) qv[r][j][d] = src[d] * scale;                             \
                memset(acc[r][j], 0, sizeof(float) * D);                                              \
                m[r][j] = -INFINITY;                                                                  \
                l[r][j] = 0.0f;                                                                       \
            }                                                                                         \
        /* pass 1: every score, and each row's maximum */                                             \
        for (int b = 0; b < nblocks; b++) {                                                           \
            const int64_t base = ((int64_t)table[b] * BS) * KVH + g;                                  \
            const int p0 = b * BS;                                                                    \
            const int nk = (kend - p0) < BS ? (kend - p0) : BS;                                       \
            NAME##_load(k_cache, base, nk, KVH, D, kf);                                                \
            for (int r = 0; r < t->rows; r++) {                                                       \
                const int row = t->row0 + r;                                                          \
                for (int tk = 0; tk < nk; tk++) {                                                     \
                    const int p = p0 + tk;                                                            \
                    int visible = 1;                                                                  \
                    if (p >= cached) {                                                                \
                        const int jj = p - cached;                                                    \
                        visible = moff < 0 ? (jj <= row) : (masks[moff + (int64_t)row * nq + jj] != 0); \
                    }                                                                                 \
                    for (int j = 0; j < rep; j++) {                                                   \
                        float *sp = s + ((int64_t)r * rep + j) * kend + p;                            \
                        if (!visible) {                                                               \
                            *sp = -INFINITY;                                                          \
                            continue;                                                                 \
                        }                                                                             \
                        float dot = 0.0f;                                                             \
                        _Pragma("omp simd reduction(+:dot)") for (int d = 0; d < D; d++) dot += qv[r][j][d] * kf[tk][d]; \
                        *sp = dot;                                                                    \
                        m[r][j] = dot > m[r][j] ? dot : m[r][j];                                      \
                    }                                                                                 \
                }                                                                                     \
            }                                                                                         \
        }                                                                                             \
        /* pass 2: weights and their sum, key by key in position order */                            \
        for (int r = 0; r < t->rows; r++)                                                             \
            for (int j = 0; j < rep; j++) {                                                           \
                float *sp = s + ((int64_t)r * rep + j) * kend;                                        \
                float sum = 0.0f;                                                                     \
                for (int p = 0; p < kend; p++) {                                                      \
                    const float e = sp[p] == -INFINITY ? 0.0f : expf(sp[p] - m[r][j]);                \
                    sp[p] = e;                                                                        \
                    sum += e;                                                                         \
                }                                                                                     \
                l[r][j] = sum;                                                                        \
            }                                                                                         \
        /* pass 3: the weighted values, key by key in position order */                              \
        for (int b = 0; b < nblocks; b++) {                                                           \
            const int64_t base = ((int64_t)table[b] * BS) * KVH + g;                                  \
            const int p0 = b * BS;                                                                    \
            const int nk = (kend - p0) < BS ? (kend - p0) : BS;                                       \
            NAME##_load(v_cache, base, nk, KVH, D, kf);                                                \
            for (int r = 0; r < t->rows; r++)                                                         \
                for (int j = 0; j < rep; j++) {                                                       \
                    const float *sp = s + ((int64_t)r * rep + j) * kend + p0;                         \
                    for (int tk = 0; tk < nk; tk++) {                                                 \
                        const float w = sp[tk];                                                       \
                        if (w == 0.0f) continue;                                                      \
                        _Pragma("omp simd") for (int d = 0; d < D; d++) acc[r][j][d] += w * kf[tk][d]; \
                    }                                                                                 \
                }                                                                                     \
        }                                                                                             \
        free(s);                                                                                      \
        for (int r = 0; r < t->rows; r++)                                                             \
            for (int j = 0; j < rep; j++) {                                                           \
                float *dst = out + ((int64_t)(q_start[it] + t->row0 + r) * H + g * rep + j) * D;      \
                const float inv = l[r][j] > 0.0f ? 1.0f / l[r][j] : 0.0f;                             \
                for (int d = 0; d < D; d++) dst[d] = acc[r][j][d] * inv;                              \
            }                                                                                         \
        return 0;                                                                                     \
    }                                                                                                 \
                                                                                                      \
    static int NAME##_task(const float *q, const KV_T *k_cache, const KV_T *v_cache, float *out,          \
                           const int32_t *q_start, const int32_t *q_len, const int32_t *ctx_len,       \
                           const int32_t *tables, const int32_t *table_off, const uint8_t *masks,      \
                           const int64_t *mask_off, int H, int KVH, int D, int BS, float scale,        \
                           int64_t ldq, const task_t *t, int lanes) {                                   \
        if (lanes != 8 && WIDE_OK(D))                                                                 \
            return WIDE_TASK(q, k_cache, v_cache, WIDE_LOAD(NAME), out, q_start, q_len, ctx_len,       \
                             tables, table_off, masks, mask_off, H, KVH, D, BS, scale, ldq, t);        \
        if (VECTOR_OK(D))                                                                             \
            return VECTOR_TASK(q, k_cache, v_cache, VECTOR_LOAD(NAME), out, q_start, q_len, ctx_len,   \
                               tables, table_off, masks, mask_off, H, KVH, D, BS, scale, ldq, t);      \
        return NAME##_task_scalar(q, k_cache, v_cache, out, q_start, q_len, ctx_len, tables, table_off, \
                                  masks, mask_off, H, KVH, D, BS, scale, ldq, t);                      \
    }                                                                                                 \
                                                                                                      \
    static int NAME(const float *q, const KV_T *k_cache, const KV_T *v_cache, float *out, int n_items,       \
             const int32_t *q_start, const int32_t *q_len, const int32_t *ctx_len, const int32_t *tables, \
             const int32_t *table_off, const uint8_t *masks, const int64_t *mask_off, int H, int KVH,   \
             int D, int BS, float scale, int64_t ldq, int lanes) {                                    \
        if (H % KVH || H / KVH > MAX_REP || D > MAX_D || BS > MAX_BS) return -1;                      \
        int n_tasks = 0;                                                                              \
        for (int i = 0; i < n_items; i++) n_tasks += KVH * ((q_len[i] + TILE_Q - 1) / TILE_Q);        \
        task_t *tasks = (task_t *)malloc(sizeof(task_t) * (n_tasks > 0 ? n_tasks : 1));               \
        if (!tasks) return -2;                                                                        \
        int n = 0;                                                                                    \
        for (int i = 0; i < n_items; i++)                                                             \
            for (int g = 0; g < KVH; g++)                                                             \
                for (int r0 = 0; r0 < q_len[i]; r0 += TILE_Q) {                                       \
                    tasks[n].item = i;                                                                \
                    tasks[n].group = g;                                                               \
                    tasks[n].row0 = r0;                                                               \
                    tasks[n].rows = (q_len[i] - r0) < TILE_Q ? (q_len[i] - r0) : TILE_Q;              \
                    n++;                                                                              \
                }                                                                                     \
        int rc = 0;                                                                                   \
        _Pragma("omp parallel for schedule(dynamic, 1) reduction(min:rc)") for (int i = 0; i < n_tasks; i++) { \
            const int r = NAME##_task(q, k_cache, v_cache, out, q_start, q_len, ctx_len, tables, table_off, \
                                      masks, mask_off, H, KVH, D, BS, scale, ldq, &tasks[i], lanes);  \
            rc = r < rc ? r : rc;                                                                     \
        }                                                                                             \
        free(tasks);                                                                                  \
        return rc;                                                                                    \
    }

#ifdef PA_AVX2
#define VECTOR_OK(D) ((D) % 8 == 0)
#define VECTOR_TASK pa_task_avx2
#define VECTOR_LOAD(NAME) NAME##_vload
#define paged_attention_f32_vload pa_load_f32
#define paged_attention_bf16_vload pa_load_bf16
#else
#define VECTOR_OK(D) 0
#define VECTOR_TASK(...) 0
#define VECTOR_LOAD(NAME) 0
#endif
#ifdef PA_AVX512
#define WIDE_OK(D) ((D) % 16 == 0)
#define WIDE_TASK pa_task_avx512
#define WIDE_LOAD(NAME) NAME##_wload
#define paged_attention_f32_wload pa_load16_f32
#define paged_attention_bf16_wload pa_load16_bf16
#else
#define WIDE_OK(D) 0
#define WIDE_TASK(...) 0
#define WIDE_LOAD(NAME) 0
#endif

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)

DEFINE_KERNEL(paged_attention_f32, float, LOAD_F32)
DEFINE_KERNEL(paged_attention_bf16, uint16_t, LOAD_BF16)

