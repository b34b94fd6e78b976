// `bench recipes`: parsing, the GEMM shapes derived from a model (every role's M, N, K), the
// speedup arithmetic, the emulation labels, the record built from measurements (ceilings, peak
// sources, MFU only on a GPU, labels in every writer) and one real tiny CPU measurement.
#include "engine/bench/bench_recipes.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <nlohmann/json.hpp>

#include "harness/verbs/bench_recipes_verb.h"
#include "kernels/core/error.h"
#include "reports/record/perf_metrics.h"
#include "reports/writers/report_writers.h"

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

TEST(BenchRecipes, ParsesModel) {
  const engine::BenchModel m = engine::parse_bench_model("128,512,4,4,64,2");
  EXPECT_EQ(m.hidden, 128);
  EXPECT_EQ(m.ffn, 512);
  EXPECT_EQ(m.heads, 4);
  EXPECT_EQ(m.kv_heads, 4);
  EXPECT_EQ(m.seq, 64);
  EXPECT_EQ(m.micro_batch, 2);
  EXPECT_EQ(m.tokens(), 128);
  for (const char* bad : {"128,512,3,3,64,2", "128,512,4,3,64,2", "128,512,4,4,64",
                          "100,512,4,4,64,2", "128,500,4,4,64,2", "128,512,4,4,15,1",
                          "128,512,4,4,64,2,1", "", "llama3_debug", "gpt_small"}) {
    EXPECT_TRUE(is_input_error([&] { engine::parse_bench_model(bad); })) << bad;
  }
  // Grouped-query attention: 2 KV heads of 4 make qkv (4 + 2*2) * 32 = 256 rows wide.
  const engine::BenchModel gqa = engine::parse_bench_model("128,512,4,2,64,2");
  EXPECT_EQ(gqa.kv_heads, 2);
  const std::vector<engine::LinearGemm> gemms = engine::model_gemms(gqa, gqa.tokens());
  ASSERT_FALSE(gemms.empty());
  EXPECT_EQ(gemms.front().linear, "qkv");
  EXPECT_EQ(gemms.front().shape.n, 256);
  EXPECT_EQ(gemms.front().shape.k, 128);
  for (const char* bad : {"16,a", "15", "0", "16,,32"}) {
    EXPECT_TRUE(is_input_error([&] { engine::parse_m_sweep(bad); })) << bad;
  }
  EXPECT_EQ(engine::parse_m_sweep("16,64,16384"), (std::vector<int64_t>{16, 64, 16384}));
}

TEST(BenchRecipes, ResolvesModelPresets) {
  // llama3_debug (docs/design.md section 24: torchtitan's debug model): H 256, F 768, 16 heads,
  // 4 KV heads, SwiGLU, RMSNorm, RoPE theta 500000, no biases; the bench's seq 128 x 4.
  const engine::BenchModel l = harness::resolve_bench_model("llama3_debug", "");
  EXPECT_EQ(l.hidden, 256);
  EXPECT_EQ(l.ffn, 768);
  EXPECT_EQ(l.heads, 16);
  EXPECT_EQ(l.kv_heads, 4);
  EXPECT_EQ(l.seq, 128);
  EXPECT_EQ(l.micro_batch, 4);
  EXPECT_EQ(l.activation, engine::Activation::kSwiGlu);
  EXPECT_EQ(l.norm, engine::NormKind::kRmsNorm);
  EXPECT_EQ(l.position, engine::PositionKind::kRope);
  EXPECT_EQ(l.rope_theta, 500000.0);
  EXPECT_FALSE(l.bias);
  // The layer step trains the preset's architecture, not the GPT-2-like default.
  const engine::ModelConfig mc = l.model_config(1);
  EXPECT_EQ(mc.norm, engine::NormKind::kRmsNorm);
  EXPECT_EQ(mc.position, engine::PositionKind::kRope);
  EXPECT_FALSE(mc.bias);
  EXPECT_EQ(engine::kv_heads_of(mc), 4);
  // qkv is (16 + 2 * 4) * 16 = 384 rows wide; SwiGLU splits fc1 into gate and up.
  const std::vector<engine::LinearGemm> gemms = engine::model_gemms(l, l.tokens());
  ASSERT_FALSE(gemms.empty());
  EXPECT_EQ(gemms.front().shape, (engine::GemmShape{512, 384, 256}));
  EXPECT_TRUE(std::any_of(gemms.begin(), gemms.end(),
                          [](const engine::LinearGemm& g) { return g.linear == "fc1_gate"; }));
  // --activation may repeat the preset's, not contradict it.
  EXPECT_EQ(harness::resolve_bench_model("llama3_debug", "swiglu").activation,
            engine::Activation::kSwiGlu);
  EXPECT_TRUE(is_input_error([] { harness::resolve_bench_model("llama3_debug", "gelu"); }));
  // gpt_small: the key table's GPT-2-like defaults (GELU, LayerNorm, learned positions, biases).
  const engine::BenchModel g = harness::resolve_bench_model("gpt_small", "");
  EXPECT_EQ(g.activation, engine::Activation::kGelu);
  EXPECT_EQ(g.norm, engine::NormKind::kLayerNorm);
  EXPECT_EQ(g.position, engine::PositionKind::kLearned);
  EXPECT_TRUE(g.bias);
  EXPECT_EQ(g.kv_heads, g.heads);
  // The explicit form keeps working through the same entry point; unknown names are refused.
  EXPECT_EQ(harness::resolve_bench_model("128,512,4,2,64,2", "relu").activation,
            engine::Activation::kRelu);
  for (const char* bad : {"llama3", "no_such_preset", "Llama3_debug"}) {
    EXPECT_TRUE(is_input_error([&] { harness::resolve_bench_model(bad, ""); })) << bad;
  }
}

