#include "engine/optimizer.h"

#include <algorithm>
#include <cmath>

#include "kernels/adamw.h"

namespace meshproof::engine {

double learning_rate(const TrainingConfig& t, int64_t step) {
  if (t.schedule == LrSchedule::kConstant) return t.lr;
  const int64_t w = t.warmup_steps;
  if (step < w) {
    // LinearLR(start_factor = 1/(W+1), end_factor = 1, total_iters = W), closed form.
    return t.lr * static_cast<double>(step + 1) / static_cast<double>(w + 1);
  }
  // CosineAnnealingLR(T_max = steps - 1 - W, eta_min = min_lr), closed form, from the milestone W
  // on (SequentialLR restarts it at epoch 0 there). validate() guarantees T_max >= 1; the clamp
  // keeps steps past the configured run (a resumed run trained longer) at min_lr.
  const double t_max = static_cast<double>(t.steps - 1 - w);
  const double epoch = std::min(static_cast<double>(step - w), t_max);
  return t.min_lr + (t.lr - t.min_lr) * (1.0 + std::cos(M_PI * epoch / t_max)) / 2.0;
}

double clip_coefficient(double norm, double max_norm) {
  if (max_norm <= 0.0) return 1.0;
  return std::min(1.0, max_norm / (norm + 1e-6));
}

AdamW::AdamW(const ModelConfig& model, const TrainingConfig& training)
    : specs_(param_specs(model)),
      training_(training),
      exp_avg_(zeros_like_params(model)),
      exp_avg_sq_(zeros_like_params(model)) {}

void AdamW::step(TensorMap& params, const TensorMap& grads, double lr) {
  ++step_;
  for (const ParamSpec& s : specs_) {
    kernels::AdamWHyper hp{lr, training_.beta1, training_.beta2, training_.adam_eps,
                           s.weight_decay() ? training_.weight_decay : 0.0};
    kernels::adamw_step(params.at(s.name), grads.at(s.name), exp_avg_.at(s.name),
                        exp_avg_sq_.at(s.name), step_, hp);
  }
}

}  // namespace meshproof::engine
