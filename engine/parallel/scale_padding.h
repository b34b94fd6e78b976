// How the MXFP8 FP8 all-gather lays out each member's block scales
// (engine/parallel/fp8_all_gather.h gather_shard), shared by the gather and the fault hook point
// that may change it (engine/faults/fault_hooks.h block_scale_padding) without either header
// including the other.
#pragma once

#include <cstdint>

namespace meshproof::engine {

// How each member's MXFP8 block scales are laid out when they are gathered: 0 rows = unpadded
// (correct: each member's scale rows land at its rows' offset). TransformerEngine keeps MXFP8
// scale_inv padded for cuBLAS's swizzled layout (rowwise rows to a multiple of 128, columnwise
// rows to a multiple of 4, zeros); the block_scale_padding_reshard fault gathers such padded
// per-member blocks back to back and cuts the result at the weight's scale rows, without removing
// each member's padding (engine/faults/fault_hooks.h, point block_scale_padding).
struct ScalePadding {
  int64_t rowwise_rows = 0;     // pad each member's [r, K/32] rowwise scales to this multiple
  int64_t columnwise_rows = 0;  // pad each member's [r/32, K] columnwise scales to this multiple
};

}  // namespace meshproof::engine
