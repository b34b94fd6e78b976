// GEMM throughput per recipe and role: FLOP/s (2 R S K per GEMM) on the CPU reference (small
// shapes: it is a fixed-order fp32 loop, a correctness reference, not a fast BLAS) and
// on CUDA when a device is usable (the bf16 cuBLASLt GEMM is the ceiling the FP8 paths are
// compared with; emulated paths include their dequantize kernels).
//   gemm_bench --benchmark_filter=cuda/      CUDA only
//   gemm_bench --benchmark_filter=cpu/bf16/  one recipe on the CPU
#include <benchmark/benchmark.h>

#include <random>
#include <string>

#include "kernels/device.h"
#include "kernels/gemm.h"
#include "tests/kernels/gemm/gemm_test_util.h"

namespace meshproof::kernels {
namespace {

using gemm_test::Recipe;
using gemm_test::TestOperand;

// The operands of `role` for the square problem R = S = K = n in the HYBRID formats.
std::pair<TestOperand, TestOperand> operands(Recipe recipe, GemmRole role, int64_t n) {
  std::mt19937_64 rng(42);
  const DType first = role == GemmRole::kFprop ? DType::kE4M3 : DType::kE5M2;
  const bool b_is_weight = role != GemmRole::kWgrad;
  return {gemm_test::make_operand(recipe, first, false, n, n, rng),
          gemm_test::make_operand(recipe, DType::kE4M3, b_is_weight, n, n, rng)};
}

void run_gemm(benchmark::State& state, Recipe recipe, GemmRole role, Device device, int64_t n) {
  MemoryTracker tracker;
  ScopedRankContext ctx(RankContext{0, device, nullptr, &tracker});
  auto [a, b] = operands(recipe, role, n);
  a.row_ref.clear();  // the fp64 references are not needed here
  a.col_ref.clear();
  b.row_ref.clear();
  b.col_ref.clear();
  if (device.is_cuda()) {
    a = a.to(device);
    b = b.to(device);
  }
  Tensor out = Tensor::zeros(Shape{n, n}, DType::kBFloat16, device);
  GemmOptions opt;
  // TE's defaults: fast accumulation for the per-tensor fprop, split accumulator elsewhere.
  opt.fast_accumulation =
      role == GemmRole::kFprop && (recipe == Recipe::kDelayed || recipe == Recipe::kCurrent);
  try {
    gemm_test::run_role(role, a, b, out, opt);  // warm-up (cuBLASLt handle, heuristics)
    synchronize_current();
  } catch (const Error& e) {
    state.SkipWithError(e.what());
    return;
  }
  for (auto _ : state) {
    gemm_test::run_role(role, a, b, out, opt);
    synchronize_current();
  }
  const double flops =
      2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n);
  // Shown as "flop=<rate>/s" with SI prefixes (G, T).
  state.counters["flop"] = benchmark::Counter(flops * static_cast<double>(state.iterations()),
                                              benchmark::Counter::kIsRate);
}

void register_all() {
  const Recipe recipes[] = {Recipe::kFp32,    Recipe::kBf16,  Recipe::kDelayed,
                            Recipe::kCurrent, Recipe::kMxfp8, Recipe::kBlock};
  const GemmRole roles[] = {GemmRole::kFprop, GemmRole::kDgrad, GemmRole::kWgrad};
  std::vector<std::pair<Device, std::vector<int64_t>>> targets = {{Device::cpu(), {64, 256}}};
  if (cuda_status().usable) targets.push_back({Device::cuda(0), {1024, 4096}});
  for (const auto& target : targets) {
    // Not a structured binding: clang 14 (the sanitizer build) cannot capture one in a lambda.
    const Device device = target.first;
    const std::vector<int64_t>& sizes = target.second;
    for (Recipe r : recipes) {
      for (GemmRole role : roles) {
        for (int64_t n : sizes) {
          const std::string name = fmt::format("{}/{}/{}/{}", device.is_cpu() ? "cpu" : "cuda",
                                               gemm_test::recipe_name(r), gemm_role_name(role), n);
          benchmark::RegisterBenchmark(
              name.c_str(), [=](benchmark::State& s) { run_gemm(s, r, role, device, n); })
              ->UseRealTime()
              ->Unit(benchmark::kMicrosecond);
        }
      }
    }
  }
}

}  // namespace
}  // namespace meshproof::kernels

int main(int argc, char** argv) {
  meshproof::kernels::register_all();
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
