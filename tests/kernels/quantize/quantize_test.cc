// CPU reference quantizers against independent fp64 re-derivations of each recipe's rule
// (fp64_reference.h), plus invariants: decode error bounds, scale rules at the edges, layouts,
// MXFP8 padding/swizzle. Data: random, adversarial (zeros, huge, NaN/inf, subnormal-range blocks,
// one outlier per block) and awkward shapes.
#include "kernels/quantize/quantize.h"

#include <gtest/gtest.h>

#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "kernels/core/formats.h"
#include "kernels/quantize/quantize_rules.h"
#include "tests/kernels/quantize/fp64_reference.h"

namespace meshproof::kernels {
namespace {

using testref::Fp8Model;

constexpr float kInf = std::numeric_limits<float>::infinity();
constexpr float kFltMax = std::numeric_limits<float>::max();

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const Tensor h = t.device().is_cpu() ? t : t.to(Device::cpu());
  const auto* p = static_cast<const uint8_t*>(h.raw_data());
  return std::vector<uint8_t>(p, p + h.nbytes().value);
}
std::vector<float> floats_of(const Tensor& t) {
  std::vector<float> v(static_cast<size_t>(t.numel().value));
  const auto b = bytes_of(t);
  std::memcpy(v.data(), b.data(), b.size());
  return v;
}

// Data generators. Each returns M*K floats.
std::vector<float> random_data(int64_t M, int64_t K, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(M * K));
  for (float& x : v) x = n(rng);
  return v;
}

// Blocks of very different character along both dims: zero rows/cols, huge values, subnormal
// range, one outlier per 32-block, a NaN and an inf in isolated places.
std::vector<float> adversarial_data(int64_t M, int64_t K, uint32_t seed, bool with_nonfinite) {
  std::vector<float> v = random_data(M, K, seed);
  std::mt19937 rng(seed + 1);
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) {
      float& x = v[static_cast<size_t>(m * K + k)];
      const int64_t region = ((m / 32) + (k / 64)) % 5;
      if (region == 0) x = 0.0f;                   // all-zero blocks
      if (region == 1) x *= 1e37f;                 // near fp32 max
      if (region == 2) x *= 1e-41f;                // fp32 subnormal range
      if (region == 3 && k % 32 == 5) x = 3e4f;    // one outlier per 1x32 block
      if (region == 4 && m % 32 == 7) x = -2e-3f;  // a small-valued row inside 32x1 blocks
    }
  }
  if (with_nonfinite && M * K > 100) {
    v[17] = std::nanf("");
    v[static_cast<size_t>(M * K - 3)] = -kInf;
  }
  return v;
}

Tensor to_tensor(int64_t M, int64_t K, const std::vector<float>& v) {
  return Tensor::from_vector<float>({M, K}, v);
}

// bf16 tensor of the same values rounded to bf16 (raw uint16), and those values as fp32.
Tensor to_bf16_tensor(int64_t M, int64_t K, std::vector<float>& v) {
  Tensor t = Tensor::empty({M, K}, DType::kBFloat16, Device::cpu());
  auto* p = static_cast<uint16_t*>(t.raw_data());
  for (size_t i = 0; i < v.size(); ++i) {
    p[i] = fmt8::float_to_bf16(v[i]);
    v[i] = fmt8::bf16_to_float(p[i]);
  }
  return t;
}

// ---- per-tensor --------------------------------------------------------------------------------

TEST(QuantizeTest, AmaxIsMaxAbsAndPropagatesNan) {
  std::vector<float> v = {1.0f, -3.5f, 2.0f, -0.0f};
  EXPECT_EQ(compute_amax(Tensor::from_vector<float>({4}, v)).to_vector<float>()[0], 3.5f);
  v[2] = -kInf;
  EXPECT_EQ(compute_amax(Tensor::from_vector<float>({4}, v)).to_vector<float>()[0], kInf);
  v[0] = std::nanf("");
  EXPECT_TRUE(std::isnan(compute_amax(Tensor::from_vector<float>({4}, v)).to_vector<float>()[0]));
}

float scale_for(float amax, DType f, float eps = 0.0f, bool pow2 = false) {
  return compute_current_scale(Tensor::from_vector<float>({1}, {amax}), f, eps, pow2)
      .to_vector<float>()[0];
}

TEST(QuantizeTest, CurrentScaleEdges) {
  EXPECT_EQ(scale_for(0.0f, DType::kE4M3), 1.0f);
  EXPECT_EQ(scale_for(kInf, DType::kE4M3), 1.0f);
  EXPECT_EQ(scale_for(std::nanf(""), DType::kE4M3), 1.0f);
  EXPECT_EQ(scale_for(2.0f, DType::kE4M3), 224.0f);
  EXPECT_EQ(scale_for(2.0f, DType::kE5M2), 28672.0f);
  EXPECT_EQ(scale_for(3.0f, DType::kE4M3), testref::div32(448.0f, 3.0f));
  // 448 / denorm_min overflows fp32: FLT_MAX, and its power-of-two floor is 2^127.
  EXPECT_EQ(scale_for(std::numeric_limits<float>::denorm_min(), DType::kE4M3), kFltMax);
  EXPECT_EQ(scale_for(std::numeric_limits<float>::denorm_min(), DType::kE4M3, 0, true),
            std::ldexp(1.0f, 127));
  // eps (TE amax_epsilon) clamps the amax before the division and before the zero check (TE's
  // compute_scale_from_amax): a tiny amax, and amax 0 too, give fp8_max / eps; NaN stays 1 and an
  // amax at or above eps is untouched.
  EXPECT_EQ(scale_for(1e-3f, DType::kE4M3, 1.0f), 448.0f);
  EXPECT_EQ(scale_for(1e-6f, DType::kE4M3, 1e-2f), testref::div32(448.0f, 1e-2f));
  EXPECT_EQ(scale_for(1e-6f, DType::kE5M2, 1e-2f), testref::div32(57344.0f, 1e-2f));
  EXPECT_EQ(scale_for(0.0f, DType::kE4M3, 1.0f), 448.0f);
  EXPECT_EQ(scale_for(std::nanf(""), DType::kE4M3, 1.0f), 1.0f);
  EXPECT_EQ(scale_for(3.0f, DType::kE4M3, 1e-2f), testref::div32(448.0f, 3.0f));
  EXPECT_EQ(scale_for(1e-6f, DType::kE4M3, 1e-2f, true), 32768.0f);  // 44800 -> 2^15
  EXPECT_EQ(scale_for(3.0f, DType::kE4M3, 0, true), 128.0f);         // 149.33 -> 128
}

