#include "engine/model/trainer.h"

#include <cmath>

#include "kernels/ops/adamw.h"
#include "kernels/ops/cast.h"
#include "kernels/ops/elementwise.h"

namespace meshproof::engine {

namespace {
const Config& validated(const Config& c) {
  validate(c);
  return c;
}

Fp8Recipe::AmaxHook or_identity(Fp8Recipe::AmaxHook h) {
  if (h) return h;
  return [](const std::string&, Fp8Role, float*, int64_t) {};
}
}  // namespace

Trainer::Trainer(const Config& config, Fp8Recipe::AmaxHook observe_amax)
    : config_(validated(config)),
      model_(config_),
      data_(config_.model.vocab, config_.data, config_.training.batch, config_.training.seq_len),
      params_(init_params(config_.model, config_.seed)),
      grads_(zeros_like_params(config_.model)),
      optimizer_(config_.model, config_.training),
      recipe_(config_.recipe, or_identity(std::move(observe_amax)), config_.seed) {}

StepMetrics Trainer::step(
    const std::function<void(int64_t step, const TensorMap& grads)>& on_grads) {
  const TrainingConfig& t = config_.training;
  StepMetrics metrics;
  metrics.step = step_;

  // Compute weights: the fp32 masters themselves for the fp32 recipe, bf16 copies (RNE) otherwise.
  TensorMap bf16_weights;
  const TensorMap* weights = &params_;
  if (config_.recipe.kind != RecipeKind::kFp32) {
    for (const ParamSpec& p : param_specs(config_.model)) {  // the MoE router stays fp32
      const kernels::Tensor& master = params_.at(p.name);
      bf16_weights.insert(
          p.name, p.fp32_compute ? master : kernels::cast_to(master, kernels::DType::kBFloat16));
    }
    weights = &bf16_weights;
  }

  // Forward/backward over micro-batches; gradients of the mean loss accumulate in fp32.
  grads_.zero_all();
  const int64_t micro_rows = t.batch / t.micro_batches;
  const double positions = static_cast<double>(t.batch * t.seq_len);
  double loss_sum = 0;
  // The MoE load-balancing loss with micro-batches (docs/design.md "Tensor-parallel experts"):
  // a routing pre-pass sums each MoE layer's statistics over every micro-batch first, so each
  // micro-batch's aux loss and gradient use the global batch's f_e and P_e.
  std::vector<moe::BalanceStats> load;
  TpContext tp;
  if (moe::needs_routing_prepass(config_)) {
    const Fp8Recipe::Snapshot before = recipe_.snapshot();
    for (int64_t mb = 0; mb < t.micro_batches; ++mb) {
      const int64_t row0 = mb * micro_rows;
      const std::vector<moe::BalanceStats> s =
          model_.routing_stats(*weights, data_.rows(step_, row0, row0 + micro_rows), {step_, row0},
                               &recipe_, {}, nullptr);
      load.resize(s.size());
      for (size_t i = 0; i < s.size(); ++i) moe::add_balance_stats(load[i], s[i]);
    }
    recipe_.restore(before);
    tp.moe_load = &load;
  }
  // Tied embeddings (docs/design.md section 33): the head's contributions H and the embedding
  // backward's E accumulate apart and are added once, E + H, as the session does on any mesh.
  const bool tied = config_.model.tied_embeddings;
  if (tied)
    grads_.insert(kTiedHeadGrad,
                  kernels::Tensor::zeros(grads_.at("embed.tok").shape(), kernels::DType::kFloat32));
  for (int64_t mb = 0; mb < t.micro_batches; ++mb) {
    const int64_t row0 = mb * micro_rows;
    const kernels::Tensor tokens = data_.rows(step_, row0, row0 + micro_rows);
    loss_sum += model_.forward_backward(*weights, tokens, {step_, row0}, 1.0 / positions, grads_,
                                        &recipe_, tp);
  }
  if (tied) {
    kernels::add_(grads_.at("embed.tok"), grads_.at(kTiedHeadGrad));
    grads_.erase(kTiedHeadGrad);
  }
  metrics.loss = loss_sum / positions;

  // Global norm in double, summed over parameters in canonical order.
  double sq = 0;
  for (const std::string& n : grads_.names()) sq += kernels::sum_of_squares(grads_.at(n));
  metrics.grad_norm = std::sqrt(sq);
  if (on_grads) on_grads(step_, grads_);

  const double coef = clip_coefficient(metrics.grad_norm, t.max_grad_norm);
  if (coef < 1.0) {
    for (const std::string& n : grads_.names()) kernels::scale_(grads_.at(n), coef);
  }
  metrics.lr = learning_rate(t, step_);
  optimizer_.step(params_, grads_, metrics.lr);
  ++step_;
  return metrics;
}

}  // namespace meshproof::engine
