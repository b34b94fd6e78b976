// NVFP4 CUDA kernels against the CPU reference: identical global amaxes, data bytes, scale codes
// and decoded values for 1x16 blocks, 16x16 tiles, the RHT and stochastic rounding, fp32 and bf16
// inputs. Skips without a usable device.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "gpu_bytes.h"
#include "kernels/core/device.h"
#include "kernels/core/formats.h"
#include "kernels/core/runtime.h"
#include "kernels/quantize/nvfp4.h"

namespace meshproof::kernels {
namespace {

using testing::bytes_of;

// Normal data with zero, huge, subnormal and outlier regions, a NaN and an inf.
Tensor make_input(int64_t M, int64_t K, bool bf16, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> n(0.0f, 2.0f);
  std::vector<float> v(static_cast<size_t>(M * K));
  for (int64_t i = 0; i < M * K; ++i) {
    float x = n(rng);
    const int64_t region = ((i / K / 16) + (i % K / 32)) % 6;
    if (region == 0) x = 0.0f;
    if (region == 1) x *= 1e30f;
    if (region == 2) x *= 1e-41f;
    if (region == 3 && i % 16 == 5) x = 3e4f;
    v[static_cast<size_t>(i)] = x;
  }
  if (!bf16) return Tensor::from_vector<float>({M, K}, v);
  Tensor t = Tensor::empty({M, K}, DType::kBFloat16, Device::cpu());
  auto* p = static_cast<uint16_t*>(t.raw_data());
  for (size_t i = 0; i < v.size(); ++i) p[i] = fmt8::float_to_bf16(v[i]);
  return t;
}

void expect_same(const QuantizedTensor& c, const QuantizedTensor& g, const std::string& what) {
  EXPECT_EQ(bytes_of(c.rowwise_data), bytes_of(g.rowwise_data)) << what;
  EXPECT_EQ(bytes_of(c.rowwise_scale_inv), bytes_of(g.rowwise_scale_inv)) << what;
  EXPECT_EQ(bytes_of(c.columnwise_data), bytes_of(g.columnwise_data)) << what;
  EXPECT_EQ(bytes_of(c.columnwise_scale_inv), bytes_of(g.columnwise_scale_inv)) << what;
  EXPECT_EQ(bytes_of(c.amax), bytes_of(g.amax)) << what;
  EXPECT_EQ(bytes_of(c.columnwise_amax), bytes_of(g.columnwise_amax)) << what;
  EXPECT_EQ(bytes_of(dequantize_nvfp4(c, true)), bytes_of(dequantize_nvfp4(g, true))) << what;
  EXPECT_EQ(bytes_of(dequantize_nvfp4(c, false)), bytes_of(dequantize_nvfp4(g, false))) << what;
}

TEST(Nvfp4Gpu, ByteEqualToCpu) {
  MP_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  for (const auto& [M, K] : {std::pair<int64_t, int64_t>{16, 16}, {64, 96}, {256, 512}}) {
    for (bool bf16 : {false, true}) {
      const Tensor x = make_input(M, K, bf16, static_cast<uint32_t>(M + K));
      const Tensor xg = x.to(gpu);
      for (int variant = 0; variant < 4; ++variant) {
        Nvfp4Options o;
        o.tile16x16 = variant == 1;
        o.rht = variant >= 2;
        if (variant == 3) o.rounding = {true, 99, 5, 1234, 16, 0, 0};
        const std::string what = fmt::format("[{}, {}] bf16 {} variant {}", M, K, bf16, variant);
        EXPECT_EQ(bytes_of(nvfp4_global_amax(x, o.rht)), bytes_of(nvfp4_global_amax(xg, o.rht)))
            << what;
        expect_same(quantize_nvfp4(x, o, {true, true}), quantize_nvfp4(xg, o, {true, true}), what);
      }
    }
  }
}

// The FP8 all-gather's NVFP4 pieces on the device (docs/design.md, "Host-device traffic per
// step"): quantizing a tiled weight, taking its tile codes and rebuilding both copies from the
// rowwise data are byte-equal to the CPU's, and none of it crosses between host and device (the
// global amaxes are split device-to-device).
TEST(Nvfp4Gpu, TiledRebuildOnTheDeviceByteEqualToCpuWithoutCopies) {
  MP_SKIP_WITHOUT_GPU();
  const Device gpu = Device::cuda(0);
  Nvfp4Options o;
  o.tile16x16 = true;
  for (const auto& [M, K] : {std::pair<int64_t, int64_t>{16, 16}, {48, 96}, {256, 512}}) {
    const Tensor x = make_input(M, K, true, static_cast<uint32_t>(3 * M + K));
    const Tensor xg = x.to(gpu);
    const std::string what = fmt::format("[{}, {}]", M, K);
    const QuantizedTensor row_c = quantize_nvfp4(x, o, {.rowwise = true, .columnwise = false});
    const QuantizedTensor got_c =
        nvfp4_tiled_from_rowwise(row_c.rowwise_data, nvfp4_tile_scales(row_c), row_c.amax);
    CopyCounter counter;
    QuantizedTensor got_g;
    Tensor tiles_g;
    {
      ScopedRankContext ctx(RankContext{0, gpu, nullptr, nullptr, &counter});
      const QuantizedTensor row_g = quantize_nvfp4(xg, o, {.rowwise = true, .columnwise = false});
      tiles_g = nvfp4_tile_scales(row_g);
      got_g = nvfp4_tiled_from_rowwise(row_g.rowwise_data, tiles_g, row_g.amax);
      synchronize_current();
    }
    EXPECT_EQ(counter.counts().total(), 0) << what;
    EXPECT_EQ(tiles_g.device(), gpu) << what;
    EXPECT_EQ(bytes_of(nvfp4_tile_scales(row_c)), bytes_of(tiles_g)) << what;
    expect_same(got_c, got_g, what);
  }
}

}  // namespace
}  // namespace meshproof::kernels
