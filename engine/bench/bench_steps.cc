// The recipe bench's figures that run the engine's model (docs/design.md section 26): the forward
// + backward step of one micro-batch of a one-layer GptModel with the recipe's quantized linears,
// timed with its peak device memory, and the loss curve of N training steps of engine::run_training
// per recipe (the convergence against BF16 and fp32). Apart from the GEMM figures
// (bench_gemms.cc, bench_grouped.cc): these time whole steps on one set of weights and one batch,
// as consecutive training steps do, not kernels over rotation pools.
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "engine/bench/bench_recipes.h"
#include "engine/bench/bench_recipes_internal.h"
#include "engine/config/config.h"
#include "engine/model/model.h"
#include "engine/model/params.h"
#include "engine/model/recipe.h"
#include "engine/model/trainer.h"
#include "engine/session/session.h"
#include "kernels/core/runtime.h"
#include "kernels/core/tensor.h"
#include "kernels/ops/cast.h"

namespace meshproof::engine {

using kernels::DType;
using kernels::Tensor;
using namespace bench_detail;  // NOLINT(google-build-using-namespace): the recipe bench's helpers

namespace bench_detail {

LayerFigure measure_layer(RecipeKind r, const RecipeBenchOptions& o) {
  Config c;
  c.model = o.model.model_config(1);
  c.model.vocab = 32;
  c.training.seq_len = o.model.seq;
  c.training.batch = o.model.micro_batch;
  c.recipe = recipe_config(r);
  validate(c);
  const GptModel model(c);
  // The model computes on the rank context's device: install o.device and a memory tracker for
  // this measurement (its peak is the step's memory: weights, gradients, activations).
  kernels::MemoryTracker tracker;
  kernels::RankContext ctx = kernels::current_context();
  ctx.device = o.device;
  ctx.memory = &tracker;
  const kernels::ScopedRankContext scope(ctx);
  LayerFigure f;
  {
    const TensorMap params = init_params(c.model, c.seed);
    TensorMap weights, grads;
    // bf16 compute copies of the fp32 masters for every recipe but fp32, as the trainer does.
    for (const std::string& n : params.names()) {
      Tensor w =
          r == RecipeKind::kFp32 ? params.at(n) : kernels::cast_to(params.at(n), DType::kBFloat16);
      weights.insert(n, w.on(o.device));
      grads.insert(n, Tensor::zeros(params.at(n).shape(), DType::kFloat32, o.device));
    }
    Fp8Recipe recipe(c.recipe, kSingleRank);
    std::mt19937 rng(7);
    std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(c.model.vocab - 1));
    std::vector<int32_t> ids(static_cast<size_t>(o.model.micro_batch * (o.model.seq + 1)));
    for (int32_t& t : ids) t = tok(rng);
    const Tensor tokens = Tensor::from_vector<int32_t>({o.model.micro_batch, o.model.seq + 1}, ids);
    f.tokens = o.model.tokens();
    f.vocab = c.model.vocab;
    const double grad_scale = 1.0 / static_cast<double>(f.tokens);
    // Gradients accumulate across repetitions (zeroing them is the optimizer step's business,
    // not the layer's); their values do not change the work done.
    time_into(f.m, o.device, o.warmup, o.iters, [&](int i) {
      model.forward_backward(weights, tokens, {i, 0}, grad_scale, grads, &recipe);
    });
  }
  f.peak_bytes = tracker.peak(o.device.type).value;
  return f;
}

ConvergenceCurve train_curve(RecipeKind r, const RecipeBenchOptions& o) {
  RunOptions ro;
  ro.config.model = o.model.model_config(o.train_layers);
  ro.config.training.seq_len = o.model.seq;
  ro.config.training.batch = o.model.micro_batch;
  ro.config.training.steps = o.steps;
  ro.config.recipe = recipe_config(r);
  ro.backend = o.device;
  ro.steps = o.steps;
  const RunResult res = run_training(ro);
  ConvergenceCurve c;
  for (const StepMetrics& m : res.metrics) c.loss.push_back(m.loss);
  return c;
}

}  // namespace bench_detail

}  // namespace meshproof::engine
