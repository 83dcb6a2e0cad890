// AVX2 + FMA kernels (compiled with -mavx2 -mfma -mf16c; run only where the CPU has them).
//
// Integer dot products with vpmaddubsw (unsigned weight quants x signed activation quants, pairs
// summed to int16) and vpmaddwd (times the sub-block scales, pairs summed to int32), one float
// scale per block. A weight block is unpacked once into registers and applied to every activation
// row of the tile. Everything here has internal linkage except avx2::gemm: this file is built with
// instructions other files must not pick up through a shared inline function.
#include <immintrin.h>

#include "gguf_blocks.h"
#include "gguf_packed.h"
#include "qgemm.h"

namespace specserve {
namespace avx2 {
namespace {

constexpr int kMaxTile = 64;
// Weight bytes ahead that a kernel asks the cache for while it works on a block: one row's share
// of the memory bandwidth rose from 71-73% to 74-79% of a read probe's in the same run (gemv_bandwidth.py,
// Zen 3; 8192 bytes was no better).
constexpr int kPrefetch = 2048;

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

inline float hsum(__m256 v) {
    __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
    lo = _mm_add_ss(lo, _mm_movehdup_ps(lo));
    return _mm_cvtss_f32(lo);
}

inline float half(const uint8_t* p) {
    uint16_t h;
    __builtin_memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

// Activation rows per pass: enough to amortise unpacking, few enough that the tile stays in L2.
inline int tile_rows(int64_t K) {
    const int64_t t = 262144 / K;
    return (int)(t < 4 ? 4 : (t > kMaxTile ? kMaxTile : t));
}

// ---- k-quants: Q4_K, Q5_K (w = d*sc*q - dmin*m, q unsigned, 32 per scale), Q6_K ---------------
// Each block is unpacked into registers and applied, in one pass, to up to four activation rows.

// pshufb patterns broadcasting int16 element j of a 128-bit lane to the whole lane.
alignas(32) const uint8_t kBroadcast16[8][32] = {
#define B16(j) {2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, \
                2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1,  \
                2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1, 2 * j, 2 * j + 1}
    B16(0), B16(1), B16(2), B16(3), B16(4), B16(5), B16(6), B16(7)
#undef B16
};

// Q6_K: with four int16 scales 4q..4q+3 in every 64-bit quarter, sub-block j (scales 2j, 2j + 1;
// q = j / 2) takes scale 2j in int16 lanes 0..7 and 2j + 1 in lanes 8..15: pattern j % 2.
alignas(32) const uint8_t kScalePair[2][32] = {
#define SP(a, b) {a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, a, a + 1, \
                  b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1, b, b + 1}
    SP(0, 2), SP(4, 6)
#undef SP
};

inline __m256i bcast16(__m256i v, int j) {
    return _mm256_shuffle_epi8(v, _mm256_load_si256((const __m256i*)kBroadcast16[j]));
}

// Q4_K / Q5_K super-block times R activation blocks (x[r * stride]): the quants of each pair of
// sub-blocks are unpacked into registers once and applied to all R rows.
template <bool Q5, int R>
inline void dot_q45k(const uint8_t* blk, const ActQ8K* x, int64_t stride, __m256* acc) {
    uint32_t w0, w1, w2;
    __builtin_memcpy(&w0, blk + 4, 4);
    __builtin_memcpy(&w1, blk + 8, 4);
    __builtin_memcpy(&w2, blk + 12, 4);
    const uint32_t lo6 = 0x3f3f3f3f, lo4 = 0x0f0f0f0f, lo2 = 0x03030303;
    const __m128i sm = _mm_set_epi32(((w2 >> 4) & lo4) | (((w1 >> 6) & lo2) << 4), w1 & lo6,
                                     (w2 & lo4) | (((w0 >> 6) & lo2) << 4), w0 & lo6);
    const __m256i s16 = _mm256_cvtepu8_epi16(sm);  // scales 0..7, mins 0..7
    const __m256i scales = _mm256_permute2x128_si256(s16, s16, 0x00);
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    const uint8_t* qs = blk + (Q5 ? 48 : 16);
    __m256i vh = _mm256_setzero_si256(), one = _mm256_set1_epi8(1);
    if (Q5) vh = _mm256_loadu_si256((const __m256i*)(blk + 16));
    __m256i sum[R];
    for (int r = 0; r < R; r++) sum[r] = _mm256_setzero_si256();
    for (int j = 0; j < 4; j++) {
        const __m256i v = _mm256_loadu_si256((const __m256i*)(qs + 32 * j));
        __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if (Q5) {
            lo = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(vh, 2 * j), one), 4));
            hi = _mm256_or_si256(hi, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(vh, 2 * j + 1), one), 4));
        }
        const __m256i s0 = bcast16(scales, 2 * j), s1 = bcast16(scales, 2 * j + 1);
        for (int r = 0; r < R; r++) {
            const int8_t* xq = x[r * stride].qs + 64 * j;
            const __m256i p0 = _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)xq));
            const __m256i p1 = _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(xq + 32)));
            sum[r] = _mm256_add_epi32(sum[r], _mm256_add_epi32(_mm256_madd_epi16(p0, s0), _mm256_madd_epi16(p1, s1)));
        }
    }
    const __m128i mins = _mm256_extracti128_si256(s16, 1);
    const __m256i mins2 = _mm256_set_m128i(_mm_unpackhi_epi16(mins, mins), _mm_unpacklo_epi16(mins, mins));
    const float d = half(blk), dmin = half(blk + 2);
    for (int r = 0; r < R; r++) {
        const ActQ8K& xr = x[r * stride];
        const __m256i off = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)xr.bsums), mins2);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sum[r]), _mm256_set1_ps(d * xr.d), acc[r]);
        acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(off), _mm256_set1_ps(dmin * xr.d), acc[r]);
    }
}

