// The vectorised CPU quantizers against the element-wise loops they replace (quantize_oracle.h):
// byte-equal data copies and scales for every recipe, both fp8 formats, fp32 and bf16 inputs,
// every usage, shapes with partial blocks, and inputs full of NaN, +-inf, subnormals, exact
// rounding ties and values beyond the format's range; the branchless encoder against
// fmt8::float_to_e4m3/e5m2 on 12.6 million bit patterns per format (every sign, exponent and top
// 12 mantissa bits, with the low bits at the rounding edges) and, in the `long` test, on all 2^32
// (docs/design.md section 21).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "kernels/core/formats.h"
#include "kernels/quantize/quantize.h"
#include "kernels/quantize/quantize_internal.h"
#include "tests/kernels/quantize/quantize_oracle.h"

namespace meshproof::kernels {
namespace {

std::vector<uint8_t> bytes_of(const Tensor& t) {
  if (!t.defined()) return {};
  const auto* p = static_cast<const uint8_t*>(t.raw_data());
  return std::vector<uint8_t>(p, p + t.nbytes().value);
}

void expect_same(const QuantizedTensor& got, const QuantizedTensor& want, const std::string& what) {
  EXPECT_EQ(bytes_of(got.rowwise_data), bytes_of(want.rowwise_data)) << what << " rowwise data";
  EXPECT_EQ(bytes_of(got.rowwise_scale_inv), bytes_of(want.rowwise_scale_inv))
      << what << " rowwise scale_inv";
  EXPECT_EQ(bytes_of(got.columnwise_data), bytes_of(want.columnwise_data))
      << what << " columnwise data";
  EXPECT_EQ(bytes_of(got.columnwise_scale_inv), bytes_of(want.columnwise_scale_inv))
      << what << " columnwise scale_inv";
}

// Exact midpoint between two adjacent finite codes of `format`: a rounding tie at scale 1.
float midpoint(DType format, std::mt19937& rng) {
  std::uniform_int_distribution<int> code(0, format == DType::kE4M3 ? 0x7D : 0x7A);
  const auto c = static_cast<uint8_t>(code(rng));
  const float lo = format == DType::kE4M3 ? fmt8::e4m3_to_float(c) : fmt8::e5m2_to_float(c);
  const float hi = format == DType::kE4M3 ? fmt8::e4m3_to_float(static_cast<uint8_t>(c + 1))
                                          : fmt8::e5m2_to_float(static_cast<uint8_t>(c + 1));
  return (lo + hi) * 0.5f;  // exact: both have at most 4 significant bits
}

// fp32 values: wide-range normals, specials (1 in 8), ties (1 in 8), and a few 0-blocks.
std::vector<float> adversarial(int64_t n, DType format, std::mt19937& rng) {
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::uniform_int_distribution<int> ex(-30, 30), pick(0, 7), sp(0, 9), sign(0, 1);
  const float specials[] = {std::numeric_limits<float>::quiet_NaN(),
                            -std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity(),
                            -std::numeric_limits<float>::infinity(),
                            std::numeric_limits<float>::denorm_min(),
                            -1e-40f,
                            0.0f,
                            -0.0f,
                            3.4e38f,
                            1e-30f};
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) {
    const int p = pick(rng);
    if (p == 0) {
      x = specials[sp(rng)];
    } else if (p == 1) {
      x = midpoint(format, rng) * (sign(rng) ? -1.0f : 1.0f);
    } else {
      x = std::ldexp(nd(rng), ex(rng));
    }
  }
  // A run of zeros (an all-zero block) and a run of subnormals.
  for (int64_t i = 0; i < std::min<int64_t>(n, 160); ++i) v[static_cast<size_t>(i)] = 0.0f;
  for (int64_t i = n / 2; i < std::min<int64_t>(n, n / 2 + 140); ++i)
    v[static_cast<size_t>(i)] = std::ldexp(1.0f + static_cast<float>(i % 7), -140);
  return v;
}

// Mostly finite inputs (1 special in 512), so that block scales are finite and the cast of
// ordinary values is what gets compared.
std::vector<float> mostly_finite(int64_t n, DType format, std::mt19937& rng) {
  std::vector<float> v = adversarial(n, format, rng);
  std::uniform_int_distribution<int> keep(0, 511);
  std::normal_distribution<float> nd(0.0f, 3.0f);
  for (float& x : v)
    if (!std::isfinite(x) && keep(rng) != 0) x = nd(rng);
  return v;
}

Tensor input(const std::vector<float>& v, int64_t M, int64_t K, bool bf16) {
  Tensor t = Tensor::from_vector<float>(Shape{M, K}, v);
  if (!bf16) return t;
  Tensor h = Tensor::empty(Shape{M, K}, DType::kBFloat16, Device::cpu());
  auto* p = static_cast<uint16_t*>(h.raw_data());
  for (size_t i = 0; i < v.size(); ++i) p[i] = fmt8::float_to_bf16(v[i]);
  return h;
}

const Usage kUsages[] = {{true, false}, {false, true}, {true, true}};

// Runs `body` with the AVX2 cast (when this CPU has it) and with the portable loop, restoring
// the default afterwards; the label says which one failed.
template <typename F>
void for_each_cast_kernel(F body) {
  std::vector<bool> modes = {false};
  detail::set_quantize_avx2(true);
  if (detail::quantize_avx2_active()) modes.push_back(true);
  for (bool avx2 : modes) {
    detail::set_quantize_avx2(avx2);
    SCOPED_TRACE(avx2 ? "AVX2 cast" : "portable cast");
    body();
  }
  detail::set_quantize_avx2(true);
}

struct Case {
  int64_t m, k;
};

TEST(QuantizeFast, PerTensorAndAmaxEqualElementLoops) {
  for_each_cast_kernel([&] {
    std::mt19937 rng(11);
    const Case shapes[] = {{1, 1}, {3, 5}, {33, 65}, {64, 128}, {70, 300}, {129, 31}};
    for (bool bf16 : {false, true}) {
      for (DType f : {DType::kE4M3, DType::kE5M2}) {
        for (const Case& c : shapes) {
          for (bool finite : {false, true}) {
            const auto v =
                finite ? mostly_finite(c.m * c.k, f, rng) : adversarial(c.m * c.k, f, rng);
            const Tensor x = input(v, c.m, c.k, bf16);
            const std::string what = fmt::format("{} {} [{}, {}] bf16={} finite={}", dtype_name(f),
                                                 "per-tensor", c.m, c.k, bf16, finite);
            const Tensor amax = compute_amax(x);
            ASSERT_EQ(bytes_of(amax), bytes_of(quantize_oracle::compute_amax(x))) << what;
            // The current scale of this data, and fixed scales (1: ties stay ties; 2^-3; 0.3).
            for (float sv : {compute_current_scale(amax, f).data<float>()[0], 1.0f, 0.125f, 0.3f}) {
              const Tensor scale = Tensor::from_vector<float>(Shape{1}, {sv});
              for (Usage u : kUsages) {
                expect_same(
                    quantize_per_tensor(x, scale, f, u, ScalingMode::kCurrentTensor),
                    quantize_oracle::quantize_per_tensor(x, scale, f, u,
                                                         ScalingMode::kCurrentTensor),
                    fmt::format("{} scale {} usage {}{}", what, sv, u.rowwise, u.columnwise));
              }
            }
          }
        }
      }
    }
  });
}

TEST(QuantizeFast, Mxfp8EqualsElementLoops) {
  for_each_cast_kernel([&] {
    std::mt19937 rng(12);
    const Case shapes[] = {{32, 32}, {64, 96}, {96, 320}, {160, 64}};
    for (bool bf16 : {false, true}) {
      for (DType f : {DType::kE4M3, DType::kE5M2}) {
        for (const Case& c : shapes) {
          for (bool finite : {false, true}) {
            const auto v =
                finite ? mostly_finite(c.m * c.k, f, rng) : adversarial(c.m * c.k, f, rng);
            const Tensor x = input(v, c.m, c.k, bf16);
            for (Usage u : kUsages) {
              expect_same(
                  quantize_mxfp8(x, f, u), quantize_oracle::quantize_mxfp8(x, f, u),
                  fmt::format("mxfp8 {} [{}, {}] bf16={} finite={} usage {}{}", dtype_name(f), c.m,
                              c.k, bf16, finite, u.rowwise, u.columnwise));
            }
          }
        }
      }
    }
  });
}

TEST(QuantizeFast, BlockEqualsElementLoops) {
  for_each_cast_kernel([&] {
    std::mt19937 rng(13);
    const Case shapes[] = {{1, 1}, {5, 130}, {128, 128}, {200, 77}, {129, 257}, {300, 140}};
    for (ScalingMode mode : {ScalingMode::kBlock1x128, ScalingMode::kBlock128x128}) {
      for (bool bf16 : {false, true}) {
        for (DType f : {DType::kE4M3, DType::kE5M2}) {
          for (const Case& c : shapes) {
            for (bool finite : {false, true}) {
              const auto v =
                  finite ? mostly_finite(c.m * c.k, f, rng) : adversarial(c.m * c.k, f, rng);
              const Tensor x = input(v, c.m, c.k, bf16);
              for (Usage u : kUsages) {
                for (auto [pow2, eps] : {std::pair{true, 0.0f}, std::pair{false, 1e-3f}}) {
                  expect_same(quantize_block(x, mode, f, u, pow2, eps),
                              quantize_oracle::quantize_block(x, mode, f, u, pow2, eps),
                              fmt::format("{} {} [{}, {}] bf16={} finite={} usage {}{} pow2={}",
                                          scaling_mode_name(mode), dtype_name(f), c.m, c.k, bf16,
                                          finite, u.rowwise, u.columnwise, pow2));
                }
              }
            }
          }
        }
      }
    }
  });
}

// Bit patterns as an fp32 tensor [1, n].
Tensor pattern_tensor(const std::vector<uint32_t>& patterns) {
  Tensor x = Tensor::empty(Shape{1, static_cast<int64_t>(patterns.size())}, DType::kFloat32,
                           Device::cpu());
  std::memcpy(x.raw_data(), patterns.data(), patterns.size() * 4);
  return x;
}

// The scalar encoder's codes of the fp32 values of `x` at scale 1.
std::vector<uint8_t> scalar_codes(DType f, const Tensor& x) {
  const float* v = x.data<float>();
  std::vector<uint8_t> want(static_cast<size_t>(x.numel().value));
  for (size_t i = 0; i < want.size(); ++i) {
    const float xi = v[i] * 1.0f;
    want[i] = f == DType::kE4M3 ? fmt8::float_to_e4m3(xi) : fmt8::float_to_e5m2(xi);
  }
  return want;
}

// Codes of the fp32 values of `x` through quantize_per_tensor at scale 1 (x * 1 is x, NaNs stay
// NaN) with the current cast kernel against `want` (scalar_codes); returns the number of
// mismatches and reports the first few.
int64_t encoder_mismatches(DType f, const Tensor& x, const std::vector<uint8_t>& want) {
  const Tensor one = Tensor::from_vector<float>(Shape{1}, {1.0f});
  const QuantizedTensor q =
      quantize_per_tensor(x, one, f, Usage{true, false}, ScalingMode::kDelayedTensor);
  const auto* got = static_cast<const uint8_t*>(q.rowwise_data.raw_data());
  const auto* bits = static_cast<const uint32_t*>(x.raw_data());
  int64_t bad = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    if (got[i] != want[i] && ++bad <= 5) {
      ADD_FAILURE() << dtype_name(f) << " input bits " << std::hex << bits[i] << " code "
                    << int(got[i]) << " want " << int(want[i]);
    }
  }
  return bad;
}

