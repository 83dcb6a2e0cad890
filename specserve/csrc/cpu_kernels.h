/* The CPU kernels around the quantized products (the layer loop, paged attention, the small
 * operations of a layer, the float32 / int8 / int4 products) as one table of functions per
 * instruction-set variant. Each variant is the same C sources (gemm_small.c, paged_attention.c,
 * layer_ops.c, decoder.c) compiled with its own flags (cpu_kernels_<isa>.c); ops.cpp registers
 * them as torch operators and picks the table by the variant id its caller passes. */
#ifndef SPECSERVE_CPU_KERNELS_H
#define SPECSERVE_CPU_KERNELS_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The most values row_topk keeps a row (its list lives on the stack). */
#define SPECSERVE_ROW_TOPK_MAX 256

enum { LIN_F32 = 0, LIN_W8A8 = 1, LIN_W4A8 = 2, LIN_EXTERNAL = 3 };

/* A projection computed elsewhere (the GGUF block kernels of ops.cpp): fn(ctx, x, M, y). */
typedef int (*external_linear_fn)(const void *ctx, const float *x, int M, float *y);

/* One projection of the layer loop, y[M, n] = x[M, k] W^T (+ bias). */
typedef struct {
    int32_t kind, n, k, pad;
    const void *w;         /* f32 [N, K], int8 [N, K], packed int4 [N, K/2], or the external kernel's context */
    const float *scale;    /* int8: [N]; int4: [N, K/32] */
    const float *minimum;  /* int4: [N, K/32] */
    const float *bias;     /* [N] or NULL */
    external_linear_fn fn; /* LIN_EXTERNAL */
} linear_t;

typedef struct {
    const float *attn_norm, *mlp_norm;
    linear_t qkv, o, gate_up, down;
    void *k_cache, *v_cache;
} layer_t;

typedef struct {
    int (*gemm_f32)(const float *x, int M, int K, const float *W, int N, float *y, const float *bias);
    int (*linear_i8q8)(const float *x, int M, int K, const int8_t *Q, const float *scale, int N, float *y,
                       const float *bias);
    int (*linear_i4q8)(const float *x, int M, int K, const uint8_t *P, const float *scale, const float *minimum,
                       int N, float *y, const float *bias);
    void (*fake_quant_q8)(const float *x, int M, int K, float *out);
    int (*paged_attention_f32)(const float *q, const float *k_cache, const float *v_cache, float *out, int n_items,
                               const int32_t *q_start, const int32_t *q_len, const int32_t *ctx_len,
                               const int32_t *tables, const int32_t *table_off, const uint8_t *masks,
                               const int64_t *mask_off, int H, int KVH, int D, int BS, float scale, int64_t ldq,
                               int lanes);
    int (*paged_attention_bf16)(const float *q, const uint16_t *k_cache, const uint16_t *v_cache, float *out,
                                int n_items, const int32_t *q_start, const int32_t *q_len, const int32_t *ctx_len,
                                const int32_t *tables, const int32_t *table_off, const uint8_t *masks,
                                const int64_t *mask_off, int H, int KVH, int D, int BS, float scale, int64_t ldq,
                               int lanes);
    void (*write_kv_f32)(const float *k, const float *v, int64_t ld, float *k_cache, float *v_cache,
                         const int64_t *slots, int T, int row);
    void (*write_kv_bf16)(const float *k, const float *v, int64_t ld, uint16_t *k_cache, uint16_t *v_cache,
                          const int64_t *slots, int T, int row);
    void (*rope_inplace)(float *x, int T, int row_stride, int n_heads, int D, const float *cos, const float *sin);
    void (*rms_norm)(const float *x, const float *w, float *y, int T, int D, float eps);
    void (*silu_mul)(const float *gu, float *out, int T, int I);
    int (*decoder_forward)(float *x, int T, int hidden, int intermediate, const layer_t *layers, int n_layers,
                           float eps, int H, int KVH, int D, int BS, int kv_bf16, const float *cos, const float *sin,
                           const int64_t *slots, int n_items, const int32_t *q_start, const int32_t *q_len,
                           const int32_t *ctx_len, const int32_t *tables, const int32_t *table_off,
                           const uint8_t *masks, const int64_t *mask_off, float scale, int lanes);
    void (*row_topk)(const float *x, int T, int n, int64_t ld, int k, int64_t *out);
    void (*row_argmax)(const float *x, int T, int n, int64_t ld, int64_t *out);
} specserve_cpu_kernels;

const specserve_cpu_kernels *specserve_cpu_kernels_generic(void);
#if defined(__x86_64__) || defined(_M_X64)
const specserve_cpu_kernels *specserve_cpu_kernels_avx2(void);
const specserve_cpu_kernels *specserve_cpu_kernels_avx512(void);
#endif

#ifdef __cplusplus
}
#endif

#endif
