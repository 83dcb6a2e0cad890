// AVX-512 + VNNI kernels (compiled with -mavx512f -mavx512bw -mavx512vl -mavx512dq -mavx512vnni
// -mavx2 -mfma -mf16c; run only where the CPU has all of them: ops.cpp isa_runs).
//
// Q4_K packed sixteen weight rows at a time (gguf_packed.h): one 64-byte vector holds four quants
// of each of sixteen rows; vpdpbusd multiplies it by four activation bytes, broadcast from memory by
// the instruction itself, and adds the four products into each row's int32 lane: one instruction per
// 64 products, where AVX2 needs a vpmaddubsw and a vpaddw per 32. A sub-block's sums take their
// scales once (vpmulld), the mins' share comes from the activations' sums per 32 (vpdpwssd), and the
// sixteen rows' results are the lanes of one float vector.
//
// Q6_K packed sixteen rows at a time likewise (vpdpbusd on its 6-bit quants, which are unsigned).
//
// Q4_0, Q4_1 and Q8_0 packed sixteen rows at a time: the same vpdpbusd over 32-element blocks (Q8_0's
// signed quants stored plus 128, so unsigned; the offsets come from the activation's sum).
//
// The other types (every type in the file's layout, Q4_K eight rows at a time) run the AVX2 kernels
// (avx2::gemm): this variant adds nothing to them. (A zmm kernel for Q6_K in the file's layout was
// faster than AVX2's at four rows and more, but a model's Q6_K tensors pack: rows not whole groups
// of sixteen are rare enough not to carry it.)
// Every activation row has its own accumulators and visits the blocks in the same order whatever
// M or the tile: a row's result is bit for bit the same alone or in any batch.
#include <immintrin.h>

#include "gguf_blocks.h"
#include "gguf_packed.h"
#include "qgemm.h"

namespace specserve {
namespace avx512 {
namespace {

constexpr int kMaxTile = 64;

inline int64_t min64(int64_t a, int64_t b) { return a < b ? a : b; }

inline int tile_rows(int64_t K) {
    const int64_t t = 262144 / K;
    return (int)(t < 4 ? 4 : (t > kMaxTile ? kMaxTile : t));
}

inline __m512i bcast4(const void* p) {
    int32_t v;
    __builtin_memcpy(&v, p, 4);
    return _mm512_set1_epi32(v);
}

// acc + four products per lane of q (unsigned) and the four signed bytes at p, broadcast by the
// instruction itself ({1to16}: GCC does not fold a separate broadcast into vpdpbusd; with one it
// was a few percent slower).
inline __m512i dpbusd_bcast(__m512i acc, __m512i q, const void* p) {
    asm("vpdpbusd %2%{1to16%}, %1, %0" : "+v"(acc) : "v"(q), "m"(*(const int32_t*)p));
    return acc;
}

// Share `part` of `kParts` of the cache lines of a block of kBlockBytes at pf, asked of L2 (where
// kAhead): a block kernel spreads the next group's prefetches over its work. Asked all at once at the
// block's start (37 lines for Q4_Kx16, 53 for Q6_Kx16) they were slower (one process, sixteen shuffled
// rounds, the 1.5B: 4 rows 39.7 -> 37.9 ms, 8 rows 58.6 -> 50.5, 16 rows 106.4 -> 96.1).
template <bool kAhead, int kBlockBytes, int kParts>
inline void prefetch_share(const uint8_t* pf, int part) {
    constexpr int kLines = (kBlockBytes + 63) / 64;
    if constexpr (kAhead)
        for (int l = kLines * part / kParts; l < kLines * (part + 1) / kParts; l++) _mm_prefetch((const char*)(pf + 64 * l), _MM_HINT_T1);
}

// ---- Q4_K packed sixteen rows at a time ---------------------------------------------------------

constexpr int kX16 = 16;
constexpr int kX16Bytes = 148 * kX16;  // a packed super-block of sixteen rows
// Byte offsets in a packed super-block (gguf_packed.h with R = 16).
constexpr int kX16Dmin = 32, kX16Scales = 64, kX16Mins = 192, kX16Qs = 320;

// Q4_Kx16 super-block times R activation blocks (x[r * stride]); acc[r] lane j += row j's share.
// With kAhead, pf is the next group's block, asked of L2 a share per sub-block.
template <int R, bool kAhead>
inline void dot_q4kx16(const uint8_t* g, const ActQ8K* x, int64_t stride, __m512* acc, const uint8_t* pf) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512i isum[R];
    for (int r = 0; r < R; r++) isum[r] = _mm512_setzero_si512();
#pragma GCC unroll 1
    for (int sp = 0; sp < 4; sp++) {
#pragma GCC unroll 2
    for (int h = 0; h < 2; h++) {
        const int s = 2 * sp + h;
        const uint8_t* qs = g + kX16Qs + 512 * sp;
        prefetch_share<kAhead, kX16Bytes, 8>(pf, s);
        __m512i p[R];
        for (int r = 0; r < R; r++) p[r] = _mm512_setzero_si512();
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            const __m512i w = _mm512_loadu_si512((const void*)(qs + 64 * t));
            const __m512i q = _mm512_and_si512(h ? _mm512_srli_epi16(w, 4) : w, m4);
            for (int r = 0; r < R; r++) p[r] = dpbusd_bcast(p[r], q, x[r * stride].qs + 32 * s + 4 * t);
        }
        const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(g + kX16Scales + 16 * s)));
        for (int r = 0; r < R; r++) isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(p[r], sc));
    }
    }
    __m512i off[R];  // mins: pairs of sub-blocks against pairs of 32-sums
    for (int r = 0; r < R; r++) off[r] = _mm512_setzero_si512();
    for (int pr = 0; pr < 4; pr++) {
        const __m512i mn = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(g + kX16Mins + 32 * pr)));
        for (int r = 0; r < R; r++) off[r] = _mm512_dpwssd_epi32(off[r], mn, bcast4(x[r * stride].bsums32 + 2 * pr));
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)g));
    const __m512 dmin = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(g + kX16Dmin)));
    for (int r = 0; r < R; r++) {
        const __m512 xd = _mm512_set1_ps(x[r * stride].d);
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, xd), acc[r]);
        acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(off[r]), _mm512_mul_ps(dmin, xd), acc[r]);
    }
}

