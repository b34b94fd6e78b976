// `bench recipes`: shape parsing, the record built from measurements (ceilings, ratios, peak
// sources, MFU, the "measured" check) and one real tiny CPU measurement of every recipe.
#include "engine/bench_recipes.h"

#include <gtest/gtest.h>

#include <cmath>

#include "harness/bench_recipes_verb.h"
#include "kernels/error.h"
#include "reports/perf_metrics.h"

namespace meshproof::harness {
namespace {

using engine::GemmShape;
using engine::RecipeKind;
using kernels::GemmRole;

bool is_input_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const kernels::Error& e) {
    return e.kind() == kernels::ErrorKind::kInput;
  }
  return false;
}

TEST(BenchRecipes, ParsesShapes) {
  const auto s = engine::parse_gemm_shapes("256x512x128,32x32x32");
  ASSERT_EQ(s.size(), 2u);
  EXPECT_EQ(s[0].m, 256);
  EXPECT_EQ(s[0].n, 512);
  EXPECT_EQ(s[0].k, 128);
  EXPECT_EQ(s[1].str(), "32x32x32");
  for (const char* bad : {"", "256x256", "256x256x256x32", "100x32x32", "32x-32x32", "32xx32",
                          "32x32x32,", "a x32x32", "0x32x32"}) {
    EXPECT_TRUE(is_input_error([&] { engine::parse_gemm_shapes(bad); })) << bad;
  }
}

TEST(BenchRecipes, ParsesLayer) {
  const engine::LayerShape l = engine::parse_layer_shape("128,512,4,64,2");
  EXPECT_EQ(l.hidden, 128);
  EXPECT_EQ(l.ffn, 512);
  EXPECT_EQ(l.heads, 4);
  EXPECT_EQ(l.seq, 64);
  EXPECT_EQ(l.batch, 2);
  for (const char* bad : {"128,512,3,64,2", "128,512,4,64", "100,512,4,64,2", "128,500,4,64,2",
                          "128,512,4,15,1", "128,512,4,64,2,1", ""}) {
    EXPECT_TRUE(is_input_error([&] { engine::parse_layer_shape(bad); })) << bad;
  }
}

// A synthetic measurement with round numbers, so that every derived figure is known exactly.
engine::RecipeBenchReport synthetic(const engine::RecipeBenchOptions& o) {
  engine::RecipeBenchReport rep;
  rep.device_name = "NVIDIA H100 80GB HBM3";
  rep.copy = {1e-3, 2e9, 0, 0.8e-3, 1.25e-3};  // 2000 GB/s, 1600..2500 over the iterations
  const GemmShape s = o.shapes[0];
  const double flops = 2.0 * s.m * s.n * s.k;
  rep.bf16_gemms.push_back({GemmRole::kFprop, s, {flops / 500e12, 0, flops}});  // 500 TFLOP/s
  engine::RecipeBenchResult r;
  r.recipe = RecipeKind::kCurrent;
  r.gemm_dtype = "fp8";
  r.quantize.push_back({"activation", s, s.m, s.k, {1e-3, 1e9, 0}});      // 1000 GB/s
  r.gemms.push_back({GemmRole::kWgrad, s, {flops / 1000e12, 0, flops}});  // 1000 TFLOP/s
  r.layer = engine::LayerFigure{{2e-3, 0, 0}, 512, 32};
  rep.recipes.push_back(r);
  return rep;
}

const reports::BenchmarkFigure& find(const reports::ScenarioRecord& s, const std::string& name,
                                     const std::string& metric) {
  for (const auto& b : s.benchmarks) {
    if (b.name == name && b.metric == metric) return b;
  }
  throw std::runtime_error("no figure " + name + " " + metric);
}