// Q6_K super-block times R activation blocks.
template <int R>
inline void dot_q6k(const uint8_t* blk, const ActQ8K* x, int64_t stride, __m256* acc) {
    const __m256i sc16 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i*)(blk + 192)));  // 16 scales
    // scales 4q..4q+3 in every quarter: sub-block j's two scales are in quarters[j / 2]
    const __m256i quarters[4] = {_mm256_permute4x64_epi64(sc16, 0x00), _mm256_permute4x64_epi64(sc16, 0x55),
                                 _mm256_permute4x64_epi64(sc16, 0xAA), _mm256_permute4x64_epi64(sc16, 0xFF)};
    const __m256i m4 = _mm256_set1_epi8(0x0F), m2 = _mm256_set1_epi8(3);
    __m256i sum[R];
    for (int r = 0; r < R; r++) sum[r] = _mm256_setzero_si256();
    for (int h = 0; h < 2; h++) {
        const __m256i v0 = _mm256_loadu_si256((const __m256i*)(blk + 64 * h));
        const __m256i v1 = _mm256_loadu_si256((const __m256i*)(blk + 64 * h + 32));
        const __m256i vh = _mm256_loadu_si256((const __m256i*)(blk + 128 + 32 * h));
        for (int t = 0; t < 4; t++) {
            const __m256i lo = _mm256_and_si256(t & 2 ? _mm256_srli_epi16(t & 1 ? v1 : v0, 4) : (t & 1 ? v1 : v0), m4);
            const __m256i q = _mm256_or_si256(lo, _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(vh, 2 * t), m2), 4));
            const int j = 4 * h + t;  // sub-block of 32: scales 2j (first 16) and 2j + 1
            const __m256i sc = _mm256_shuffle_epi8(quarters[j / 2], _mm256_load_si256((const __m256i*)kScalePair[j & 1]));
            for (int r = 0; r < R; r++) {
                const __m256i p = _mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i*)(x[r * stride].qs + 32 * j)));
                sum[r] = _mm256_add_epi32(sum[r], _mm256_madd_epi16(p, sc));
            }
        }
    }
    const float d = half(blk + 208);
    for (int r = 0; r < R; r++) {
        const ActQ8K& xr = x[r * stride];
        const __m256i off = _mm256_madd_epi16(_mm256_loadu_si256((const __m256i*)xr.bsums), sc16);
        const __m256i v = _mm256_sub_epi32(sum[r], _mm256_slli_epi32(off, 5));
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(v), _mm256_set1_ps(d * xr.d), acc[r]);
    }
}

template <int Type, int R>
inline void dot_k_fused(const uint8_t* blk, const ActQ8K* x, int64_t stride, __m256* acc) {
    if (Type == kQ6_K) dot_q6k<R>(blk, x, stride, acc);
    else dot_q45k<Type == kQ5_K, R>(blk, x, stride, acc);
}

