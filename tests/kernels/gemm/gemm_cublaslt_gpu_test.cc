// Label gpu: the cuBLASLt resources and native scaled GEMMs on a device (docs/design.md section
// 30): native block scaling (sm_90) and NVFP4 (cc 10.x) against the exact emulation (the CPU
// reference GEMM of the same quantized operands), the algorithm cache hit on a repeated shape,
// and the per-stream handle/workspace freed by release_stream_resources (device memory flat over
// 30 create/use/release rounds). Each test skips with the reason when no usable device (or not
// the compute capability its path needs) is present.
//
// NONE OF THESE HAS RUN ON A DEVICE: the build machine of this change has no GPU. The tolerances
// are derived, not measured (see native_tolerance).
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "kernels/core/device.h"
#include "kernels/core/device_reserve.h"
#include "kernels/core/runtime.h"
#include "kernels/gemm/cublaslt_plan.h"
#include "kernels/gemm/cublaslt_resources.h"
#include "kernels/gemm/gemm.h"
#include "kernels/gemm/gemm_internal.h"
#include "kernels/quantize/nvfp4.h"
#include "kernels/quantize/quantize.h"
#include "tests/gpu_test.h"
#include "tests/kernels/gemm/gemm_test_util.h"
#if MESHPROOF_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace meshproof::kernels {
namespace {

// Every test here drives the CUDA GEMM (detail::gemm_cuda_path, device streams): compiled only
// in CUDA builds, where each skips without a usable GPU (tests/gpu_test.h).
#if MESHPROOF_HAVE_CUDA

using gemm_test::TestOperand;

constexpr double kU32 = 0x1p-24;
constexpr double kUBf16 = 0x1p-8;

Tensor ones_on_device(int64_t rows, int64_t cols) {
  return Tensor::from_vector<float>(Shape{rows, cols},
                                    std::vector<float>(static_cast<size_t>(rows * cols), 1.0f))
      .to(Device::cuda(0));
}

double gamma(double n, double u) { return n * u / (1.0 - n * u); }

int device_cc() {
  for (const GpuInfo& g : cuda_status().gpus) {
    if (g.index == 0) return g.cc_major * 10 + g.cc_minor;
  }
  return 0;
}

// Native vs exact emulation. Both sum the same exact products (FP8/FP4 values with their block
// scales) and differ only by accumulation order and precision (docs/design.md sections 4 and 8):
// the emulation (CPU reference) is within gamma_{K+2}(2^-24) * sum|a b| of the exact value. The
// native block-scaled kernels accumulate each 128-long K block in the tensor core's FP8
// accumulator before scaling it in fp32; we bound that accumulator like recursive summation with
// u = 2^-14 over the 128 terms (the DeepSeek-V3 report's ~14 significant bits on Hopper, the same
// assumption as kernels_gemm_cuda_test's fast accumulation): gamma_130(2^-14) * sum|a b|. NVFP4's
// native kernel applies the two global decode scales once (alpha = gds_a * gds_b: two more fp32
// roundings) where the emulation rounds each decoded element once (two per product): 4u more.
// A bf16 output adds one rounding on each side. Not measured: no device was available.
double native_tolerance(int64_t k, double abs_sum, double ref, bool bf16_out, bool block) {
  double err = 2.0 * gamma(static_cast<double>(k + 2), kU32) * abs_sum;
  err += block ? gamma(130.0, 0x1p-14) * abs_sum : 4.0 * kU32 * abs_sum;
  return bf16_out ? err + 2.0 * kUBf16 * (std::fabs(ref) + err) : err;
}

struct RoleCase {
  GemmRole role;
  DType out;
};

std::string role_case_name(const testing::TestParamInfo<RoleCase>& info) {
  return fmt::format("{}_{}", gemm_role_name(info.param.role),
                     info.param.out == DType::kFloat32 ? "f32out_accumulate" : "bf16out");
}

// Runs `role` on the CPU (the exact emulation's values) and on the device (the native path, which
// the test asserts gemm_cuda_path chose) and compares element by element.
void compare_native(GemmRole role, const TestOperand& a, const TestOperand& b, DType out_dtype,
                    bool block, const detail::GemmProblem& problem) {
  const gemm_test::Reference ref = gemm_test::reference(role, a, b);
  const lt::PathDecision path = detail::gemm_cuda_path(problem, 0);
  ASSERT_EQ(path.path, lt::GemmPath::kNativeScaled) << path.emulation;
  MemoryTracker tracker;
  GemmOptions opt;
  opt.accumulate = out_dtype == DType::kFloat32;  // fp32 outputs also exercise beta = 1
  std::mt19937_64 rng(99);
  std::normal_distribution<float> nd(0.0f, 10.0f);
  std::vector<float> init(static_cast<size_t>(ref.rows * ref.cols));
  for (auto& v : init) v = nd(rng);
  Tensor cpu_out = out_dtype == DType::kFloat32
                       ? Tensor::from_vector<float>(Shape{ref.rows, ref.cols}, init)
                       : Tensor::empty(Shape{ref.rows, ref.cols}, out_dtype, Device::cpu());
  Tensor gpu_out = cpu_out.to(Device::cuda(0));
  {
    ScopedRankContext cpu_ctx(RankContext{0, Device::cpu(), nullptr, &tracker});
    gemm_test::run_role(role, a, b, cpu_out, opt);
  }
  ScopedRankContext ctx(RankContext{0, Device::cuda(0), nullptr, &tracker});
  const TestOperand da = a.to(Device::cuda(0));
  const TestOperand db = b.to(Device::cuda(0));
  gemm_test::run_role(role, da, db, gpu_out, opt);
  synchronize_current();
  const std::vector<double> want = gemm_test::output_values(cpu_out);
  const std::vector<double> got = gemm_test::output_values(gpu_out);
  const int64_t k = role == GemmRole::kFprop ? a.cols : role == GemmRole::kDgrad ? a.cols : a.rows;
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const double extra = opt.accumulate ? 2.0 * kU32 * std::fabs(want[i]) : 0.0;
    const double tol =
        native_tolerance(k, ref.abs_sum[i], want[i], out_dtype == DType::kBFloat16, block) + extra;
    if (!(std::fabs(got[i] - want[i]) <= tol) && bad++ < 5) {
      ADD_FAILURE() << "element " << i << ": native " << got[i] << " emulation " << want[i]
                    << " tol " << tol;
    }
  }
  EXPECT_EQ(bad, 0);
}