struct ExpectedGemm {
  const char* linear;
  GemmRole role;
  int64_t m, n, k;  // the role's own output rows, output columns, reduction length
};

void expect_gemms(const std::vector<engine::LinearGemm>& got,
                  const std::vector<ExpectedGemm>& want) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE(i);
    EXPECT_EQ(got[i].linear, want[i].linear);
    EXPECT_EQ(got[i].role, want[i].role);
    const GemmShape d = engine::gemm_dims(got[i]);
    EXPECT_EQ(d, (GemmShape{want[i].m, want[i].n, want[i].k})) << d.str();
    // The kernels' convention: fprop's (tokens, out, in) for every role; same FLOPs.
    EXPECT_EQ(d.m * d.n * d.k, got[i].shape.m * got[i].shape.n * got[i].shape.k);
  }
}

// H=256, F=1024, 4 heads, S=128, micro-batch 4: T = 512 tokens.
TEST(BenchRecipes, DerivesEveryGemmOfTheModel) {
  const engine::BenchModel m = engine::parse_bench_model("256,1024,4,4,128,4");
  using enum GemmRole;
  expect_gemms(engine::model_gemms(m, m.tokens()), {{"qkv", kFprop, 512, 768, 256},
                                                    {"qkv", kDgrad, 512, 256, 768},
                                                    {"qkv", kWgrad, 768, 256, 512},
                                                    {"proj", kFprop, 512, 256, 256},
                                                    {"proj", kDgrad, 512, 256, 256},
                                                    {"proj", kWgrad, 256, 256, 512},
                                                    {"fc1", kFprop, 512, 1024, 256},
                                                    {"fc1", kDgrad, 512, 256, 1024},
                                                    {"fc1", kWgrad, 1024, 256, 512},
                                                    {"fc2", kFprop, 512, 256, 1024},
                                                    {"fc2", kDgrad, 512, 1024, 256},
                                                    {"fc2", kWgrad, 256, 1024, 512}});
  // SwiGLU: fc1 is the engine's two GEMMs fc1_gate and fc1_up, each N = F (together 2F).
  const engine::BenchModel g =
      engine::parse_bench_model("256,1024,4,4,128,4", engine::Activation::kSwiGlu);
  const std::vector<engine::LinearGemm> gg = engine::model_gemms(g, g.tokens());
  ASSERT_EQ(gg.size(), 15u);
  expect_gemms({gg.begin() + 6, gg.begin() + 12}, {{"fc1_gate", kFprop, 512, 1024, 256},
                                                   {"fc1_gate", kDgrad, 512, 256, 1024},
                                                   {"fc1_gate", kWgrad, 1024, 256, 512},
                                                   {"fc1_up", kFprop, 512, 1024, 256},
                                                   {"fc1_up", kDgrad, 512, 256, 1024},
                                                   {"fc1_up", kWgrad, 1024, 256, 512}});
  // The M sweep: M tokens at the model's N, K.
  const std::vector<engine::LinearGemm> small = engine::model_gemms(m, 16);
  EXPECT_EQ(engine::gemm_dims(small[0]), (GemmShape{16, 768, 256}));
  EXPECT_EQ(engine::gemm_dims(small[11]), (GemmShape{256, 1024, 16}));
}