// One weight row against R activation rows (x[r * stride], one block after another): the block
// is unpacked into registers once for the R rows; the accumulators stay in registers.
template <int Type, int R>
inline void row_k(const uint8_t* row, const ActQ8K* x, int64_t stride, int64_t nb, float* out) {
    constexpr int kBytes = Type == kQ4_K ? 144 : (Type == kQ5_K ? 176 : 210);
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        for (int l = 0; l < kBytes; l += 64) _mm_prefetch((const char*)(row + b * kBytes + kPrefetch + l), _MM_HINT_T0);
        dot_k_fused<Type, R>(row + b * kBytes, x + b, stride, acc);
    }
    for (int r = 0; r < R; r++) out[r] = hsum(acc[r]);
}

// Weight rows [n0, n1) against every activation row, in tiles of activation rows that stay in L2:
// each weight row is read once per tile (from memory for the first, from cache after), its blocks
// unpacked into registers for groups of four activation rows.
template <int Type>
void gemm_k(const GemmTask& t, int64_t n0, int64_t n1) {
    const int64_t nb = t.K / kQK;
    const int tile = tile_rows(t.K);
    const ActQ8K* xq = (const ActQ8K*)t.xq;
    float out[kMaxTile];
    for (int64_t m0 = 0; m0 < t.M; m0 += tile) {
        const int mt = (int)min64(tile, t.M - m0);
        const ActQ8K* x = xq + m0 * nb;
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t* row = t.w + n * t.row_bytes;
            int i = 0;
            for (; i + 4 <= mt; i += 4) row_k<Type, 4>(row, x + i * nb, nb, nb, out + i);
            switch (mt - i) {
                case 3: row_k<Type, 3>(row, x + i * nb, nb, nb, out + i); break;
                case 2: row_k<Type, 2>(row, x + i * nb, nb, nb, out + i); break;
                case 1: row_k<Type, 1>(row, x + i * nb, nb, nb, out + i); break;
                default: break;
            }
            for (int r = 0; r < mt; r++) t.y[(m0 + r) * t.ldy + n] = out[r] + (t.bias ? t.bias[n] : 0.0f);
        }
    }
}

// ---- Q4_K packed in groups of eight weight rows (gguf_packed.h) ------------------------------------------
// One vector: four quants of each of the eight rows; times four activation bytes broadcast, the
// pair sums of a whole sub-block add up in int16 and take the sub-block scale once. The eight rows'
// results are the eight lanes of the float accumulator, so no horizontal sums.

inline __m256i bcast4(const int8_t* p) {
    int32_t v;
    __builtin_memcpy(&v, p, 4);
    return _mm256_set1_epi32(v);
}

// int16 lanes 2r, 2r+1 = scale[r]: eight unsigned bytes, each doubled.
inline __m256i dup_u8_scales(const uint8_t* p) {
    const __m128i v = _mm_loadl_epi64((const __m128i*)p);
    return _mm256_cvtepu8_epi16(_mm_unpacklo_epi8(v, v));
}

// Q4_Kx8 super-block times R activation blocks; acc[r] lane j += row j's share.
template <int R>
inline void dot_q4kx8(const uint8_t* g, const ActQ8K* x, int64_t stride, __m256* acc) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i isum[R], off[R];
    for (int r = 0; r < R; r++) isum[r] = off[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
    for (int s = 0; s < 8; s++) {
        const uint8_t* qs = g + 160 + 256 * (s >> 1);
        __m256i p[R];
        for (int r = 0; r < R; r++) p[r] = _mm256_setzero_si256();
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            const __m256i w = _mm256_loadu_si256((const __m256i*)(qs + 32 * t));
            const __m256i q = _mm256_and_si256(s & 1 ? _mm256_srli_epi16(w, 4) : w, m4);
            for (int r = 0; r < R; r++)
                p[r] = _mm256_add_epi16(p[r], _mm256_maddubs_epi16(q, bcast4(x[r * stride].qs + 32 * s + 4 * t)));
        }
        const __m256i sc = dup_u8_scales(g + 32 + 8 * s);
        for (int r = 0; r < R; r++) isum[r] = _mm256_add_epi32(isum[r], _mm256_madd_epi16(p[r], sc));
    }
    for (int pr = 0; pr < 4; pr++) {  // mins: pairs of sub-blocks against pairs of 32-sums
        const __m256i mn = _mm256_cvtepu8_epi16(_mm_loadu_si128((const __m128i*)(g + 96 + 16 * pr)));
        for (int r = 0; r < R; r++)
            off[r] = _mm256_add_epi32(off[r], _mm256_madd_epi16(mn, bcast4((const int8_t*)(x[r * stride].bsums32 + 2 * pr))));
    }
    const __m256 d = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)g));
    const __m256 dmin = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)(g + 16)));
    for (int r = 0; r < R; r++) {
        const __m256 xd = _mm256_set1_ps(x[r * stride].d);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r]), _mm256_mul_ps(d, xd), acc[r]);
        acc[r] = _mm256_fnmadd_ps(_mm256_cvtepi32_ps(off[r]), _mm256_mul_ps(dmin, xd), acc[r]);
    }
}

