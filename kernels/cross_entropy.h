// Softmax cross-entropy of logits against target ids (docs/design.md section 3: mean over all B*S
// positions). The softmax is computed in double per row.
//   logits, dlogits: [M, V]; targets: int32 [M].
// Returns the SUM of the M per-row losses (double) so micro-batches and ranks can be combined
// before dividing by the global position count. dlogits = grad_scale * (softmax - onehot), where
// the caller passes grad_scale = 1 / (global positions) for a mean loss.
#pragma once

#include <vector>

#include "kernels/tensor.h"

namespace meshproof::kernels {

double cross_entropy_forward_backward(const Tensor& logits, const Tensor& targets,
                                      double grad_scale, Tensor& dlogits);
// Forward only (evaluation, finite differences): the sum of the per-row losses.
double cross_entropy_forward(const Tensor& logits, const Tensor& targets);

// Vocabulary-parallel cross-entropy (Megatron's parallel cross-entropy; docs/design.md section
// 24) in pieces around the caller's collectives over tp. `logits` [M, Vl] are this shard's
// vocabulary columns [vocab_begin, vocab_begin + Vl) of a vocabulary of `vocab`; targets int32 [M]
// are global ids in [0, vocab). Per-row values are double, on the host:
//   1. cross_entropy_shard_max: the row maxima of the shard (-inf for Vl = 0); the caller takes
//      the maximum over tp.
//   2. cross_entropy_shard_sums: given the global maxima, sum_c exp(logit - max) of the shard and
//      the target's logit where the shard holds the target (0 elsewhere); the caller sums both
//      over tp and forms log_z = max + log(sum), loss = log_z - target logit (the single-rank
//      formulas).
//   3. cross_entropy_shard_grad: dlogits = grad_scale * (exp(logit - log_z) - onehot(target)).
// On a CUDA device the pieces run on a host copy of the logits (dlogits is copied back).
std::vector<double> cross_entropy_shard_max(const Tensor& logits);
struct CrossEntropyShardSums {
  std::vector<double> sum_exp, target_logit;  // [M]
};
CrossEntropyShardSums cross_entropy_shard_sums(const Tensor& logits, const Tensor& targets,
                                               int64_t vocab_begin, int64_t vocab,
                                               const std::vector<double>& row_max);
void cross_entropy_shard_grad(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                              int64_t vocab, const std::vector<double>& log_z, double grad_scale,
                              Tensor& dlogits);

}  // namespace meshproof::kernels