// The bench inputs: unit variance and mean 0 within sampling error, bounded, deterministic per
// seed, distinct across seeds. Bounds for 2^20 samples: the sample mean's standard error is
// 2^-10 ~ 1e-3 (5 sigma: 5e-3); the sample variance's is sqrt((mu4 - 1) / n) with the Irwin-Hall
// (n=4) fourth moment mu4 = 2.7, ~1.3e-3 (5 sigma: 6.4e-3, rounded up to 7e-3); a scale off by
// one bit of the four-uniform sum's range (variance x4) or an uncentred sum fails.
TEST(BenchRecipes, BenchValuesAreUnitVarianceBoundedAndPerSeed) {
  const int64_t n = int64_t{1} << 20;
  const std::vector<float> a = engine::bench_values(n, 5);
  ASSERT_EQ(a.size(), static_cast<size_t>(n));
  double sum = 0, sq = 0;
  float lo = 0, hi = 0;
  for (float x : a) {
    sum += x;
    sq += static_cast<double>(x) * x;
    lo = std::min(lo, x);
    hi = std::max(hi, x);
  }
  const double mean = sum / static_cast<double>(n);
  EXPECT_NEAR(mean, 0.0, 5e-3);
  EXPECT_NEAR(sq / static_cast<double>(n) - mean * mean, 1.0, 7e-3);
  EXPECT_GE(lo, -2 * std::sqrt(3.0f));
  EXPECT_LE(hi, 2 * std::sqrt(3.0f));
  EXPECT_LT(lo, -3.0f);  // the tails are reached: a bell, not a narrow band
  EXPECT_GT(hi, 3.0f);
  EXPECT_EQ(engine::bench_values(1000, 5), std::vector<float>(a.begin(), a.begin() + 1000));
  const std::vector<float> b = engine::bench_values(1000, 6);
  EXPECT_NE(b, std::vector<float>(a.begin(), a.begin() + 1000));
}

TEST(BenchRecipes, SpeedupArithmetic) {
  // bf16 2 ms, GEMM 0.5 ms, quantization 0.5 ms: autocast 2 / 1 = 2, pre-quantized 2 / 0.5 = 4.
  const engine::Speedup s = engine::gemm_speedup(2e-3, 0.5e-3, 0.5e-3);
  EXPECT_DOUBLE_EQ(s.autocast, 2.0);
  EXPECT_DOUBLE_EQ(s.prequantized, 4.0);
  // No quantization (bf16, fp32): both speedups are the same ratio.
  const engine::Speedup u = engine::gemm_speedup(1.0, 4.0, 0.0);
  EXPECT_DOUBLE_EQ(u.autocast, 0.25);
  EXPECT_DOUBLE_EQ(u.prequantized, 0.25);
  for (const auto& [b, g, q] :
       {std::tuple{0.0, 1.0, 0.0}, std::tuple{1.0, 0.0, 0.0}, std::tuple{1.0, 1.0, -1.0}}) {
    // Captured by copy: clang (the sanitizer build) does not capture structured bindings.
    EXPECT_TRUE(is_input_error([b = b, g = g, q = q] { engine::gemm_speedup(b, g, q); }));
  }
  // A role's quantization time is the sum of its quantizations' medians.
  engine::RoleFigure r;
  r.bf16.seconds = 3;
  r.time.seconds = 1;
  r.quantize.resize(2);
  r.quantize[0].m.seconds = 0.25;
  r.quantize[1].m.seconds = 0.75;
  EXPECT_DOUBLE_EQ(r.quantize_seconds(), 1.0);
  EXPECT_DOUBLE_EQ(r.speedup().autocast, 1.5);
  EXPECT_DOUBLE_EQ(r.speedup().prequantized, 3.0);
}

