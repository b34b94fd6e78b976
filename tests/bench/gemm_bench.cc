// GEMM throughput per recipe and role: FLOP/s (2 R S K per GEMM) on the CPU reference and
// on CUDA when a device is usable (the bf16 cuBLASLt GEMM is the ceiling the FP8 paths are
// compared with; emulated paths include their dequantize kernels).
//   gemm_bench --benchmark_filter=cuda/      CUDA only
//   gemm_bench --benchmark_filter=cpu/bf16/  one recipe on the CPU
// CPU rows come in threes, measured in the same run (docs/design.md section 21): the packed GEMM
// with the kernel it selects (cpu/R/ROLE/n), with the portable micro-kernel (.../portable), and the
// pre-packing kernel kept as the tests' oracle (.../old). cpu/peak_no_fma is the ceiling: 8-lane
// multiplies and adds in 12 independent chains, no FMA, the same instruction mix as the kernel.
#include <benchmark/benchmark.h>

#include <random>
#include <string>

#include "kernels/core/device.h"
#include "kernels/gemm/gemm.h"
#include "kernels/gemm/gemm_internal.h"
#include "tests/kernels/gemm/gemm_oracle.h"
#include "tests/kernels/gemm/gemm_test_util.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

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

void run_packed_or_cuda(benchmark::State& state, GemmRole role, const TestOperand& a,
                        const TestOperand& b, Tensor& out, const GemmOptions& opt);

// Which CPU implementation a benchmark row runs.
enum class CpuImpl { kPacked, kPackedPortable, kOld };

void run_gemm(benchmark::State& state, Recipe recipe, GemmRole role, Device device, int64_t n,
              CpuImpl impl = CpuImpl::kPacked) {
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
  if (impl == CpuImpl::kOld) {
    const detail::GemmProblem p = gemm_oracle::problem(role, a.op(), n, n, b.op(), n, n);
    for (auto _ : state) gemm_oracle::gemm_cpu(p, out, false);
  } else {
    detail::set_cpu_gemm_kernel(impl == CpuImpl::kPackedPortable ? detail::CpuGemmKernel::kPortable
                                                                 : detail::CpuGemmKernel::kAuto);
    run_packed_or_cuda(state, role, a, b, out, opt);
    detail::set_cpu_gemm_kernel(detail::CpuGemmKernel::kAuto);
  }
  const double flops =
      2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n);
  // Shown as "flop=<rate>/s" with SI prefixes (G, T).
  state.counters["flop"] = benchmark::Counter(flops * static_cast<double>(state.iterations()),
                                              benchmark::Counter::kIsRate);
}

void run_packed_or_cuda(benchmark::State& state, GemmRole role, const TestOperand& a,
                        const TestOperand& b, Tensor& out, const GemmOptions& opt) {
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
}

#if defined(__x86_64__)
// The no-FMA fp32 ceiling of one core: per iteration 7 independent 8-lane multiplies (p = p * y)
// and 7 independent adds (acc = acc + p): the micro-kernel's instruction mix without its loads.
// y is 1.0, hidden from the compiler, so nothing is folded and nothing overflows.
__attribute__((target("avx2"))) void peak_no_fma(benchmark::State& state) {
  constexpr int64_t kIters = 1 << 20;
  constexpr int kChains = 7;
  __m256 p[kChains], acc[kChains];
  for (int i = 0; i < kChains; ++i) {
    p[i] = _mm256_set1_ps(1.0f + static_cast<float>(i));
    acc[i] = _mm256_setzero_ps();
  }
  __m256 y = _mm256_set1_ps(1.0f);
  for (auto _ : state) {
    for (int64_t it = 0; it < kIters; ++it) {
      __asm__ volatile("" : "+x"(y));
      for (int i = 0; i < kChains; ++i) {
        p[i] = _mm256_mul_ps(p[i], y);
        acc[i] = _mm256_add_ps(acc[i], p[i]);
      }
    }
  }
  benchmark::DoNotOptimize(acc);
  benchmark::DoNotOptimize(p);
  state.counters["flop"] =
      benchmark::Counter(2.0 * 8 * kChains * kIters * static_cast<double>(state.iterations()),
                         benchmark::Counter::kIsRate);
}
#endif

void register_all() {
  const Recipe recipes[] = {Recipe::kFp32,    Recipe::kBf16,  Recipe::kDelayed,
                            Recipe::kCurrent, Recipe::kMxfp8, Recipe::kBlock};
  const GemmRole roles[] = {GemmRole::kFprop, GemmRole::kDgrad, GemmRole::kWgrad};
  std::vector<std::pair<Device, std::vector<int64_t>>> targets = {{Device::cpu(), {64, 256, 512}}};
#if defined(__x86_64__)
  if (detail::cpu_gemm_kernel_available(detail::CpuGemmKernel::kAvx2))
    benchmark::RegisterBenchmark("cpu/peak_no_fma", peak_no_fma)->UseRealTime();
#endif
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
          if (!device.is_cpu()) continue;
          for (const auto& [impl, suffix] :
               {std::pair{CpuImpl::kPackedPortable, "portable"}, std::pair{CpuImpl::kOld, "old"}}) {
            const CpuImpl im = impl;
            benchmark::RegisterBenchmark(
                (name + "/" + suffix).c_str(),
                [=](benchmark::State& s) { run_gemm(s, r, role, device, n, im); })
                ->UseRealTime()
                ->Unit(benchmark::kMicrosecond);
          }
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
