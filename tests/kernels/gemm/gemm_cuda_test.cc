// Label gpu: the CUDA GEMMs (cuBLASLt native paths and the exact emulations) against the CPU
// reference, for every recipe and role; accumulate on the device. Skips without a usable device.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "kernels/core/device.h"
#include "kernels/gemm/gemm.h"
#include "kernels/quantize/quantize.h"
#if MESHPROOF_HAVE_CUDA
#include "kernels/gemm/gemm_cuda_kernels.h"
#endif
#include "tests/gpu_test.h"
#include "tests/kernels/gemm/gemm_test_util.h"

namespace meshproof::kernels {
namespace {

using gemm_test::make_operand;
using gemm_test::Recipe;
using gemm_test::TestOperand;

constexpr double kU32 = 0x1p-24;
constexpr double kUBf16 = 0x1p-8;

// CUDA vs CPU: both sum the same products (fp32-exact for bf16/FP8 values) in fp32, only in a
// different order (cuBLASLt splits K across tiles/threads), so each is within gamma_{K+2} *
// sum|a b| of the exact value (see gemm_test.cc) and they differ by at most twice that. FP8
// fast accumulation (fprop) keeps partial sums in the tensor core's reduced-precision
// accumulator (about 14 significant bits on Hopper per the DeepSeek-V3 report, which measured
// ~2% worst relative error at K = 4096) before promoting to fp32; we bound it like recursive
// summation with u = 2^-14: gamma_{K+2}(2^-14) * sum|a b| (not measured here: the build machine
// has no GPU). A bf16 output adds one rounding on each side: u_bf16 (|ref| + err) each.
double tolerance(int64_t k, double abs_sum, double ref, bool bf16_out, bool fast_accum) {
  const double n = static_cast<double>(k + 2);
  const double g = n * kU32 / (1.0 - n * kU32);
  double err = 2.0 * g * abs_sum;
  if (fast_accum) err += n * 0x1p-14 / (1.0 - n * 0x1p-14) * abs_sum;
  return bf16_out ? err + 2.0 * kUBf16 * (std::fabs(ref) + err) : err;
}

struct Shapes {
  int64_t m, n, k;
};

// FP8 paths need every dimension a multiple of 16 (MXFP8: 32; block: partial blocks kept).
Shapes shapes_for(Recipe r) {
  switch (r) {
    case Recipe::kFp32:
    case Recipe::kBf16:
      return {33, 20, 47};  // odd shapes: any layout works for the high-precision paths
    case Recipe::kMxfp8:
      return {128, 64, 192};
    case Recipe::kBlock:
      return {160, 144, 208};
    default:
      return {64, 48, 96};
  }
}

struct Case {
  Recipe recipe;
  GemmRole role;
  DType out;
  bool fast;
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  return fmt::format("{}_{}_{}{}", gemm_test::recipe_name(info.param.recipe),
                     gemm_role_name(info.param.role),
                     info.param.out == DType::kFloat32 ? "f32out" : "bf16out",
                     info.param.fast ? "_fastaccum" : "");
}

class GemmCudaTest : public testing::TestWithParam<Case> {};

TEST_P(GemmCudaTest, MatchesCpuReference) {
  MP_SKIP_WITHOUT_GPU();
  const Case c = GetParam();
  const Shapes s = shapes_for(c.recipe);
  std::mt19937_64 rng(4321 + static_cast<int>(c.recipe) * 10 + static_cast<int>(c.role));
  TestOperand a, b;
  int64_t k = 0;
  switch (c.role) {
    case GemmRole::kFprop:
      a = make_operand(c.recipe, DType::kE4M3, false, s.m, s.k, rng);
      b = make_operand(c.recipe, DType::kE4M3, true, s.n, s.k, rng);
      k = s.k;
      break;
    case GemmRole::kDgrad:
      a = make_operand(c.recipe, DType::kE5M2, false, s.m, s.n, rng);
      b = make_operand(c.recipe, DType::kE4M3, true, s.n, s.k, rng);
      k = s.n;
      break;
    case GemmRole::kWgrad:
      a = make_operand(c.recipe, DType::kE5M2, false, s.m, s.n, rng);
      b = make_operand(c.recipe, DType::kE4M3, false, s.m, s.k, rng);
      k = s.m;
      break;
  }
  const gemm_test::Reference ref = gemm_test::reference(c.role, a, b);
  MemoryTracker tracker;
  ScopedRankContext ctx(RankContext{0, Device::cuda(0), nullptr, &tracker});
  GemmOptions opt;
  opt.fast_accumulation = c.fast;
  opt.accumulate = c.out == DType::kFloat32;  // fp32 outputs also exercise beta = 1
  std::vector<float> init(static_cast<size_t>(ref.rows * ref.cols));
  std::normal_distribution<float> nd(0.0f, 10.0f);
  for (auto& v : init) v = nd(rng);
  Tensor cpu_out = c.out == DType::kFloat32
                       ? Tensor::from_vector<float>(Shape{ref.rows, ref.cols}, init)
                       : Tensor::empty(Shape{ref.rows, ref.cols}, c.out, Device::cpu());
  Tensor gpu_out = cpu_out.to(Device::cuda(0));
  {
    ScopedRankContext cpu_ctx(RankContext{0, Device::cpu(), nullptr, &tracker});
    gemm_test::run_role(c.role, a, b, cpu_out, opt);
  }
  const TestOperand da = a.to(Device::cuda(0));
  const TestOperand db = b.to(Device::cuda(0));
  gemm_test::run_role(c.role, da, db, gpu_out, opt);
  synchronize_current();
  const std::vector<double> want = gemm_test::output_values(cpu_out);
  const std::vector<double> got = gemm_test::output_values(gpu_out);
  int bad = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    // accumulate adds one fp32 rounding of the sum on each side: u (|want|) each.
    const double extra = opt.accumulate ? 2.0 * kU32 * std::fabs(want[i]) : 0.0;
    const double tol =
        tolerance(k, ref.abs_sum[i], want[i], c.out == DType::kBFloat16, c.fast) + extra;
    if (!(std::fabs(got[i] - want[i]) <= tol) && bad++ < 5) {
      ADD_FAILURE() << "element " << i << ": cuda " << got[i] << " cpu " << want[i] << " tol "
                    << tol;
    }
  }
  EXPECT_EQ(bad, 0);
}

std::vector<Case> all_cases() {
  std::vector<Case> v;
  for (Recipe r : {Recipe::kFp32, Recipe::kBf16, Recipe::kDelayed, Recipe::kCurrent, Recipe::kMxfp8,
                   Recipe::kBlock}) {
    for (GemmRole role : {GemmRole::kFprop, GemmRole::kDgrad, GemmRole::kWgrad}) {
      for (DType out : {DType::kFloat32, DType::kBFloat16}) {
        v.push_back({r, role, out, false});
        // Fast accumulation is what fprop uses for per-tensor recipes.
        if (role == GemmRole::kFprop && (r == Recipe::kDelayed || r == Recipe::kCurrent)) {
          v.push_back({r, role, out, true});
        }
      }
    }
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(AllRecipesAndRoles, GemmCudaTest, testing::ValuesIn(all_cases()),
                         case_name);

// The GEMM's device pad+swizzle of MXFP8 scales (used by the native cc 10.x path, which this
// test can reach on any GPU) must give the same bytes as the quantizer's independent CPU
// mxfp8_pad_scales + mxfp8_swizzle_scales, for both copies: rowwise S[r, c] = scale[r, c];
// columnwise (read transposed: r = the K index, c = the M/32 index) S[r, c] = scale[c, r].
TEST(GemmCudaMxfp8, DeviceSwizzleMatchesQuantizerLayout) {
  MP_SKIP_WITHOUT_GPU();
#if MESHPROOF_HAVE_CUDA
  MemoryTracker tracker;
  ScopedRankContext ctx(RankContext{0, Device::cuda(0), nullptr, &tracker});
  std::mt19937_64 rng(12);
  // M = 160 and K = 96 leave partial 128-row tiles and a partial 4-column tile to pad.
  const int64_t m = 160, k = 96;
  std::normal_distribution<float> nd(0.0f, 3.0f);
  std::vector<float> v(static_cast<size_t>(m * k));
  for (auto& x : v) x = nd(rng);
  const Tensor x = Tensor::from_vector<float>(Shape{m, k}, v);
  const QuantizedTensor q = quantize_mxfp8(x, DType::kE4M3, Usage{true, true});
  for (QuantizedCopy which : {QuantizedCopy::kRowwise, QuantizedCopy::kColumnwise}) {
    const bool row = which == QuantizedCopy::kRowwise;
    const Tensor& compact = row ? q.rowwise_scale_inv : q.columnwise_scale_inv;
    // e8m0 tensors have no typed accessor: compare raw bytes.
    auto bytes = [](const Tensor& t) {
      const Tensor h = t.to(Device::cpu());
      const auto* p = static_cast<const uint8_t*>(h.raw_data());
      return std::vector<uint8_t>(p, p + h.nbytes().value);
    };
    const std::vector<uint8_t> want =
        bytes(mxfp8_swizzle_scales(mxfp8_pad_scales(compact, which), which));
    const Tensor dev = compact.to(Device::cuda(0));
    const int64_t rows = row ? m : k;            // non-reduction index range
    const int64_t cols = row ? k / 32 : m / 32;  // 32-block index range
    Tensor out = Tensor::empty(Shape{detail::swizzled_e8m0_bytes(rows, cols)}, DType::kUInt8,
                               Device::cuda(0));
    ASSERT_EQ(detail::launch_swizzle_e8m0(static_cast<const uint8_t*>(dev.raw_data()), rows, cols,
                                          row ? k / 32 : 1, row ? 1 : k,
                                          static_cast<uint8_t*>(out.raw_data()), nullptr),
              cudaSuccess);
    synchronize_current();
    EXPECT_EQ(bytes(out), want) << (row ? "rowwise" : "columnwise");
  }
#endif
}

TEST(GemmCudaErrors, Fp8DimsNotMultipleOf16) {
  MP_SKIP_WITHOUT_GPU();
  const GpuInfo& g = cuda_status().gpus.at(0);
  if (g.cc_major * 10 + g.cc_minor < 89) GTEST_SKIP() << "per-tensor FP8 GEMMs need sm_89+";
  MemoryTracker tracker;
  ScopedRankContext ctx(RankContext{0, Device::cuda(0), nullptr, &tracker});
  std::mt19937_64 rng(5);
  const TestOperand x =
      gemm_test::make_per_tensor(ScalingMode::kCurrentTensor, DType::kE4M3, 24, 40, rng)
          .to(Device::cuda(0));
  const TestOperand w =
      gemm_test::make_per_tensor(ScalingMode::kCurrentTensor, DType::kE4M3, 16, 40, rng)
          .to(Device::cuda(0));
  Tensor y = Tensor::empty(Shape{24, 16}, DType::kBFloat16, Device::cuda(0));
  try {
    gemm_fprop(x.op(), w.op(), y);
    ADD_FAILURE() << "expected an input error for K = 40";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInput);
    EXPECT_NE(std::string(e.what()).find("multiple of 16"), std::string::npos) << e.what();
  }
}

TEST(GemmCudaErrors, MixedDevices) {
  MP_SKIP_WITHOUT_GPU();
  MemoryTracker tracker;
  ScopedRankContext ctx(RankContext{0, Device::cuda(0), nullptr, &tracker});
  std::mt19937_64 rng(6);
  const TestOperand x = gemm_test::make_fp32(8, 16, rng);
  const TestOperand w = gemm_test::make_fp32(4, 16, rng).to(Device::cuda(0));
  Tensor y = Tensor::empty(Shape{8, 4}, DType::kFloat32, Device::cuda(0));
  try {
    gemm_fprop(x.op(), w.op(), y);
    ADD_FAILURE() << "expected an input error for X on the cpu";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInput);
    EXPECT_NE(std::string(e.what()).find("operand X is on cpu"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace meshproof::kernels