TEST(BenchRecipes, LabelsEmulatedRecipes) {
  using enum RecipeKind;
  for (RecipeKind r : engine::RecipeBenchOptions::all_bench_recipes()) {
    EXPECT_EQ(engine::recipe_emulation(r, 0), "CPU emulation");  // every CPU figure
    EXPECT_EQ(engine::recipe_gemm_dtype(r, 0), "fp32");
  }
  EXPECT_EQ(engine::recipe_emulation(kMxfp8, 90), "MXFP8 as bf16 GEMMs below sm_100");
  EXPECT_EQ(engine::recipe_gemm_dtype(kMxfp8, 90), "bf16");
  EXPECT_EQ(engine::recipe_emulation(kMxfp8, 100), "");
  EXPECT_EQ(engine::recipe_gemm_dtype(kMxfp8, 100), "fp8");
  EXPECT_EQ(engine::recipe_emulation(kCurrent, 90), "");
  EXPECT_EQ(engine::recipe_emulation(kDelayed, 80), "per-tensor FP8 as fp32 GEMMs below sm_89");
  EXPECT_EQ(engine::recipe_emulation(kBlock, 100), "block scaling as dequantized fp32 GEMMs");
  // Block scaling is native on sm_90 with cuBLASLt >= 12.9 (every role is 1x128 x 128x128 or
  // 1x128 x 1x128), NVFP4 on cc 10.x with cuBLASLt >= 12.8: the labels follow the GEMM's own
  // path decision (kernels::lt::choose_gemm_path), the library version included.
  EXPECT_EQ(engine::recipe_emulation(kBlock, 90, 120900), "");
  EXPECT_EQ(engine::recipe_gemm_dtype(kBlock, 90, 120900), "fp8");
  EXPECT_EQ(engine::recipe_emulation(kBlock, 90, 120800),
            "block scaling as dequantized fp32 GEMMs (cuBLASLt 120800 < 12.9)");
  EXPECT_EQ(engine::recipe_gemm_dtype(kBlock, 90, 120800), "fp32");
  EXPECT_EQ(engine::recipe_emulation(kNvfp4, 100, 120800), "");
  EXPECT_EQ(engine::recipe_gemm_dtype(kNvfp4, 100, 120800), "fp4");
  EXPECT_EQ(engine::recipe_emulation(kNvfp4, 90, 130100), "NVFP4 as dequantized fp32 GEMMs");
  EXPECT_EQ(engine::recipe_emulation(kMxfp8, 120, 130100), "MXFP8 as bf16 GEMMs outside sm_10x");
  EXPECT_EQ(engine::recipe_emulation(kDelayed, 90, 0), "");  // per-tensor needs no new mode
  // At measured shapes: a linear with K = 64 (fprop's reduction) is not native for block scaling.
  EXPECT_EQ(engine::recipe_emulation(kBlock, 90, 120900, {{256, 128, 384}}), "");
  EXPECT_EQ(engine::recipe_emulation(kBlock, 90, 120900, {{256, 128, 384}, {256, 128, 64}}),
            "block scaling as dequantized fp32 GEMMs ([R, S, K] = [256, 128, 64]: native needs R, "
            "S multiples of 16 and K of 128)");
  EXPECT_EQ(engine::recipe_emulation(kBlock, 0, 120900, {{256, 128, 384}}), "CPU emulation");
  EXPECT_EQ(engine::recipe_emulation(kBf16, 90), "");
  EXPECT_EQ(engine::recipe_emulation(kFp32, 90), "");
  EXPECT_EQ(engine::recipe_m_multiple(kMxfp8), 32);
  EXPECT_EQ(engine::recipe_m_multiple(kCurrent), 16);
}

engine::Measurement timed(double seconds, double flops = 0) {
  engine::Measurement m;
  m.seconds = seconds;
  m.flops = flops;
  m.min_seconds = 0.5 * seconds;
  m.max_seconds = 2 * seconds;
  m.samples = {seconds, 0.5 * seconds, 2 * seconds};
  return m;
}