TEST(QuantizeFast, BranchlessEncoderOnEveryRoundingEdge) {
  for_each_cast_kernel([&] {
    // Every sign, exponent and top 12 mantissa bits (2^21 prefixes) x low 11 bits at the edges:
    // every tie of both formats (the round bit is at or above bit 11 for normal targets), the
    // values just above and below it, and every subnormal-target rounding position down to bit 11.
    const uint32_t lows[] = {0x000, 0x001, 0x3FF, 0x400, 0x401, 0x7FF};
    std::mt19937 rng(14);
    for (DType f : {DType::kE4M3, DType::kE5M2}) {
      for (uint32_t chunk = 0; chunk < 8; ++chunk) {
        std::vector<uint32_t> p;
        p.reserve((1u << 18) * 6);
        for (uint32_t prefix = chunk << 18; prefix < (chunk + 1) << 18; ++prefix)
          for (uint32_t low : lows) p.push_back((prefix << 11) | low);
        // Shuffled, so that neighbouring lanes of a vector hold unrelated values (a lane-order
        // mistake then changes the output).
        std::shuffle(p.begin(), p.end(), rng);
        const Tensor x = pattern_tensor(p);
        ASSERT_EQ(encoder_mismatches(f, x, scalar_codes(f, x)), 0)
            << dtype_name(f) << " chunk " << chunk;
      }
    }
  });
}

