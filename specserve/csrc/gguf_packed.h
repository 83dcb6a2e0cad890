// Q4_K weights repacked several rows at a time, so that one vector holds four consecutive quants of
// each of eight (a 32-byte vector: Q4_Kx8, for AVX2) or sixteen (a 64-byte vector: Q4_Kx16, for
// AVX-512) weight rows. A kernel multiplies it by four activation bytes broadcast, so the rows'
// results come out as the lanes of one vector (no horizontal sums), and applies each sub-block
// scale once per sub-block, not once per 32 products:
//   - AVX2 (vpmaddubsw): the rows' pair sums in int16 lanes, a whole sub-block's worth added in
//     int16 (16 products of a 4-bit quant and an int8 of at most 127 in magnitude: at most 30480,
//     no overflow), then times the scales (vpmaddwd);
//   - AVX-512 VNNI (vpdpbusd): four products added into each row's int32 lane in one instruction,
//     the activation bytes broadcast from memory by the instruction itself, then times the scales.
// The repacking is lossless (unpack_group gives the file's bytes back) and takes 148 bytes per row
// per 256 weights against the file's 144 (the sub-block scales and mins kept as whole bytes).
//
// Q6_K packed sixteen rows at a time (for AVX-512 VNNI) the same way: a vector holds four 6-bit quants
// of each of sixteen rows, the sub-block scales apply once per sub-block of 16 (vpmulld), 210 bytes per
// row per 256 weights, as in the file.
//
// A packed tensor keeps the shape [rows, row bytes] (rows a multiple of the group's R rows); group g
// (rows Rg..Rg+R-1) starts at byte R * g * row bytes and holds its super-blocks one after another,
// each R times the file's block bytes. Q4_K, 148 * R bytes (r = row in the group, s = sub-block of 32):
//     0         d[r]                f16
//     2R        dmin[r]             f16
//     4R        scale[s][r]         u8
//     12R       min[s/2][r][s%2]    u8
//     20R       qs[s/2][t][r][i]    the file's qs[32(s/2) + 4t + i] (t = 0..7, i = 0..3): low nibble, quant
//                                   4t + i of sub-block s & ~1; high nibble, of sub-block s | 1
// Q6_K, 210 * R bytes (R = 16; quant j of a row, 0..255, is the file's 6-bit value, 32 + the weight's
// multiple of d * scale; u = j / 4 is its group of four):
//     0         d[r]                f16
//     2R        scale[g][r]         i8 (g = sub-block of 16)
//     18R       sixteen runs of 12R bytes, v = 0..15, each in the order the kernel reads them:
//       +0        a[r][i]           bits 0-5: quant 4v + i; bits 6, 7: bits 0, 1 of quant 4(v + 48) + i
//       +4R       b[r][i]           bits 0-5: quant 4(v + 16) + i; bits 6, 7: bits 2, 3 of quant 4(v + 48) + i
//       +8R       c[r][i]           bits 0-5: quant 4(v + 32) + i; bits 6, 7: bits 4, 5 of quant 4(v + 48) + i
//                                   (three of a run's four quants are one AND away: 9 vector operations
//                                   unpack a run where nibbles and a byte of top bits took 13)
// Q4_0, Q4_1, Q8_0 (blocks of 32), R = 16, the file's block bytes times R:
//     0         d[r]                f16
//     2R        m[r]                f16 (Q4_1 only)
//     then      qs[t][r][i]         the file's quant byte 4t + i of row r (t = 0..3, or 0..7 for Q8_0,
//                                   whose signed quants are stored plus 128: q ^ 0x80)
#pragma once

#include <cstdint>

#include "gguf_blocks.h"

namespace specserve {

// The file's type a packed type holds (the type itself where it is not packed).
static inline int unpacked_type_of(int type) { return is_packed(type) ? type % 100 : type; }

// Whether `packed_type` is a packed layout of the ggml type `type`.
static inline bool packs(int packed_type, int type) { return is_packed(packed_type) && unpacked_type_of(packed_type) == type; }

// One group's rows of `nb` super-blocks of the file's type (row r at src + r * src_row_bytes) into
// the packed layout at dst; and back (dst rows of the file's bytes).
void pack_group(int packed_type, const uint8_t* src, int64_t src_row_bytes, int64_t nb, uint8_t* dst);
void unpack_group(int packed_type, const uint8_t* src, int64_t nb, uint8_t* dst, int64_t dst_row_bytes);

}  // namespace specserve