// A synthetic measurement with round numbers, so that every derived figure is known exactly.
engine::RecipeBenchReport synthetic(const engine::RecipeBenchOptions& o, int cc) {
  engine::RecipeBenchReport rep;
  rep.device_name = cc ? "NVIDIA H100 80GB HBM3" : "cpu";
  rep.compute_capability = cc;
  rep.copy = {1e-3, 2e9, 0, 0.8e-3, 1.25e-3, {}};  // 2000 GB/s, 1600..2500 over the repetitions
  const engine::LinearGemm g{"qkv", GemmRole::kFprop, {512, 768, 256}};
  const double flops = 2.0 * 512 * 768 * 256;
  for (RecipeKind k : {RecipeKind::kBf16, RecipeKind::kMxfp8}) {
    engine::RecipeBenchResult r;
    r.recipe = k;
    r.gemm_dtype = engine::recipe_gemm_dtype(k, cc);
    r.emulation = engine::recipe_emulation(k, cc);
    engine::RoleFigure f;
    f.gemm = g;
    f.bf16 = timed(2e-3, flops);
    f.time = k == RecipeKind::kBf16 ? f.bf16 : timed(1e-3, flops);
    if (k == RecipeKind::kMxfp8) {
      f.quantize.push_back({"x", false, 512, 256, timed(0.25e-3)});
      f.quantize.push_back({"w", false, 768, 256, timed(0.75e-3)});
      f.quantize[0].m.bytes = 1e6;
      f.quantize[1].m.bytes = 1e6;
    }
    r.roles.push_back(f);
    r.layer = engine::LayerFigure{timed(k == RecipeKind::kBf16 ? 4e-3 : 2e-3), 512, 32, 1 << 20};
    rep.recipes.push_back(r);
  }
  return rep;
}

const reports::BenchmarkFigure& find(const reports::ScenarioRecord& s, const std::string& name,
                                     const std::string& metric) {
  for (const auto& b : s.benchmarks) {
    if (b.name == name && b.metric == metric) return b;
  }
  throw std::runtime_error("no figure " + name + " " + metric);
}

TEST(BenchRecipes, RecordOnAKnownGpu) {
  engine::RecipeBenchOptions o;
  o.device = kernels::Device::cuda(0);  // only names the copy figure; nothing runs
  const reports::RunRecord run =
      bench_recipes_record(synthetic(o, 90), o, "cuda:0", "NVIDIA H100 80GB HBM3");
  ASSERT_EQ(run.scenarios.size(), 3u);
  const auto& ceil = run.scenarios[0];
  EXPECT_EQ(ceil.name, "recipes.ceilings");
  EXPECT_DOUBLE_EQ(find(ceil, "copy cudaMemcpy d2d", "gbps").value, 2000);
  EXPECT_DOUBLE_EQ(*find(ceil, "copy cudaMemcpy d2d", "gbps").min, 1600);
  EXPECT_DOUBLE_EQ(*find(ceil, "copy cudaMemcpy d2d", "gbps").max, 2500);
  EXPECT_EQ(find(ceil, "copy cudaMemcpy d2d", "gbps").emulated, "");  // native on a GPU
  EXPECT_EQ(*find(ceil, "bf16 gemm qkv fprop 512x768x256", "tflops").ceiling, 989);

  const auto& mx = run.scenarios[2];
  EXPECT_EQ(mx.name, "recipes.mxfp8");
  const std::string n = "qkv fprop 512x768x256";
  EXPECT_DOUBLE_EQ(find(mx, n, "bf16_ms").value, 2);
  EXPECT_DOUBLE_EQ(find(mx, n, "gemm_ms").value, 1);
  EXPECT_DOUBLE_EQ(find(mx, n, "quantize_ms").value, 1);
  // 2 / (1 + 1) and 2 / 1; per repetition: 2/(1+1), 1/(0.5+0.5), 4/(2+2) = 1 each.
  const auto& ac = find(mx, n, "speedup_autocast");
  EXPECT_DOUBLE_EQ(ac.value, 1.0);
  EXPECT_EQ(ac.samples, (std::vector<double>{1.0, 1.0, 1.0}));
  EXPECT_DOUBLE_EQ(find(mx, n, "speedup_prequantized").value, 2.0);
  // MXFP8 on sm_90 is an emulation: its figures say so, the bf16 baseline beside them does not.
  EXPECT_EQ(find(mx, n, "gemm_ms").emulated, "MXFP8 as bf16 GEMMs below sm_100");
  EXPECT_EQ(find(mx, n, "speedup_autocast").emulated, "MXFP8 as bf16 GEMMs below sm_100");
  EXPECT_EQ(find(mx, n, "bf16_ms").emulated, "");
  // Its GEMMs run in bf16 there: the bf16 peak of the table.
  EXPECT_EQ(*find(mx, n, "gemm_tflops").ceiling, 989);
  EXPECT_EQ(find(mx, n, "gemm_tflops").ceiling_source, "table:H100 bf16");
  ASSERT_TRUE(mx.performance && mx.performance->mfu);
  EXPECT_DOUBLE_EQ(find(mx, "layer step", "speedup_vs_bf16").value, 2.0);
  EXPECT_DOUBLE_EQ(find(mx, "layer step", "peak_memory_mib").value, 1.0);
  const auto& bf = run.scenarios[1];
  EXPECT_EQ(find(bf, n, "gemm_ms").emulated, "");  // bf16 on a GPU is native
  EXPECT_DOUBLE_EQ(find(bf, n, "speedup_autocast").value, 1.0);

  // The labels reach every writer.
  const std::string json = reports::render_json(run);
  EXPECT_NE(json.find("\"emulated\": \"MXFP8 as bf16 GEMMs below sm_100\""), std::string::npos);
  EXPECT_NE(json.find("\"samples\""), std::string::npos);
  EXPECT_NE(reports::render_markdown(run).find(
                "qkv fprop 512x768x256 (emulated: MXFP8 as bf16 GEMMs below sm_100)"),
            std::string::npos);
  EXPECT_NE(reports::render_html(run).find(
                "qkv fprop 512x768x256 (emulated: MXFP8 as bf16 GEMMs below sm_100)"),
            std::string::npos);
  EXPECT_NE(reports::render_junit(run).find(
                "<property name=\"emulated\" value=\"MXFP8 as bf16 GEMMs below sm_100\"/>"),
            std::string::npos);
  EXPECT_EQ(reports::run_verdict(run), reports::Verdict::kPass);
}

