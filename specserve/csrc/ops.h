// What ops.cpp shares with kernel_ops.cpp: the instruction-set variants and the GGUF product.
#pragma once

#include <cstdint>

namespace specserve {

// Variant ids, as the Python side names them (specserve.model.ops.ISAS).
enum Isa : int64_t { kGeneric = 0, kAvx2 = 1, kAvx512Vnni = 2, kIsaCount = 3 };

constexpr int kMaxParts = 4;

// Whether variant `isa` was compiled into this library and runs on this CPU.
bool isa_runs(int64_t isa);

// One weight tensor of a (possibly fused) projection.
struct LinearPart {
    const uint8_t* w;
    int64_t row_bytes;
    int64_t rows;
    int64_t type;
};

// y[M, sum rows] = x[M, K] times the parts stacked along the output (+ bias): the activations
// rounded once per type family, then chunks of output columns of every part taken dynamically by
// the threads (parts of different types cost different time per column). Arguments checked by
// the caller. `prefetch`: GemmTask's (an index into kPrefetchPolicies).
void linear_core(const LinearPart* parts, int n_parts, const float* x, int64_t M, int64_t K, float* y,
                 const float* bias, int64_t isa, int64_t prefetch);

}  // namespace specserve
