// GGUF (ggml) block formats read as the file stores them, and the activation formats the integer
// kernels multiply them with. Layouts follow ggml-common.h in llama.cpp; nothing here depends on
// torch, so the ISA-specific kernel files stay quick to compile.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>

namespace specserve {

// ggml type ids (the GGUF file's tensor types) this package reads.
enum GgmlType : int {
    kF32 = 0, kF16 = 1, kQ4_0 = 2, kQ4_1 = 3, kQ8_0 = 8, kQ4_K = 12, kQ5_K = 13, kQ6_K = 14, kBF16 = 30,
};

// Q4_K repacked eight or sixteen rows at a time, Q6_K, Q4_0, Q4_1 and Q8_0 sixteen (gguf_packed.h):
// our ids, 100 (eight rows) or 200 (sixteen) + the ggml type.
enum PackedType : int {
    kQ4_Kx8 = 112, kQ4_Kx16 = 212, kQ6_Kx16 = 214, kQ4_0x16 = 202, kQ4_1x16 = 203, kQ8_0x16 = 208,
};

constexpr int kQK = 256;  // elements of a k-quant super-block
constexpr int kQ32 = 32;  // elements of a legacy (Q4_0, Q4_1, Q8_0) block

struct TypeInfo {
    int block_elems;
    int block_bytes;
};

static inline bool type_info(int type, TypeInfo* out) {
    switch (type) {
        case kF32: *out = {1, 4}; return true;
        case kF16: *out = {1, 2}; return true;
        case kBF16: *out = {1, 2}; return true;
        case kQ4_0: *out = {32, 18}; return true;
        case kQ4_1: *out = {32, 20}; return true;
        case kQ8_0: *out = {32, 34}; return true;
        case kQ4_K: *out = {256, 144}; return true;
        case kQ5_K: *out = {256, 176}; return true;
        case kQ6_K: *out = {256, 210}; return true;
        case kQ4_Kx8: *out = {256, 148}; return true;  // per row: a group of 8 rows is 8x this
        case kQ4_Kx16: *out = {256, 148}; return true;  // a group of 16 rows is 16x this
        case kQ6_Kx16: *out = {256, 210}; return true;
        case kQ4_0x16: *out = {32, 18}; return true;
        case kQ4_1x16: *out = {32, 20}; return true;
        case kQ8_0x16: *out = {32, 34}; return true;
        default: return false;
    }
}

static inline bool is_packed(int type) {
    return type == kQ4_Kx8 || type == kQ4_Kx16 || type == kQ6_Kx16 || type == kQ4_0x16 || type == kQ4_1x16 ||
           type == kQ8_0x16;
}
// Weight rows per group of a packed type (1 for the file's own types).
static inline int pack_rows(int type) { return type == kQ4_Kx8 ? 8 : (is_packed(type) ? 16 : 1); }
// Types multiplied with ActQ8K activations (the packed ones included), and with ActQ8B.
static inline bool is_legacy_quant(int type) {
    return type == kQ4_0 || type == kQ4_1 || type == kQ8_0 || type == kQ4_0x16 || type == kQ4_1x16 || type == kQ8_0x16;
}
static inline bool is_k_quant(int type) {
    return type == kQ4_K || type == kQ5_K || type == kQ6_K || (is_packed(type) && !is_legacy_quant(type));
}

// IEEE half -> float, bit-exact (no F16C needed: used on load paths and by the scalar kernels).
static inline float fp16_to_fp32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    uint32_t exp = (h >> 10) & 0x1F, mant = h & 0x3FF, bits;
    if (exp == 0) {
        if (mant == 0) {
            bits = sign;
        } else {  // subnormal: normalise
            exp = 127 - 15 + 1;
            while ((mant & 0x400) == 0) { mant <<= 1; exp--; }
            bits = sign | (exp << 23) | ((mant & 0x3FF) << 13);
        }
    } else if (exp == 31) {
        bits = sign | 0x7F800000u | (mant << 13);
    } else {
        bits = sign | ((exp + 127 - 15) << 23) | (mant << 13);
    }
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

static inline float read_fp16(const uint8_t* p) {
    uint16_t h;
    std::memcpy(&h, p, 2);
    return fp16_to_fp32(h);
}

static inline float bf16_to_fp32(uint16_t h) {
    const uint32_t bits = (uint32_t)h << 16;
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
}

// The 6-bit scale and min of sub-block j (0..7) of a Q4_K / Q5_K super-block.
static inline void k_scale_min(int j, const uint8_t* q, uint8_t* d, uint8_t* m) {
    if (j < 4) {
        *d = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *d = (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Activations, quantized per row (every row alone: a row's numbers never depend on the others).
//   Q8K: per 256 elements, d = max|x| / 127, q = round(x / d); sums of q per 16 and per 32 (for the
//        k-quants' mins and offsets);
//   Q8B: per 32 elements, the same rule, and d * sum(q) (for Q4_1's mins).
// Legacy blocks are summed in two chains, even and odd blocks, added at the end (the float adds of
// 32-element blocks would otherwise wait on each other); every path sums in that order.
struct ActQ8K {
    float d;
    int16_t bsums[16];
    int16_t bsums32[8];  // sums of q per 32 (Q4_K's mins, in the packed kernels' pairs)
    int8_t qs[kQK];
    int32_t q6_offset[16];  // -32 * bsums (Q6_K's quants are stored plus 32; the packed kernel's start)
};
struct ActQ8B {
    float d;
    float s;  // d * sum(qs)
    int8_t qs[kQ32];
    int32_t qsum;  // sum(qs) (the packed kernels' offsets: Q4_0's 8, Q8_0's 128)
};

// Quantize `n` (a multiple of the block) floats into blocks.
void quantize_q8k(const float* x, int64_t n, ActQ8K* out);
void quantize_q8b(const float* x, int64_t n, ActQ8B* out);

// One row of a weight tensor of `type`, `n` elements, dequantized to float.
bool dequantize_row(int type, const uint8_t* src, int64_t n, float* dst);

}  // namespace specserve
