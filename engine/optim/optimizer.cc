#include "engine/optim/optimizer.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "engine/parallel/rank_scalars.h"
#include "kernels/ops/adamw.h"
#include "kernels/ops/elementwise.h"

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

OptimizerStepResult sharded_optimizer_step(ShardPlan& plan, mesh::RankComms& comms,
                                           const TrainingConfig& t, int64_t step) {
  using mesh::MeshDim;
  OptimizerStepResult r;
  const bool tp_lead = comms.mesh().coord(comms.rank(), MeshDim::kTp) == 0;
  std::vector<const kernels::Tensor*> counted;
  for (const ShardedParam& p : plan.params())
    if (tp_lead || p.layout.placement(MeshDim::kTp).is_shard()) counted.push_back(&p.grad);
  // The shards' sums of squares in plan order; on a device the sums run there (bitwise the
  // host's) and only this rank's total comes back.
  double sq = 0;
  mesh::Communicator& pp = comms.group(mesh::DimSet{MeshDim::kPp});
  if (pp.size() == 1) {
    sq = kernels::sum_of_squares_total(counted);
  } else {
    // Pipeline stages (docs/design.md section 33): each parameter's sum of squares at its model
    // index (0 for the parameters of other stages and the uncounted tp replicas), gathered over
    // pp (the counterparts hold the other stages' parameters with the same shard boxes), then
    // added in model order from 0: the pp = 1 rank's sum bit for bit (sum_of_squares_total adds
    // the per-tensor sums in order, and adding +0.0 to a sum of squares changes no bit).
    // A tied embed.tok is held by both end stages with the same gradient: only the first
    // stage's copy is counted, once, as with one stage.
    std::vector<double> mine(plan.model_params(), 0.0);
    for (const ShardedParam& p : plan.params())
      if ((tp_lead || p.layout.placement(MeshDim::kTp).is_shard()) &&
          stage_reports(p.spec, plan.stage()))
        mine[p.model_index] = kernels::sum_of_squares_total({&p.grad});
    const std::vector<double> all = gather_doubles(pp, mine);
    for (size_t k = 0; k < mine.size(); ++k)
      for (int s = 0; s < pp.size(); ++s) sq += all[static_cast<size_t>(s) * mine.size() + k];
  }
  r.grad_norm =
      std::sqrt(sum_doubles(comms.group(mesh::DimSet{MeshDim::kDpShard, MeshDim::kTp}), sq));
  const double coef = clip_coefficient(r.grad_norm, t.max_grad_norm);
  r.lr = learning_rate(t, step);
  for (ShardedParam& p : plan.params()) {
    if (coef < 1.0) kernels::scale_(p.grad, coef);
    if (p.master.numel().value == 0) continue;
    kernels::AdamWHyper hp{r.lr, t.beta1, t.beta2, t.adam_eps,
                           p.spec.weight_decay() ? t.weight_decay : 0.0};
    kernels::adamw_step(p.master, p.grad, p.exp_avg, p.exp_avg_sq, step + 1, hp);
  }
  return r;
}

}  // namespace meshproof::engine
