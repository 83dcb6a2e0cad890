// Products of float activations with GGUF-quantized weights: y[m, n] = sum_k x[m, k] W[n, k].
//
// The activations are first rounded to int8 per row (ActQ8K for the k-quants, ActQ8B for the
// legacy types; see gguf_blocks.h); the weights stay in the file's blocks (or Q4_K repacked
// losslessly eight or sixteen rows at a time, gguf_packed.h). A kernel walks its
// weight rows once and, for each block, unpacks it once and applies it to every activation row of
// a tile: M rows cost little more weight traffic than one (the room a token tree is verified in).
//
// Every activation row has its own accumulators and visits the blocks in the same order whatever
// M, the tile or the thread split: a row's result is bit for bit the same alone or in any batch.
// Variants (one per instruction set, each compiled with its own flags) agree to rounding, not bit
// for bit: the caller picks one variant per weight shape, never per row count.
#pragma once

#include <cstdint>

namespace specserve {

struct GemmTask {
    int type;            // ggml type of the weight rows
    const uint8_t* w;    // [N, row_bytes] the file's blocks, or packed groups of 8 rows (gguf_packed.h)
    int64_t row_bytes;
    int64_t K;           // elements per row
    const void* xq;      // M rows of K / block activation blocks (ActQ8K or ActQ8B)
    int64_t M;
    float* y;            // y[m * ldy + n]
    int64_t ldy;
    const float* bias;   // [N] or null
    int64_t prefetch;    // how a packed kernel prefetches: an index into kPrefetchPolicies
};

// How a packed kernel prefetches the weights it streams: from tiles of `ahead_rows` activation rows
// on, the next group of weight rows is asked of L2 while this one is worked on; otherwise the bytes
// `distance` ahead in its own stream are asked of L1. Which pays is the machine's (a 2-core Zen 4: the
// next group, 4 rows of the 1.5B 10% faster; a 2-core Zen 5: 8 KB ahead, 4 rows 15-25% faster):
// KernelTuner.choose_prefetch times them on the model (quant.PREFETCH_POLICIES names them, in this order).
struct PrefetchPolicy {
    int ahead_rows;
    int distance;
};
constexpr PrefetchPolicy kPrefetchPolicies[] = {{2, 2048}, {1 << 30, 2048}, {1 << 30, 8192}};
constexpr int kPrefetchPolicyCount = sizeof(kPrefetchPolicies) / sizeof(kPrefetchPolicies[0]);

// Computes columns [n0, n1) of task.y for every activation row.
using GemmFn = void (*)(const GemmTask& task, int64_t n0, int64_t n1);

namespace generic {
void gemm(const GemmTask& task, int64_t n0, int64_t n1);
}
namespace avx2 {
void gemm(const GemmTask& task, int64_t n0, int64_t n1);
}
namespace avx512 {  // AVX-512 F/BW/VL + VNNI; the types it has no kernel of its own for run avx2's
void gemm(const GemmTask& task, int64_t n0, int64_t n1);
}

}  // namespace specserve