constexpr int kX8Bytes = 148 * 8;  // a packed super-block of eight rows

// `ahead` (where the prefetch policy says so, qgemm.h): the next group's blocks asked of L2 instead of this group's
// next bytes of L1, as the AVX-512 kernels do (measured on a Zen 4 running this variant: 2 rows of
// the 1.5B 41.5 -> 39.5 ms, 4 rows 62.6 -> 61.5).
template <int R>
inline void group_q4kx8(const uint8_t* g, const ActQ8K* x, int64_t stride, int64_t nb, __m256* out, const uint8_t* ahead,
                        int distance) {
    __m256 acc[R];
    for (int r = 0; r < R; r++) acc[r] = _mm256_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = g + b * kX8Bytes;
        if (ahead)
            for (int l = 0; l < kX8Bytes; l += 64) _mm_prefetch((const char*)(ahead + b * kX8Bytes + l), _MM_HINT_T1);
        else
            for (int l = 0; l < kX8Bytes; l += 64) _mm_prefetch((const char*)(blk + distance + l), _MM_HINT_T0);
        dot_q4kx8<R>(blk, x + b, stride, acc);
    }
    for (int r = 0; r < R; r++) out[r] = acc[r];
}

// Activation rows a packed group is applied to in one pass (their int16 and int32 sums in registers).
constexpr int kX8Rows = 4;  // 6 or 8 spill registers: slower (measured on Zen 3)

// Groups of eight weight rows in [n0, n1) against every activation row, tiled like gemm_k.
void gemm_q4kx8(const GemmTask& t, int64_t n0, int64_t n1) {
    const int64_t nb = t.K / kQK;
    const int tile = tile_rows(t.K);
    const ActQ8K* xq = (const ActQ8K*)t.xq;
    const PrefetchPolicy policy = kPrefetchPolicies[t.prefetch];
    __m256 out[kX8Rows];
    for (int64_t m0 = 0; m0 < t.M; m0 += tile) {
        const int mt = (int)min64(tile, t.M - m0);
        const ActQ8K* x = xq + m0 * nb;
        for (int64_t n = n0; n < n1; n += 8) {
            const uint8_t* g = t.w + n * t.row_bytes;
            const __m256 bias = t.bias ? _mm256_loadu_ps(t.bias + n) : _mm256_setzero_ps();
            for (int i = 0; i < mt; i += kX8Rows) {
                const int rows = mt - i < kX8Rows ? mt - i : kX8Rows;
                const uint8_t* ahead = i == 0 && mt >= policy.ahead_rows && n + 8 < n1 ? g + 8 * t.row_bytes : nullptr;
                const int d = policy.distance;
                switch (rows) {
                    case 4: group_q4kx8<4>(g, x + i * nb, nb, nb, out, ahead, d); break;
                    case 3: group_q4kx8<3>(g, x + i * nb, nb, nb, out, ahead, d); break;
                    case 2: group_q4kx8<2>(g, x + i * nb, nb, nb, out, ahead, d); break;
                    default: group_q4kx8<1>(g, x + i * nb, nb, nb, out, ahead, d); break;
                }
                for (int r = 0; r < rows; r++) _mm256_storeu_ps(t.y + (m0 + i + r) * t.ldy + n, _mm256_add_ps(out[r], bias));
            }
        }
    }
}

// ---- legacy types, 32 per block: Q8_0 (w = d*q), Q4_0 (w = d*(q-8)), Q4_1 (w = d*q + m) ---------
// Two chains per row (even and odd blocks; see gguf_blocks.h), in every path.