// ---- Q6_K packed sixteen rows at a time -----------------------------------------------------------

constexpr int kQ6x16Bytes = 210 * kX16;
constexpr int kQ6x16Scales = 32, kQ6x16Runs = 288, kQ6x16Run = 192;  // gguf_packed.h with R = 16

// Q6_Kx16 super-block times R activation blocks; acc[r] lane j += row j's share. Run v of the block
// gives four groups of four quants, u = v, v + 16, v + 32, v + 48 (sub-blocks v / 4 + 4k); a
// sub-block's sums start at the activation's -32 * (its sum) (the quants are stored plus 32), take
// its four groups (vpdpbusd), then its scales. The block is read front to back.
template <int R, bool kAhead>
inline void dot_q6kx16_by_run(const uint8_t* g, const ActQ8K* x, int64_t stride, __m512* acc, const uint8_t* pf) {
    const __m512i m3f = _mm512_set1_epi8(0x3F), m03 = _mm512_set1_epi8(0x03), m0f = _mm512_set1_epi8(0x0F),
                  mc0 = _mm512_set1_epi8((char)0xC0);
    __m512i isum[R];
    for (int r = 0; r < R; r++) isum[r] = _mm512_setzero_si512();
#pragma GCC unroll 4
    for (int c = 0; c < 4; c++) {  // runs 4c .. 4c + 3 complete sub-blocks c, c + 4, c + 8, c + 12
        __m512i p[4][R];
        for (int k = 0; k < 4; k++)
            for (int r = 0; r < R; r++) p[k][r] = bcast4(x[r * stride].q6_offset + c + 4 * k);
#pragma GCC unroll 4
        for (int i = 0; i < 4; i++) {
            const int v = 4 * c + i;
            prefetch_share<kAhead, kQ6x16Bytes, 16>(pf, v);
            const uint8_t* run = g + kQ6x16Runs + kQ6x16Run * v;
            const __m512i a = _mm512_loadu_si512((const void*)run);
            const __m512i b = _mm512_loadu_si512((const void*)(run + 64));
            const __m512i c = _mm512_loadu_si512((const void*)(run + 128));
            // quants of groups 0..2: the low six bits; group 3's: the top two bits of a, b, c in turn
            const __m512i y = _mm512_ternarylogic_epi32(_mm512_srli_epi16(a, 6), _mm512_srli_epi16(b, 4), m03, 0xE4);
            const __m512i q[4] = {
                _mm512_and_si512(a, m3f), _mm512_and_si512(b, m3f), _mm512_and_si512(c, m3f),
                _mm512_ternarylogic_epi32(y, _mm512_srli_epi16(_mm512_and_si512(c, mc0), 2), m0f, 0xE4),
            };
            for (int k = 0; k < 4; k++)
                for (int r = 0; r < R; r++) p[k][r] = dpbusd_bcast(p[k][r], q[k], x[r * stride].qs + 4 * (v + 16 * k));
        }
        for (int k = 0; k < 4; k++) {
            const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(g + kQ6x16Scales + 16 * (c + 4 * k))));
            for (int r = 0; r < R; r++) isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(p[k][r], sc));
        }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)g));
    for (int r = 0; r < R; r++)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, _mm512_set1_ps(x[r * stride].d)), acc[r]);
}

