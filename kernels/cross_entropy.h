// Softmax cross-entropy of logits against target ids (docs/design.md section 3: mean over all B*S
// positions). The softmax is computed in double per row.
//   logits, dlogits: [M, V]; targets: int32 [M].
// Returns the SUM of the M per-row losses (double) so micro-batches and ranks can be combined
// before dividing by the global position count. dlogits = grad_scale * (softmax - onehot), where
// the caller passes grad_scale = 1 / (global positions) for a mean loss.
#pragma once

#include "kernels/tensor.h"

namespace meshproof::kernels {

double cross_entropy_forward_backward(const Tensor& logits, const Tensor& targets,
                                      double grad_scale, Tensor& dlogits);
// Forward only (evaluation, finite differences): the sum of the per-row losses.
double cross_entropy_forward(const Tensor& logits, const Tensor& targets);

}  // namespace meshproof::kernels
