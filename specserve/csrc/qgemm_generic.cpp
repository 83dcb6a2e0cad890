// Portable kernels (no instruction-set flags): the activation rounding every variant shares, row
// dequantization (embedding lookups, tests, float conversions), and a plain-C++ product for CPUs
// without a vectorised variant. Also the reference the vectorised variants are tested against.
#include <cmath>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#include <vector>

#include "gguf_blocks.h"
#include "gguf_packed.h"
#include "qgemm.h"

namespace specserve {

namespace {

// The rounding of one block: d = max|x| / 127, q = x / d rounded to nearest, ties away from zero
// (as (int)(v + copysign(0.5, v))). SSE2 where there is x86-64 (every such CPU has it), the same
// arithmetic in plain C++ elsewhere.
template <int N>
float round_block(const float* x, int8_t* q) {
#if defined(__SSE2__)
    const __m128 sign = _mm_set1_ps(-0.0f), half = _mm_set1_ps(0.5f);
    __m128 m = _mm_setzero_ps();
    for (int j = 0; j < N; j += 4) m = _mm_max_ps(m, _mm_andnot_ps(sign, _mm_loadu_ps(x + j)));
    m = _mm_max_ps(m, _mm_movehl_ps(m, m));
    m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
    const float amax = _mm_cvtss_f32(m);
    const float d = amax / 127.0f;
    const __m128 inv = _mm_set1_ps(d > 0.0f ? 1.0f / d : 0.0f);
    for (int j = 0; j < N; j += 16) {
        __m128i v[4];
        for (int k = 0; k < 4; k++) {
            const __m128 y = _mm_mul_ps(_mm_loadu_ps(x + j + 4 * k), inv);
            v[k] = _mm_cvttps_epi32(_mm_add_ps(y, _mm_or_ps(_mm_and_ps(y, sign), half)));
        }
        const __m128i w = _mm_packs_epi16(_mm_packs_epi32(v[0], v[1]), _mm_packs_epi32(v[2], v[3]));
        _mm_storeu_si128((__m128i*)(q + j), w);
    }
    return d;
#else
    float amax = 0.0f;
    for (int j = 0; j < N; j++) {
        const float a = std::fabs(x[j]);
        amax = a > amax ? a : amax;
    }
    const float d = amax / 127.0f;
    const float inv = d > 0.0f ? 1.0f / d : 0.0f;
    for (int j = 0; j < N; j++) {
        const float y = x[j] * inv;
        q[j] = (int8_t)(int)(y + (y < 0.0f ? -0.5f : 0.5f));
    }
    return d;
#endif
}

}  // namespace

void quantize_q8k(const float* x, int64_t n, ActQ8K* out) {
    for (int64_t b = 0; b < n / kQK; b++) {
        ActQ8K& o = out[b];
        o.d = round_block<kQK>(x + b * kQK, o.qs);
        for (int g = 0; g < 16; g++) {
            int s = 0;
            for (int j = 0; j < 16; j++) s += o.qs[g * 16 + j];
            o.bsums[g] = (int16_t)s;
        }
        for (int g = 0; g < 8; g++) o.bsums32[g] = (int16_t)(o.bsums[2 * g] + o.bsums[2 * g + 1]);
        for (int g = 0; g < 16; g++) o.q6_offset[g] = -32 * o.bsums[g];
    }
}

void quantize_q8b(const float* x, int64_t n, ActQ8B* out) {
    for (int64_t b = 0; b < n / kQ32; b++) {
        ActQ8B& o = out[b];
        o.d = round_block<kQ32>(x + b * kQ32, o.qs);
        int s = 0;
        for (int j = 0; j < kQ32; j++) s += o.qs[j];
        o.s = o.d * (float)s;
        o.qsum = s;
    }
}

bool dequantize_row(int type, const uint8_t* src, int64_t n, float* dst) {
    switch (type) {
        case kF32:
            std::memcpy(dst, src, sizeof(float) * n);
            return true;
        case kF16:
            for (int64_t i = 0; i < n; i++) dst[i] = read_fp16(src + 2 * i);
            return true;
        case kBF16:
            for (int64_t i = 0; i < n; i++) {
                uint16_t h;
                std::memcpy(&h, src + 2 * i, 2);
                dst[i] = bf16_to_fp32(h);
            }
            return true;
        case kQ4_0:
            for (int64_t b = 0; b < n / 32; b++, src += 18, dst += 32) {
                const float d = read_fp16(src);
                for (int j = 0; j < 16; j++) {
                    dst[j] = ((src[2 + j] & 0xF) - 8) * d;
                    dst[j + 16] = ((src[2 + j] >> 4) - 8) * d;
                }
            }
            return true;
        case kQ4_1:
            for (int64_t b = 0; b < n / 32; b++, src += 20, dst += 32) {
                const float d = read_fp16(src), m = read_fp16(src + 2);
                for (int j = 0; j < 16; j++) {
                    dst[j] = (src[4 + j] & 0xF) * d + m;
                    dst[j + 16] = (src[4 + j] >> 4) * d + m;
                }
            }
            return true;
        case kQ8_0:
            for (int64_t b = 0; b < n / 32; b++, src += 34, dst += 32) {
                const float d = read_fp16(src);
                for (int j = 0; j < 32; j++) dst[j] = (int8_t)src[2 + j] * d;
            }
            return true;
        case kQ4_K:
            for (int64_t b = 0; b < n / kQK; b++, src += 144) {
                const float d = read_fp16(src), dmin = read_fp16(src + 2);
                const uint8_t* q = src + 16;
                for (int j = 0; j < 4; j++, q += 32) {
                    uint8_t s0, m0, s1, m1;
                    k_scale_min(2 * j, src + 4, &s0, &m0);
                    k_scale_min(2 * j + 1, src + 4, &s1, &m1);
                    const float d0 = d * s0, c0 = dmin * m0, d1 = d * s1, c1 = dmin * m1;
                    for (int l = 0; l < 32; l++) *dst++ = d0 * (q[l] & 0xF) - c0;
                    for (int l = 0; l < 32; l++) *dst++ = d1 * (q[l] >> 4) - c1;
                }
            }
            return true;
        case kQ5_K:
            for (int64_t b = 0; b < n / kQK; b++, src += 176) {
                const float d = read_fp16(src), dmin = read_fp16(src + 2);
                const uint8_t* qh = src + 16;
                const uint8_t* q = src + 48;
                for (int j = 0; j < 4; j++, q += 32) {
                    uint8_t s0, m0, s1, m1;
                    k_scale_min(2 * j, src + 4, &s0, &m0);
                    k_scale_min(2 * j + 1, src + 4, &s1, &m1);
                    const float d0 = d * s0, c0 = dmin * m0, d1 = d * s1, c1 = dmin * m1;
                    for (int l = 0; l < 32; l++) *dst++ = d0 * ((q[l] & 0xF) + (((qh[l] >> (2 * j)) & 1) << 4)) - c0;
                    for (int l = 0; l < 32; l++) *dst++ = d1 * ((q[l] >> 4) + (((qh[l] >> (2 * j + 1)) & 1) << 4)) - c1;
                }
            }
            return true;
        case kQ6_K:
            for (int64_t b = 0; b < n / kQK; b++, src += 210, dst += kQK) {
                const float d = read_fp16(src + 208);
                const int8_t* sc = (const int8_t*)(src + 192);
                for (int h = 0; h < 2; h++) {
                    const uint8_t* ql = src + 64 * h;
                    const uint8_t* qh = src + 128 + 32 * h;
                    float* y = dst + 128 * h;
                    const int8_t* s = sc + 8 * h;
                    for (int l = 0; l < 32; l++) {
                        const int is = l / 16;
                        y[l] = d * s[is] * (((ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4)) - 32);
                        y[l + 32] = d * s[is + 2] * (((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32);
                        y[l + 64] = d * s[is + 4] * (((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
                        y[l + 96] = d * s[is + 6] * (((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
                    }
                }
            }
            return true;
        default:
            return false;
    }
}

namespace generic {

namespace {

// The unsigned 4/5/6-bit quants of one k-quant super-block, with its per-32 scales and mins
// (Q4_K, Q5_K: w = d * scale * q - dmin * min) or per-16 scales (Q6_K: w = d * scale * (q - 32)).
struct KBlock {
    uint8_t q[kQK];
    int scale[16];
    int min[8];
    float d, dmin;
};

void unpack_k(int type, const uint8_t* src, KBlock* o) {
    if (type == kQ6_K) {
        o->d = read_fp16(src + 208);
        o->dmin = 0.0f;
        for (int j = 0; j < 16; j++) o->scale[j] = ((const int8_t*)(src + 192))[j];
        for (int h = 0; h < 2; h++) {
            const uint8_t* ql = src + 64 * h;
            const uint8_t* qh = src + 128 + 32 * h;
            uint8_t* q = o->q + 128 * h;
            for (int l = 0; l < 32; l++) {
                q[l] = (ql[l] & 0xF) | (((qh[l] >> 0) & 3) << 4);
                q[l + 32] = (ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4);
                q[l + 64] = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
                q[l + 96] = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
            }
        }
        return;
    }
    o->d = read_fp16(src);
    o->dmin = read_fp16(src + 2);
    for (int j = 0; j < 8; j++) {
        uint8_t s, m;
        k_scale_min(j, src + 4, &s, &m);
        o->scale[j] = s;
        o->min[j] = m;
    }
    const uint8_t* qs = src + (type == kQ5_K ? 48 : 16);
    const uint8_t* qh = src + 16;
    for (int j = 0; j < 4; j++)
        for (int l = 0; l < 32; l++) {
            int lo = qs[32 * j + l] & 0xF, hi = qs[32 * j + l] >> 4;
            if (type == kQ5_K) {
                lo += ((qh[l] >> (2 * j)) & 1) << 4;
                hi += ((qh[l] >> (2 * j + 1)) & 1) << 4;
            }
            o->q[64 * j + l] = (uint8_t)lo;
            o->q[64 * j + 32 + l] = (uint8_t)hi;
        }
}

// One super-block of one weight row against one activation block: the integer sums, then floats.
float dot_k(int type, const KBlock& w, const ActQ8K& x) {
    if (type == kQ6_K) {
        int sum = 0;
        for (int g = 0; g < 16; g++) {
            int s = 0;
            for (int j = 0; j < 16; j++) s += (int)w.q[16 * g + j] * x.qs[16 * g + j];
            sum += w.scale[g] * (s - 32 * x.bsums[g]);
        }
        return w.d * x.d * (float)sum;
    }
    int sum = 0, mins = 0;
    for (int g = 0; g < 8; g++) {
        int s = 0;
        for (int j = 0; j < 32; j++) s += (int)w.q[32 * g + j] * x.qs[32 * g + j];
        sum += w.scale[g] * s;
        mins += w.min[g] * (x.bsums[2 * g] + x.bsums[2 * g + 1]);
    }
    return w.d * x.d * (float)sum - w.dmin * x.d * (float)mins;
}

// One legacy block (32 elements) against one activation block: the block's product, and (Q4_1)
// its mins' share, kept apart as the vectorised kernels keep them.
float dot_legacy(int type, const uint8_t* src, const ActQ8B& x, float* mins) {
    const float d = read_fp16(src);
    int s = 0;
    if (type == kQ8_0) {
        for (int j = 0; j < 32; j++) s += (int8_t)src[2 + j] * x.qs[j];
        return (float)s * (d * x.d);
    }
    const uint8_t* qs = src + (type == kQ4_1 ? 4 : 2);
    const int off = type == kQ4_0 ? 8 : 0;
    for (int j = 0; j < 16; j++) s += ((qs[j] & 0xF) - off) * x.qs[j] + ((qs[j] >> 4) - off) * x.qs[j + 16];
    if (type == kQ4_1) *mins += read_fp16(src + 2) * x.s;
    return (float)s * (d * x.d);
}

}  // namespace

void gemm_rows(const GemmTask& t, int64_t n0, int64_t n1);

void gemm(const GemmTask& t, int64_t n0, int64_t n1) {
    if (!is_packed(t.type)) return gemm_rows(t, n0, n1);
    // Packed groups of rows: each group back in the file's layout, then the same arithmetic (here
    // packing changes nothing in the results).
    const int type = unpacked_type_of(t.type), R = pack_rows(t.type);
    TypeInfo info;
    type_info(type, &info);
    const int64_t nb = t.K / info.block_elems, file_rb = nb * info.block_bytes;
    thread_local std::vector<uint8_t> rows;
    rows.resize((size_t)(R * file_rb));
    GemmTask u = t;
    u.type = type;
    u.row_bytes = file_rb;
    u.w = rows.data();
    for (int64_t g0 = n0; g0 < n1; g0 += R) {
        unpack_group(t.type, t.w + g0 * t.row_bytes, nb, rows.data(), file_rb);
        u.y = t.y + g0;
        u.bias = t.bias ? t.bias + g0 : nullptr;
        gemm_rows(u, 0, R);
    }
}

void gemm_rows(const GemmTask& t, int64_t n0, int64_t n1) {
    TypeInfo info;
    type_info(t.type, &info);
    const int64_t nb = t.K / info.block_elems;
    constexpr int MT = 64;  // activation rows per pass over a weight row
    float acc[MT], odd[MT], mins[MT], odd_mins[MT];
    KBlock w;
    for (int64_t m0 = 0; m0 < t.M; m0 += MT) {
        const int mt = (int)(t.M - m0 < MT ? t.M - m0 : MT);
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t* row = t.w + n * t.row_bytes;
            for (int i = 0; i < mt; i++) acc[i] = odd[i] = mins[i] = odd_mins[i] = 0.0f;
            for (int64_t b = 0; b < nb; b++) {
                const uint8_t* blk = row + b * info.block_bytes;
                if (is_k_quant(t.type)) {
                    unpack_k(t.type, blk, &w);
                    for (int i = 0; i < mt; i++) acc[i] += dot_k(t.type, w, ((const ActQ8K*)t.xq)[(m0 + i) * nb + b]);
                } else {  // two chains, even and odd blocks
                    for (int i = 0; i < mt; i++)
                        (b & 1 ? odd : acc)[i] += dot_legacy(t.type, blk, ((const ActQ8B*)t.xq)[(m0 + i) * nb + b],
                                                            (b & 1 ? odd_mins : mins) + i);
                }
            }
            for (int i = 0; i < mt; i++)
                t.y[(m0 + i) * t.ldy + n] = (acc[i] + odd[i]) + (mins[i] + odd_mins[i]) + (t.bias ? t.bias[n] : 0.0f);
        }
    }
}

}  // namespace generic
}  // namespace specserve
