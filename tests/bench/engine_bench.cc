// CPU step time of a fixed small GPT (V=256, H=128, A=4, L=2, F=512, S=64, B=8): one optimizer
// step = data, forward, backward, global-norm clipping and AdamW. Reports tokens/s.
// BM_TrainStepH256/fp32 is the larger peer of tools/bench-vs-torch --size h256 (H=256, L=4,
// F=1024, S=128, B=8), where the GEMMs dominate.
#include <benchmark/benchmark.h>

#include "engine/model/trainer.h"

namespace meshproof::engine {
namespace {

Config bench_config(RecipeKind recipe, bool h256 = false) {
  Config c;
  c.model.vocab = 256;
  c.model.hidden = 128;
  c.model.heads = 4;
  c.model.layers = 2;
  c.model.ffn = 512;
  c.model.max_positions = 64;
  c.training.seq_len = 64;
  c.training.batch = 8;
  c.training.steps = 1000000;
  c.recipe.kind = recipe;
  c.recipe.amax_history_len = 16;
  if (h256) {
    c.model.hidden = 256;
    c.model.layers = 4;
    c.model.ffn = 1024;
    c.model.max_positions = 128;
    c.training.seq_len = 128;
  }
  return c;
}

void BM_TrainStep(benchmark::State& state, RecipeKind recipe) {
  Trainer trainer(bench_config(recipe));
  for (auto _ : state) {
    StepMetrics m = trainer.step();
    benchmark::DoNotOptimize(m.loss);
  }
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(state.iterations() * 8 * 64),
                                                  benchmark::Counter::kIsRate);
}

BENCHMARK_CAPTURE(BM_TrainStep, fp32, RecipeKind::kFp32)->Unit(benchmark::kMillisecond);

void BM_TrainStepH256(benchmark::State& state, RecipeKind recipe) {
  Trainer trainer(bench_config(recipe, true));
  for (auto _ : state) {
    StepMetrics m = trainer.step();
    benchmark::DoNotOptimize(m.loss);
  }
  state.counters["tokens/s"] = benchmark::Counter(static_cast<double>(state.iterations() * 8 * 128),
                                                  benchmark::Counter::kIsRate);
}
BENCHMARK_CAPTURE(BM_TrainStepH256, fp32, RecipeKind::kFp32)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_TrainStep, bf16, RecipeKind::kBf16)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_TrainStep, current, RecipeKind::kCurrent)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_TrainStep, delayed, RecipeKind::kDelayed)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_TrainStep, mxfp8, RecipeKind::kMxfp8)->Unit(benchmark::kMillisecond);
BENCHMARK_CAPTURE(BM_TrainStep, block, RecipeKind::kBlock)->Unit(benchmark::kMillisecond);

}  // namespace
}  // namespace meshproof::engine

BENCHMARK_MAIN();