TEST(QuantizeTest, CurrentScaleMatchesFp64OnRandomAmax) {
  std::mt19937 rng(3);
  for (int i = 0; i < 20000; ++i) {
    const float amax = fmt8::bits_float(rng() % 0x7F800000u);
    for (bool pow2 : {false, true}) {
      for (DType f : {DType::kE4M3, DType::kE5M2}) {
        ASSERT_EQ(scale_for(amax, f, 0, pow2), testref::current_scale(amax, fp8_max(f), 0, pow2))
            << std::hexfloat << amax;
        // eps = 2^-10: amaxes below it are clamped.
        const float eps = 0x1p-10f;
        ASSERT_EQ(scale_for(amax, f, eps, pow2),
                  testref::current_scale(amax, fp8_max(f), eps, pow2))
            << std::hexfloat << amax;
      }
    }
  }
}

void expect_per_tensor_matches_reference(const QuantizedTensor& q, const std::vector<float>& x,
                                         int64_t M, int64_t K, float scale, bool e5m2) {
  const Fp8Model model = Fp8Model::make(e5m2);
  const auto row = bytes_of(q.rowwise_data);
  const auto col = bytes_of(q.columnwise_data);
  ASSERT_EQ(q.rowwise_data.shape(), (Shape{M, K}));
  ASSERT_EQ(q.columnwise_data.shape(), (Shape{K, M}));
  EXPECT_EQ(floats_of(q.rowwise_scale_inv)[0], testref::div32(1.0f, scale));
  EXPECT_EQ(floats_of(q.columnwise_scale_inv)[0], testref::div32(1.0f, scale));
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) {
      const uint8_t want = model.encode(testref::mul32(x[static_cast<size_t>(m * K + k)], scale));
      ASSERT_EQ(row[static_cast<size_t>(m * K + k)], want) << "m=" << m << " k=" << k;
      ASSERT_EQ(col[static_cast<size_t>(k * M + m)], want) << "m=" << m << " k=" << k;
    }
  }
}

TEST(QuantizeTest, CurrentScalingMatchesFp64Rule) {
  struct Case {
    int64_t M, K;
    bool adversarial;
  };
  for (const Case c :
       {Case{3, 5, false}, Case{33, 70, false}, Case{64, 128, true}, Case{37, 131, true}}) {
    for (DType f : {DType::kE4M3, DType::kE5M2}) {
      const auto x =
          c.adversarial ? adversarial_data(c.M, c.K, 11, false) : random_data(c.M, c.K, 5, 3.0f);
      const QuantizedTensor q = quantize_current(to_tensor(c.M, c.K, x), f, {true, true});
      const float amax = testref::amax_of(x, 0, 1, x.size());
      EXPECT_EQ(floats_of(q.amax)[0], amax);
      const float scale = testref::current_scale(amax, fp8_max(f), 0, false);
      EXPECT_EQ(floats_of(q.scale)[0], scale);
      EXPECT_EQ(q.mode, ScalingMode::kCurrentTensor);
      expect_per_tensor_matches_reference(q, x, c.M, c.K, scale, f == DType::kE5M2);
    }
  }
}

TEST(QuantizeTest, CurrentScalingWithNonFiniteData) {
  // The whole current-scaling path (amax -> scale -> cast) on data holding NaN or inf: the amax
  // is NaN / inf, so the scale falls back to 1 (docs/design.md: amax 0/inf/NaN -> 1), NaN stays NaN
  // in the bytes (0x7F with its sign), inf saturates to the largest finite code with its sign.
  const int64_t M = 40, K = 36;
  for (DType f : {DType::kE4M3, DType::kE5M2}) {
    const bool e5m2 = f == DType::kE5M2;
    const uint8_t max_code = e5m2 ? 0x7B : 0x7E;
    for (bool with_nan : {true, false}) {
      for (bool pow2 : {false, true}) {
        auto x = adversarial_data(M, K, 31, true);  // NaN at 17, -inf at M*K-3
        if (!with_nan) x[17] = 2.5f;
        x[40] = kInf;
        const QuantizedTensor q = quantize_current(to_tensor(M, K, x), f, {true, true}, 0, pow2);
        const float amax = floats_of(q.amax)[0];
        if (with_nan) {
          EXPECT_TRUE(std::isnan(amax));
        } else {
          EXPECT_EQ(amax, kInf);
        }
        EXPECT_EQ(floats_of(q.scale)[0], 1.0f);
        expect_per_tensor_matches_reference(q, x, M, K, 1.0f, e5m2);
        const auto row = bytes_of(q.rowwise_data);
        const auto col = bytes_of(q.columnwise_data);
        if (with_nan) {
          EXPECT_EQ(row[17] & 0x7F, 0x7F);
          EXPECT_EQ(col[static_cast<size_t>((17 % K) * M + 17 / K)] & 0x7F, 0x7F);
        }
        EXPECT_EQ(row[40], max_code);
        EXPECT_EQ(row[static_cast<size_t>(M * K - 3)], 0x80 | max_code);
        const auto d = dequantize(q, QuantizedCopy::kRowwise).to_vector<float>();
        EXPECT_EQ(std::isnan(d[17]), with_nan);
        EXPECT_EQ(d[40], fp8_max(f));
        EXPECT_EQ(d[static_cast<size_t>(M * K - 3)], -fp8_max(f));
      }
    }
  }
}

TEST(QuantizeTest, PerTensorWithNonFiniteInputsAndGivenScale) {
  // Delayed scaling quantizes with whatever scale the state holds; NaN stays NaN, inf saturates.
  const int64_t M = 40, K = 36;
  const auto x = adversarial_data(M, K, 21, true);
  for (float scale : {1.0f, 0.5f, 1e-30f, 3.0e30f}) {
    const QuantizedTensor q =
        quantize_per_tensor(to_tensor(M, K, x), Tensor::from_vector<float>({1}, {scale}),
                            DType::kE4M3, {true, true}, ScalingMode::kDelayedTensor);
    expect_per_tensor_matches_reference(q, x, M, K, scale, false);
    EXPECT_FALSE(q.amax.defined());
  }
}

