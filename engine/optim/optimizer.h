// Optimizer pieces of docs/design.md section 3: learning-rate schedules, global-norm clipping and
// AdamW over a TensorMap of float32 master weights (the single-rank Trainer), and the sharded
// optimizer step of a training session over its local shards (sections 5 and 20).
#pragma once

#include <cstdint>

#include "engine/config/config.h"
#include "engine/model/params.h"
#include "engine/parallel/shard_plan.h"
#include "mesh/core/communicator.h"

namespace meshproof::engine {

// Learning rate of 0-based step s (docs/scenarios.md, docs/design.md section 15):
//   constant:      lr
//   warmup_cosine: PyTorch's SequentialLR([LinearLR(start_factor=1/(W+1), total_iters=W),
//                  CosineAnnealingLR(T_max=steps-1-W, eta_min=min_lr)], milestones=[W]) stepped
//                  once after every optimizer step, W = warmup_steps:
//                  s <  W: lr * (s+1) / (W+1)
//                  s >= W: min_lr + (lr - min_lr) * (1 + cos(pi * (s-W) / (steps-1-W))) / 2
//                  so the peak lr is used once (at s = W) and min_lr at the last step s = steps-1.
//                  Needs W <= steps - 2 (validate()); steps past steps-1 stay at min_lr.
double learning_rate(const TrainingConfig& t, int64_t step);

// coef = min(1, max_norm / (norm + 1e-6)) (torch.nn.utils.clip_grad_norm_); 1 when disabled.
double clip_coefficient(double norm, double max_norm);

class AdamW {
 public:
  AdamW(const ModelConfig& model, const TrainingConfig& training);
  // One update of every parameter with learning rate `lr`; weight decay only on ndim >= 2.
  void step(TensorMap& params, const TensorMap& grads, double lr);
  int64_t steps_taken() const { return step_; }
  TensorMap& exp_avg() { return exp_avg_; }
  TensorMap& exp_avg_sq() { return exp_avg_sq_; }

 private:
  std::vector<ParamSpec> specs_;
  TrainingConfig training_;
  TensorMap exp_avg_, exp_avg_sq_;
  int64_t step_ = 0;
};

// The sharded optimizer step: the global gradient norm over the plan's reduced gradient shards
// (the shards over dp_shard x tp are disjoint except for tp-replicated parameters, which only tp
// rank 0 counts; dp_replicate replicas are not summed), clipping, then AdamW on every non-empty
// local shard as step `step` + 1 (bias correction). Collective over dp_shard x tp. Runs where the
// plan's shards live: on a device the sums of squares, the clipping and AdamW are device
// kernels and the host receives only the rank's sum of squares (8 bytes).
struct OptimizerStepResult {
  double grad_norm = 0;  // before clipping
  double lr = 0;
};
OptimizerStepResult sharded_optimizer_step(ShardPlan& plan, mesh::RankComms& comms,
                                           const TrainingConfig& training, int64_t step);

}  // namespace meshproof::engine
