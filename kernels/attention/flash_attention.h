// Fused causal attention (flash-style, docs/design.md section 34): the layouts, causal mask and
// grouped-query heads of kernels/attention/attention.h, computed tile by tile with an online
// softmax, so the [B, A, S, S] probabilities are never stored. The forward saves the output and lse
// [B, A, S] (float32: m_i + log l_i, the natural log-sum-exp of row i's scaled scores); the
// backward recomputes each probability as exp(s_ij - lse_i) and uses D_i = sum_c dO_ic O_ic in
// place of sum_j P_ij dP_ij.
//
// Arithmetic is float32 (storage float32 or bfloat16), so results are close to, not equal to,
// kernels/attention/attention.h's double reference, which stays the exact reference (CPU backend,
// goldens). The CUDA kernels (flash_attention.cu) keep a K/V tile of kFlashKeyTile(d) rows in
// shared memory and a head row in registers (at most kFlashMaxHeadDim / 32 values per lane). The
// CPU path runs the same algorithm (same tiles, same online rescaling, float32) so that its error
// against the reference can be bounded and tested on any machine.
#pragma once

#include <cstdint>

#include "kernels/attention/attention.h"
#include "kernels/core/tensor.h"

namespace meshproof::kernels {

inline constexpr int64_t kFlashMaxHeadDim = 256;  // 8 float registers per lane per row vector
// Keys (and queries in the backward) per shared-memory tile, at most 32 (one per lane): two tiles
// of T x d floats stay within 32 KiB (under the 48 KiB default without opt-in). The dispatch
// passes it to the launchers, which reject anything else.
inline constexpr int64_t kFlashKeyTile(int64_t head_dim) { return head_dim <= 128 ? 32 : 16; }

// Whether the fused kernels take this shape (head_dim <= kFlashMaxHeadDim); the engine uses the
// reference kernels otherwise.
bool flash_attention_supported(const AttentionShape& shape);

// out [B*S, A*d] as attention_forward; lse float32 [B, A, S].
void flash_attention_forward(const Tensor& qkv, const AttentionShape& shape, Tensor& out,
                             Tensor& lse);
// dqkv [B*S, (A + 2KV)d] from dout, the forward's qkv, out and lse (a group's dk and dv summed
// over its query heads in head order). Deterministic: no atomics, fixed orders.
void flash_attention_backward(const Tensor& dout, const Tensor& qkv, const Tensor& out,
                              const Tensor& lse, const AttentionShape& shape, Tensor& dqkv);

}  // namespace meshproof::kernels
