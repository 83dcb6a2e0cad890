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
 * Layouts (row-major, contiguous):
 *   q:                  [T, H, D] float32, rows ldq floats apart (q may be a view of fused q/k/v)
 *   out:                [T, H, D] float32
 *   k_cache, v_cache:   [num_blocks, block_size, KVH, D] float32 or bfloat16
 *   per item i:         q_start[i], q_len[i], ctx_len[i], table_off[i] (into tables),
 *                       mask_off[i] (into masks, a [q_len, q_len] uint8 matrix; -1 = causal)
 * Built by specserve.model.native with -O3 -fopenmp and the ISA flags of the machine.
 */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

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

#define DEFINE_KERNEL(NAME, KV_T, LOAD)                                                             \
    /* nk keys (or values) of one KV head from one cache block, as float32 */                          \
    static void NAME##_load(const KV_T *cache, int64_t base, int nk, int KVH, int D, float kf[][D]) {    \
        for (int tk = 0; tk < nk; tk++) {                                                             \
            const KV_T *src = cache + (base + (int64_t)tk * KVH) * D;                                 \
            for (int d = 0; d < D; d++) kf[tk][d] = LOAD(src[d]);                                     \
        }                                                                                             \
    }                                                                                                 \
                                                                                                      \
    static int NAME##_task(const float *q, const KV_T *k_cache, const KV_T *v_cache, float *out,       \
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
    int NAME(const float *q, const KV_T *k_cache, const KV_T *v_cache, float *out, int n_items,       \
             const int32_t *q_start, const int32_t *q_len, const int32_t *ctx_len, const int32_t *tables, \
             const int32_t *table_off, const uint8_t *masks, const int64_t *mask_off, int H, int KVH,   \
             int D, int BS, float scale, int64_t ldq) {                                               \
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
                                      masks, mask_off, H, KVH, D, BS, scale, ldq, &tasks[i]);         \
            rc = r < rc ? r : rc;                                                                     \
        }                                                                                             \
        free(tasks);                                                                                  \
        return rc;                                                                                    \
    }

#define LOAD_F32(x) (x)
#define LOAD_BF16(x) bf16_to_f32(x)

DEFINE_KERNEL(paged_attention_f32, float, LOAD_F32)
DEFINE_KERNEL(paged_attention_bf16, uint16_t, LOAD_BF16)

