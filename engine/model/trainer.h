// The single-rank training loop (docs/design.md sections 3 and 20): data -> micro-batched
// forward/backward with fp32 gradient accumulation -> global-norm clipping -> AdamW, on whole
// tensors. It is the independent reference of the sharded session (engine/session/session.h), not
// its 1-rank case: it shares only the model math, the recipe and the optimizer formulas, and none
// of the session's sharding, gathering, reduction or checkpoint-state code, so a bug in those
// cannot hide by being on both sides of a parity test (tests/engine/parallel compare every mesh
// with it).
#pragma once

#include <cstdint>
#include <functional>

#include "engine/config/config.h"
#include "engine/model/data.h"
#include "engine/model/model.h"
#include "engine/model/params.h"
#include "engine/model/recipe.h"
#include "engine/optim/optimizer.h"

namespace meshproof::engine {

struct StepMetrics {
  int64_t step = 0;
  double loss = 0;       // mean cross-entropy over the global batch's B*S positions
  double grad_norm = 0;  // global L2 norm before clipping
  double lr = 0;
};

class Trainer {
 public:
  // `observe_amax` (optional) sees every amax the recipe records, as the session's amax
  // reduction would (tests count and name them); on one rank there is nothing to reduce.
  explicit Trainer(const Config& config, Fp8Recipe::AmaxHook observe_amax = {});

  // Runs one optimizer step. `on_grads`, when set, sees the reduced gradients before clipping.
  StepMetrics step(const std::function<void(int64_t step, const TensorMap& grads)>& on_grads = {});

  const TensorMap& params() const { return params_; }
  TensorMap& params() { return params_; }
  const MarkovSource& data() const { return data_; }
  int64_t steps_done() const { return step_; }
  Fp8Recipe& recipe() { return recipe_; }

 private:
  Config config_;
  GptModel model_;
  MarkovSource data_;
  TensorMap params_;  // float32 master weights (fp32 recipe: also the compute weights)
  TensorMap grads_;   // float32 gradients
  AdamW optimizer_;
  Fp8Recipe recipe_;  // quantization of the linear layers' GEMMs (disabled for fp32/bf16)
  int64_t step_ = 0;
};

}  // namespace meshproof::engine
