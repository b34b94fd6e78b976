// Contract between the quantizers (kernels/quantize/quantize.h, written independently) and the
// GEMMs: for operands produced by quantize_*, every role's CPU GEMM must equal the fp64 product of
// the values the quantizer's own dequantize() gives for the copies the role reads (fprop X.row
// W.row, dgrad dY.row W.col, wgrad dY.col X.col). A disagreement on any layout (transposed copies,
// scale shapes, 32x1 blocks, 128x128 blocks) fails here.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "kernels/gemm/gemm.h"
#include "kernels/quantize/quantize.h"
#include "tests/kernels/gemm/gemm_test_util.h"

namespace meshproof::kernels {
namespace {

using gemm_test::Recipe;
using gemm_test::TestOperand;

// Same bound as gemm_test.cc: recursive fp32 summation over K products, the per-tensor decode
// rounding fp32(q * scale_inv) once per operand: gamma_{K+2} * sum|a b|.
double bound(int64_t k, double abs_sum) {
  const double n = static_cast<double>(k + 2);
  return n * 0x1p-24 / (1.0 - n * 0x1p-24) * abs_sum;
}

Tensor random_tensor(int64_t rows, int64_t cols, float stddev, std::mt19937_64& rng) {
  std::normal_distribution<float> nd(0.0f, stddev);
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (auto& x : v) x = nd(rng);
  return Tensor::from_vector<float>(Shape{rows, cols}, v);
}

TestOperand quantized(Recipe recipe, DType format, bool weight, int64_t rows, int64_t cols,
                      std::mt19937_64& rng) {
  const Tensor x = random_tensor(rows, cols, weight ? 0.02f : 1.0f, rng);
  const Usage both{true, true};
  TestOperand t;
  t.quantized = true;
  t.rows = rows;
  t.cols = cols;
  switch (recipe) {
    case Recipe::kDelayed: {
      // The scale comes from the previous step's history, as in training: the amax recorded
      // last step was 0.8x this step's, so this step's largest elements saturate (the copies the
      // GEMM reads then hold fp8 max, and dequantize() must say so too).
      DelayedScalingState state = make_delayed_scaling_state(4, Device::cpu());
      const float amax = compute_amax(x).to_vector<float>()[0];
      record_amax(state, Tensor::from_vector<float>(Shape{1}, {0.8f * amax}));
      update_delayed_scaling(state, AmaxAlgo::kMax, 0, fp8_max(format));
      t.q = quantize_per_tensor(x, state.scale, format, both, ScalingMode::kDelayedTensor);
      EXPECT_EQ(t.q.mode, ScalingMode::kDelayedTensor);
      const uint8_t max_code = format == DType::kE5M2 ? 0x7B : 0x7E;
      int saturated = 0;
      const auto* codes = static_cast<const uint8_t*>(t.q.rowwise_data.raw_data());
      for (int64_t i = 0; i < rows * cols; ++i) saturated += (codes[i] & 0x7F) == max_code;
      EXPECT_GT(saturated, 0) << "the delayed scale was meant to saturate the largest elements";
      break;
    }
    case Recipe::kCurrent:
      t.q = quantize_current(x, format, both);
      break;
    case Recipe::kMxfp8:
      t.q = quantize_mxfp8(x, format, both);
      break;
    case Recipe::kBlock:
      t.q = quantize_block(x, weight ? ScalingMode::kBlock128x128 : ScalingMode::kBlock1x128,
                           format, both);
      break;
    default:
      ADD_FAILURE() << "recipe not covered here";
  }
  const std::vector<float> row = dequantize(t.q, QuantizedCopy::kRowwise).to_vector<float>();
  const std::vector<float> col = dequantize(t.q, QuantizedCopy::kColumnwise).to_vector<float>();
  t.row_ref.assign(row.begin(), row.end());
  t.col_ref.assign(col.begin(), col.end());
  return t;
}

class GemmQuantizedContractTest : public testing::TestWithParam<Recipe> {};

TEST_P(GemmQuantizedContractTest, AllRolesMatchDequantizedProduct) {
  const Recipe recipe = GetParam();
  // MXFP8 needs multiples of 32; block shapes leave partial 128-blocks.
  const int64_t m = recipe == Recipe::kBlock ? 160 : 64;
  const int64_t n = recipe == Recipe::kBlock ? 136 : 96;
  const int64_t k = recipe == Recipe::kBlock ? 200 : 128;
  std::mt19937_64 rng(77 + static_cast<int>(recipe));
  const TestOperand x = quantized(recipe, DType::kE4M3, false, m, k, rng);
  const TestOperand w = quantized(recipe, DType::kE4M3, true, n, k, rng);
  const TestOperand dy = quantized(recipe, DType::kE5M2, false, m, n, rng);
  struct RoleCase {
    GemmRole role;
    const TestOperand* a;
    const TestOperand* b;
    int64_t red;
  };
  for (const RoleCase& rc :
       {RoleCase{GemmRole::kFprop, &x, &w, k}, RoleCase{GemmRole::kDgrad, &dy, &w, n},
        RoleCase{GemmRole::kWgrad, &dy, &x, m}}) {
    const gemm_test::Reference ref = gemm_test::reference(rc.role, *rc.a, *rc.b);
    Tensor out = Tensor::empty(Shape{ref.rows, ref.cols}, DType::kFloat32, Device::cpu());
    gemm_test::run_role(rc.role, *rc.a, *rc.b, out);
    const float* got = out.data<float>();
    for (size_t i = 0; i < ref.value.size(); ++i) {
      ASSERT_LE(std::fabs(got[i] - ref.value[i]), bound(rc.red, ref.abs_sum[i]))
          << gemm_role_name(rc.role) << " element " << i << " got " << got[i] << " want "
          << ref.value[i];
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, GemmQuantizedContractTest,
                         testing::Values(Recipe::kDelayed, Recipe::kCurrent, Recipe::kMxfp8,
                                         Recipe::kBlock),
                         [](const testing::TestParamInfo<Recipe>& info) {
                           return std::string(gemm_test::recipe_name(info.param));
                         });

}  // namespace
}  // namespace meshproof::kernels
