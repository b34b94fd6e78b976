// Softmax cross-entropy of logits against target ids (docs/design.md section 3: mean over all B*S
// positions). The softmax is computed in double per row.
//   logits, dlogits: [M, V]; targets: int32 [M].
// Returns the SUM of the M per-row losses (double, added in row order) so micro-batches and ranks
// can be combined before dividing by the global position count. On a CUDA device the row losses
// and their sum stay on the device; only the sum (8 bytes) is downloaded. dlogits = grad_scale *
// (softmax - onehot), where the caller passes grad_scale = 1 / (global positions) for a mean loss.
#pragma once

#include "kernels/core/tensor.h"

namespace meshproof::kernels {

double cross_entropy_forward_backward(const Tensor& logits, const Tensor& targets,
                                      double grad_scale, Tensor& dlogits);
// Forward only (evaluation, finite differences): the sum of the per-row losses.
double cross_entropy_forward(const Tensor& logits, const Tensor& targets);

// Vocabulary-parallel cross-entropy (Megatron's parallel cross-entropy; docs/design.md section
// 24) in pieces around the caller's collectives over tp. `logits` [M, Vl] are this shard's
// vocabulary columns [vocab_begin, vocab_begin + Vl) of a vocabulary of `vocab`; targets int32 [M]
// are global ids in [0, vocab). Per-row values are float64 tensors [M] on the logits' device (a
// CUDA step keeps them there: docs/design.md, "Host-device traffic per step"):
//   1. cross_entropy_shard_max: the row maxima of the shard (-inf for Vl = 0); the caller takes
//      the maximum over tp (cross_entropy_combine_ranks).
//   2. cross_entropy_shard_sums: given the global maxima, sum_c exp(logit - max) of the shard and
//      the target's logit where the shard holds the target (0 elsewhere); the caller sums both
//      over tp.
//   3. cross_entropy_shard_loss: log_z = max + log(sum) per row and the sum of the counted rows'
//      losses log_z - target logit in row order (the single-rank formulas); the one scalar that
//      leaves the device.
//   4. cross_entropy_shard_grad: dlogits = grad_scale * (exp(logit - log_z) - onehot(target)).
// Targets outside [0, vocab) are an input error. On the CPU piece 2 (and 4) report them; on a
// CUDA device piece 2 marks the row's target logit NaN (no download), and piece 3, finding a NaN
// among the target logits, scans the targets on the device and reports the first one outside
// (a NaN logit with valid targets is returned as a NaN loss, as on the CPU).
Tensor cross_entropy_shard_max(const Tensor& logits);
struct CrossEntropyShardSums {
  Tensor sum_exp, target_logit;  // float64 [M]
};
CrossEntropyShardSums cross_entropy_shard_sums(const Tensor& logits, const Tensor& targets,
                                               int64_t vocab_begin, int64_t vocab,
                                               const Tensor& row_max);
// Combines the tp ranks' per-row values gathered in rank order (`every` float64 [ranks * M], rank
// t's values at [t * M, (t + 1) * M)) into [M]: max, or the sum in rank order (rank 0's value,
// plus rank 1's, ...), on `every`'s device.
Tensor cross_entropy_combine_ranks(const Tensor& every, int ranks, bool max);
// Rows counted in the loss: all for sp_size 1; under sequence parallelism (the logits hold every
// position's rows, r = b * seq + s) those whose s lies in sequence shard sp_rank of sp_size.
// Sets log_z (float64 [M], on the inputs' device) and returns the sum of the counted rows'
// log_z - target_logit, added in row order. `targets` and `vocab` serve the device's target check.
double cross_entropy_shard_loss(const Tensor& row_max, const Tensor& sum_exp,
                                const Tensor& target_logit, const Tensor& targets, int64_t vocab,
                                int64_t seq, int sp_size, int sp_rank, Tensor& log_z);
void cross_entropy_shard_grad(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                              int64_t vocab, const Tensor& log_z, double grad_scale,
                              Tensor& dlogits);

}  // namespace meshproof::kernels
