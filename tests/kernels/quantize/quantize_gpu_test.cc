// CUDA quantizers against the CPU reference: identical bytes for every quantizer, copy, format,
// input dtype and several shapes (including partial tiles and multi-tile grids). Skips without a
// usable device.
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gpu_bytes.h"
#include "kernels/core/device.h"
#include "kernels/core/formats.h"
#include "kernels/quantize/quantize.h"

namespace meshproof::kernels {
namespace {

using testing::bytes_of;

// Random normal data with zeros, huge, subnormal-range blocks, an outlier per 32, a NaN, a -NaN
// and a -inf.
Tensor make_input(int64_t M, int64_t K, bool bf16, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 2.0f);
  std::vector<float> v(static_cast<size_t>(M * K));
  for (int64_t i = 0; i < M * K; ++i) {
    float x = n(rng);
    const int64_t m = i / K, k = i % K;
    const int64_t region = ((m / 32) + (k / 64)) % 6;
    if (region == 0) x = 0.0f;
    if (region == 1) x *= 1e36f;
    if (region == 2) x *= 1e-41f;
    if (region == 3 && k % 32 == 5) x = 3e4f;
    v[static_cast<size_t>(i)] = x;
  }
  if (M * K > 300) {
    v[123] = std::nanf("");
    v[200] = -std::nanf("");  // keeps its sign in the codes (rules::cast_element)
    v[static_cast<size_t>(M * K - 7)] = -std::numeric_limits<float>::infinity();
  }
  if (!bf16) return Tensor::from_vector<float>({M, K}, v);
  Tensor t = Tensor::empty({M, K}, DType::kBFloat16, Device::cpu());
  auto* p = static_cast<uint16_t*>(t.raw_data());
  for (size_t i = 0; i < v.size(); ++i) p[i] = fmt8::float_to_bf16(v[i]);
  return t;
}

void expect_same(const QuantizedTensor& cpu, const QuantizedTensor& gpu, const char* what) {
  EXPECT_EQ(bytes_of(cpu.rowwise_data), bytes_of(gpu.rowwise_data)) << what << " rowwise data";
  EXPECT_EQ(bytes_of(cpu.rowwise_scale_inv), bytes_of(gpu.rowwise_scale_inv)) << what;
  EXPECT_EQ(bytes_of(cpu.columnwise_data), bytes_of(gpu.columnwise_data)) << what << " col data";
  EXPECT_EQ(bytes_of(cpu.columnwise_scale_inv), bytes_of(gpu.columnwise_scale_inv)) << what;
  EXPECT_EQ(bytes_of(cpu.amax), bytes_of(gpu.amax)) << what << " amax";
  EXPECT_EQ(bytes_of(cpu.scale), bytes_of(gpu.scale)) << what << " scale";
  for (QuantizedCopy c : {QuantizedCopy::kRowwise, QuantizedCopy::kColumnwise}) {
    const bool present = c == QuantizedCopy::kRowwise ? cpu.has_rowwise() : cpu.has_columnwise();
    if (!present) continue;
    EXPECT_EQ(bytes_of(dequantize(cpu, c)), bytes_of(dequantize(gpu, c))) << what << " dequant";
  }
}

struct ShapeCase {
  int64_t M, K;
};

TEST(QuantizeGpuTest, AllQuantizersMatchCpuBytes) {
  MP_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  for (const ShapeCase s : {ShapeCase{32, 32}, ShapeCase{64, 96}, ShapeCase{96, 160},
                            ShapeCase{256, 384}, ShapeCase{1024, 2048}}) {
    for (bool bf16 : {false, true}) {
      const Tensor xc = make_input(s.M, s.K, bf16, static_cast<uint32_t>(s.M * 7 + s.K));
      const Tensor xg = xc.to(gpu);
      EXPECT_EQ(bytes_of(compute_amax(xc)), bytes_of(compute_amax(xg)));
      for (DType f : {DType::kE4M3, DType::kE5M2}) {
        for (Usage u : {Usage{true, false}, Usage{false, true}, Usage{true, true}}) {
          expect_same(quantize_current(xc, f, u), quantize_current(xg, f, u), "current");
          expect_same(quantize_current(xc, f, u, 0.0f, true),
                      quantize_current(xg, f, u, 0.0f, true), "current pow2");
          expect_same(quantize_mxfp8(xc, f, u), quantize_mxfp8(xg, f, u), "mxfp8");
          expect_same(quantize_block(xc, ScalingMode::kBlock1x128, f, u),
                      quantize_block(xg, ScalingMode::kBlock1x128, f, u), "block1x128");
          expect_same(quantize_block(xc, ScalingMode::kBlock128x128, f, u),
                      quantize_block(xg, ScalingMode::kBlock128x128, f, u), "block128x128");
          // recipe.eps and recipe.power_2_scale false (fp32 block scales): the same rule on both.
          expect_same(quantize_current(xc, f, u, 0.25f, false),
                      quantize_current(xg, f, u, 0.25f, false), "current eps");
          expect_same(quantize_block(xc, ScalingMode::kBlock1x128, f, u, false, 0.25f),
                      quantize_block(xg, ScalingMode::kBlock1x128, f, u, false, 0.25f),
                      "block1x128 fp32 scales eps");
          expect_same(quantize_block(xc, ScalingMode::kBlock128x128, f, u, false, 0.0f),
                      quantize_block(xg, ScalingMode::kBlock128x128, f, u, false, 0.0f),
                      "block128x128 fp32 scales");
          expect_same(quantize_block(xc, ScalingMode::kBlock128x128, f, u, true, 0.25f),
                      quantize_block(xg, ScalingMode::kBlock128x128, f, u, true, 0.25f),
                      "block128x128 eps");
        }
        const Tensor scale = Tensor::from_vector<float>({1}, {0.37f});
        expect_same(
            quantize_per_tensor(xc, scale, f, {true, true}, ScalingMode::kDelayedTensor),
            quantize_per_tensor(xg, scale.to(gpu), f, {true, true}, ScalingMode::kDelayedTensor),
            "delayed");
      }
    }
  }
}

TEST(QuantizeGpuTest, AwkwardShapesForPerTensorAndBlock) {
  MP_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  for (const ShapeCase s : {ShapeCase{1, 1}, ShapeCase{3, 5}, ShapeCase{33, 70},
                            ShapeCase{129, 257}, ShapeCase{300, 1}, ShapeCase{1, 300}}) {
    const Tensor xc = make_input(s.M, s.K, false, 99);
    const Tensor xg = xc.to(gpu);
    const Usage both{true, true};
    expect_same(quantize_current(xc, DType::kE4M3, both), quantize_current(xg, DType::kE4M3, both),
                "current");
    expect_same(quantize_block(xc, ScalingMode::kBlock1x128, DType::kE4M3, both),
                quantize_block(xg, ScalingMode::kBlock1x128, DType::kE4M3, both), "block1x128");
    expect_same(quantize_block(xc, ScalingMode::kBlock128x128, DType::kE5M2, both),
                quantize_block(xg, ScalingMode::kBlock128x128, DType::kE5M2, both), "block128x128");
    EXPECT_EQ(bytes_of(transpose_2d(xc)), bytes_of(transpose_2d(xg)));
  }
}

TEST(QuantizeGpuTest, ScaleRulesAndDelayedStateMatchCpu) {
  MP_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  std::mt19937 rng(5);
  for (int i = 0; i < 200; ++i) {
    const float a = fmt8::bits_float(rng());  // any bit pattern, NaN and inf included
    const Tensor ac = Tensor::from_vector<float>({1}, {a});
    for (bool pow2 : {false, true}) {
      EXPECT_EQ(bytes_of(compute_current_scale(ac, DType::kE4M3, 1e-12f, pow2)),
                bytes_of(compute_current_scale(ac.to(gpu), DType::kE4M3, 1e-12f, pow2)));
    }
  }
  DelayedScalingState sc = make_delayed_scaling_state(5, Device::cpu());
  DelayedScalingState sg = make_delayed_scaling_state(5, gpu);
  for (int step = 0; step < 12; ++step) {
    for (int j = 0; j < 2; ++j) {
      const float a = std::ldexp(1.0f + static_cast<float>(rng() % 100) / 100.0f,
                                 static_cast<int>(rng() % 20) - 10);
      const Tensor t = Tensor::from_vector<float>({1}, {a});
      record_amax(sc, t);
      record_amax(sg, t.to(gpu));
    }
    const AmaxAlgo algo = step % 3 == 0 ? AmaxAlgo::kMostRecent : AmaxAlgo::kMax;
    update_delayed_scaling(sc, algo, step % 2, 448.0f);
    update_delayed_scaling(sg, algo, step % 2, 448.0f);
    ASSERT_EQ(bytes_of(sc.scale), bytes_of(sg.scale)) << step;
    ASSERT_EQ(bytes_of(sc.amax_history), bytes_of(sg.amax_history)) << step;
  }
}

}  // namespace
}  // namespace meshproof::kernels
