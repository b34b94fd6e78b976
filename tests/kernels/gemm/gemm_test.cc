// CPU GEMM reference vs an fp64 reference computed from the decoded operand values, for every
// recipe and role; accumulate; output dtypes; error cases.
#include "kernels/gemm/gemm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "kernels/core/error.h"
#include "tests/kernels/gemm/gemm_test_util.h"

namespace meshproof::kernels {
namespace {

using gemm_test::make_operand;
using gemm_test::Recipe;
using gemm_test::TestOperand;

// Unit roundoff of fp32 (24-bit significand) and bf16 (8-bit significand), round to nearest.
constexpr double kU32 = 0x1p-24;
constexpr double kUBf16 = 0x1p-8;

// Error bound of the CPU GEMM against the exact sum over the decoded values (Higham, recursive
// summation): the K-1 fp32 additions contribute gamma_{K-1}; each product is rounded once to fp32
// (exact for bf16/FP8 values, at most u for fp32 inputs); per-tensor FP8 operands decode to
// fp32(q * scale_inv), one more rounding each (2u). So |c - c_exact| <= gamma_{K+2} sum_k |a_k b_k|
// with gamma_n = n u / (1 - n u). A bf16 output adds one round-to-nearest-even: u_bf16 |c|.
double bound(int64_t k, double abs_sum, double ref, bool bf16_out) {
  const double n = static_cast<double>(k + 2);
  const double g = n * kU32 / (1.0 - n * kU32);
  const double fp32_err = g * abs_sum;
  return bf16_out ? fp32_err + kUBf16 * (std::fabs(ref) + fp32_err) : fp32_err;
}

struct Shapes {
  int64_t m, n, k;
};

// Shapes per recipe: odd sizes where the format allows them; multiples of 32 for MXFP8; not
// multiples of 128 for block scaling so that partial blocks are exercised.
Shapes shapes_for(Recipe r) {
  switch (r) {
    case Recipe::kMxfp8:
      return {64, 96, 160};
    case Recipe::kBlock:
      return {160, 136, 200};
    default:
      return {33, 20, 47};
  }
}

struct Case {
  Recipe recipe;
  GemmRole role;
  DType out;
};

std::string case_name(const testing::TestParamInfo<Case>& info) {
  return fmt::format("{}_{}_{}", gemm_test::recipe_name(info.param.recipe),
                     gemm_role_name(info.param.role),
                     info.param.out == DType::kFloat32 ? "f32out" : "bf16out");
}

// Builds the two operands of `role` in the HYBRID formats (X, W e4m3; dY e5m2).
std::pair<TestOperand, TestOperand> operands(Recipe recipe, GemmRole role, Shapes s,
                                             std::mt19937_64& rng) {
  switch (role) {
    case GemmRole::kFprop:
      return {make_operand(recipe, DType::kE4M3, false, s.m, s.k, rng),
              make_operand(recipe, DType::kE4M3, true, s.n, s.k, rng)};
    case GemmRole::kDgrad:
      return {make_operand(recipe, DType::kE5M2, false, s.m, s.n, rng),
              make_operand(recipe, DType::kE4M3, true, s.n, s.k, rng)};
    case GemmRole::kWgrad:
      return {make_operand(recipe, DType::kE5M2, false, s.m, s.n, rng),
              make_operand(recipe, DType::kE4M3, false, s.m, s.k, rng)};
  }
  return {};
}

int64_t reduction_len(GemmRole role, Shapes s) {
  return role == GemmRole::kFprop ? s.k : role == GemmRole::kDgrad ? s.n : s.m;
}

class GemmCpuTest : public testing::TestWithParam<Case> {};

TEST_P(GemmCpuTest, MatchesFp64ReferenceWithinFp32AccumulationBound) {
  const Case c = GetParam();
  const Shapes s = shapes_for(c.recipe);
  std::mt19937_64 rng(1234 + static_cast<int>(c.recipe) * 10 + static_cast<int>(c.role));
  auto [a, b] = operands(c.recipe, c.role, s, rng);
  const gemm_test::Reference ref = gemm_test::reference(c.role, a, b);
  Tensor out = Tensor::empty(Shape{ref.rows, ref.cols}, c.out, Device::cpu());
  gemm_test::run_role(c.role, a, b, out);
  const std::vector<double> got = gemm_test::output_values(out);
  const int64_t k = reduction_len(c.role, s);
  int bad = 0;
  double worst = 0.0;  // largest error / bound, printed to show how tight the bound is
  for (size_t i = 0; i < got.size(); ++i) {
    const double tol = bound(k, ref.abs_sum[i], ref.value[i], c.out == DType::kBFloat16);
    const double err = std::fabs(got[i] - ref.value[i]);
    worst = std::max(worst, tol > 0 ? err / tol : err);
    if (!(err <= tol) && bad++ < 5) {
      ADD_FAILURE() << "element " << i << ": got " << got[i] << " want " << ref.value[i] << " err "
                    << err << " > bound " << tol;
    }
  }
  EXPECT_EQ(bad, 0);
  RecordProperty("worst_error_over_bound", std::to_string(worst));
}

std::vector<Case> all_cases() {
  std::vector<Case> v;
  for (Recipe r : {Recipe::kFp32, Recipe::kBf16, Recipe::kDelayed, Recipe::kCurrent, Recipe::kMxfp8,
                   Recipe::kBlock}) {
    for (GemmRole role : {GemmRole::kFprop, GemmRole::kDgrad, GemmRole::kWgrad}) {
      for (DType out : {DType::kFloat32, DType::kBFloat16}) v.push_back({r, role, out});
    }
  }
  return v;
}

INSTANTIATE_TEST_SUITE_P(AllRecipesAndRoles, GemmCpuTest, testing::ValuesIn(all_cases()),
                         case_name);

// A bf16 output is exactly the round-to-nearest-even of the fp32 output (same summation order).
TEST(GemmCpu, Bf16OutputIsRneOfFp32Output) {
  std::mt19937_64 rng(7);
  TestOperand x = gemm_test::make_fp32(17, 64, rng);
  TestOperand w = gemm_test::make_fp32(9, 64, rng);
  Tensor y32 = Tensor::empty(Shape{17, 9}, DType::kFloat32, Device::cpu());
  Tensor y16 = Tensor::empty(Shape{17, 9}, DType::kBFloat16, Device::cpu());
  gemm_fprop(x.op(), w.op(), y32);
  gemm_fprop(x.op(), w.op(), y16);
  const float* f = y32.data<float>();
  const auto* h = static_cast<const uint16_t*>(y16.raw_data());
  for (int i = 0; i < 17 * 9; ++i) {
    // RNE written independently: the two candidates and a tie broken to the even one.
    uint32_t u;
    std::memcpy(&u, &f[i], 4);
    const uint32_t lo = u & 0xFFFF0000u, hi = lo + 0x10000u;
    const uint32_t rem = u & 0xFFFFu;
    uint32_t pick = rem < 0x8000u ? lo : rem > 0x8000u ? hi : (((lo >> 16) & 1u) ? hi : lo);
    ASSERT_EQ(h[i], static_cast<uint16_t>(pick >> 16)) << "element " << i;
  }
}

// Runs twice and compares bits: the CPU reference is deterministic.
TEST(GemmCpu, Deterministic) {
  std::mt19937_64 rng(8);
  TestOperand dy = gemm_test::make_fp32(40, 24, rng);
  TestOperand x = gemm_test::make_fp32(40, 31, rng);
  Tensor a = Tensor::empty(Shape{24, 31}, DType::kFloat32, Device::cpu());
  Tensor b = Tensor::empty(Shape{24, 31}, DType::kFloat32, Device::cpu());
  gemm_wgrad(dy.op(), x.op(), a);
  gemm_wgrad(dy.op(), x.op(), b);
  EXPECT_EQ(std::memcmp(a.raw_data(), b.raw_data(), a.nbytes().value), 0);
}

// accumulate: out = out + result, with out's previous contents random; one extra fp32 rounding.
TEST(GemmCpu, AccumulateAddsIntoFp32Output) {
  for (Recipe r : {Recipe::kBf16, Recipe::kCurrent, Recipe::kMxfp8}) {
    std::mt19937_64 rng(99);
    const Shapes s = shapes_for(r);
    auto [dy, x] = operands(r, GemmRole::kWgrad, s, rng);
    const gemm_test::Reference ref = gemm_test::reference(GemmRole::kWgrad, dy, x);
    std::vector<float> init(static_cast<size_t>(ref.rows * ref.cols));
    std::normal_distribution<float> nd(0.0f, 100.0f);
    for (auto& v : init) v = nd(rng);
    Tensor dw = Tensor::from_vector<float>(Shape{ref.rows, ref.cols}, init);
    GemmOptions opt;
    opt.accumulate = true;
    gemm_wgrad(dy.op(), x.op(), dw, opt);
    const float* got = dw.data<float>();
    for (size_t i = 0; i < init.size(); ++i) {
      const double want = static_cast<double>(init[i]) + ref.value[i];
      // GEMM bound plus the rounding of the final fp32 addition (u |want| plus the GEMM error).
      const double g = bound(s.m, ref.abs_sum[i], ref.value[i], false);
      const double tol = g + kU32 * (std::fabs(want) + g);
      ASSERT_LE(std::fabs(got[i] - want), tol) << gemm_test::recipe_name(r) << " element " << i;
    }
  }
}

// float64 mode (the model's finite-difference checks): every role against the exact sum, in
// float64, with the fp64 recursive-summation bound gamma_K * sum|a b| (u = 2^-53), accumulate
// included; mixing float64 with another dtype is an input error.
TEST(GemmCpu, Float64AllRolesAndMixedDtypeError) {
  constexpr int64_t m = 7, n = 5, k = 9;
  std::mt19937_64 rng(5);
  std::normal_distribution<double> nd(0.0, 1.0);
  auto random = [&](int64_t r, int64_t c) {
    std::vector<double> v(static_cast<size_t>(r * c));
    for (double& x : v) x = nd(rng);
    return Tensor::from_vector<double>(Shape{r, c}, v);
  };
  const Tensor x = random(m, k), w = random(n, k), dy = random(m, n);
  const double* xv = x.data<double>();
  const double* wv = w.data<double>();
  const double* dyv = dy.data<double>();
  auto check = [&](const Tensor& got, int64_t rows, int64_t cols, int64_t len, auto term,
                   const char* what, double offset) {
    const double g =
        static_cast<double>(len) * 0x1p-53 / (1.0 - static_cast<double>(len) * 0x1p-53);
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        long double exact = 0, abs_sum = 0;
        for (int64_t t = 0; t < len; ++t) {
          exact += term(i, j, t);
          abs_sum += std::fabs(static_cast<double>(term(i, j, t)));
        }
        const double tol = g * static_cast<double>(abs_sum) + 0x1p-53 * std::fabs(offset + exact);
        EXPECT_LE(std::fabs(got.data<double>()[i * cols + j] - offset - static_cast<double>(exact)),
                  tol)
            << what << " (" << i << ", " << j << ")";
      }
  };
  Tensor y = Tensor::zeros(Shape{m, n}, DType::kFloat64, Device::cpu());
  gemm_fprop(&x, &w, y);
  check(
      y, m, n, k, [&](int64_t i, int64_t j, int64_t t) { return xv[i * k + t] * wv[j * k + t]; },
      "fprop", 0.0);
  Tensor dx = Tensor::zeros(Shape{m, k}, DType::kFloat64, Device::cpu());
  gemm_dgrad(&dy, &w, dx);
  check(
      dx, m, k, n, [&](int64_t i, int64_t j, int64_t t) { return dyv[i * n + t] * wv[t * k + j]; },
      "dgrad", 0.0);
  Tensor dw = Tensor::from_vector<double>(Shape{n, k}, std::vector<double>(n * k, 1.5));
  gemm_wgrad(&dy, &x, dw, {.accumulate = true});
  check(
      dw, n, k, m, [&](int64_t i, int64_t j, int64_t t) { return dyv[t * n + i] * xv[t * k + j]; },
      "wgrad accumulate", 1.5);

