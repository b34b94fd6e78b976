// The MoE router on the tensors' device (docs/design.md sections 27 and 37): probabilities, top-k
// choice and combine weights, the per-expert counts and probability sums, and the backward to the
// logits. The CPU reference and the CUDA kernels run the same row functions
// (kernels/moe/moe_row.h), so the integer choices and every double operation are the same; the one
// difference is the device's exp (see moe_row.h). Every output stays on the logits' device; only
// the counts cross (engine/moe/moe.cc downloads them to size the dispatch).
//
// Shapes: T tokens, E experts, k = top_k.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/core/tensor.h"

namespace meshproof::kernels {

// logits float32 (or float64, CPU only) [T, E] -> probs float64 [T, E], expert int32 [T, k],
// weight float64 [T, k] (route_row per token; float values rounded to float in fp32 mode).
// All on the logits' device; outputs allocated here.
struct MoeRouteOut {
  Tensor probs, expert, weight;
};
MoeRouteOut moe_route(const Tensor& logits, int64_t top_k, bool sigmoid);

// Routed (token, choice) pairs per expert: int64 [E] on expert's device, counted in any order
// (integers: the result does not depend on it).
Tensor moe_expert_counts(const Tensor& expert, int64_t experts);

// Sum over the tokens in token order of probs[t, e], per expert: float64 [E] on probs' device (the
// load-balancing statistic P_e's numerator).
Tensor moe_prob_sums(const Tensor& probs);

// d(objective)/d(logits) [T, E] in `dtype` (float32 or bfloat16; float64 on the CPU), on probs'
// device: route_backward_row per token in double, rounded once. d_weight float64 [T, k]; aux
// float64 [E] on the same device, or undefined for zero.
Tensor moe_route_backward(const Tensor& probs, const Tensor& expert, const Tensor& weight,
                          const Tensor& d_weight, const Tensor& aux, bool sigmoid, DType dtype);

}  // namespace meshproof::kernels