// The NaN rules shared with the CUDA kernels (kernels/quantize/quantize_rules.h): what a NaN
// encodes to and dequantizes to is stated, not left to the hardware (x86 keeps the NaN operand of a
// multiply, a GPU makes its canonical 0x7FFFFFFF), so both backends give the same bytes. An MXFP8
// block with a -NaN: the element keeps its sign (0xFF), its finite neighbours meet the block's NaN
// scale and encode as +NaN; dequantized, the element is its code's NaN and the neighbours the
// scale's.
TEST(QuantizeTest, NanRulesAreExplicitAndMatchTheCpuQuantizers) {
  const float neg_nan = fmt8::bits_float(0xFFC00123u);  // sign and payload set
  const float pos_nan = fmt8::bits_float(0x7FC00000u);
  for (bool e5m2 : {false, true}) {
    EXPECT_EQ(rules::cast_element(neg_nan, 2.0f, e5m2), 0xFF);
    EXPECT_EQ(rules::cast_element(neg_nan, pos_nan, e5m2), 0xFF);
    EXPECT_EQ(rules::cast_element(pos_nan, 0.5f, e5m2), 0x7F);
    EXPECT_EQ(rules::cast_element(1.0f, pos_nan, e5m2), 0x7F);
    EXPECT_EQ(rules::cast_element(-1.0f, 2.0f, e5m2), rules::cast_fp8(-2.0f, e5m2));
  }
  EXPECT_EQ(fmt8::float_bits(rules::scaled_value(fmt8::e4m3_to_float(0xFF), pos_nan)), 0xFFC00000u);
  EXPECT_EQ(fmt8::float_bits(rules::scaled_value(2.0f, fmt8::e8m0_to_float(0xFF))), 0x7FC00000u);
  EXPECT_EQ(rules::scaled_value(1.5f, 0.25f), 0.375f);

  const int64_t M = 32, K = 64;
  std::vector<float> x(static_cast<size_t>(M * K), 1.25f);
  x[5] = neg_nan;  // block (0, 0) of the rowwise copy, block (0, 5) of the columnwise one
  for (DType f : {DType::kE4M3, DType::kE5M2}) {
    const QuantizedTensor q = quantize_mxfp8(to_tensor(M, K, x), f, {true, true});
    const auto row = bytes_of(q.rowwise_data);
    const auto col = bytes_of(q.columnwise_data);
    EXPECT_EQ(row[5], 0xFF);
    EXPECT_EQ(row[6], 0x7F);   // same rowwise block: NaN scale
    EXPECT_NE(row[40], 0x7F);  // the next rowwise block is finite
    EXPECT_EQ(col[5], 0xFF);
    EXPECT_EQ(col[K + 5], 0x7F);  // same column block (rows 0..31 of column 5)
    EXPECT_NE(col[6], 0x7F);
    const auto d = dequantize(q, QuantizedCopy::kRowwise).to_vector<float>();
    EXPECT_EQ(fmt8::float_bits(d[5]), 0xFFC00000u);
    EXPECT_EQ(fmt8::float_bits(d[6]), 0x7FC00000u);
    EXPECT_EQ(d[40], 1.25f);
  }
}

TEST(QuantizeTest, DecodedWithinRelativeErrorBound) {
  // After current scaling every finite scaled value is within [-max, max], so the fp8 cast of a
  // normal-range element is off by at most half an ulp, 2^-(mbits+1) relative; a subnormal-range
  // element by at most half the smallest subnormal spacing, 2^-(bias+mbits) (2^-10 for e4m3,
  // 2^-17 for e5m2), in the scaled domain.
  // Unlike the power-of-two block scales, a current scale s is an arbitrary fp32, so three more
  // fp32 roundings sit between x and the decoded d: v = fl(x*s), scale_inv = fl(1/s) and
  // d = fl(q*scale_inv). Each is off by at most 2^-24 relative (the data keep every product in
  // fp32's normal range), so with u = 2^-24:
  //   |d - x| <= half_ulp(v)/s + u|x| [v vs x*s] + u|q|/s [scale_inv vs 1/s] + u|q|*scale_inv [d]
  // where half_ulp(v)/s <= 2^-(mbits+1) |x| (1+u) (normal) or 2^-(bias+mbits) scale_inv (1+2u)
  // (subnormal, 1/s <= scale_inv (1+2u)), and |q|/s, |q|*scale_inv <= |x| (1+2^-(mbits+1))(1+2u).
  const double u = std::ldexp(1.0, -24);
  const int64_t M = 48, K = 96;
  auto x = random_data(M, K, 9, 10.0f);
  // Tiny elements that land below the fp8 normal range after scaling (s ~ 448/amax for e4m3,
  // 57344/amax for e5m2, amax ~ 40): all five for e4m3, the last two for e5m2.
  for (size_t i = 0; i < 5; ++i)
    x[5 + i] = std::array<float, 5>{1e-4f, -3e-5f, 1e-6f, 1e-8f, -3e-9f}[i];
  for (DType f : {DType::kE4M3, DType::kE5M2}) {
    const bool e5m2 = f == DType::kE5M2;
    const int mbits = e5m2 ? 2 : 3;
    const int bias = e5m2 ? 15 : 7;
    const QuantizedTensor q = quantize_current(to_tensor(M, K, x), f, {true, true});
    const double scale = floats_of(q.scale)[0];
    const double scale_inv = floats_of(q.rowwise_scale_inv)[0];
    const double min_normal = std::ldexp(1.0, 1 - bias);
    int64_t n_subnormal = 0;
    for (QuantizedCopy which : {QuantizedCopy::kRowwise, QuantizedCopy::kColumnwise}) {
      const auto d = dequantize(q, which).to_vector<float>();
      for (size_t i = 0; i < x.size(); ++i) {
        const double ax = std::fabs(static_cast<double>(x[i]));
        const bool subnormal = ax * scale < min_normal;
        n_subnormal += subnormal;
        const double cast = subnormal ? std::ldexp(scale_inv, -(bias + mbits)) * (1 + 2 * u)
                                      : std::ldexp(ax, -(mbits + 1)) * (1 + u);
        const double rounding =
            u * ax * (1 + 2 * (1 + std::ldexp(1.0, -(mbits + 1))) * (1 + 2 * u));
        ASSERT_LE(std::fabs(static_cast<double>(d[i]) - x[i]), cast + rounding) << i;
      }
    }
    EXPECT_GE(n_subnormal, e5m2 ? 4 : 10);  // the tiny elements above, in both copies
  }
}