  Tensor y32 = Tensor::zeros(Shape{m, n}, DType::kFloat32, Device::cpu());
  try {
    gemm_fprop(&x, &w, y32);
    FAIL() << "float64 operands into a float32 output accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInput);
    EXPECT_NE(std::string(e.what()).find("float64 GEMMs take float64 X, W and output"),
              std::string::npos)
        << e.what();
  }
}

// A high-precision operand with a quantized one (decoded on the CPU like any other), and a rank-3
// activation [B, S, K] whose leading dims are flattened into M. Same bound as above.
TEST(GemmCpu, MixedOperandKindsAndRank3Input) {
  std::mt19937_64 rng(11);
  TestOperand x = gemm_test::make_bf16(6, 64, rng);
  x.hp = x.hp.view(Shape{2, 3, 64});
  TestOperand w = gemm_test::make_mxfp8(DType::kE4M3, 32, 64, rng);
  const gemm_test::Reference ref = gemm_test::reference(GemmRole::kFprop, x, w);
  Tensor y = Tensor::empty(Shape{2, 3, 32}, DType::kFloat32, Device::cpu());
  gemm_fprop(x.op(), w.op(), y);
  const std::vector<double> got = gemm_test::output_values(y);
  ASSERT_EQ(got.size(), ref.value.size());
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_LE(std::fabs(got[i] - ref.value[i]), bound(64, ref.abs_sum[i], ref.value[i], false))
        << "element " << i;
  }
}

