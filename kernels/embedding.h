// Token + position embedding (docs/design.md section 3): x[b*S + s, :] = tok[ids[b, s], :] + pos[s,
// :].
//   ids: int32 [B, S]; tok: [V, H]; pos: [P, H] with P >= S; x: [B*S, H].
// Backward ACCUMULATES into dtok/dpos (float32/float64 parameter gradients, whatever dx's dtype;
// rows summed in a fixed order: deterministic).
#pragma once

#include "kernels/tensor.h"

namespace meshproof::kernels {

void embedding_forward(const Tensor& ids, const Tensor& tok, const Tensor& pos, Tensor& x);
void embedding_backward(const Tensor& dx, const Tensor& ids, Tensor& dtok, Tensor& dpos);

}  // namespace meshproof::kernels
