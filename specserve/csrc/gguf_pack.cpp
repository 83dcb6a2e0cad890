// Repacking Q4_K rows eight or sixteen at a time, and Q6_K sixteen (layouts in gguf_packed.h), and back.
#include <cstring>

#include "gguf_packed.h"

namespace specserve {

namespace {

// The sub-block scales and mins of a Q4_K super-block in the file's 12 bytes (k_scale_min's inverse).
void encode_scale_min(const uint8_t* sc, const uint8_t* mn, uint8_t* q) {
    for (int j = 0; j < 4; j++) {
        q[j] = (uint8_t)((sc[j] & 63) | ((sc[j + 4] >> 4) << 6));
        q[j + 4] = (uint8_t)((mn[j] & 63) | ((mn[j + 4] >> 4) << 6));
        q[j + 8] = (uint8_t)((sc[j + 4] & 0xF) | ((mn[j + 4] & 0xF) << 4));
    }
}

// Byte offsets of a packed super-block's fields for R rows (gguf_packed.h).
struct Q4KLayout {
    int R;
    int dmin() const { return 2 * R; }
    int scale(int s, int r) const { return 4 * R + R * s + r; }
    int min(int s, int r) const { return 12 * R + 2 * R * (s / 2) + 2 * r + s % 2; }
    int qs(int p, int t, int r) const { return 20 * R + 32 * R * p + 4 * R * t + 4 * r; }
    int bytes() const { return 148 * R; }
};

void pack_q4k(const Q4KLayout L, const uint8_t* src, int64_t rb, int64_t nb, uint8_t* dst) {
    for (int64_t b = 0; b < nb; b++, dst += L.bytes()) {
        for (int r = 0; r < L.R; r++) {
            const uint8_t* blk = src + r * rb + b * 144;
            std::memcpy(dst + 2 * r, blk, 2);
            std::memcpy(dst + L.dmin() + 2 * r, blk + 2, 2);
            for (int s = 0; s < 8; s++) {
                uint8_t sc, mn;
                k_scale_min(s, blk + 4, &sc, &mn);
                dst[L.scale(s, r)] = sc;
                dst[L.min(s, r)] = mn;
            }
            for (int p = 0; p < 4; p++)
                for (int t = 0; t < 8; t++) std::memcpy(dst + L.qs(p, t, r), blk + 16 + 32 * p + 4 * t, 4);
        }
    }
}

void unpack_q4k(const Q4KLayout L, const uint8_t* src, int64_t nb, uint8_t* dst, int64_t rb) {
    for (int64_t b = 0; b < nb; b++, src += L.bytes()) {
        for (int r = 0; r < L.R; r++) {
            uint8_t* blk = dst + r * rb + b * 144;
            std::memcpy(blk, src + 2 * r, 2);
            std::memcpy(blk + 2, src + L.dmin() + 2 * r, 2);
            uint8_t sc[8], mn[8];
            for (int s = 0; s < 8; s++) {
                sc[s] = src[L.scale(s, r)];
                mn[s] = src[L.min(s, r)];
            }
            encode_scale_min(sc, mn, blk + 4);
            for (int p = 0; p < 4; p++)
                for (int t = 0; t < 8; t++) std::memcpy(blk + 16 + 32 * p + 4 * t, src + L.qs(p, t, r), 4);
        }
    }
}

// Q6_K: quant j of a file block (6 bits, 0..63) and back. The file keeps, per half h of 128 quants,
// ql[64h + l] (low nibbles of quants 128h + l, high nibbles of 128h + 64 + l, l < 64) and
// qh[32h + l] (bits 2c, 2c + 1: quant 128h + 32c + l, l < 32).
inline int q6_get(const uint8_t* blk, int j) {
    const int h = j / 128, c = (j % 128) / 32, l = j % 32;
    const uint8_t ql = blk[64 * h + 32 * (c & 1) + l];
    const uint8_t qh = blk[128 + 32 * h + l];
    return ((c & 2 ? ql >> 4 : ql) & 0xF) | (((qh >> (2 * c)) & 3) << 4);
}

inline void q6_set(uint8_t* blk, int j, int q) {  // blk's ql and qh start zeroed
    const int h = j / 128, c = (j % 128) / 32, l = j % 32;
    blk[64 * h + 32 * (c & 1) + l] |= (uint8_t)((q & 0xF) << (c & 2 ? 4 : 0));
    blk[128 + 32 * h + l] |= (uint8_t)((q >> 4) << (2 * c));
}

struct Q6KLayout {
    static constexpr int R = 16;
    static int scale(int g, int r) { return 2 * R + R * g + r; }
    // quant j (= 4u + i) of row r: its low four bits' byte (nibble: high for u >= 32) and top bits'
    // byte, in the 192-byte run of v = u % 16
    static int run(int j) { return 18 * R + 12 * R * (j / 4 % 16); }
    static int ql(int j, int r) { return run(j) + 4 * R * (j / 64 % 2) + 4 * r + j % 4; }
    static int qh(int j, int r) { return run(j) + 8 * R + 4 * r + j % 4; }
    static constexpr int bytes() { return 210 * R; }
};

void pack_q6k(const uint8_t* src, int64_t rb, int64_t nb, uint8_t* dst) {
    using L = Q6KLayout;
    for (int64_t b = 0; b < nb; b++, dst += L::bytes()) {
        std::memset(dst, 0, L::bytes());
        for (int r = 0; r < L::R; r++) {
            const uint8_t* blk = src + r * rb + b * 210;
            std::memcpy(dst + 2 * r, blk + 208, 2);
            for (int g = 0; g < 16; g++) dst[L::scale(g, r)] = blk[192 + g];
            for (int j = 0; j < kQK; j++) {
                const int q = q6_get(blk, j), u = j / 4;
                dst[L::ql(j, r)] |= (uint8_t)((q & 0xF) << (u >= 32 ? 4 : 0));
                dst[L::qh(j, r)] |= (uint8_t)((q >> 4) << (2 * (u / 16)));
            }
        }
    }
}

void unpack_q6k(const uint8_t* src, int64_t nb, uint8_t* dst, int64_t rb) {
    using L = Q6KLayout;
    for (int64_t b = 0; b < nb; b++, src += L::bytes()) {
        for (int r = 0; r < L::R; r++) {
            uint8_t* blk = dst + r * rb + b * 210;
            std::memset(blk, 0, 192);
            std::memcpy(blk + 208, src + 2 * r, 2);
            for (int g = 0; g < 16; g++) blk[192 + g] = src[L::scale(g, r)];
            for (int j = 0; j < kQK; j++) {
                const int u = j / 4;
                const int lo = (src[L::ql(j, r)] >> (u >= 32 ? 4 : 0)) & 0xF;
                const int hi = (src[L::qh(j, r)] >> (2 * (u / 16))) & 3;
                q6_set(blk, j, lo | (hi << 4));
            }
        }
    }
}

}  // namespace

void pack_group(int packed_type, const uint8_t* src, int64_t src_row_bytes, int64_t nb, uint8_t* dst) {
    if (packed_type == kQ6_Kx16) pack_q6k(src, src_row_bytes, nb, dst);
    else if (is_packed(packed_type)) pack_q4k(Q4KLayout{pack_rows(packed_type)}, src, src_row_bytes, nb, dst);
}

void unpack_group(int packed_type, const uint8_t* src, int64_t nb, uint8_t* dst, int64_t dst_row_bytes) {
    if (packed_type == kQ6_Kx16) unpack_q6k(src, nb, dst, dst_row_bytes);
    else if (is_packed(packed_type)) unpack_q4k(Q4KLayout{pack_rows(packed_type)}, src, nb, dst, dst_row_bytes);
}

}  // namespace specserve
