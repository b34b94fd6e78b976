// The packed CPU GEMM against the pre-packing kernel (gemm_oracle.h): BITWISE equal output for
// every recipe's operand decode, every role (and so every transpose), odd shapes with row, column
// and K-block tails, fp32 / bf16 / accumulated outputs, special values (NaN, inf, -0, subnormals,
// NaN codes, E8M0 scales 0, 254 and 0xFF), and every micro-kernel this CPU can run
// (docs/design.md section 21).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/core/error.h"
#include "kernels/core/runtime.h"
#include "kernels/gemm/gemm_internal.h"
#include "tests/kernels/gemm/gemm_oracle.h"
#include "tests/kernels/gemm/gemm_test_util.h"

namespace meshproof::kernels {
namespace {

using detail::CpuGemmKernel;
using gemm_test::Recipe;
using gemm_test::TestOperand;

// Restores automatic kernel selection when a test ends.
struct KernelGuard {
  explicit KernelGuard(CpuGemmKernel k) { detail::set_cpu_gemm_kernel(k); }
  ~KernelGuard() { detail::set_cpu_gemm_kernel(CpuGemmKernel::kAuto); }
};

std::vector<CpuGemmKernel> kernels_here() {
  std::vector<CpuGemmKernel> v = {CpuGemmKernel::kPortable};
  if (detail::cpu_gemm_kernel_available(CpuGemmKernel::kAvx2)) v.push_back(CpuGemmKernel::kAvx2);
  return v;
}

const char* kernel_name(CpuGemmKernel k) {
  return k == CpuGemmKernel::kAvx2 ? "avx2" : k == CpuGemmKernel::kPortable ? "portable" : "auto";
}

// Overwrites about 1 in `one_in` elements of every copy of `t`, and 1 in 8 block scales, with
// special values (callers pass about K, so that a fair share of the outputs stays finite).
void inject_specials(TestOperand& t, std::mt19937_64& rng, int64_t one_in) {
  std::uniform_int_distribution<int> pick(0, 15);
  std::uniform_int_distribution<int64_t> hit(0, one_in - 1);
  if (!t.quantized) {
    const size_t n = static_cast<size_t>(t.hp.numel().value);
    if (t.hp.dtype() == DType::kFloat32) {
      const float sp[] = {std::numeric_limits<float>::quiet_NaN(),
                          -std::numeric_limits<float>::quiet_NaN(),
                          std::numeric_limits<float>::infinity(),
                          -std::numeric_limits<float>::infinity(),
                          -0.0f,
                          0.0f,
                          std::numeric_limits<float>::denorm_min(),
                          -1.5e-39f,
                          3.0e38f,
                          -3.0e38f};
      float* p = t.hp.data<float>();
      for (size_t i = 0; i < n; ++i)
        if (hit(rng) == 0) p[i] = sp[static_cast<size_t>(pick(rng)) % std::size(sp)];
    } else {
      const uint16_t sp[] = {0x7FC0, 0xFFC1, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x807F, 0x7F7F};
      auto* p = static_cast<uint16_t*>(t.hp.raw_data());
      for (size_t i = 0; i < n; ++i)
        if (hit(rng) == 0) p[i] = sp[static_cast<size_t>(pick(rng)) % std::size(sp)];
    }
    return;
  }
  std::uniform_int_distribution<int> byte(0, 255);
  for (Tensor* d : {&t.q.rowwise_data, &t.q.columnwise_data}) {
    auto* p = static_cast<uint8_t*>(d->raw_data());
    for (int64_t i = 0; i < d->numel().value; ++i)
      if (hit(rng) == 0) p[i] = static_cast<uint8_t>(byte(rng));  // NaN/inf/-0 codes included
  }
  if (t.q.mode == ScalingMode::kMxfp8) {
    const uint8_t sp[] = {0, 1, 254, 255, 127, 200};
    for (Tensor* s : {&t.q.rowwise_scale_inv, &t.q.columnwise_scale_inv}) {
      auto* p = static_cast<uint8_t*>(s->raw_data());
      for (int64_t i = 0; i < s->numel().value; ++i)
        if (pick(rng) < 2) p[i] = sp[static_cast<size_t>(pick(rng)) % std::size(sp)];
    }
  } else {
    const float sp[] = {std::numeric_limits<float>::quiet_NaN(), 0.0f, 1e-40f, 3e38f, -0.5f};
    for (Tensor* s : {&t.q.rowwise_scale_inv, &t.q.columnwise_scale_inv}) {
      float* p = s->data<float>();
      for (int64_t i = 0; i < s->numel().value; ++i)
        if (pick(rng) < 2) p[i] = sp[static_cast<size_t>(pick(rng)) % std::size(sp)];
    }
  }
}

struct Dims {
  int64_t a_rows, a_cols, b_rows, b_cols;
};

// Logical operand dims of `role` for the problem C[R, S], reduction K.
Dims role_dims(GemmRole role, int64_t R, int64_t S, int64_t K) {
  switch (role) {
    case GemmRole::kFprop:  // X[R,K], W[S,K]
      return {R, K, S, K};
    case GemmRole::kDgrad:  // dY[R,K], W[K,S]
      return {R, K, K, S};
    case GemmRole::kWgrad:  // dY[K,R], X[K,S]
      return {K, R, K, S};
  }
  return {};
}

// The output's bit patterns (fp32 or bf16), with every NaN replaced by one marker. The rule is
// "the same bits, NaN where the old kernel gave NaN": which NaN an x86 add or multiply returns
// when both operands are NaN (or when it makes the default NaN 0xFFC00000) depends on the operand
// order the compiler encodes, and the old kernel's own AVX2 clone, SSE2 clone and column tails
// differ in that order, so a NaN's sign and payload were never reproducible (section 21).
std::vector<uint32_t> bits_of(const Tensor& t) {
  std::vector<uint32_t> v(static_cast<size_t>(t.numel().value));
  constexpr uint32_t kNanMarker = 0xFFFFFFFFu;
  for (size_t i = 0; i < v.size(); ++i) {
    if (t.dtype() == DType::kFloat32) {
      const uint32_t u = fmt8::float_bits(t.data<float>()[i]);
      v[i] = (u & 0x7FFFFFFFu) > 0x7F800000u ? kNanMarker : u;
    } else {
      const uint16_t h = static_cast<const uint16_t*>(t.raw_data())[i];
      v[i] = (h & 0x7FFFu) > 0x7F80u ? kNanMarker : h;
    }
  }
  return v;
}

// How many output elements are NaN (so that a case with specials really exercises them).
int64_t nan_count(const Tensor& t) {
  int64_t n = 0;
  for (uint32_t u : bits_of(t)) n += u == 0xFFFFFFFFu;
  return n;
}

// Outputs seen by the special-value cases of one test: both must end up non-zero (the cases
// really produce NaN and still check ordinary bits).
int64_t g_special_nan = 0, g_special_other = 0;

// One case: new GEMM vs oracle, bit for bit, for fp32, bf16 and accumulated fp32 outputs.
void expect_bitwise(Recipe recipe, GemmRole role, int64_t R, int64_t S, int64_t K, bool specials,
                    CpuGemmKernel kernel, uint64_t seed) {
  SCOPED_TRACE(fmt::format("{} {} R={} S={} K={} specials={} kernel={}",
                           gemm_test::recipe_name(recipe), gemm_role_name(role), R, S, K, specials,
                           kernel_name(kernel)));
  std::mt19937_64 rng(seed);
  const Dims d = role_dims(role, R, S, K);
  const DType first = role == GemmRole::kFprop ? DType::kE4M3 : DType::kE5M2;
  TestOperand a = gemm_test::make_operand(recipe, first, false, d.a_rows, d.a_cols, rng);
  TestOperand b = gemm_test::make_operand(recipe, DType::kE4M3, role != GemmRole::kWgrad, d.b_rows,
                                          d.b_cols, rng);
  if (specials) {
    inject_specials(a, rng, std::max<int64_t>(16, K));
    inject_specials(b, rng, std::max<int64_t>(16, K));
  }
  const detail::GemmProblem p =
      gemm_oracle::problem(role, a.op(), d.a_rows, d.a_cols, b.op(), d.b_rows, d.b_cols);
  ASSERT_EQ(p.r, R);
  ASSERT_EQ(p.s, S);
  ASSERT_EQ(p.k, K);
  KernelGuard guard(kernel);
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    Tensor got = Tensor::zeros(Shape{R, S}, dt, Device::cpu());
    Tensor want = Tensor::zeros(Shape{R, S}, dt, Device::cpu());
    gemm_test::run_role(role, a, b, got);
    gemm_oracle::gemm_cpu(p, want, false);
    ASSERT_EQ(bits_of(got), bits_of(want)) << dtype_name(dt) << " output differs";
    if (specials) {
      const int64_t nans = nan_count(got);
      g_special_nan += nans;
      g_special_other += R * S - nans;
    }
  }
  // accumulate: out += C on a non-zero start
  std::normal_distribution<float> nd(0.0f, 4.0f);
  std::vector<float> start(static_cast<size_t>(R * S));
  for (float& x : start) x = nd(rng);
  Tensor got = Tensor::from_vector<float>(Shape{R, S}, start);
  Tensor want = Tensor::from_vector<float>(Shape{R, S}, start);
  GemmOptions acc;
  acc.accumulate = true;
  gemm_test::run_role(role, a, b, got, acc);
  gemm_oracle::gemm_cpu(p, want, true);
  ASSERT_EQ(bits_of(got), bits_of(want)) << "accumulated output differs";
}

class GemmBitwiseTest : public testing::TestWithParam<Recipe> {};

// Shapes around the tile sizes (6 x 16, K blocks of 256): 1, tails, exact multiples, and K that
// crosses one or two K-block boundaries. MXFP8 needs every dim a multiple of 32.
TEST_P(GemmBitwiseTest, EqualsPrePackingKernelBitForBit) {
  MemoryTracker tracker;
  ScopedRankContext ctx(RankContext{0, Device::cpu(), nullptr, &tracker});
  const Recipe recipe = GetParam();
  struct Shape3 {
    int64_t r, s, k;
  };
  std::vector<Shape3> shapes;
  if (recipe == Recipe::kMxfp8) {
    shapes = {{32, 32, 32}, {64, 96, 288}, {96, 32, 544}, {32, 160, 256}, {160, 64, 64}};
  } else {
    shapes = {{1, 1, 1},      {1, 17, 3},    {7, 1, 5},     {5, 15, 255},
              {6, 16, 256},   {13, 33, 257}, {19, 47, 129}, {64, 64, 64},
              {37, 130, 513}, {12, 32, 700}, {131, 3, 130}, {2, 200, 31}};
  }
  uint64_t seed = 1;
  g_special_nan = g_special_other = 0;
  for (CpuGemmKernel kernel : kernels_here()) {
    for (GemmRole role : {GemmRole::kFprop, GemmRole::kDgrad, GemmRole::kWgrad}) {
      for (const Shape3& sh : shapes) {
        for (bool specials : {false, true}) {
          expect_bitwise(recipe, role, sh.r, sh.s, sh.k, specials, kernel, seed++);
          if (HasFatalFailure()) return;
        }
      }
    }
  }
  EXPECT_GT(g_special_nan, 0);
  EXPECT_GT(g_special_other, 0);
}

INSTANTIATE_TEST_SUITE_P(AllRecipes, GemmBitwiseTest,
                         testing::Values(Recipe::kFp32, Recipe::kBf16, Recipe::kDelayed,
                                         Recipe::kCurrent, Recipe::kMxfp8, Recipe::kBlock),
                         [](const testing::TestParamInfo<Recipe>& i) {
                           return std::string(gemm_test::recipe_name(i.param));
                         });

// Mixed operand kinds (a quantized operand with a bf16 or fp32 one) and e4m3 x e5m2 pairs go
// through the same packing; one shape with tails per role.
TEST(GemmBitwise, MixedOperandKinds) {
  MemoryTracker tracker;
  ScopedRankContext ctx(RankContext{0, Device::cpu(), nullptr, &tracker});
  std::mt19937_64 rng(7);
  for (CpuGemmKernel kernel : kernels_here()) {
    KernelGuard guard(kernel);
    for (GemmRole role : {GemmRole::kFprop, GemmRole::kDgrad, GemmRole::kWgrad}) {
      const Dims d = role_dims(role, 23, 41, 300);
      TestOperand a =
          gemm_test::make_operand(Recipe::kBf16, DType::kE4M3, false, d.a_rows, d.a_cols, rng);
      TestOperand b =
          gemm_test::make_operand(Recipe::kBlock, DType::kE5M2, true, d.b_rows, d.b_cols, rng);
      inject_specials(a, rng, 300);
      const detail::GemmProblem p =
          gemm_oracle::problem(role, a.op(), d.a_rows, d.a_cols, b.op(), d.b_rows, d.b_cols);
      Tensor got = Tensor::zeros(Shape{p.r, p.s}, DType::kFloat32, Device::cpu());
      Tensor want = Tensor::zeros(Shape{p.r, p.s}, DType::kFloat32, Device::cpu());
      gemm_test::run_role(role, a, b, got);
      gemm_oracle::gemm_cpu(p, want, false);
      EXPECT_EQ(bits_of(got), bits_of(want)) << gemm_role_name(role) << " " << kernel_name(kernel);
    }
  }
}

// The packing's decode tables against the per-element decoders they replace, for every input:
// all 256 codes of both formats, and every (code, E8M0 scale) pair against std::ldexp.
TEST(GemmBitwise, DecodeTablesEqualLdexpForEveryCodeAndScale) {
  for (DType f : {DType::kE4M3, DType::kE5M2}) {
    const float* table = detail::fp8_decode_table(f);
    const float* pow2 = detail::e8m0_pow2_table();
    for (int q = 0; q < 256; ++q) {
      const float v = gemm_oracle::decode_fp8(f, static_cast<uint8_t>(q));
      ASSERT_EQ(fmt8::float_bits(table[q]), fmt8::float_bits(v)) << dtype_name(f) << " code " << q;
      for (int e = 0; e < 255; ++e) {
        const float want = std::ldexp(v, e - 127);
        const float got = table[q] * pow2[e];
        ASSERT_EQ(fmt8::float_bits(got), fmt8::float_bits(want))
            << dtype_name(f) << " code " << q << " e8m0 " << e;
      }
    }
  }
}

// Which kernel runs is observable and settable; AVX2 on a CPU without it is an input error.
TEST(GemmBitwise, KernelSelection) {
  const CpuGemmKernel autok = detail::cpu_gemm_kernel();
  EXPECT_NE(autok, CpuGemmKernel::kAuto);
  EXPECT_EQ(autok == CpuGemmKernel::kAvx2, detail::cpu_gemm_kernel_available(CpuGemmKernel::kAvx2));
  {
    KernelGuard g(CpuGemmKernel::kPortable);
    EXPECT_EQ(detail::cpu_gemm_kernel(), CpuGemmKernel::kPortable);
  }
  EXPECT_EQ(detail::cpu_gemm_kernel(), autok);
  if (!detail::cpu_gemm_kernel_available(CpuGemmKernel::kAvx2)) {
    EXPECT_THROW(detail::set_cpu_gemm_kernel(CpuGemmKernel::kAvx2), Error);
  }
}

}  // namespace
}  // namespace meshproof::kernels