TEST(QuantizeTest, Bf16InputGivesSameBytesAsItsFp32Values) {
  const int64_t M = 64, K = 64;
  auto x = adversarial_data(M, K, 4, true);
  const Tensor xb = to_bf16_tensor(M, K, x);  // x now holds the bf16 values as fp32
  const Tensor xf = to_tensor(M, K, x);
  const Usage both{true, true};
  auto same = [](const QuantizedTensor& a, const QuantizedTensor& b) {
    EXPECT_EQ(bytes_of(a.rowwise_data), bytes_of(b.rowwise_data));
    EXPECT_EQ(bytes_of(a.columnwise_data), bytes_of(b.columnwise_data));
    EXPECT_EQ(bytes_of(a.rowwise_scale_inv), bytes_of(b.rowwise_scale_inv));
    EXPECT_EQ(bytes_of(a.columnwise_scale_inv), bytes_of(b.columnwise_scale_inv));
  };
  same(quantize_current(xb, DType::kE4M3, both), quantize_current(xf, DType::kE4M3, both));
  same(quantize_mxfp8(xb, DType::kE4M3, both), quantize_mxfp8(xf, DType::kE4M3, both));
  same(quantize_block(xb, ScalingMode::kBlock1x128, DType::kE4M3, both),
       quantize_block(xf, ScalingMode::kBlock1x128, DType::kE4M3, both));
  same(quantize_block(xb, ScalingMode::kBlock128x128, DType::kE5M2, both),
       quantize_block(xf, ScalingMode::kBlock128x128, DType::kE5M2, both));
}

// ---- delayed scaling ---------------------------------------------------------------------------

float scalar(const Tensor& t) { return t.to_vector<float>()[0]; }
Tensor amax_t(float a) { return Tensor::from_vector<float>({1}, {a}); }

TEST(QuantizeTest, DelayedScalingWindowMax) {
  DelayedScalingState s = make_delayed_scaling_state(3, Device::cpu());
  EXPECT_EQ(scalar(s.scale), 1.0f);  // the first step quantizes with scale 1
  const float max = 448.0f;
  // Step 1: two quantizations in the step max-accumulate into the current slot.
  record_amax(s, amax_t(1.5f));
  record_amax(s, amax_t(2.0f));
  record_amax(s, amax_t(-0.5f));  // amax is a magnitude
  update_delayed_scaling(s, AmaxAlgo::kMax, 0, max);
  EXPECT_EQ(scalar(s.scale), 224.0f);
  EXPECT_EQ(s.amax_history.to_vector<float>(), (std::vector<float>{0, 0, 2}));
  record_amax(s, amax_t(4.0f));
  update_delayed_scaling(s, AmaxAlgo::kMax, 0, max);
  EXPECT_EQ(scalar(s.scale), 112.0f);
  EXPECT_EQ(s.amax_history.to_vector<float>(), (std::vector<float>{0, 2, 4}));
  record_amax(s, amax_t(1.0f));
  update_delayed_scaling(s, AmaxAlgo::kMax, 0, max);  // window {1, 2, 4}
  EXPECT_EQ(scalar(s.scale), 112.0f);
  record_amax(s, amax_t(0.5f));
  update_delayed_scaling(s, AmaxAlgo::kMax, 0, max);  // window {0.5, 4, 1}: 2 dropped
  EXPECT_EQ(scalar(s.scale), 112.0f);
  record_amax(s, amax_t(0.25f));
  update_delayed_scaling(s, AmaxAlgo::kMax, 0, max);  // window {0.25, 1, 0.5}: 4 dropped
  EXPECT_EQ(scalar(s.scale), 448.0f);
}

TEST(QuantizeTest, DelayedScalingMostRecentMarginAndEdges) {
  DelayedScalingState s = make_delayed_scaling_state(4, Device::cpu());
  record_amax(s, amax_t(8.0f));
  update_delayed_scaling(s, AmaxAlgo::kMostRecent, 1, 57344.0f);
  EXPECT_EQ(scalar(s.scale), 57344.0f / 8.0f / 2.0f);
  record_amax(s, amax_t(3.0f));
  update_delayed_scaling(s, AmaxAlgo::kMostRecent, 2, 448.0f);
  EXPECT_EQ(scalar(s.scale), testref::div32(448.0f, 3.0f) / 4.0f);
  const float before = scalar(s.scale);
  // amax 0 (nothing recorded this step): most_recent keeps the previous scale.
  update_delayed_scaling(s, AmaxAlgo::kMostRecent, 0, 448.0f);
  EXPECT_EQ(scalar(s.scale), before);
  record_amax(s, amax_t(kInf));
  update_delayed_scaling(s, AmaxAlgo::kMostRecent, 0, 448.0f);
  EXPECT_EQ(scalar(s.scale), before);
  record_amax(s, amax_t(std::nanf("")));
  update_delayed_scaling(s, AmaxAlgo::kMostRecent, 0, 448.0f);
  EXPECT_EQ(scalar(s.scale), before);
  record_amax(s, amax_t(std::numeric_limits<float>::denorm_min()));
  update_delayed_scaling(s, AmaxAlgo::kMostRecent, 0, 448.0f);
  EXPECT_EQ(scalar(s.scale), kFltMax);  // infinite quotient
  // History length 1: the window is the current step only.
  DelayedScalingState one = make_delayed_scaling_state(1, Device::cpu());
  record_amax(one, amax_t(2.0f));
  update_delayed_scaling(one, AmaxAlgo::kMax, 0, 448.0f);
  EXPECT_EQ(scalar(one.scale), 224.0f);
  EXPECT_EQ(one.amax_history.to_vector<float>(), (std::vector<float>{0}));
  EXPECT_THROW(make_delayed_scaling_state(0, Device::cpu()), Error);
}

// ---- decode error bound (block-scaled recipes) -------------------------------------------------