TEST(BenchRecipes, RecordOnTheCpuHasNoMfuAndIsLabelledEmulated) {
  engine::RecipeBenchOptions o;
  const reports::RunRecord run = bench_recipes_record(synthetic(o, 0), o, "cpu", "");
  for (const auto& s : run.scenarios) {
    SCOPED_TRACE(s.name);
    for (const auto& b : s.benchmarks) {
      EXPECT_EQ(b.emulated, "CPU emulation") << b.name << " " << b.metric;
      EXPECT_FALSE(b.ceiling && b.ceiling_source.rfind("table", 0) == 0);
      EXPECT_NE(b.ceiling_source.rfind("calibration", 0), 0u);
    }
    if (s.performance) {
      EXPECT_FALSE(s.performance->mfu);
      EXPECT_FALSE(s.performance->peak_tflops);
    }
  }
  EXPECT_NE(
      reports::render_junit(run).find("<property name=\"emulated\" value=\"CPU emulation\"/>"),
      std::string::npos);
}

TEST(BenchRecipes, MeasuredCheckFailsOnAZeroFigure) {
  engine::RecipeBenchOptions o;
  engine::RecipeBenchReport rep = synthetic(o, 0);
  rep.recipes[1].roles[0].quantize[0].m.bytes = 0;  // a quantizer that moved nothing
  const reports::RunRecord run = bench_recipes_record(rep, o, "cpu", "");
  EXPECT_EQ(reports::scenario_verdict(run.scenarios[2]), reports::Verdict::kFail);
  EXPECT_EQ(reports::run_verdict(run), reports::Verdict::kFail);
}