class NativeBlockScaling : public testing::TestWithParam<RoleCase> {};

// M = 256 tokens, N = 128, K = 384: every role's R and S are multiples of 16 and its reduction a
// multiple of 128, so all three take the native path (fprop 1x128 x 128x128, dgrad 1x128 x
// 128x128 (W's columnwise copy), wgrad 1x128 x 1x128).
TEST_P(NativeBlockScaling, MatchesExactEmulation) {
  MP_SKIP_WITHOUT_GPU();
  if (device_cc() != 90) {
    GTEST_SKIP() << "native block scaling runs on sm_90 only; this device is sm_" << device_cc()
                 << " (its emulation is covered by kernels_gemm_cuda_test)";
  }
  if (cublaslt_runtime_version() < lt::kLtVersionBlock) {
    GTEST_SKIP() << "cuBLASLt " << cublaslt_runtime_version() << " predates the block modes (12.9)";
  }
  const RoleCase c = GetParam();
  const int64_t m = 256, n = 128, k = 384;
  std::mt19937_64 rng(2024 + static_cast<int>(c.role));
  using gemm_test::make_block;
  TestOperand a, b;
  detail::GemmProblem p;
  p.role = c.role;
  switch (c.role) {
    case GemmRole::kFprop:
      a = make_block(false, DType::kE4M3, m, k, rng);  // X
      b = make_block(true, DType::kE4M3, n, k, rng);   // W
      p.a = {a.op(), false, "X"}, p.b = {b.op(), false, "W"}, p.r = m, p.s = n, p.k = k;
      break;
    case GemmRole::kDgrad:
      a = make_block(false, DType::kE4M3, m, n, rng);  // dY
      b = make_block(true, DType::kE4M3, n, k, rng);   // W
      p.a = {a.op(), false, "dY"}, p.b = {b.op(), true, "W"}, p.r = m, p.s = k, p.k = n;
      break;
    case GemmRole::kWgrad:
      a = make_block(false, DType::kE4M3, m, n, rng);  // dY
      b = make_block(false, DType::kE4M3, m, k, rng);  // X
      p.a = {a.op(), true, "dY"}, p.b = {b.op(), true, "X"}, p.r = n, p.s = k, p.k = m;
      break;
  }
  compare_native(c.role, a, b, c.out, /*block=*/true, p);
}

std::vector<RoleCase> role_cases() {
  std::vector<RoleCase> v;
  for (GemmRole r : {GemmRole::kFprop, GemmRole::kDgrad, GemmRole::kWgrad}) {
    for (DType out : {DType::kFloat32, DType::kBFloat16}) v.push_back({r, out});
  }
  return v;
}
INSTANTIATE_TEST_SUITE_P(Roles, NativeBlockScaling, testing::ValuesIn(role_cases()),
                         role_case_name);