// Checks the format's error bound on decoded values of a power-of-two block scale: si[i] is the
// scale_inv applied to element i (2^(e-127) for MXFP8, 1/scale for block scaling). Because si is a
// power of two, v = x / si is what the quantizer cast (x * 2^k is exact in fp32 while it stays
// normal), and q * si is the exact decode. So:
//   - |v| in the fp8 normal range [2^(1-bias), max]: the cast is off by at most half an ulp of v's
//     binade, |d - x| <= 2^-(mbits+1) |x|, plus 2^-150 (half an fp32 denormal) when x itself is an
//     fp32 subnormal and the decode multiply rounds;
//   - |v| below the fp8 normal range: at most half the smallest fp8 subnormal spacing,
//     2^-(bias+mbits) in the scaled domain, plus 2^-150 if x * 2^k underflowed in fp32 first;
//     times si back in x's domain, plus 2^-150 for the decode multiply.
// Non-finite x, NaN blocks (MXFP8 exponent 255: si NaN) and saturated elements (|v| > max: only in
// blocks whose amax was inf) carry no error bound and are left out; the return value counts the
// elements checked in each branch so a caller can see both were exercised.
struct BoundCounts {
  int64_t normal = 0;
  int64_t subnormal = 0;  // nonzero x whose scaled value is below the fp8 normal range
  BoundCounts& operator+=(const BoundCounts& o) {
    normal += o.normal;
    subnormal += o.subnormal;
    return *this;
  }
};
BoundCounts expect_decoded_within_bound(const std::vector<float>& x, const std::vector<float>& d,
                                        const std::vector<double>& si, const Fp8Model& model,
                                        const char* what) {
  const double tiny = std::ldexp(1.0, -150);
  const double min_normal = std::ldexp(1.0, 1 - model.bias);
  BoundCounts n;
  for (size_t i = 0; i < x.size(); ++i) {
    const double xv = x[i];
    if (!std::isfinite(xv) || !std::isfinite(si[i])) continue;
    const double v = std::fabs(xv) / si[i];
    if (v > model.max) continue;
    const double err = std::fabs(static_cast<double>(d[i]) - xv);
    double bound;
    if (v >= min_normal) {
      bound = std::ldexp(std::fabs(xv), -(model.mbits + 1)) +
              (std::fabs(xv) < std::ldexp(1.0, -126) ? tiny : 0.0);
      ++n.normal;
    } else {
      bound = (std::ldexp(1.0, -(model.bias + model.mbits)) + tiny) * si[i] + tiny;
      n.subnormal += xv != 0;
    }
    EXPECT_LE(err, bound) << what << " element " << i << " x=" << std::hexfloat << x[i]
                          << " d=" << d[i] << " scale_inv=" << si[i];
    if (err > bound) break;  // one report per copy is enough
  }
  return n;
}

// ---- MXFP8 -------------------------------------------------------------------------------------

// `counts` (optional) receives how many elements the decode error bound checked in each branch.
void expect_mxfp8_matches_reference(const std::vector<float>& x, int64_t M, int64_t K, DType f,
                                    BoundCounts* counts = nullptr) {
  const bool e5m2 = f == DType::kE5M2;
  const Fp8Model model = Fp8Model::make(e5m2);
  const QuantizedTensor q = quantize_mxfp8(to_tensor(M, K, x), f, {true, true});
  ASSERT_EQ(q.rowwise_scale_inv.shape(), (Shape{M, K / 32}));
  ASSERT_EQ(q.columnwise_scale_inv.shape(), (Shape{M / 32, K}));
  ASSERT_EQ(q.columnwise_data.shape(), (Shape{M, K}));
  const auto row = bytes_of(q.rowwise_data);
  const auto rs = bytes_of(q.rowwise_scale_inv);
  const auto col = bytes_of(q.columnwise_data);
  const auto cs = bytes_of(q.columnwise_scale_inv);
  auto check_block = [&](size_t base, size_t stride, uint8_t got_e, const std::vector<uint8_t>& d) {
    const float amax = testref::amax_of(x, base, stride, 32);
    const int e = testref::mxfp8_exponent(amax, model.max);
    ASSERT_EQ(got_e, e) << "block at " << base << " amax " << amax;
    const float mult = e == 255 ? NAN : static_cast<float>(std::ldexp(1.0, 127 - e));
    for (size_t i = 0; i < 32; ++i) {
      const size_t idx = base + i * stride;
      ASSERT_EQ(d[idx], model.encode(testref::mul32(x[idx], mult))) << "element " << idx;
      // Round-up rule: a finite block never saturates (except at the clamped exponent 254).
      if (std::isfinite(amax) && e < 254) {
        ASSERT_LE(std::fabs(testref::mul32(x[idx], mult)), model.max) << idx;
      }
    }
  };
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t kb = 0; kb < K / 32; ++kb) {
      check_block(static_cast<size_t>(m * K + kb * 32), 1,
                  rs[static_cast<size_t>(m * (K / 32) + kb)], row);
    }
  }
  for (int64_t mb = 0; mb < M / 32; ++mb) {
    for (int64_t k = 0; k < K; ++k) {
      check_block(static_cast<size_t>(mb * 32 * K + k), static_cast<size_t>(K),
                  cs[static_cast<size_t>(mb * K + k)], col);
    }
  }
  // Dequantization is exact: q * 2^(e-127).
  const auto d = dequantize(q, QuantizedCopy::kRowwise).to_vector<float>();
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) {
      const size_t i = static_cast<size_t>(m * K + k);
      const int e = rs[static_cast<size_t>(m * (K / 32) + k / 32)];
      const double want = model.decode(row[i]) * std::ldexp(1.0, e - 127);
      if (std::isnan(want)) {
        ASSERT_TRUE(std::isnan(d[i]));
      } else {
        // Exact in fp64, then one rounding to fp32 (overflow to inf for saturated blocks whose
        // amax was inf: 448 * 2^127).
        ASSERT_EQ(d[i], static_cast<float>(want)) << i;
      }
    }
  }
  // Both copies within the format's error bound of the input.
  std::vector<double> row_si(x.size()), col_si(x.size());
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) {
      const size_t i = static_cast<size_t>(m * K + k);
      const int er = rs[static_cast<size_t>(m * (K / 32) + k / 32)];
      const int ec = cs[static_cast<size_t>((m / 32) * K + k)];
      row_si[i] = er == 255 ? NAN : std::ldexp(1.0, er - 127);
      col_si[i] = ec == 255 ? NAN : std::ldexp(1.0, ec - 127);
    }
  }
  const BoundCounts nr = expect_decoded_within_bound(
      x, dequantize(q, QuantizedCopy::kRowwise).to_vector<float>(), row_si, model, "rowwise");
  const BoundCounts nc = expect_decoded_within_bound(
      x, dequantize(q, QuantizedCopy::kColumnwise).to_vector<float>(), col_si, model, "colwise");
  if (counts != nullptr) {
    *counts = nr;
    *counts += nc;
  }
}

TEST(QuantizeTest, Mxfp8MatchesFp64RuleRandom) {
  BoundCounts n;
  expect_mxfp8_matches_reference(random_data(64, 96, 2, 5.0f), 64, 96, DType::kE4M3, &n);
  EXPECT_GT(n.normal, 0);
  expect_mxfp8_matches_reference(random_data(32, 32, 3, 1e-3f), 32, 32, DType::kE5M2, &n);
  EXPECT_GT(n.normal, 0);
}