// One real measurement of every recipe on a tiny model: every figure is there and positive.
TEST(BenchRecipes, MeasuresEveryRecipeOnTheCpu) {
  engine::RecipeBenchOptions o;
  o.model = engine::parse_bench_model("32,64,2,2,16,2");
  o.m_sweep = {16, 32};
  o.iters = 2;
  o.warmup = 1;
  o.steps = 2;
  const engine::RecipeBenchReport rep = engine::run_recipe_bench(o);
  EXPECT_EQ(rep.device_name, "cpu");
  EXPECT_GT(rep.copy.seconds, 0);
  ASSERT_TRUE(rep.bf16_curve && rep.fp32_curve);
  EXPECT_EQ(rep.bf16_curve->loss.size(), 2u);
  ASSERT_EQ(rep.recipes.size(), std::size(engine::kRecipeNames));
  for (const auto& r : rep.recipes) {
    SCOPED_TRACE(std::string(engine::recipe_name(r.recipe)));
    EXPECT_EQ(r.gemm_dtype, "fp32");  // the CPU backend multiplies in fp32
    EXPECT_EQ(r.emulation, "CPU emulation");
    ASSERT_EQ(r.roles.size(), 12u);  // 4 linears x 3 roles
    for (const auto& g : r.roles) {
      EXPECT_GT(g.time.seconds, 0);
      EXPECT_GT(g.bf16.seconds, 0);
      EXPECT_EQ(g.time.samples.size(), 2u);
      EXPECT_EQ(g.quantize.size(), engine::is_fp8(r.recipe) ? 2u : 0u);
      for (const auto& q : g.quantize) EXPECT_GT(q.m.seconds, 0);
    }
    // 4 linears x 2 Ms, except where the recipe cannot take M = 16 (MXFP8 blocks of 32).
    EXPECT_EQ(r.sweep.size(), r.recipe == RecipeKind::kMxfp8 ? 4u : 8u);
    // The grouped expert GEMM: fc1 (64 x 32) as 4 experts over the 32 tokens split 16/12/0/4,
    // one figure per role with the routed rows as M; quantized per expert (2 operand copies per
    // role as the dense GEMMs); the bf16 recipe's times are the baselines.
    EXPECT_EQ(r.split.rows, (std::vector<int64_t>{16, 12, 0, 4}));
    ASSERT_EQ(r.grouped.size(), 3u);
    for (size_t i = 0; i < r.grouped.size(); ++i) {
      const engine::RoleFigure& g = r.grouped[i];
      EXPECT_EQ(g.gemm.linear, "experts fc1 rows 16/12/0/4");
      EXPECT_EQ(g.gemm.role, (std::array{GemmRole::kFprop, GemmRole::kDgrad, GemmRole::kWgrad})[i]);
      EXPECT_EQ(g.gemm.shape, (GemmShape{32, 64, 32}));
      EXPECT_GT(g.time.seconds, 0);
      EXPECT_GT(g.bf16.seconds, 0);
      EXPECT_EQ(g.time.samples.size(), 2u);
      EXPECT_DOUBLE_EQ(g.time.flops, 2.0 * 32 * 64 * 32);  // routed rows only, not the padding
      EXPECT_EQ(g.quantize.size(), engine::is_fp8(r.recipe) ? 2u : 0u);
      for (const auto& q : g.quantize) {
        EXPECT_GT(q.m.seconds, 0);
        EXPECT_GT(q.m.bytes, 0);
        // x / dy: every expert's padded block; w: the 4 experts' [64, 32] weights.
        EXPECT_EQ(q.rows, q.operand == std::string("w") ? 4 * 64 : r.split.padded_rows());
      }
      if (r.recipe == RecipeKind::kBf16) {
        EXPECT_EQ(g.time.samples, g.bf16.samples);
      }
    }
    ASSERT_TRUE(r.layer);
    EXPECT_GT(r.layer->m.seconds, 0);
    EXPECT_EQ(r.layer->tokens, 32);
    EXPECT_GT(r.layer->peak_bytes, 0);
    ASSERT_TRUE(r.convergence);
    EXPECT_EQ(r.convergence->loss.size(), 2u);
  }
  // Same init and data: the fp32 recipe's curve is the fp32 reference's.
  EXPECT_EQ(rep.recipes[0].convergence->loss, rep.fp32_curve->loss);
  // The record keeps the loss curves and the HTML plots them beside the speedups and the sweep.
  const reports::RunRecord run = bench_recipes_record(rep, o, "cpu", "");
  const reports::ScenarioRecord& mx = run.scenarios[1 + 4];  // ceilings, fp32, bf16, delayed, ...
  ASSERT_EQ(mx.name, "recipes.mxfp8");
  EXPECT_EQ(mx.config.at("convergence").at("loss").size(), 2u);
  const std::string html = reports::render_html(run);
  for (const char* plot :
       {"Speedup over BF16 at the same shape: recipes.mxfp8 (emulated: CPU emulation)",
        "Small-M sweep (fprop): recipes.mxfp8 (emulated: CPU emulation)",
        "Loss difference per step: recipes.mxfp8 (emulated: CPU emulation)"}) {
    EXPECT_NE(html.find(plot), std::string::npos) << plot;
  }
  // The grouped rows in every writer that lists figures, each labelled: JSON (emulated and the
  // split in config), Markdown and HTML.
  const std::string grouped = "grouped experts fc1 rows 16/12/0/4 wgrad 64x32x32";
  const nlohmann::json js = nlohmann::json::parse(reports::render_json(run));
  size_t grouped_figures = 0;
  for (const nlohmann::json& sc : js.at("scenarios")) {
    if (sc.at("name") == "recipes.ceilings") continue;
    EXPECT_EQ(sc.at("config").at("grouped_split").at("rows"), (std::vector<int64_t>{16, 12, 0, 4}));
    for (const nlohmann::json& f : sc.at("benchmarks")) {
      if (f.at("name").get<std::string>().rfind("grouped ", 0) != 0) continue;
      ++grouped_figures;
      EXPECT_EQ(f.at("emulated"), "CPU emulation") << f.at("name");
    }
  }
  // Per recipe 3 roles x (bf16_ms, gemm_ms, gemm_tflops, 2 speedups), + quantize_ms when FP8.
  EXPECT_EQ(grouped_figures, 7u * 3u * 5u + 5u * 3u);
  EXPECT_EQ(mx.config.at("grouped_split").at("padded_rows"),
            (std::vector<int64_t>{32, 32, 32, 32}));
  EXPECT_EQ(mx.config.at("grouped_split").at("alignment"), 32);
  EXPECT_NE(reports::render_markdown(run).find(grouped + " (emulated: CPU emulation)"),
            std::string::npos);
  EXPECT_NE(html.find(grouped), std::string::npos);
  // JUnit carries figures per suite only: its `emulated` property covers the grouped rows too.
  EXPECT_NE(reports::render_junit(run).find(R"(<property name="emulated" value="CPU emulation"/>)"),
            std::string::npos);
  EXPECT_EQ(reports::run_verdict(run), reports::Verdict::kPass);
}

