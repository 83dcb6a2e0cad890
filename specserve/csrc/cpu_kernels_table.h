/* The body of a variant's translation unit: every kernel source, then its table. Included by
 * cpu_kernels_<isa>.c after it names the table's accessor (CPU_KERNELS_TABLE). */
#include "decoder.c"

const specserve_cpu_kernels *CPU_KERNELS_TABLE(void) {
    static const specserve_cpu_kernels table = {
        gemm_f32,      linear_i8q8,   linear_i4q8, fake_quant_q8, paged_attention_f32, paged_attention_bf16,
        write_kv_f32,  write_kv_bf16, rope_inplace, rms_norm,     silu_mul,            decoder_forward,
        row_topk,      row_argmax,
    };
    return &table;
}