// NVFP4 fprop (X 1x16 blocks x W 16x16 tiles) and dgrad (dY x W's columnwise copy) natively on
// cc 10.x, against the CPU GEMM of the same quantized operands (the exact emulation).
TEST(NativeNvfp4, MatchesExactEmulation) {
  MP_SKIP_WITHOUT_GPU();
  const int cc = device_cc();
  if (cc < 100 || cc >= 110) {
    GTEST_SKIP() << "native NVFP4 runs on cc 10.x only; this device is sm_" << cc;
  }
  if (cublaslt_runtime_version() < lt::kLtVersionMxNvfp4) {
    GTEST_SKIP() << "cuBLASLt " << cublaslt_runtime_version() << " predates VEC16_UE4M3 (12.8)";
  }
  const int64_t m = 128, n = 96, k = 160;  // multiples of 32, partial 128x4 scale tiles
  std::mt19937_64 rng(5);
  std::normal_distribution<float> nd(0.0f, 2.0f);
  auto rand = [&](int64_t r, int64_t c) {
    std::vector<float> v(static_cast<size_t>(r * c));
    for (auto& x : v) x = nd(rng);
    return Tensor::from_vector<float>(Shape{r, c}, v);
  };
  MemoryTracker tracker;
  ScopedRankContext cpu_ctx(RankContext{0, Device::cpu(), nullptr, &tracker});
  const QuantizedTensor x = quantize_nvfp4(rand(m, k), Nvfp4Options{}, Usage{true, false});
  const QuantizedTensor dy = quantize_nvfp4(rand(m, n), Nvfp4Options{}, Usage{true, false});
  Nvfp4Options tiles;
  tiles.tile16x16 = true;
  const QuantizedTensor w = quantize_nvfp4(rand(n, k), tiles, Usage{true, true});
  auto on_device = [](const QuantizedTensor& q) {
    QuantizedTensor d = q;
    for (Tensor* t : {&d.rowwise_data, &d.rowwise_scale_inv, &d.columnwise_data,
                      &d.columnwise_scale_inv, &d.amax, &d.columnwise_amax, &d.scale}) {
      if (t->defined()) *t = t->to(Device::cuda(0));
    }
    return d;
  };
  // The exact values each copy decodes to, for the error bound's sum|a b|.
  const std::vector<float> xv = dequantize_nvfp4(x, true).to_vector<float>();
  const std::vector<float> dyv = dequantize_nvfp4(dy, true).to_vector<float>();
  const std::vector<float> wv = dequantize_nvfp4(w, true).to_vector<float>();    // [n, k]
  const std::vector<float> wtv = dequantize_nvfp4(w, false).to_vector<float>();  // [k, n]
  for (GemmRole role : {GemmRole::kFprop, GemmRole::kDgrad}) {
    const bool fprop = role == GemmRole::kFprop;
    const int64_t rows = m, cols = fprop ? n : k, red = fprop ? k : n;
    Tensor want = Tensor::zeros(Shape{rows, cols}, DType::kFloat32, Device::cpu());
    if (fprop) {
      gemm_fprop(&x, &w, want);
    } else {
      gemm_dgrad(&dy, &w, want);
    }
    const QuantizedTensor da = on_device(fprop ? x : dy);
    const QuantizedTensor dw = on_device(w);
    detail::GemmProblem p{role, {&da, false, fprop ? "X" : "dY"}, {&dw, !fprop, "W"}, rows, cols,
                          red};
    const lt::PathDecision path = detail::gemm_cuda_path(p, 0);
    ASSERT_EQ(path.path, lt::GemmPath::kNativeScaled) << path.emulation;
    Tensor got_d = Tensor::zeros(Shape{rows, cols}, DType::kFloat32, Device::cuda(0));
    {
      ScopedRankContext ctx(RankContext{0, Device::cuda(0), nullptr, &tracker});
      if (fprop) {
        gemm_fprop(&da, &dw, got_d);
      } else {
        gemm_dgrad(&da, &dw, got_d);
      }
      synchronize_current();
    }
    const std::vector<float> got = got_d.to(Device::cpu()).to_vector<float>();
    const std::vector<float> ref = want.to_vector<float>();
    const std::vector<float>& av = fprop ? xv : dyv;
    int bad = 0;
    for (int64_t i = 0; i < rows; ++i) {
      for (int64_t j = 0; j < cols; ++j) {
        double abs_sum = 0;
        for (int64_t t = 0; t < red; ++t) {
          // B's value at (j, t) of the canonical [cols, red] matrix: W[j, t] for fprop, W^T for
          // dgrad (the columnwise copy, stored [k, n]).
          const double bv = fprop ? wv[j * k + t] : wtv[j * n + t];
          abs_sum += std::fabs(static_cast<double>(av[i * red + t]) * bv);
        }
        const double w_ij = ref[i * cols + j], g_ij = got[i * cols + j];
        const double tol = native_tolerance(red, abs_sum, w_ij, false, /*block=*/false);
        if (!(std::fabs(g_ij - w_ij) <= tol) && bad++ < 5) {
          ADD_FAILURE() << gemm_role_name(role) << " (" << i << ", " << j << "): native " << g_ij
                        << " emulation " << w_ij << " tol " << tol;
        }
      }
    }
    EXPECT_EQ(bad, 0) << gemm_role_name(role);
  }
}

