// MoE token rows on the tensors' device (docs/design.md sections 27 and 37): the dispatch of the
// (token, choice) pairs into per-expert blocks, the permutation of the token rows into them, the
// weighted combine back and the backward of both. Pure index work and double arithmetic in a
// fixed order rounded once, the same on the CPU reference and the CUDA kernels (explicit
// __d*_rn operations on the device), so both backends give the same bytes.
//
// Shapes: T tokens, k = top_k, E experts, P dispatched (padded) rows, H row width.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/core/tensor.h"

namespace meshproof::kernels {

// expert int32 [T, k] and the pair counts int64 [E] (moe_expert_counts) on the same device ->
// token int64 [P] (the source token of each row, -1 for padding) and slot int64 [T, k] (the row
// of each pair), there. Expert e's block starts at offset_e = sum over e' < e of
// padded_block(count_e', align, keep_empty) (kernels/moe/moe_row.h) and holds its pairs first, in
// (token, choice) order: the stable counting sort of the pairs by expert. `padded` is P, the sum
// of all blocks, which the caller computed from its host copy of the counts (checked on the CPU).
struct MoeDispatchOut {
  Tensor token, slot;
};
MoeDispatchOut moe_dispatch(const Tensor& expert, const Tensor& counts, int64_t align,
                            bool keep_empty, int64_t padded);

// x [T, H] (any dtype) -> [P, H]: row p holds x[token[p]], padding rows (token -1) are zero.
Tensor moe_permute(const Tensor& x, const Tensor& token);

// out [T, H] (float32, bfloat16 or float64) = for each t, sum over j in order of
// weight[t, j] * y[slot[t, j]] in double (the first term w * y, then acc + w * y), rounded once to
// out's dtype; weight undefined: the plain sum of the rows (the backward of the permutation).
// y [P, H] float, slot int64 [T, k], weight float64 [T, k].
void moe_combine(const Tensor& y, const Tensor& slot, const Tensor& weight, Tensor& out);

// Backward of moe_combine: dy [P, H] (dy's dtype) = weight[t, j] * dout[t] at row slot[t, j]
// (double, rounded once), zero on the padding rows; returns d_weight float64 [T, k] =
// sum over h in order of dout[t, h] * y[slot[t, j], h] in double.
Tensor moe_combine_backward(const Tensor& dout, const Tensor& y, const Tensor& slot,
                            const Tensor& weight, Tensor& dy);

}  // namespace meshproof::kernels
