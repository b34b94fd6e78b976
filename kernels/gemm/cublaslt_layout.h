// The scale layouts cuBLASLt's block-scaled GEMMs read (docs/design.md section 31), as index
// functions shared by the host tests and the device conversion kernels (gemm.cu): header-only and
// free of fmt so that nvcc compiles it. Each offset function maps the source scale (o, kb) of an
// operand (o: its outer, non-reduction index; kb: its block index along K) to its destination.
#pragma once

#include <cstdint>

#include "kernels/core/formats.h"  // MP_HOST_DEVICE

namespace meshproof::kernels::lt {

MP_HOST_DEVICE inline constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }
MP_HOST_DEVICE inline constexpr int64_t round_up(int64_t a, int64_t b) {
  return ceil_div(a, b) * b;
}

// VEC128_32F (1x128 blocks): the scales of an operand with `outer` rows form an fp32 matrix
// [ceil(K/128), roundup(outer, 4)] row-major: the outer index is contiguous and padded to 4 floats
// (16 bytes) per K block (TransformerEngine's "GEMM-ready" 1D layout).
MP_HOST_DEVICE inline int64_t vec128_scale_elems(int64_t outer, int64_t k_blocks) {
  return k_blocks * round_up(outer, 4);
}
MP_HOST_DEVICE inline int64_t vec128_scale_offset(int64_t o, int64_t kb, int64_t outer) {
  return kb * round_up(outer, 4) + o;
}

// BLK128x128_32F (128x128 tiles): [ceil(outer/128), roundup(ceil(K/128), 4)] row-major, the K
// block index contiguous and padded to 4 floats (TransformerEngine's "GEMM-ready" 2D layout).
MP_HOST_DEVICE inline int64_t blk128_scale_elems(int64_t outer, int64_t k_blocks) {
  return ceil_div(outer, 128) * round_up(k_blocks, 4);
}
MP_HOST_DEVICE inline int64_t blk128_scale_offset(int64_t ob, int64_t kb, int64_t k_blocks) {
  return ob * round_up(k_blocks, 4) + kb;
}

// VEC32_UE8M0 / VEC16_UE4M3: one byte per (o, kb), padded to [roundup(outer, 128),
// roundup(k_blocks, 4)] and cut into 128x4 tiles of 512 bytes, tiles ordered along K first; in a
// tile, row o%32 of each 32-row group is 16 bytes holding the 4 groups (o%128)/32 of 4 K blocks:
//   byte = ((o/128) * ceil(k_blocks/4) + kb/4) * 512 + (o%32) * 16 + ((o%128)/32) * 4 + kb%4.
MP_HOST_DEVICE inline int64_t swizzled_128x4_bytes(int64_t outer, int64_t k_blocks) {
  return round_up(outer, 128) * round_up(k_blocks, 4);
}
MP_HOST_DEVICE inline int64_t swizzled_128x4_offset(int64_t o, int64_t kb, int64_t k_blocks) {
  return ((o / 128) * ceil_div(k_blocks, 4) + kb / 4) * 512 + (o % 32) * 16 + ((o % 128) / 32) * 4 +
         kb % 4;
}

}  // namespace meshproof::kernels::lt