// The same sums sub-block by sub-block (each run read four times, from the cache): only one
// sub-block's sums live per row, so eight rows fit the registers. Integer sums in another order:
// the same result, bit for bit.
template <int R, bool kAhead>
inline void dot_q6kx16_by_sub_block(const uint8_t* g, const ActQ8K* x, int64_t stride, __m512* acc, const uint8_t* pf) {
    const __m512i m3f = _mm512_set1_epi8(0x3F), m03 = _mm512_set1_epi8(0x03), m0f = _mm512_set1_epi8(0x0F),
                  mc0 = _mm512_set1_epi8((char)0xC0);
    __m512i isum[R];
    for (int r = 0; r < R; r++) isum[r] = _mm512_setzero_si512();
#pragma GCC unroll 16
    for (int s = 0; s < 16; s++) {  // sub-block s: quants 16s .. 16s + 15 = groups u = 4s .. 4s + 3 (runs v = u % 16)
        const int k = s / 4;
        prefetch_share<kAhead, kQ6x16Bytes, 16>(pf, s);
        __m512i p[R];
        for (int r = 0; r < R; r++) p[r] = bcast4(x[r * stride].q6_offset + s);
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {
            const int u = 4 * s + t, v = u % 16;
            const uint8_t* run = g + kQ6x16Runs + kQ6x16Run * v;
            __m512i q;
            if (k < 3) {
                q = _mm512_and_si512(_mm512_loadu_si512((const void*)(run + 64 * k)), m3f);
            } else {
                const __m512i a = _mm512_loadu_si512((const void*)run);
                const __m512i b = _mm512_loadu_si512((const void*)(run + 64));
                const __m512i c = _mm512_loadu_si512((const void*)(run + 128));
                const __m512i y = _mm512_ternarylogic_epi32(_mm512_srli_epi16(a, 6), _mm512_srli_epi16(b, 4), m03, 0xE4);
                q = _mm512_ternarylogic_epi32(y, _mm512_srli_epi16(_mm512_and_si512(c, mc0), 2), m0f, 0xE4);
            }
            for (int r = 0; r < R; r++) p[r] = dpbusd_bcast(p[r], q, x[r * stride].qs + 4 * u);
        }
        const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i*)(g + kQ6x16Scales + 16 * s)));
        for (int r = 0; r < R; r++) isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(p[r], sc));
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)g));
    for (int r = 0; r < R; r++)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(d, _mm512_set1_ps(x[r * stride].d)), acc[r]);
}

// Few rows: by run (four sub-blocks' sums live per row, every run unpacked once); more: by sub-block.
template <int R, bool kAhead>
inline void dot_q6kx16(const uint8_t* g, const ActQ8K* x, int64_t stride, __m512* acc, const uint8_t* pf) {
    if constexpr (R <= 4) dot_q6kx16_by_run<R, kAhead>(g, x, stride, acc, pf);
    else dot_q6kx16_by_sub_block<R, kAhead>(g, x, stride, acc, pf);
}

// ---- Q4_0, Q4_1, Q8_0 packed sixteen rows at a time (blocks of 32) -------------------------------