TEST(QuantizeTest, Mxfp8MatchesFp64RuleAdversarial) {
  // The outlier and small-row regions put many nonzero elements below e4m3's normal range after
  // scaling, so both branches of the decode bound run (measured: 13561 normal / 13063 subnormal
  // checks for the first call, 8192 / 4094 for the second; e5m2's wider range leaves none).
  BoundCounts n;
  expect_mxfp8_matches_reference(adversarial_data(96, 160, 8, false), 96, 160, DType::kE4M3, &n);
  EXPECT_GT(n.normal, 0);
  EXPECT_GT(n.subnormal, 0);
  expect_mxfp8_matches_reference(adversarial_data(64, 128, 8, true), 64, 128, DType::kE4M3, &n);
  EXPECT_GT(n.normal, 0);
  EXPECT_GT(n.subnormal, 0);
  expect_mxfp8_matches_reference(adversarial_data(64, 64, 9, true), 64, 64, DType::kE5M2, &n);
  EXPECT_GT(n.normal, 0);
}

TEST(QuantizeTest, Mxfp8ScaleExponentEdges) {
  // One block per row: amax chosen to land on each branch of the E8M0 rule.
  const std::vector<float> amaxes = {0.0f,
                                     448.0f,                           // v = 1 exactly -> 127
                                     std::nextafter(448.0f, 1000.0f),  // round up -> 128
                                     kFltMax,                 // v = FLT_MAX/448 ~ 2^119.2 -> 247
                                     std::ldexp(1.0f, -140),  // v subnormal <= 2^-127
                                     std::ldexp(1.0f, -118),  // v slightly > 2^-127
                                     kInf,
                                     std::nanf("")};
  const int64_t M = 32, K = 32;
  std::vector<float> x(static_cast<size_t>(M * K), 0.0f);
  for (size_t r = 0; r < amaxes.size(); ++r) x[r * K + 3] = amaxes[r];
  const QuantizedTensor q = quantize_mxfp8(to_tensor(M, K, x), DType::kE4M3, {true, false});
  const auto rs = bytes_of(q.rowwise_scale_inv);
  EXPECT_EQ(rs[0], 0);
  EXPECT_EQ(rs[1], 127);
  EXPECT_EQ(rs[2], 128);
  EXPECT_EQ(rs[3], 247);  // a finite amax never reaches exponent 254 (v <= FLT_MAX/448)
  EXPECT_EQ(rs[4], 0);
  EXPECT_EQ(rs[5], 1);
  EXPECT_EQ(rs[6], 0xFE);
  EXPECT_EQ(rs[7], 0xFF);
  for (size_t r = 0; r < amaxes.size(); ++r) {
    EXPECT_EQ(rs[r], testref::mxfp8_exponent(amaxes[r], 448.0f)) << r;
  }
}

TEST(QuantizeTest, Mxfp8RejectsNonQuantizableShapesNamingThem) {
  for (const Shape& s : {Shape{33, 64}, Shape{64, 48}, Shape{2, 3, 32}}) {
    try {
      quantize_mxfp8(Tensor::zeros(s, DType::kFloat32, Device::cpu()));
      FAIL() << s.str();
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::kInput);
      EXPECT_NE(e.message().find(s.str()), std::string::npos) << e.message();
    }
  }
  // Leading dims are flattened: [2, 16, 32] is M = 32.
  EXPECT_NO_THROW(quantize_mxfp8(Tensor::zeros({2, 16, 32}, DType::kFloat32, Device::cpu())));
}

TEST(QuantizeTest, Mxfp8PaddingAndSwizzle) {
  const int64_t M = 160, K = 96;  // rowwise scales [160, 3] -> padded [256, 4]
  const QuantizedTensor q =
      quantize_mxfp8(to_tensor(M, K, random_data(M, K, 1)), DType::kE4M3, {true, true});
  const Tensor rp = mxfp8_pad_scales(q.rowwise_scale_inv, QuantizedCopy::kRowwise);
  ASSERT_EQ(rp.shape(), (Shape{256, 4}));
  const Tensor cp = mxfp8_pad_scales(q.columnwise_scale_inv, QuantizedCopy::kColumnwise);
  ASSERT_EQ(cp.shape(), (Shape{8, 128}));  // [roundup(5,4), roundup(96,128)]
  const auto rs = bytes_of(q.rowwise_scale_inv);
  const auto rpb = bytes_of(rp);
  for (int64_t r = 0; r < 256; ++r) {
    for (int64_t c = 0; c < 4; ++c) {
      const uint8_t want = (r < M && c < 3) ? rs[static_cast<size_t>(r * 3 + c)] : 0;
      ASSERT_EQ(rpb[static_cast<size_t>(r * 4 + c)], want) << r << "," << c;
    }
  }
  // The swizzle is a permutation of the padded bytes placed by the docs/design.md formula.
  for (QuantizedCopy which : {QuantizedCopy::kRowwise, QuantizedCopy::kColumnwise}) {
    const Tensor& padded = which == QuantizedCopy::kRowwise ? rp : cp;
    const bool rowwise = which == QuantizedCopy::kRowwise;
    const int64_t R = rowwise ? padded.shape()[0] : padded.shape()[1];
    const int64_t C = rowwise ? padded.shape()[1] : padded.shape()[0];
    std::set<int64_t> seen;
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t c = 0; c < C; ++c) {
        const int64_t off = mxfp8_swizzle_offset(r, c, C);
        EXPECT_EQ(off, ((r / 128) * ((C + 3) / 4) + c / 4) * 512 + (r % 32) * 16 +
                           ((r % 128) / 32) * 4 + c % 4);
        seen.insert(off);
      }
    }
    EXPECT_EQ(static_cast<int64_t>(seen.size()), R * C);
    EXPECT_EQ(*seen.begin(), 0);
    EXPECT_EQ(*seen.rbegin(), R * C - 1);
    const auto sw = bytes_of(mxfp8_swizzle_scales(padded, which));
    const auto pb = bytes_of(padded);
    for (int64_t r = 0; r < R; ++r) {
      for (int64_t c = 0; c < C; ++c) {
        const int64_t src = rowwise ? r * C + c : c * R + r;
        ASSERT_EQ(sw[static_cast<size_t>(mxfp8_swizzle_offset(r, c, C))],
                  pb[static_cast<size_t>(src)]);
      }
    }
  }
  // Spot values of the formula: row 32 of a tile goes to byte 4, row 1 to byte 16, col 4 to the
  // next 512-byte tile.
  EXPECT_EQ(mxfp8_swizzle_offset(32, 0, 4), 4);
  EXPECT_EQ(mxfp8_swizzle_offset(1, 0, 4), 16);
  EXPECT_EQ(mxfp8_swizzle_offset(0, 4, 8), 512);
  EXPECT_EQ(mxfp8_swizzle_offset(128, 0, 8), 1024);
}

