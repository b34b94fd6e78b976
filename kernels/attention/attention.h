// Causal multi-head self-attention core (docs/design.md sections 3 and 24), no FP8:
//   qkv:   [B*S, (A + 2KV)d], columns grouped by KV head (the fused QKV linear's output): group g
//          (0 <= g < KV, r = A/KV query heads each) holds columns [g(r+2)d, (g+1)(r+2)d): its r
//          query heads (d each), then its k (d), then its v (d). Query head h uses group h / r.
//          With KV = A (the default) this is the per-head [q, k, v] interleave.
//   out:   [B*S, H], head h in columns [h*d, (h+1)*d).
//   probs: [B, A, S, S] saved softmax(q·kᵀ/sqrt(d)) with the causal mask (zeros above the
//          diagonal), computed in double and stored in the compute dtype (fp32 or fp64).
// Backward writes dqkv [B*S, (A + 2KV)d] (same layout; a group's dk and dv summed over its query
// heads in head order).
//
// Rotary position embedding (RoPE, docs/design.md section 24) acts on the same fused layout in
// place: every q head and every k head is rotated over interleaved pairs (2i, 2i+1) by the angle
// p * theta^(-2i/d), p = positions[s] for the tokens at sequence index s (the global positions,
// also under sequence parallelism). Angles, sines and cosines and the rotation are computed in
// double and rounded once to the compute dtype. The backward rotates the gradients by -angle
// (the rotation's transpose); v columns are untouched.
#pragma once

#include <cstdint>
#include <string_view>
#include <vector>

#include "kernels/core/tensor.h"

namespace meshproof::kernels {

struct AttentionShape {
  int64_t batch = 0;     // B
  int64_t seq = 0;       // S
  int64_t heads = 0;     // A
  int64_t head_dim = 0;  // d
  int64_t kv_heads = 0;  // KV (grouped-query attention; divides A); 0 means A
  int64_t kv() const { return kv_heads > 0 ? kv_heads : heads; }
  int64_t qkv_width() const { return (heads + 2 * kv()) * head_dim; }
};

void attention_forward(const Tensor& qkv, const AttentionShape& shape, Tensor& out, Tensor& probs);
void attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& probs,
                        const AttentionShape& shape, Tensor& dqkv);

// positions: S host values (the position of sequence index s).
void rope_forward(Tensor& qkv, const AttentionShape& shape, double theta,
                  const std::vector<int64_t>& positions);
void rope_backward(Tensor& dqkv, const AttentionShape& shape, double theta,
                   const std::vector<int64_t>& positions);

namespace detail {
// The checks every attention kernel makes of its shape and its qkv operand (the reference here and
// the fused kernels of kernels/attention/flash_attention.h): positive dims, KV dividing A, qkv
// [B, S, (A + 2KV)d] of a floating dtype on the current device.
void check_attention_operand(std::string_view op, const Tensor& qkv, const AttentionShape& s);
}  // namespace detail

}  // namespace meshproof::kernels