TEST(BenchRecipes, RecordUsesTablePeakForKnownGpus) {
  engine::RecipeBenchOptions o;
  o.device = kernels::Device::cuda(0);  // only names the copy figure; nothing runs
  o.shapes = {{256, 512, 128}};
  o.layer = {256, 1024, 4, 128, 4};
  const reports::RunRecord run =
      bench_recipes_record(synthetic(o), o, "cuda:0", "NVIDIA H100 80GB HBM3");
  ASSERT_EQ(run.scenarios.size(), 2u);
  const auto& ceil = run.scenarios[0];
  EXPECT_EQ(ceil.name, "recipes.ceilings");
  EXPECT_DOUBLE_EQ(find(ceil, "copy cudaMemcpy d2d", "gbps").value, 2000);
  // The range from the slowest (1.25 ms) and fastest (0.8 ms) iteration; unmeasured figures
  // (min/max seconds 0) have none.
  EXPECT_DOUBLE_EQ(*find(ceil, "copy cudaMemcpy d2d", "gbps").min, 1600);
  EXPECT_DOUBLE_EQ(*find(ceil, "copy cudaMemcpy d2d", "gbps").max, 2500);
  const auto& bf16 = find(ceil, "bf16 gemm fprop 256x512x128", "tflops");
  // Not exact: the synthetic time flops/500e12 and the figure flops/t/1e12 round three times
  // (at most ~3 ulp); measured (the same double operations in Python) 500 - 5.7e-14, 0.5 ulp.
  // EXPECT_DOUBLE_EQ allows 4 ulp (4.5e-13 at 500).
  EXPECT_DOUBLE_EQ(bf16.value, 500);
  ASSERT_TRUE(bf16.ceiling);
  EXPECT_EQ(*bf16.ceiling, 989);  // H100 dense bf16 (docs/design.md section 9): a table constant
  // value / 989 with the value 0.5 ulp off 500: measured 1.1e-16 (1 ulp) from 500.0 / 989.
  EXPECT_DOUBLE_EQ(*bf16.ratio, 500.0 / 989);

  const auto& s = run.scenarios[1];
  EXPECT_EQ(s.name, "recipes.current");
  const auto& q = find(s, "quantize activation 256x128", "gbps");
  EXPECT_DOUBLE_EQ(q.value, 1000);
  EXPECT_DOUBLE_EQ(*q.ceiling, 2000);
  EXPECT_DOUBLE_EQ(*q.ratio, 0.5);
  EXPECT_EQ(q.ceiling_source, "measured:copy");
  const auto& g = find(s, "gemm wgrad 256x512x128", "tflops");
  // Three roundings as for the bf16 figure: measured 1000 - 1.1e-13 (0.5 ulp).
  EXPECT_DOUBLE_EQ(g.value, 1000);
  EXPECT_EQ(*g.ceiling, 1979);  // H100 dense fp8, a table constant
  EXPECT_EQ(g.ceiling_source, "table:H100 fp8");
  const auto& t = find(s, "layer step", "step_time_ms");
  EXPECT_DOUBLE_EQ(t.value, 2);
  EXPECT_FALSE(t.higher_is_better);
  ASSERT_TRUE(s.performance);
  const double flops = reports::model_flops_per_step({1, 256, 1024, 32, 128, false}, 512);
  EXPECT_DOUBLE_EQ(s.performance->model_flops_per_step, flops);
  // The MFU is flops / 2e-3 / 1 device / 1e12 / 1979: the same divisions as the expected
  // expression (the one by 1 is exact); measured difference 0. EXPECT_DOUBLE_EQ (4 ulp) rather
  // than ==, so a compiler reordering the divisions does not fail the test.
  EXPECT_DOUBLE_EQ(*s.performance->mfu, flops / 2e-3 / 1e12 / 1979);
  // The layer step's tflops ratio is the MFU by construction (same value over the same peak).
  EXPECT_DOUBLE_EQ(find(s, "layer step", "tflops").ratio.value(), *s.performance->mfu);
  EXPECT_EQ(reports::scenario_verdict(s), reports::Verdict::kPass);
  EXPECT_NO_THROW(reports::to_json(run));
}

TEST(BenchRecipes, RecordCalibratesUnknownDevicesWithTheMeasuredBf16Gemm) {
  engine::RecipeBenchOptions o;
  o.shapes = {{256, 512, 128}};
  o.layer = {256, 1024, 4, 128, 4};
  engine::RecipeBenchReport rep = synthetic(o);
  rep.recipes[0].gemm_dtype = "fp32";
  const reports::RunRecord run = bench_recipes_record(rep, o, "cpu", "");
  const auto& g = find(run.scenarios[1], "gemm wgrad 256x512x128", "tflops");
  // The ceiling is the measured bf16 figure (500 - 5.7e-14, see above); the ratio of two
  // figures with the same rounding pattern came out exactly 2 (measured), within 4 ulp anyway.
  EXPECT_DOUBLE_EQ(*g.ceiling, 500);
  EXPECT_DOUBLE_EQ(*g.ratio, 2.0);
  EXPECT_EQ(g.ceiling_source, "calibration:measured bf16 gemm");
  EXPECT_FALSE(find(run.scenarios[0], "bf16 gemm fprop 256x512x128", "tflops").ceiling);
}

TEST(BenchRecipes, MeasuredCheckFailsOnAZeroFigure) {
  engine::RecipeBenchOptions o;
  o.shapes = {{256, 512, 128}};
  engine::RecipeBenchReport rep = synthetic(o);
  rep.recipes[0].quantize[0].m.bytes = 0;  // a quantizer that moved nothing
  const reports::RunRecord run = bench_recipes_record(rep, o, "cpu", "");
  EXPECT_EQ(reports::scenario_verdict(run.scenarios[1]), reports::Verdict::kFail);
  EXPECT_EQ(reports::run_verdict(run), reports::Verdict::kFail);
}

// One real measurement of every recipe on a tiny problem: every figure is there and positive.
TEST(BenchRecipes, MeasuresEveryRecipeOnTheCpu) {
  engine::RecipeBenchOptions o;
  o.shapes = {{32, 64, 96}};
  o.layer = {32, 64, 2, 16, 2};
  o.iters = 2;
  o.warmup = 1;
  const engine::RecipeBenchReport rep = engine::run_recipe_bench(o);
  EXPECT_EQ(rep.device_name, "cpu");
  EXPECT_GT(rep.copy.seconds, 0);
  ASSERT_EQ(rep.bf16_gemms.size(), 1u);
  ASSERT_EQ(rep.recipes.size(), 7u);  // fp32, bf16, delayed, current, mxfp8, block, nvfp4
  for (const auto& r : rep.recipes) {
    SCOPED_TRACE(std::string(engine::recipe_name(r.recipe)));
    EXPECT_EQ(r.gemm_dtype, "fp32");  // the CPU backend multiplies in fp32
    EXPECT_EQ(r.quantize.size(), r.recipe == RecipeKind::kFp32 ? 0u : 2u);
    for (const auto& q : r.quantize) {
      EXPECT_GT(q.m.seconds, 0);
      // At least the input read once plus one byte per element written.
      EXPECT_GE(q.m.bytes, q.rows * q.cols * 3.0);
    }
    ASSERT_EQ(r.gemms.size(), 3u);
    for (const auto& g : r.gemms) {
      EXPECT_GT(g.m.seconds, 0);
      EXPECT_DOUBLE_EQ(g.m.flops, 2.0 * 32 * 64 * 96);
    }
    ASSERT_TRUE(r.layer);
    EXPECT_GT(r.layer->m.seconds, 0);
    EXPECT_EQ(r.layer->tokens, 32);
  }
}

}  // namespace
}  // namespace meshproof::harness