// ---- block scaling -----------------------------------------------------------------------------

// `counts` (optional) receives how many elements the decode error bound checked in each branch.
// `pow2` and `eps`: the scale options (TE QParams power_2_scale, amax_epsilon).
void expect_block_matches_reference(const std::vector<float>& x, int64_t M, int64_t K,
                                    ScalingMode mode, DType f, BoundCounts* counts = nullptr,
                                    bool pow2 = true, float eps = 0.0f) {
  const bool e5m2 = f == DType::kE5M2;
  const Fp8Model model = Fp8Model::make(e5m2);
  const QuantizedTensor q = quantize_block(to_tensor(M, K, x), mode, f, {true, true}, pow2, eps);
  const int64_t mb = (M + 127) / 128;
  const int64_t kb = (K + 127) / 128;
  const bool tile = mode == ScalingMode::kBlock128x128;
  ASSERT_EQ(q.rowwise_scale_inv.shape(), tile ? (Shape{mb, kb}) : (Shape{M, kb}));
  ASSERT_EQ(q.columnwise_scale_inv.shape(), tile ? (Shape{kb, mb}) : (Shape{K, mb}));
  ASSERT_EQ(q.columnwise_data.shape(), (Shape{K, M}));
  const auto row = bytes_of(q.rowwise_data);
  const auto col = bytes_of(q.columnwise_data);
  const auto rs = floats_of(q.rowwise_scale_inv);
  const auto cs = floats_of(q.columnwise_scale_inv);
  // fp64 scale of a block [m0, m1) x [k0, k1).
  auto block_scale = [&](int64_t m0, int64_t m1, int64_t k0, int64_t k1) {
    double a = 0;
    bool nan = false;
    for (int64_t m = m0; m < m1; ++m) {
      for (int64_t k = k0; k < k1; ++k) {
        const float v = x[static_cast<size_t>(m * K + k)];
        nan |= std::isnan(v);
        a = std::max(a, std::fabs(static_cast<double>(v)));
      }
    }
    return testref::current_scale(nan ? NAN : static_cast<float>(a), model.max, eps, pow2);
  };
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) {
      float s_row, s_col;
      if (tile) {
        const int64_t m0 = m / 128 * 128, k0 = k / 128 * 128;
        s_row = s_col = block_scale(m0, std::min(M, m0 + 128), k0, std::min(K, k0 + 128));
        ASSERT_EQ(rs[static_cast<size_t>((m / 128) * kb + k / 128)], testref::div32(1.0f, s_row));
        ASSERT_EQ(cs[static_cast<size_t>((k / 128) * mb + m / 128)], testref::div32(1.0f, s_col));
      } else {
        const int64_t k0 = k / 128 * 128, m0 = m / 128 * 128;
        s_row = block_scale(m, m + 1, k0, std::min(K, k0 + 128));
        s_col = block_scale(m0, std::min(M, m0 + 128), k, k + 1);
        ASSERT_EQ(rs[static_cast<size_t>(m * kb + k / 128)], testref::div32(1.0f, s_row));
        ASSERT_EQ(cs[static_cast<size_t>(k * mb + m / 128)], testref::div32(1.0f, s_col));
      }
      const float xv = x[static_cast<size_t>(m * K + k)];
      ASSERT_EQ(row[static_cast<size_t>(m * K + k)], model.encode(testref::mul32(xv, s_row)))
          << m << "," << k;
      ASSERT_EQ(col[static_cast<size_t>(k * M + m)], model.encode(testref::mul32(xv, s_col)))
          << m << "," << k;
    }
  }
  // Dequantize both copies: exact decode times a power of two, in logical positions.
  BoundCounts n;
  for (QuantizedCopy which : {QuantizedCopy::kRowwise, QuantizedCopy::kColumnwise}) {
    const auto d = dequantize(q, which).to_vector<float>();
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t k = 0; k < K; ++k) {
        const bool rw = which == QuantizedCopy::kRowwise;
        const uint8_t qb =
            rw ? row[static_cast<size_t>(m * K + k)] : col[static_cast<size_t>(k * M + m)];
        const float si =
            rw ? rs[static_cast<size_t>(tile ? (m / 128) * kb + k / 128 : m * kb + k / 128)]
               : cs[static_cast<size_t>(tile ? (k / 128) * mb + m / 128 : k * mb + m / 128)];
        const double want = model.decode(qb) * static_cast<double>(si);
        const float got = d[static_cast<size_t>(m * K + k)];
        if (std::isnan(want)) {
          ASSERT_TRUE(std::isnan(got));
        } else {
          ASSERT_EQ(got, static_cast<float>(want));
        }
      }
    }
    // Within the format's error bound of the input. The bound assumes an exact decode, which
    // holds for power-of-2 scales only; fp32 scales add one fp32 rounding per element (checked
    // exactly above instead).
    if (!pow2) continue;
    std::vector<double> si(x.size());
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t k = 0; k < K; ++k) {
        si[static_cast<size_t>(m * K + k)] =
            which == QuantizedCopy::kRowwise
                ? rs[static_cast<size_t>(tile ? (m / 128) * kb + k / 128 : m * kb + k / 128)]
                : cs[static_cast<size_t>(tile ? (k / 128) * mb + m / 128 : k * mb + m / 128)];
      }
    }
    n += expect_decoded_within_bound(x, d, si, model,
                                     which == QuantizedCopy::kRowwise ? "rowwise" : "colwise");
  }
  if (counts != nullptr) *counts = n;
}

TEST(QuantizeTest, Block1x128MatchesFp64Rule) {
  BoundCounts n;
  expect_block_matches_reference(random_data(130, 200, 6, 2.0f), 130, 200, ScalingMode::kBlock1x128,
                                 DType::kE4M3, &n);
  EXPECT_GT(n.normal, 0);
  expect_block_matches_reference(adversarial_data(129, 257, 7, true), 129, 257,
                                 ScalingMode::kBlock1x128, DType::kE4M3, &n);
  EXPECT_GT(n.normal, 0);
  EXPECT_GT(n.subnormal, 0);  // measured 19336 normal / 34328 subnormal checks
  expect_block_matches_reference(random_data(5, 3, 6), 5, 3, ScalingMode::kBlock1x128, DType::kE5M2,
                                 &n);
  EXPECT_GT(n.normal, 0);
}