// A repeated GEMM (same shape, dtypes, layouts, alignment) runs the heuristic once: the second
// call is one cache hit and no miss.
TEST(CublasLtAlgoCache, HitsOnRepeatedShape) {
  MP_SKIP_WITHOUT_GPU();
  MemoryTracker tracker;
  ScopedRankContext ctx(RankContext{0, Device::cuda(0), nullptr, &tracker});
  const Tensor x = ones_on_device(64, 96);
  const Tensor w = ones_on_device(48, 96);
  Tensor y = Tensor::empty(Shape{64, 48}, DType::kFloat32, Device::cuda(0));
  const LtAlgoCacheStats s0 = cublaslt_algo_cache_stats();
  gemm_fprop(&x, &w, y);
  const LtAlgoCacheStats s1 = cublaslt_algo_cache_stats();
  EXPECT_EQ((s1.hits - s0.hits) + (s1.misses - s0.misses), 1);  // one lookup per GEMM
  gemm_fprop(&x, &w, y);
  const LtAlgoCacheStats s2 = cublaslt_algo_cache_stats();
  EXPECT_EQ(s2.hits - s1.hits, 1);
  EXPECT_EQ(s2.misses, s1.misses);
  EXPECT_EQ(s2.entries, s1.entries);
  synchronize_current();
  EXPECT_EQ(y.to(Device::cpu()).to_vector<float>()[0], 96.0f);
}

// 30 rounds of: a new stream, a GEMM on it (which makes its handle and 32 MiB workspace), then
// release_stream_resources and cudaStreamDestroy, as mesh::LocalWorld does for its rank streams.
// The workspace bytes go back to the baseline every round, and the device's free memory after the
// last round is within one workspace of the first round's (without the release it would have
// dropped by 29 x 32 MiB).
TEST(CublasLtResources, WorkspacesFreedWithTheStream) {
  MP_SKIP_WITHOUT_GPU();
  ASSERT_EQ(cudaSetDevice(0), cudaSuccess);
  const int64_t base_bytes = cublaslt_reserved_bytes(Device::cuda(0));
  const int64_t base_streams = cublaslt_stream_count();
  size_t free_first = 0, free_last = 0, total = 0;
  MemoryTracker tracker;
  for (int round = 0; round < 30; ++round) {
    cudaStream_t st = nullptr;
    ASSERT_EQ(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking), cudaSuccess);
    {
      ScopedRankContext ctx(RankContext{0, Device::cuda(0), st, &tracker});
      const Tensor x = ones_on_device(32, 64);
      const Tensor w = ones_on_device(16, 64);
      Tensor y = Tensor::empty(Shape{32, 16}, DType::kFloat32, Device::cuda(0));
      gemm_fprop(&x, &w, y);
      EXPECT_EQ(cublaslt_stream_count(), base_streams + 1);
      EXPECT_GT(cublaslt_reserved_bytes(Device::cuda(0)), base_bytes);
      // The per-rank memory figures see it as the device reserve "cublaslt".
      int64_t reported = 0;
      for (const NamedReserve& r : device_reserves(Device::cuda(0)))
        if (r.name == "cublaslt") reported = r.bytes.value;
      EXPECT_EQ(reported, cublaslt_reserved_bytes(Device::cuda(0)));
      synchronize_current();
    }
    release_stream_resources(st);
    ASSERT_EQ(cudaStreamDestroy(st), cudaSuccess);
    EXPECT_EQ(cublaslt_stream_count(), base_streams) << "round " << round;
    EXPECT_EQ(cublaslt_reserved_bytes(Device::cuda(0)), base_bytes) << "round " << round;
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    ASSERT_EQ(cudaMemGetInfo(round == 0 ? &free_first : &free_last, &total), cudaSuccess);
  }
  const int64_t drop = static_cast<int64_t>(free_first) - static_cast<int64_t>(free_last);
  EXPECT_LT(drop, int64_t{32} << 20) << "device memory fell by " << drop << " bytes over 29 rounds";
}
#endif

}  // namespace
}  // namespace meshproof::kernels
