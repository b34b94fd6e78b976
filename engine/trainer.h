// The training loop on one rank (docs/design.md section 3): data -> micro-batched forward/backward
// with fp32 gradient accumulation -> gradient reduction hook -> global-norm clipping -> AdamW.
// Communication is only reached through CommHooks (identity on a single rank), so the sharded
// executor reuses this loop's math unchanged.
#pragma once

#include <cstdint>
#include <functional>

#include "engine/config.h"
#include "engine/data.h"
#include "engine/model.h"
#include "engine/optimizer.h"
#include "engine/params.h"
#include "engine/recipe.h"

namespace meshproof::engine {

struct CommHooks {
  // Reduces the gradients of this step over the data-parallel group (identity: one rank).
  std::function<void(TensorMap& grads)> reduce_grads = [](TensorMap&) {};
  // Sums a scalar over the group (loss sums, squared gradient norms of shards).
  std::function<double(double)> sum_scalar = [](double v) { return v; };
  // MAX-reduces amax values over the amax group in place (FP8 recipes; identity here).
  Fp8Recipe::AmaxHook reduce_amax = [](const std::string&, Fp8Role, float*, int64_t) {};
};

struct StepMetrics {
  int64_t step = 0;
  double loss = 0;       // mean cross-entropy over the global batch's B*S positions
  double grad_norm = 0;  // global L2 norm before clipping
  double lr = 0;
};

class Trainer {
 public:
  explicit Trainer(const Config& config, CommHooks hooks = {});

  // Runs one optimizer step. `on_grads`, when set, sees the reduced gradients before clipping.
  StepMetrics step(const std::function<void(int64_t step, const TensorMap& grads)>& on_grads = {});

  const TensorMap& params() const { return params_; }
  TensorMap& params() { return params_; }
  const MarkovSource& data() const { return data_; }
  int64_t steps_done() const { return step_; }
  Fp8Recipe& recipe() { return recipe_; }

 private:
  Config config_;
  CommHooks hooks_;
  GptModel model_;
  MarkovSource data_;
  TensorMap params_;  // float32 master weights (fp32 recipe: also the compute weights)
  TensorMap grads_;   // float32 gradients
  AdamW optimizer_;
  Fp8Recipe recipe_;  // quantization of the linear layers' GEMMs (disabled for fp32/bf16)
  int64_t step_ = 0;
};

}  // namespace meshproof::engine