TEST(QuantizeTest, Block128x128MatchesFp64Rule) {
  BoundCounts n;
  expect_block_matches_reference(random_data(200, 130, 6, 2.0f), 200, 130,
                                 ScalingMode::kBlock128x128, DType::kE4M3, &n);
  EXPECT_GT(n.normal, 0);
  expect_block_matches_reference(adversarial_data(257, 129, 7, true), 257, 129,
                                 ScalingMode::kBlock128x128, DType::kE5M2, &n);
  EXPECT_GT(n.normal, 0);
  EXPECT_GT(n.subnormal, 0);  // measured 20926 normal / 24832 subnormal checks (e5m2)
}

// power_2_scale false (TE Float8BlockScaling with NVTE_FP8_BLOCK_SCALING_FP32_SCALES): fp32 scales
// fp8_max / amax, not rounded; eps clamps the block amax first.
TEST(QuantizeTest, BlockFp32ScalesAndEpsMatchFp64Rule) {
  expect_block_matches_reference(random_data(130, 200, 6, 2.0f), 130, 200, ScalingMode::kBlock1x128,
                                 DType::kE4M3, nullptr, false);
  expect_block_matches_reference(random_data(200, 130, 8, 2.0f), 200, 130,
                                 ScalingMode::kBlock128x128, DType::kE5M2, nullptr, false, 1e-3f);
  expect_block_matches_reference(adversarial_data(129, 257, 7, true), 129, 257,
                                 ScalingMode::kBlock1x128, DType::kE4M3, nullptr, true, 1e-3f);
  // One block with amax 3: 448/3 = 149.33 (fp32 scale) against 128 (power of 2); the bytes differ.
  std::vector<float> x(2 * 128, 0.0f);
  for (int k = 0; k < 128; ++k) {
    x[k] = k == 7 ? 3.0f : 0.37f * static_cast<float>(k % 5);
    x[128 + k] = 1e-6f;  // tiny amax: eps decides the scale
  }
  const Tensor t = to_tensor(2, 128, x);
  const QuantizedTensor p2 =
      quantize_block(t, ScalingMode::kBlock1x128, DType::kE4M3, {true, false});
  const QuantizedTensor f32 =
      quantize_block(t, ScalingMode::kBlock1x128, DType::kE4M3, {true, false}, false);
  EXPECT_EQ(floats_of(p2.rowwise_scale_inv)[0], 1.0f / 128.0f);
  const float s = testref::div32(448.0f, 3.0f);
  EXPECT_EQ(floats_of(f32.rowwise_scale_inv)[0], testref::div32(1.0f, s));
  int mantissa_bits = 0;  // a non-power-of-2 scale_inv has mantissa bits set
  for (float v : floats_of(f32.rowwise_scale_inv))
    mantissa_bits += (fmt8::float_bits(v) & 0x7FFFFF) != 0;
  EXPECT_GT(mantissa_bits, 0);
  EXPECT_NE(bytes_of(p2.rowwise_data), bytes_of(f32.rowwise_data));
  // eps 1e-2 on the 1e-6 block: scale = 448 / 1e-2 exactly as the formula says (pow2 off).
  const QuantizedTensor e =
      quantize_block(t, ScalingMode::kBlock1x128, DType::kE4M3, {true, false}, false, 1e-2f);
  EXPECT_EQ(floats_of(e.rowwise_scale_inv)[1], testref::div32(1.0f, testref::div32(448.0f, 1e-2f)));
  EXPECT_EQ(floats_of(f32.rowwise_scale_inv)[1],
            testref::div32(1.0f, testref::div32(448.0f, 1e-6f)));
  EXPECT_THROW(
      quantize_block(t, ScalingMode::kBlock1x128, DType::kE4M3, {true, false}, true, -1.0f), Error);
}

TEST(QuantizeTest, BlockScaleEdges) {
  // All-zero block -> scale 1 (scale_inv 1); a block of 1e-40 (subnormal) gets a huge power of
  // two; a block with amax 448 gets exactly 1; 449 -> 0.5.
  std::vector<float> x(4 * 128, 0.0f);
  for (int k = 0; k < 128; ++k) {
    x[128 + k] = 1e-40f;
    x[256 + k] = k == 5 ? 448.0f : 1.0f;
    x[384 + k] = k == 9 ? -449.0f : 1.0f;
  }
  const QuantizedTensor q =
      quantize_block(to_tensor(4, 128, x), ScalingMode::kBlock1x128, DType::kE4M3, {true, false});
  const auto rs = floats_of(q.rowwise_scale_inv);
  EXPECT_EQ(rs[0], 1.0f);
  EXPECT_EQ(rs[1], 1.0f / testref::current_scale(1e-40f, 448.0f, 0, true));
  EXPECT_EQ(rs[2], 1.0f);
  EXPECT_EQ(rs[3], 2.0f);
}

// ---- misc --------------------------------------------------------------------------------------

TEST(QuantizeTest, ScalingModeNames) {
  EXPECT_EQ(scaling_mode_name(ScalingMode::kMxfp8), "mxfp8");
  EXPECT_EQ(scaling_mode_name(ScalingMode::kBlock128x128), "block_128x128");
  EXPECT_EQ(scaling_mode_name(ScalingMode::kCurrentTensor), "current_tensor");
  EXPECT_EQ(scaling_mode_name(ScalingMode::kDelayedTensor), "delayed_tensor");
}

TEST(QuantizeTest, InputErrors) {
  const Tensor i32 = Tensor::zeros({4, 4}, DType::kInt32, Device::cpu());
  EXPECT_THROW(compute_amax(i32), Error);
  const Tensor x = Tensor::zeros({4, 4}, DType::kFloat32, Device::cpu());
  EXPECT_THROW(quantize_current(x, DType::kBFloat16, {}), Error);
  EXPECT_THROW(quantize_block(x, ScalingMode::kMxfp8), Error);
  QuantizedTensor q = quantize_current(x, DType::kE4M3, {true, false});
  try {
    dequantize(q, QuantizedCopy::kColumnwise);
    FAIL();
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInput);
    EXPECT_NE(e.message().find("columnwise"), std::string::npos);
  }
}

TEST(QuantizeTest, Transpose) {
  std::vector<float> v(6);
  for (int i = 0; i < 6; ++i) v[static_cast<size_t>(i)] = static_cast<float>(i);
  const auto t = transpose_2d(Tensor::from_vector<float>({2, 3}, v));
  EXPECT_EQ(t.shape(), (Shape{3, 2}));
  EXPECT_EQ(t.to_vector<float>(), (std::vector<float>{0, 3, 1, 4, 2, 5}));
}

}  // namespace
}  // namespace meshproof::kernels