// A quantized activation whose data and logical shape keep leading dims [B, S, K].
TEST(GemmCpu, QuantizedRank3Operand) {
  std::mt19937_64 rng(13);
  TestOperand x =
      gemm_test::make_per_tensor(ScalingMode::kCurrentTensor, DType::kE4M3, 32, 16, rng);
  x.q.rowwise_data = x.q.rowwise_data.view(Shape{2, 16, 16});
  x.q.logical_shape = Shape{2, 16, 16};
  TestOperand w = gemm_test::make_per_tensor(ScalingMode::kCurrentTensor, DType::kE4M3, 8, 16, rng);
  const gemm_test::Reference ref = gemm_test::reference(GemmRole::kFprop, x, w);
  Tensor y = Tensor::empty(Shape{2, 16, 8}, DType::kFloat32, Device::cpu());
  gemm_fprop(x.op(), w.op(), y);
  const std::vector<double> got = gemm_test::output_values(y);
  for (size_t i = 0; i < got.size(); ++i) {
    ASSERT_LE(std::fabs(got[i] - ref.value[i]), bound(16, ref.abs_sum[i], ref.value[i], false))
        << "element " << i;
  }
}

// Expects an input error whose message contains `needle`.
template <typename F>
void expect_input_error(F&& f, const std::string& needle) {
  try {
    f();
    ADD_FAILURE() << "no error thrown; expected one mentioning '" << needle << "'";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInput) << e.what();
    EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
  }
}