// One block of 32 times R activation blocks; acc[r] lane j += row j's share. Q4_0's quants are the
// weight plus 8 and Q8_0's (as packed) plus 128: the sums start at -8 or -128 times the activation's
// sum. Q4_1 adds its min times the activation block's sum (x.s = d * sum).
template <int FileType, int R>
inline void dot_legacy16(const uint8_t* g, const ActQ8B* x, int64_t stride, __m512* acc) {
    constexpr int kHead = FileType == kQ4_1 ? 4 : 2;
    const uint8_t* qs = g + kX16 * kHead;
    __m512i p[R];
    for (int r = 0; r < R; r++)
        p[r] = FileType == kQ4_1 ? _mm512_setzero_si512()
                                 : _mm512_set1_epi32((FileType == kQ8_0 ? -128 : -8) * x[r * stride].qsum);
    if constexpr (FileType == kQ8_0) {
#pragma GCC unroll 8
        for (int t = 0; t < 8; t++) {
            const __m512i w = _mm512_loadu_si512((const void*)(qs + 64 * t));
            for (int r = 0; r < R; r++) p[r] = dpbusd_bcast(p[r], w, x[r * stride].qs + 4 * t);
        }
    } else {
        const __m512i m4 = _mm512_set1_epi8(0x0F);
#pragma GCC unroll 4
        for (int t = 0; t < 4; t++) {  // low nibbles: quants 4t..4t+3; high: 16 + 4t..
            const __m512i w = _mm512_loadu_si512((const void*)(qs + 64 * t));
            const __m512i lo = _mm512_and_si512(w, m4), hi = _mm512_and_si512(_mm512_srli_epi16(w, 4), m4);
            for (int r = 0; r < R; r++) p[r] = dpbusd_bcast(p[r], lo, x[r * stride].qs + 4 * t);
            for (int r = 0; r < R; r++) p[r] = dpbusd_bcast(p[r], hi, x[r * stride].qs + 16 + 4 * t);
        }
    }
    const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)g));
    for (int r = 0; r < R; r++)
        acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p[r]), _mm512_mul_ps(d, _mm512_set1_ps(x[r * stride].d)), acc[r]);
    if constexpr (FileType == kQ4_1) {
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(g + 2 * kX16)));
        for (int r = 0; r < R; r++) acc[r] = _mm512_fmadd_ps(m, _mm512_set1_ps(x[r * stride].s), acc[r]);
    }
}

// ---- every packed type: groups of sixteen weight rows against every activation row ----------------

// What the group loop needs of a packed type: its activations, block bytes and size, the rows of a
// pass, the float sums a row keeps across blocks (two for the 32-element blocks, even and odd, whose
// adds would otherwise wait on each other), and the block kernel.
template <int Type>
struct Packed16;
template <>
struct Packed16<kQ4_Kx16> {
    using Act = ActQ8K;
    static constexpr int kElems = kQK, kBytes = kX16Bytes, kChains = 1;
    // activation rows per pass: 8, with the sub-block loop unrolled by pairs only (fully unrolled,
    // 8 rows spilled registers and were slower than 4); against 4 rows a pass, three alternating
    // processes on the 1.5B: 8 rows 63.3 -> 58.8 ms, 16 rows 111.2 -> 106.3, a 256-token prefill
    // 1.23-1.35 -> 1.20-1.21 s
    static constexpr int kRows = 8;
    template <int R, bool kAhead>
    static void dot(const uint8_t* g, const Act* x, int64_t stride, __m512* acc, const uint8_t* pf) { dot_q4kx16<R, kAhead>(g, x, stride, acc, pf); }
    static constexpr bool kSpreads = true;
};
template <>
struct Packed16<kQ6_Kx16> {
    using Act = ActQ8K;
    static constexpr int kElems = kQK, kBytes = kQ6x16Bytes, kChains = 1, kRows = 8;
    template <int R, bool kAhead>
    static void dot(const uint8_t* g, const Act* x, int64_t stride, __m512* acc, const uint8_t* pf) { dot_q6kx16<R, kAhead>(g, x, stride, acc, pf); }
    static constexpr bool kSpreads = true;
};
template <int FileType>
struct Legacy16 {
    using Act = ActQ8B;
    static constexpr int kElems = kQ32, kChains = 2, kRows = 4;
    static constexpr int kBytes = kX16 * (FileType == kQ8_0 ? 34 : (FileType == kQ4_1 ? 20 : 18));
    template <int R, bool kAhead>
    static void dot(const uint8_t* g, const Act* x, int64_t stride, __m512* acc, const uint8_t*) { dot_legacy16<FileType, R>(g, x, stride, acc); }
    static constexpr bool kSpreads = false;  // blocks of 5 to 9 lines: asked at the block's start
};
template <>
struct Packed16<kQ4_0x16> : Legacy16<kQ4_0> {};
template <>
struct Packed16<kQ4_1x16> : Legacy16<kQ4_1> {};
template <>
struct Packed16<kQ8_0x16> : Legacy16<kQ8_0> {};

