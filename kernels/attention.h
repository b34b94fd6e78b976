// Causal multi-head self-attention core (docs/design.md section 3), no FP8:
//   qkv:   [B*S, 3H], per-head interleaved columns (the fused QKV linear's output): for head h
//          (d = H/A) columns [h*3d, h*3d+d) are q, the next d are k, the next d are v.
//   out:   [B*S, H], head h in columns [h*d, (h+1)*d).
//   probs: [B, A, S, S] saved softmax(q·kᵀ/sqrt(d)) with the causal mask (zeros above the
//          diagonal), computed in double and stored in the compute dtype (fp32 or fp64).
// Backward writes dqkv [B*S, 3H] (same interleaving).
#pragma once

#include <cstdint>

#include "kernels/tensor.h"

namespace meshproof::kernels {

struct AttentionShape {
  int64_t batch = 0;     // B
  int64_t seq = 0;       // S
  int64_t heads = 0;     // A
  int64_t head_dim = 0;  // d
};

void attention_forward(const Tensor& qkv, const AttentionShape& shape, Tensor& out, Tensor& probs);
void attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& probs,
                        const AttentionShape& shape, Tensor& dqkv);

}  // namespace meshproof::kernels
