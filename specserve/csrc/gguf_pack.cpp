// Repacking Q4_K rows eight or sixteen at a time, and Q6_K, Q4_0, Q4_1, Q8_0 sixteen (layouts in
// gguf_packed.h), and back.
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

// Q6_K: a file block's 256 6-bit quants and back. The file keeps, per half h of 128 quants,
// ql[64h + l] (low nibbles of quants 128h + l, high nibbles of 128h + 64 + l, l < 64) and
// qh[32h + l] (bits 2c, 2c + 1: quant 128h + 32c + l, l < 32).
void q6_quants(const uint8_t* blk, uint8_t* q) {
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++) {
            const uint8_t ql0 = blk[64 * h + l], ql1 = blk[64 * h + 32 + l], qh = blk[128 + 32 * h + l];
            q[128 * h + l] = (uint8_t)((ql0 & 0xF) | ((qh & 3) << 4));
            q[128 * h + 32 + l] = (uint8_t)((ql1 & 0xF) | (((qh >> 2) & 3) << 4));
            q[128 * h + 64 + l] = (uint8_t)((ql0 >> 4) | (((qh >> 4) & 3) << 4));
            q[128 * h + 96 + l] = (uint8_t)((ql1 >> 4) | (((qh >> 6) & 3) << 4));
        }
}

void q6_block(const uint8_t* q, uint8_t* blk) {  // the quants' ql and qh
    for (int h = 0; h < 2; h++)
        for (int l = 0; l < 32; l++) {
            const uint8_t* x = q + 128 * h + l;
            blk[64 * h + l] = (uint8_t)((x[0] & 0xF) | (x[64] << 4));
            blk[64 * h + 32 + l] = (uint8_t)((x[32] & 0xF) | (x[96] << 4));
            blk[128 + 32 * h + l] = (uint8_t)((x[0] >> 4) | ((x[32] >> 4) << 2) | ((x[64] >> 4) << 4) | ((x[96] >> 4) << 6));
        }
}

// Offsets in a packed Q6_K super-block of R = 16 rows (gguf_packed.h): run v holds a, b, c for the
// quants of groups u = v, v + 16, v + 32, v + 48 (quant 4u + i).
struct Q6KLayout {
    static constexpr int R = 16;
    static int scale(int g, int r) { return 2 * R + R * g + r; }
    static int run(int v) { return 18 * R + 12 * R * v; }
    static constexpr int bytes() { return 210 * R; }
};

void pack_q6k(const uint8_t* src, int64_t rb, int64_t nb, uint8_t* dst) {
    using L = Q6KLayout;
    uint8_t q[kQK];
    for (int64_t b = 0; b < nb; b++, dst += L::bytes()) {
        for (int r = 0; r < L::R; r++) {
            const uint8_t* blk = src + r * rb + b * 210;
            std::memcpy(dst + 2 * r, blk + 208, 2);
            for (int g = 0; g < 16; g++) dst[L::scale(g, r)] = blk[192 + g];
            q6_quants(blk, q);
            for (int v = 0; v < 16; v++) {
                uint8_t* run = dst + L::run(v) + 4 * r;
                for (int i = 0; i < 4; i++) {
                    const uint8_t q0 = q[4 * v + i], q1 = q[4 * (v + 16) + i], q2 = q[4 * (v + 32) + i], q3 = q[4 * (v + 48) + i];
                    run[i] = (uint8_t)(q0 | (q3 << 6));
                    run[4 * L::R + i] = (uint8_t)(q1 | ((q3 >> 2) << 6));
                    run[8 * L::R + i] = (uint8_t)(q2 | ((q3 >> 4) << 6));
                }
            }
        }
    }
}

