// Repacking Q4_K rows eight at a time (layouts in gguf_packed.h) and back.
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

void pack_q4k(const uint8_t* src, int64_t rb, int64_t nb, uint8_t* dst) {
    for (int64_t b = 0; b < nb; b++, dst += kQ4Kx8Bytes) {
        for (int r = 0; r < kPackRows; r++) {
            const uint8_t* blk = src + r * rb + b * 144;
            std::memcpy(dst + 2 * r, blk, 2);
            std::memcpy(dst + 16 + 2 * r, blk + 2, 2);
            for (int s = 0; s < 8; s++) {
                uint8_t sc, mn;
                k_scale_min(s, blk + 4, &sc, &mn);
                dst[32 + 8 * s + r] = sc;
                dst[96 + 16 * (s / 2) + 2 * r + s % 2] = mn;
            }
            for (int p = 0; p < 4; p++)
                for (int t = 0; t < 8; t++) std::memcpy(dst + 160 + 256 * p + 32 * t + 4 * r, blk + 16 + 32 * p + 4 * t, 4);
        }
    }
}

void unpack_q4k(const uint8_t* src, int64_t nb, uint8_t* dst, int64_t rb) {
    for (int64_t b = 0; b < nb; b++, src += kQ4Kx8Bytes) {
        for (int r = 0; r < kPackRows; r++) {
            uint8_t* blk = dst + r * rb + b * 144;
            std::memcpy(blk, src + 2 * r, 2);
            std::memcpy(blk + 2, src + 16 + 2 * r, 2);
            uint8_t sc[8], mn[8];
            for (int s = 0; s < 8; s++) {
                sc[s] = src[32 + 8 * s + r];
                mn[s] = src[96 + 16 * (s / 2) + 2 * r + s % 2];
            }
            encode_scale_min(sc, mn, blk + 4);
            for (int p = 0; p < 4; p++)
                for (int t = 0; t < 8; t++) std::memcpy(blk + 16 + 32 * p + 4 * t, src + 160 + 256 * p + 32 * t + 4 * r, 4);
        }
    }
}

}  // namespace

void pack_group(int type, const uint8_t* src, int64_t src_row_bytes, int64_t nb, uint8_t* dst) {
    if (type == kQ4_K) pack_q4k(src, src_row_bytes, nb, dst);
}

void unpack_group(int packed_type, const uint8_t* src, int64_t nb, uint8_t* dst, int64_t dst_row_bytes) {
    if (packed_type == kQ4_Kx8) unpack_q4k(src, nb, dst, dst_row_bytes);
}

}  // namespace specserve