// All 2^32 fp32 inputs, both formats, both cast kernels (label long). Each chunk's patterns are
// written once into one reused tensor and the scalar encoder's codes computed once, then checked
// against each cast kernel (a fresh 64 MiB tensor per chunk and kernel and the scalar codes per
// kernel made this 164 s of one CPU under `make test` on the development machine, the suite's
// longest test).
TEST(QuantizeFastLong, BranchlessEncoderOnAllFp32Inputs) {
  constexpr int64_t kChunk = int64_t{1} << 24;
  Tensor x = Tensor::empty(Shape{1, kChunk}, DType::kFloat32, Device::cpu());
  auto* bits = static_cast<uint32_t*>(x.raw_data());
  for (DType f : {DType::kE4M3, DType::kE5M2}) {
    for (uint64_t base = 0; base < (uint64_t{1} << 32); base += kChunk) {
      for (int64_t i = 0; i < kChunk; ++i) bits[i] = static_cast<uint32_t>(base + i);
      const std::vector<uint8_t> want = scalar_codes(f, x);
      for_each_cast_kernel([&] {
        ASSERT_EQ(encoder_mismatches(f, x, want), 0) << dtype_name(f) << " from " << base;
      });
      if (HasFatalFailure()) return;
    }
  }
}

}  // namespace
}  // namespace meshproof::kernels