// A group against R activation rows. Where the prefetch policy says so (qgemm.h: a tile of two rows or
// more, on a machine where the timing finds it pays), the next group's blocks
// (`ahead`) are asked of L2 as these are read: the work per byte is then long enough that the
// nearer prefetch alone lets the memory idle, and the passes after the first read this group from
// the cache (measured, 2-core Zen 4: 4 rows of a K = 8960 Q4_K projection 10.3 -> 6.6 ms, 16 rows of
// Q6_K 10% faster; one row slower with it, so not there). With `ahead` the near prefetch into L1
// is left to the hardware (both at once took a 4-row forward of the 1.5B 47.7 -> 42.5 ms, one
// process, eight interleaved rounds), and Q4_K's and Q6_K's block kernels spread the next group's
// prefetches over their sub-blocks (prefetch_share). Together with ops.cpp's longer chunks, the
// 1.5B's forward against the build before, six alternating processes: 1 row 31.6 -> 28.1 ms, 4 rows
// 49.9 -> 40.8, 16 rows 128.1 -> 122.7.
template <int Type, int R, bool kAhead>
inline void group16(const uint8_t* g, const typename Packed16<Type>::Act* x, int64_t stride, int64_t nb, __m512* out,
                    const uint8_t* ahead, int distance) {
    using P = Packed16<Type>;
    __m512 acc[P::kChains][R];
    for (int c = 0; c < P::kChains; c++)
        for (int r = 0; r < R; r++) acc[c][r] = _mm512_setzero_ps();
    for (int64_t b = 0; b < nb; b++) {
        const uint8_t* blk = g + b * P::kBytes;
        if constexpr (!kAhead)
            for (int l = 0; l < P::kBytes; l += 64) _mm_prefetch((const char*)(blk + distance + l), _MM_HINT_T0);
        else if constexpr (!P::kSpreads)
            for (int l = 0; l < P::kBytes; l += 64) _mm_prefetch((const char*)(ahead + b * P::kBytes + l), _MM_HINT_T1);
        P::template dot<R, kAhead && P::kSpreads>(blk, x + b, stride, acc[b % P::kChains], kAhead ? ahead + b * P::kBytes : nullptr);
    }
    for (int r = 0; r < R; r++) out[r] = P::kChains == 2 ? _mm512_add_ps(acc[0][r], acc[1][r]) : acc[0][r];
}

template <int Type, int R>
inline void group16_rows(int rows, const uint8_t* g, const typename Packed16<Type>::Act* x, int64_t nb, __m512* out,
                         const uint8_t* ahead, int distance) {
    if constexpr (R > 1) {
        if (rows < R) return group16_rows<Type, R - 1>(rows, g, x, nb, out, ahead, distance);
    }
    if (ahead) group16<Type, R, true>(g, x, nb, nb, out, ahead, distance);
    else group16<Type, R, false>(g, x, nb, nb, out, nullptr, distance);
}

template <int Type>
void gemm_packed16(const GemmTask& t, int64_t n0, int64_t n1) {
    using P = Packed16<Type>;
    constexpr int kRows = P::kRows;
    const int64_t nb = t.K / P::kElems;
    const int tile = tile_rows(t.K);
    const typename P::Act* xq = (const typename P::Act*)t.xq;
    const PrefetchPolicy policy = kPrefetchPolicies[t.prefetch];
    __m512 out[kRows];
    for (int64_t m0 = 0; m0 < t.M; m0 += tile) {
        const int mt = (int)min64(tile, t.M - m0);
        const typename P::Act* x = xq + m0 * nb;
        for (int64_t n = n0; n < n1; n += kX16) {
            const uint8_t* g = t.w + n * t.row_bytes;
            const __m512 bias = t.bias ? _mm512_loadu_ps(t.bias + n) : _mm512_setzero_ps();
            for (int i = 0; i < mt; i += kRows) {
                const int rows = mt - i < kRows ? mt - i : kRows;
                const uint8_t* ahead = i == 0 && mt >= policy.ahead_rows && n + kX16 < n1 ? g + kX16 * t.row_bytes : nullptr;
                group16_rows<Type, kRows>(rows, g, x + i * nb, nb, out, ahead, policy.distance);
                for (int r = 0; r < rows; r++) _mm512_storeu_ps(t.y + (m0 + i + r) * t.ldy + n, _mm512_add_ps(out[r], bias));
            }
        }
    }
}

}  // namespace

void gemm(const GemmTask& t, int64_t n0, int64_t n1) {
    switch (t.type) {
        case kQ4_Kx16: return gemm_packed16<kQ4_Kx16>(t, n0, n1);
        case kQ6_Kx16: return gemm_packed16<kQ6_Kx16>(t, n0, n1);
        case kQ4_0x16: return gemm_packed16<kQ4_0x16>(t, n0, n1);
        case kQ4_1x16: return gemm_packed16<kQ4_1x16>(t, n0, n1);
        case kQ8_0x16: return gemm_packed16<kQ8_0x16>(t, n0, n1);
        default: return avx2::gemm(t, n0, n1);
    }
}

}  // namespace avx512
}  // namespace specserve
