// `bench recipes` on the CUDA backend (skipped without a usable device): every recipe's GEMMs,
// their BF16 baselines and quantizations are measured with cudaEvents, the copy ceiling is a
// device-to-device copy, the layer step (one forward + backward of a one-layer GptModel) runs on
// the device too, and the record uses the device's table peak when it has one.
#include <gtest/gtest.h>

#include "engine/bench/bench_recipes.h"
#include "harness/run/runner.h"
#include "harness/verbs/bench_recipes_verb.h"
#include "kernels/core/device.h"
#include "tests/gpu_test.h"

namespace meshproof::harness {
namespace {

TEST(BenchRecipesGpu, MeasuresEveryRecipeOnTheDevice) {
  MP_SKIP_WITHOUT_GPU();
  engine::RecipeBenchOptions o;
  o.device = kernels::Device::cuda(0);
  o.model = engine::parse_bench_model("128,512,4,4,64,2");
  o.m_sweep = {16};
  o.iters = 3;
  o.warmup = 1;
  kernels::RankContext ctx;
  ctx.device = o.device;
  kernels::ScopedRankContext scoped(ctx);
  const engine::RecipeBenchReport rep = engine::run_recipe_bench(o);
  EXPECT_EQ(rep.device_name, kernels::cuda_status().gpus[0].name);
  EXPECT_GT(rep.copy.seconds, 0);
  ASSERT_EQ(rep.recipes.size(), std::size(engine::kRecipeNames));
  for (const auto& r : rep.recipes) {
    SCOPED_TRACE(std::string(engine::recipe_name(r.recipe)));
    const bool quantized =
        r.recipe != engine::RecipeKind::kFp32 && r.recipe != engine::RecipeKind::kBf16;
    ASSERT_EQ(r.roles.size(), 12u);
    for (const auto& g : r.roles) {
      EXPECT_GT(g.time.seconds, 0);
      EXPECT_GT(g.bf16.seconds, 0);
      EXPECT_EQ(g.quantize.size(), quantized ? 2u : 0u);
      for (const auto& q : g.quantize) EXPECT_GT(q.m.seconds, 0);
    }
    ASSERT_TRUE(r.layer);
    EXPECT_GT(r.layer->m.seconds, 0);
    EXPECT_GT(r.layer->tokens, 0);
  }
  const reports::RunRecord run = bench_recipes_record(rep, o, o.device.str(), rep.device_name);
  for (const auto& s : run.scenarios) {
    EXPECT_EQ(reports::scenario_verdict(s), reports::Verdict::kPass) << s.name;
  }
}

// The calibration meshproof run uses for GPUs outside the peak table: a measured bf16 GEMM, a
// positive rate no faster than the fastest dense bf16 peak in the table (GB200, 2500 TFLOP/s),
// measured once per device (the second call returns the cached figure).
TEST(BenchRecipesGpu, MeasuredBf16PeakForTheRunner) {
  MP_SKIP_WITHOUT_GPU();
  const std::optional<double> peak = measured_bf16_peak(0);
  ASSERT_TRUE(peak.has_value());
  EXPECT_GT(*peak, 0.0);
  EXPECT_LT(*peak, 2500.0);
  EXPECT_EQ(measured_bf16_peak(0), peak);
}

}  // namespace
}  // namespace meshproof::harness