TEST(GemmCpuErrors, ShapeMismatchNamesRoleAndOperands) {
  std::mt19937_64 rng(1);
  TestOperand x = gemm_test::make_fp32(4, 8, rng);
  TestOperand w = gemm_test::make_fp32(6, 9, rng);
  Tensor y = Tensor::empty(Shape{4, 6}, DType::kFloat32, Device::cpu());
  expect_input_error([&] { gemm_fprop(x.op(), w.op(), y); }, "gemm_fprop: X[M,K] and W[N,K]");
  expect_input_error([&] { gemm_fprop(x.op(), w.op(), y); }, "[6, 9]");
  TestOperand dy = gemm_test::make_fp32(4, 5, rng);
  Tensor dx = Tensor::empty(Shape{4, 9}, DType::kFloat32, Device::cpu());
  expect_input_error([&] { gemm_dgrad(dy.op(), w.op(), dx); }, "gemm_dgrad: dY[M,N] and W[N,K]");
  TestOperand x3 = gemm_test::make_fp32(3, 9, rng);
  Tensor dw = Tensor::empty(Shape{5, 9}, DType::kFloat32, Device::cpu());
  expect_input_error([&] { gemm_wgrad(dy.op(), x3.op(), dw); }, "disagree on M");
}

TEST(GemmCpuErrors, OutputShapeAndDtype) {
  std::mt19937_64 rng(2);
  TestOperand x = gemm_test::make_fp32(4, 8, rng);
  TestOperand w = gemm_test::make_fp32(6, 8, rng);
  Tensor wrong = Tensor::empty(Shape{6, 4}, DType::kFloat32, Device::cpu());
  expect_input_error([&] { gemm_fprop(x.op(), w.op(), wrong); }, "output Y");
  Tensor i32 = Tensor::empty(Shape{4, 6}, DType::kInt32, Device::cpu());
  expect_input_error([&] { gemm_fprop(x.op(), w.op(), i32); }, "expected float32 or bfloat16");
  Tensor bf = Tensor::empty(Shape{4, 6}, DType::kBFloat16, Device::cpu());
  GemmOptions acc;
  acc.accumulate = true;
  expect_input_error([&] { gemm_fprop(x.op(), w.op(), bf, acc); }, "accumulate needs a float32");
}

TEST(GemmCpuErrors, MissingCopyAndBadScale) {
  std::mt19937_64 rng(3);
  TestOperand dy =
      gemm_test::make_per_tensor(ScalingMode::kCurrentTensor, DType::kE5M2, 32, 16, rng);
  TestOperand w =
      gemm_test::make_per_tensor(ScalingMode::kCurrentTensor, DType::kE4M3, 16, 48, rng);
  w.q.columnwise_data = Tensor();
  w.q.columnwise_scale_inv = Tensor();
  Tensor dx = Tensor::empty(Shape{32, 48}, DType::kFloat32, Device::cpu());
  expect_input_error([&] { gemm_dgrad(dy.op(), w.op(), dx); }, "W");
  expect_input_error([&] { gemm_dgrad(dy.op(), w.op(), dx); }, "has no columnwise copy");
  TestOperand mx = gemm_test::make_mxfp8(DType::kE4M3, 32, 64, rng);
  TestOperand mw = gemm_test::make_mxfp8(DType::kE4M3, 32, 64, rng);
  mx.q.rowwise_scale_inv = Tensor::empty(Shape{32, 3}, DType::kE8M0, Device::cpu());
  Tensor y = Tensor::empty(Shape{32, 32}, DType::kFloat32, Device::cpu());
  expect_input_error([&] { gemm_fprop(mx.op(), mw.op(), y); }, "rowwise copy scale_inv");
  const QuantizedTensor* null_q = nullptr;
  expect_input_error([&] { gemm_fprop(null_q, mw.op(), y); }, "null pointer");
}

}  // namespace
}  // namespace meshproof::kernels