void unpack_q6k(const uint8_t* src, int64_t nb, uint8_t* dst, int64_t rb) {
    using L = Q6KLayout;
    uint8_t q[kQK];
    for (int64_t b = 0; b < nb; b++, src += L::bytes()) {
        for (int r = 0; r < L::R; r++) {
            uint8_t* blk = dst + r * rb + b * 210;
            std::memcpy(blk + 208, src + 2 * r, 2);
            for (int g = 0; g < 16; g++) blk[192 + g] = src[L::scale(g, r)];
            for (int v = 0; v < 16; v++) {
                const uint8_t* run = src + L::run(v) + 4 * r;
                for (int i = 0; i < 4; i++) {
                    const uint8_t a = run[i], bb = run[4 * L::R + i], c = run[8 * L::R + i];
                    q[4 * v + i] = a & 0x3F;
                    q[4 * (v + 16) + i] = bb & 0x3F;
                    q[4 * (v + 32) + i] = c & 0x3F;
                    q[4 * (v + 48) + i] = (uint8_t)((a >> 6) | ((bb >> 6) << 2) | ((c >> 6) << 4));
                }
            }
            q6_block(q, blk);
        }
    }
}

// The 32-element types, sixteen rows: each block's scales (f16 d[r], then Q4_1's m[r]), then its
// quants in runs of four bytes per row: run t holds bytes 4t..4t+3 of every row's quants. Q8_0's
// signed quants are stored plus 128 (as unsigned bytes: q ^ 0x80).
struct LegacyLayout {
    int type;  // the file's type
    int head() const { return type == kQ4_1 ? 4 : 2; }  // the file block's scale bytes
    int qbytes() const { return type == kQ8_0 ? 32 : 16; }
    int block() const { return head() + qbytes(); }
};

void pack_legacy(const LegacyLayout L, const uint8_t* src, int64_t rb, int64_t nb, uint8_t* dst) {
    constexpr int R = 16;
    const uint8_t flip = L.type == kQ8_0 ? 0x80 : 0;
    for (int64_t b = 0; b < nb; b++, dst += R * L.block()) {
        for (int r = 0; r < R; r++) {
            const uint8_t* blk = src + r * rb + b * L.block();
            std::memcpy(dst + 2 * r, blk, 2);
            if (L.type == kQ4_1) std::memcpy(dst + 2 * R + 2 * r, blk + 2, 2);
            for (int t = 0; t < L.qbytes() / 4; t++)
                for (int i = 0; i < 4; i++) dst[R * L.head() + 4 * R * t + 4 * r + i] = blk[L.head() + 4 * t + i] ^ flip;
        }
    }
}

void unpack_legacy(const LegacyLayout L, const uint8_t* src, int64_t nb, uint8_t* dst, int64_t rb) {
    constexpr int R = 16;
    const uint8_t flip = L.type == kQ8_0 ? 0x80 : 0;
    for (int64_t b = 0; b < nb; b++, src += R * L.block()) {
        for (int r = 0; r < R; r++) {
            uint8_t* blk = dst + r * rb + b * L.block();
            std::memcpy(blk, src + 2 * r, 2);
            if (L.type == kQ4_1) std::memcpy(blk + 2, src + 2 * R + 2 * r, 2);
            for (int t = 0; t < L.qbytes() / 4; t++)
                for (int i = 0; i < 4; i++) blk[L.head() + 4 * t + i] = src[R * L.head() + 4 * R * t + 4 * r + i] ^ flip;
        }
    }
}

}  // namespace

void pack_group(int packed_type, const uint8_t* src, int64_t src_row_bytes, int64_t nb, uint8_t* dst) {
    if (packed_type == kQ6_Kx16) pack_q6k(src, src_row_bytes, nb, dst);
    else if (packed_type == kQ4_Kx8 || packed_type == kQ4_Kx16) pack_q4k(Q4KLayout{pack_rows(packed_type)}, src, src_row_bytes, nb, dst);
    else if (is_packed(packed_type)) pack_legacy(LegacyLayout{unpacked_type_of(packed_type)}, src, src_row_bytes, nb, dst);
}

void unpack_group(int packed_type, const uint8_t* src, int64_t nb, uint8_t* dst, int64_t dst_row_bytes) {
    if (packed_type == kQ6_Kx16) unpack_q6k(src, nb, dst, dst_row_bytes);
    else if (packed_type == kQ4_Kx8 || packed_type == kQ4_Kx16) unpack_q4k(Q4KLayout{pack_rows(packed_type)}, src, nb, dst, dst_row_bytes);
    else if (is_packed(packed_type)) unpack_legacy(LegacyLayout{unpacked_type_of(packed_type)}, src, nb, dst, dst_row_bytes);
}

}  // namespace specserve
