// Q4_K weights repacked eight rows at a time, so that one 32-byte vector holds four consecutive
// quants of each of eight weight rows. A kernel multiplies it by four activation bytes broadcast
// (vpmaddubsw: the eight rows' pair sums in int16 lanes), adds a whole sub-block's worth of those in
// int16 (16 products of a 4-bit quant and an int8 of at most 127 in magnitude: at most 30480, no
// overflow) and applies the sub-block scale once per sub-block, not once per 32 products: about half
// the multiplies per weight of the file's layout, and the eight rows' results come out as the
// eight lanes of one float vector. The repacking is lossless (unpack_group gives the file's bytes
// back) and takes 148 bytes per row per 256 weights against the file's 144 (the sub-block scales and
// mins kept as whole bytes).
//
// A packed tensor keeps the shape [rows, row bytes] (rows a multiple of 8); group g (rows 8g..8g+7)
// starts at byte 8 * g * row bytes and holds its super-blocks one after another. Q4_Kx8, 1184 bytes
// per super-block of eight rows (r = row in the group, s = sub-block of 32):
//     0   d[r]                f16
//    16   dmin[r]             f16
//    32   scale[s][r]         u8
//    96   min[s/2][r][s%2]    u8
//   160   qs[s/2][t][r][i]    the file's qs[32(s/2) + 4t + i] (t = 0..7, i = 0..3): low nibble, quant
//                             4t + i of sub-block s & ~1; high nibble, of sub-block s | 1
#pragma once

#include <cstdint>

#include "gguf_blocks.h"

namespace specserve {

constexpr int kPackRows = 8;
constexpr int kQ4Kx8Bytes = 1184;

// The packed type of a ggml type, or -1 where there is none.
static inline int packed_type_of(int type) {
    return type == kQ4_K ? kQ4_Kx8 : -1;
}
static inline int unpacked_type_of(int type) {
    return type == kQ4_Kx8 ? kQ4_K : type;
}

// Eight rows of `nb` super-blocks of `type` (kQ4_K), row r at src + r * src_row_bytes, into
// one packed group at dst; and back (dst rows of the file's bytes).
void pack_group(int type, const uint8_t* src, int64_t src_row_bytes, int64_t nb, uint8_t* dst);
void unpack_group(int packed_type, const uint8_t* src, int64_t nb, uint8_t* dst, int64_t dst_row_bytes);

}  // namespace specserve