// acc[r] and extra[r] (Q4_1's mins: m * d_x * sum(q_x)) += one block for R activation rows.
template <int Type, int R>
inline void dot_legacy(const uint8_t* blk, const ActQ8B* x, int64_t stride, __m256* acc, float* extra) {
    const __m256i ones = _mm256_set1_epi16(1);
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const float d = half(blk);
    if (Type == kQ4_1) {
        const float mn = half(blk + 2);
        const __m128i v = _mm_loadu_si128((const __m128i*)(blk + 4));
        const __m256i q = _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
        for (int r = 0; r < R; r++) {
            const ActQ8B& xi = x[r * stride];
            const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(q, _mm256_loadu_si256((const __m256i*)xi.qs)), ones);
            acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * xi.d), acc[r]);
            extra[r] += mn * xi.s;
        }
        return;
    }
    __m256i q;  // signed quants
    if (Type == kQ8_0) {
        q = _mm256_loadu_si256((const __m256i*)(blk + 2));
    } else {
        const __m128i v = _mm_loadu_si128((const __m128i*)(blk + 2));
        q = _mm256_sub_epi8(_mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4)),
                            _mm256_set1_epi8(8));
    }
    const __m256i aq = _mm256_sign_epi8(q, q);
    for (int r = 0; r < R; r++) {
        const ActQ8B& xi = x[r * stride];
        const __m256i sx = _mm256_sign_epi8(_mm256_loadu_si256((const __m256i*)xi.qs), q);
        const __m256i p = _mm256_madd_epi16(_mm256_maddubs_epi16(aq, sx), ones);
        acc[r] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_set1_ps(d * xi.d), acc[r]);
    }
}

// One weight row against R activation rows, in registers: two chains (even, odd blocks) of
// vector sums and of Q4_1's mins, added at the end.
template <int Type, int R>
inline void row_legacy(const uint8_t* row, const ActQ8B* x, int64_t stride, int64_t nb, float* out) {
    constexpr int kBytes = Type == kQ8_0 ? 34 : (Type == kQ4_0 ? 18 : 20);
    __m256 acc[2][R];
    float extra[2][R];
    for (int c = 0; c < 2; c++)
        for (int r = 0; r < R; r++) {
            acc[c][r] = _mm256_setzero_ps();
            extra[c][r] = 0.0f;
        }
    int64_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        dot_legacy<Type, R>(row + b * kBytes, x + b, stride, acc[0], extra[0]);
        dot_legacy<Type, R>(row + (b + 1) * kBytes, x + b + 1, stride, acc[1], extra[1]);
    }
    if (b < nb) dot_legacy<Type, R>(row + b * kBytes, x + b, stride, acc[0], extra[0]);
    for (int r = 0; r < R; r++) out[r] = hsum(_mm256_add_ps(acc[0][r], acc[1][r])) + (extra[0][r] + extra[1][r]);
}

template <int Type>
void gemm_legacy(const GemmTask& t, int64_t n0, int64_t n1) {
    const int64_t nb = t.K / kQ32;
    const int tile = tile_rows(t.K);
    const ActQ8B* xq = (const ActQ8B*)t.xq;
    float out[kMaxTile];
    for (int64_t m0 = 0; m0 < t.M; m0 += tile) {  // tiles of activation rows that stay in L2
        const int mt = (int)min64(tile, t.M - m0);
        const ActQ8B* x = xq + m0 * nb;
        for (int64_t n = n0; n < n1; n++) {
            const uint8_t* row = t.w + n * t.row_bytes;
            int i = 0;
            for (; i + 4 <= mt; i += 4) row_legacy<Type, 4>(row, x + i * nb, nb, nb, out + i);
            switch (mt - i) {
                case 3: row_legacy<Type, 3>(row, x + i * nb, nb, nb, out + i); break;
                case 2: row_legacy<Type, 2>(row, x + i * nb, nb, nb, out + i); break;
                case 1: row_legacy<Type, 1>(row, x + i * nb, nb, nb, out + i); break;
                default: break;
            }
            for (int r = 0; r < mt; r++) t.y[(m0 + r) * t.ldy + n] = out[r] + (t.bias ? t.bias[n] : 0.0f);
        }
    }
}

}  // namespace

void gemm(const GemmTask& t, int64_t n0, int64_t n1) {
    switch (t.type) {
        case kQ4_Kx8: return gemm_q4kx8(t, n0, n1);
        case kQ4_K: return gemm_k<kQ4_K>(t, n0, n1);
        case kQ5_K: return gemm_k<kQ5_K>(t, n0, n1);
        case kQ6_K: return gemm_k<kQ6_K>(t, n0, n1);
        case kQ8_0: return gemm_legacy<kQ8_0>(t, n0, n1);
        case kQ4_0: return gemm_legacy<kQ4_0>(t, n0, n1);
        case kQ4_1: return gemm_legacy<kQ4_1>(t, n0, n1);
        default: return;
    }
}

}  // namespace avx2
}  // namespace specserve