// The uneven split of the grouped GEMM: T/2, 3T/8, 0, T/8 routed rows, each expert padded to the
// recipe's alignment (the engine's dispatch rule), the empty expert one zero block when quantized.
TEST(BenchRecipes, GroupedSplitIsUnevenWithAnEmptyExpertPaddedPerRecipe) {
  for (const auto& [kind, name] : engine::kRecipeNames) {
    SCOPED_TRACE(std::string(name));
    const engine::GroupedSplit g = engine::grouped_split(kind, 512);
    EXPECT_EQ(g.rows, (std::vector<int64_t>{256, 192, 0, 64}));
    EXPECT_EQ(g.tokens(), 512);
    const int64_t a = kind == RecipeKind::kBlock   ? 128
                      : kind == RecipeKind::kMxfp8 ? 32
                      : engine::is_fp8(kind)       ? 16
                                                   : 1;
    EXPECT_EQ(g.alignment, a);
    ASSERT_EQ(g.padded.size(), 4u);
    for (size_t e = 0; e < 4; ++e) {
      EXPECT_EQ(g.padded[e] % a, 0);
      EXPECT_GE(g.padded[e], g.rows[e]);
      EXPECT_LT(g.padded[e], std::max<int64_t>(g.rows[e], 1) + a);
    }
    EXPECT_EQ(g.padded[2], engine::is_fp8(kind) ? a : 0);
  }
  EXPECT_EQ(engine::grouped_split(RecipeKind::kBlock, 32).padded,
            (std::vector<int64_t>{128, 128, 128, 128}));
  EXPECT_TRUE(is_input_error([] { engine::grouped_split(RecipeKind::kFp32, 12); }));
  EXPECT_TRUE(is_input_error([] { engine::grouped_split(RecipeKind::kFp32, 0); }));
}

}  // namespace
}  // namespace meshproof::harness
