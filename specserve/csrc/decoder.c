/* The decoder layers of one step (decodes, draft trees, prefill chunks) in one native call.
 *
 * A decode step of a small model is a few hundred small operations; run one by one from Python
 * the interpreter costs as much as the arithmetic. This driver runs them back to back:
 *
 *   for each layer:  h = rms_norm(x); qkv = h Wqkv; rope(q, k); cache <- k, v;
 *                    a = attention(q, cache); x += a Wo;
 *                    h = rms_norm(x); x += silu_mul(h Wgu) Wdown
 *
 * with the same kernels the Python path calls through the operators (gemm_small.c, paged_attention.c,
 * layer_ops.c, and ops.cpp's GGUF products), so its numbers are that path's numbers.
 */
#include "cpu_kernels.h"
#include "gemm_small.c"
#include "layer_ops.c"
#include "paged_attention.c"

static int run_linear(const linear_t *l, const float *x, int M, float *y) {
    switch (l->kind) {
        case LIN_F32: return gemm_f32(x, M, l->k, (const float *)l->w, l->n, y, l->bias);
        case LIN_W8A8: return linear_i8q8(x, M, l->k, (const int8_t *)l->w, l->scale, l->n, y, l->bias);
        case LIN_W4A8: return linear_i4q8(x, M, l->k, (const uint8_t *)l->w, l->scale, l->minimum, l->n, y, l->bias);
        case LIN_EXTERNAL: return l->fn(l->w, x, M, y);
        default: return -10;
    }
}

/* x: [T, hidden] residual stream, updated in place through n_layers layers. */
static int decoder_forward(float *x, int T, int hidden, int intermediate, const layer_t *layers, int n_layers, float eps,
                    int H, int KVH, int D, int BS, int kv_bf16, const float *cos, const float *sin,
                    const int64_t *slots, int n_items, const int32_t *q_start, const int32_t *q_len,
                    const int32_t *ctx_len, const int32_t *tables, const int32_t *table_off, const uint8_t *masks,
                    const int64_t *mask_off, float scale, int lanes) {
    const int qkv_w = (H + 2 * KVH) * D;
    float *h = (float *)malloc(sizeof(float) * (size_t)T * hidden);
    float *qkv = (float *)malloc(sizeof(float) * (size_t)T * qkv_w);
    float *att = (float *)malloc(sizeof(float) * (size_t)T * H * D);
    float *gu = (float *)malloc(sizeof(float) * (size_t)T * 2 * intermediate);
    float *act = (float *)malloc(sizeof(float) * (size_t)T * intermediate);
    float *tmp = (float *)malloc(sizeof(float) * (size_t)T * hidden);
    int rc = (h && qkv && att && gu && act && tmp) ? 0 : -2;
    for (int li = 0; li < n_layers && rc == 0; li++) {
        const layer_t *L = layers + li;
        rms_norm(x, L->attn_norm, h, T, hidden, eps);
        if ((rc = run_linear(&L->qkv, h, T, qkv))) break;
        rope_inplace(qkv, T, qkv_w, H + KVH, D, cos, sin);
        const float *k = qkv + H * D, *v = k + KVH * D;
        if (kv_bf16) {
            write_kv_bf16(k, v, qkv_w, (uint16_t *)L->k_cache, (uint16_t *)L->v_cache, slots, T, KVH * D);
            rc = paged_attention_bf16(qkv, (const uint16_t *)L->k_cache, (const uint16_t *)L->v_cache, att, n_items,
                                      q_start, q_len, ctx_len, tables, table_off, masks, mask_off, H, KVH, D, BS,
                                      scale, qkv_w, lanes);
        } else {
            write_kv_f32(k, v, qkv_w, (float *)L->k_cache, (float *)L->v_cache, slots, T, KVH * D);
            rc = paged_attention_f32(qkv, (const float *)L->k_cache, (const float *)L->v_cache, att, n_items, q_start,
                                     q_len, ctx_len, tables, table_off, masks, mask_off, H, KVH, D, BS, scale, qkv_w,
                                     lanes);
        }
        if (rc) break;
        if ((rc = run_linear(&L->o, att, T, tmp))) break;
        for (int64_t i = 0; i < (int64_t)T * hidden; i++) x[i] += tmp[i];
        rms_norm(x, L->mlp_norm, h, T, hidden, eps);
        if ((rc = run_linear(&L->gate_up, h, T, gu))) break;
        silu_mul(gu, act, T, intermediate);
        if ((rc = run_linear(&L->down, act, T, tmp))) break;
        for (int64_t i = 0; i < (int64_t)T * hidden; i++) x[i] += tmp[i];
    }
    free(h);
    free(qkv);
    free(att);
    free(gu);
    free(act);
    free(tmp);
    return rc;
}
