// Optimizer pieces of DESIGN.md section 3: learning-rate schedules, global-norm clipping and
// AdamW over a TensorMap of float32 master weights (the local shards once sharded).
#pragma once

#include <cstdint>

#include "engine/config.h"
#include "engine/params.h"

namespace meshproof::engine {

// Learning rate of 0-based step `step`:
//   constant:      lr
//   warmup_cosine: lr * (step+1) / warmup for step < warmup, then
//                  min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * (step - warmup) / max(1, steps -
//                  warmup)))
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

}  // namespace meshproof::engine
