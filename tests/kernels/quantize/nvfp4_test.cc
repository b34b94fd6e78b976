// NVFP4 (kernels/quantize/nvfp4.h, docs/design.md section 25) on the CPU: the E2M1 cast on every
// code, tie and signed zero; the two-level scale rules at their edges; layouts and nibble order;
// the RHT's orthogonality and the wgrad product identity; stochastic rounding unbiased and
// reproducible, and mesh-independent (a shard quantized with its offsets equals that part of the
// whole). The byte-for-byte check of whole tensors against an independent implementation is the
// numpy test (nvfp4_verb_test.py).
#include "kernels/quantize/nvfp4.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "kernels/core/error.h"
#include "kernels/core/formats.h"
#include "kernels/gemm/gemm.h"
#include "kernels/quantize/nvfp4_rules.h"
#include "kernels/quantize/quantize.h"

namespace meshproof::kernels {
namespace {

namespace nv = rules::nvfp4;

constexpr float kFltMax = std::numeric_limits<float>::max();
constexpr float kInf = std::numeric_limits<float>::infinity();
// Magnitudes of E2M1 codes 0..7, from the format definition (not from formats.h).
constexpr double kE2M1[8] = {0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0};

std::vector<uint8_t> bytes_of(const Tensor& t) {
  const auto* p = static_cast<const uint8_t*>(t.raw_data());
  return std::vector<uint8_t>(p, p + t.nbytes().value);
}
uint8_t code_at(const Tensor& data, int64_t i) {
  const uint8_t b = static_cast<const uint8_t*>(data.raw_data())[i / 2];
  return static_cast<uint8_t>((i & 1) ? b >> 4 : b & 0xFu);
}
Tensor make(int64_t M, int64_t K, const std::vector<float>& v) {
  return Tensor::from_vector<float>({M, K}, v);
}
std::vector<float> normal(int64_t n, uint32_t seed, float sd = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0.0f, sd);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = d(rng);
  return v;
}
double e2m1_value(uint8_t code) { return ((code & 8) ? -1.0 : 1.0) * kE2M1[code & 7]; }

// ---- E2M1 -----------------------------------------------------------------------------------

TEST(Nvfp4E2M1, EveryCodeDecodesAndRoundTrips) {
  for (int c = 0; c < 16; ++c) {
    const auto code = static_cast<uint8_t>(c);
    const double want = e2m1_value(code);
    EXPECT_EQ(static_cast<double>(fmt8::e2m1_to_float(code)), want) << "code " << c;
    // Every value encodes back to its code, except -0.0 (code 8): the contract gives -0 code 0.
    EXPECT_EQ(nv::e2m1_rne(fmt8::e2m1_to_float(code)), c == 8 ? 0 : c) << "code " << c;
  }
}

TEST(Nvfp4E2M1, EveryTieGoesToTheEvenMantissa) {
  // Midpoints between neighbouring magnitudes; the winner is the code with mantissa bit 0.
  const struct {
    float tie;
    uint8_t code;
  } ties[] = {{0.25f, 0}, {0.75f, 2}, {1.25f, 2}, {1.75f, 4}, {2.5f, 4}, {3.5f, 6}, {5.0f, 6}};
  for (const auto& t : ties) {
    EXPECT_EQ(nv::e2m1_rne(t.tie), t.code) << t.tie;
    EXPECT_EQ(nv::e2m1_rne(-t.tie), t.code | 8) << -t.tie;
    // Just off the tie: the nearer neighbour.
    const float above = std::nextafter(t.tie, 10.0f);
    const float below = std::nextafter(t.tie, 0.0f);
    const uint8_t lo = nv::e2m1_rne(below);
    const uint8_t hi = nv::e2m1_rne(above);
    EXPECT_EQ(hi, lo + 1) << t.tie;
    EXPECT_LT(std::abs(e2m1_value(lo) - below), std::abs(e2m1_value(lo + 1) - below));
  }
}

TEST(Nvfp4E2M1, SignedZerosAndNegativeUnderflowAndClamp) {
  EXPECT_EQ(nv::e2m1_rne(0.0f), 0);
  EXPECT_EQ(nv::e2m1_rne(-0.0f), 0);   // -0 is code 0
  EXPECT_EQ(nv::e2m1_rne(-0.25f), 8);  // negative, rounds to zero: code 8
  EXPECT_EQ(nv::e2m1_rne(-1e-45f), 8);
  EXPECT_EQ(nv::e2m1_rne(1e-45f), 0);
  EXPECT_EQ(nv::e2m1_rne(nv::clamp6(7.0f)), 7);
  EXPECT_EQ(nv::e2m1_rne(nv::clamp6(-kInf)), 15);
  EXPECT_EQ(nv::e2m1_rne(std::nanf("")), 7);  // documented: NaN -> +6
}

// Every 4099th fp32 bit pattern in [0, 6]: the code is the nearest magnitude in float64, ties to
// the even code, for both signs.
TEST(Nvfp4E2M1, SweepIsNearestInFloat64) {
  const uint32_t six = fmt8::float_bits(6.0f);
  for (uint32_t b = 0; b <= six; b += 4099) {
    const float x = fmt8::bits_float(b);
    int best = 0;
    for (int c = 1; c < 8; ++c) {
      const double d = std::abs(kE2M1[c] - x), db = std::abs(kE2M1[best] - x);
      if (d < db || (d == db && c % 2 == 0)) best = c;
    }
    ASSERT_EQ(nv::e2m1_rne(x), best) << x;
    ASSERT_EQ(nv::e2m1_rne(-x), x > 0.0f ? best | 8 : 0) << -x;
  }
}

// ---- scales and layouts ----------------------------------------------------------------------

TEST(Nvfp4Quantize, NibbleOrderAndExactValues) {
  // amax 6: S_enc = 448, dec = 448, enc = 1/(448 * fp32(1/448)) within an ulp of 1, so E2M1
  // values come through unchanged and element i carries code i.
  std::vector<float> v(16 * 16);
  for (int64_t i = 0; i < 16 * 16; ++i)
    v[static_cast<size_t>(i)] = static_cast<float>(e2m1_value(i % 16 == 8 ? 0 : i % 16));
  const QuantizedTensor q = quantize_nvfp4(make(16, 16, v), {}, {true, true});
  EXPECT_EQ(q.amax.data<float>()[0], 6.0f);
  EXPECT_EQ(q.rowwise_data.nbytes().value, 16 * 8);
  EXPECT_EQ(bytes_of(q.rowwise_data)[0], 0x10);  // element 0 low nibble, element 1 high nibble
  EXPECT_EQ(bytes_of(q.rowwise_data)[7], 0xFE);
  for (int64_t i = 0; i < 16; ++i) EXPECT_EQ(code_at(q.rowwise_data, i), i == 8 ? 0 : i);
  EXPECT_EQ(bytes_of(q.rowwise_scale_inv)[0], 0x7E);  // 448
  // Decode is fp32(fp32(e2m1 * 448) * fp32(1/448)): fp32(1/448) is inexact, so the value comes
  // back within one rounding (relative 2^-24) of the element, not necessarily exactly.
  const Tensor d = dequantize_nvfp4(q, true);
  for (int64_t i = 0; i < 256; ++i) {
    const float want = v[static_cast<size_t>(i)];
    EXPECT_EQ(d.data<float>()[i], (want * 448.0f) * (1.0f / 448.0f)) << i;
    EXPECT_LE(std::abs(d.data<float>()[i] - want), std::abs(want) * 0x1.0p-23f) << i;
  }
  // Columnwise [K, M]: element (m, k) at k * M + m. Column k holds one value, so its group has
  // its own block scale; the decode is within the E4M3 scale rounding (relative 2^-4) of it.
  const Tensor dc = dequantize_nvfp4(q, false);
  for (int64_t k = 0; k < 16; ++k) {
    const float want = v[static_cast<size_t>(3 * 16 + k)];
    EXPECT_LE(std::abs(dc.data<float>()[k * 16 + 3] - want), std::abs(want) / 16.0f) << k;
  }
}

TEST(Nvfp4Quantize, ZeroTensorAndZeroBlocks) {
  const QuantizedTensor z =
      quantize_nvfp4(make(16, 32, std::vector<float>(512, 0.0f)), {}, {true, true});
  EXPECT_EQ(nv::global_encode_scale(0.0f), kFltMax);  // 2688/0 = inf, capped
  for (uint8_t b : bytes_of(z.rowwise_data)) EXPECT_EQ(b, 0);
  for (uint8_t b : bytes_of(z.rowwise_scale_inv)) EXPECT_EQ(b, 0);
  for (int64_t i = 0; i < 512; ++i) EXPECT_EQ(dequantize_nvfp4(z, true).data<float>()[i], 0.0f);
  // One zero block among nonzero ones: scale code 0, codes 0, decodes to 0.
  std::vector<float> v = normal(16 * 32, 3);
  for (int k = 16; k < 32; ++k) v[static_cast<size_t>(5 * 32 + k)] = 0.0f;
  const QuantizedTensor q = quantize_nvfp4(make(16, 32, v), {}, {true, false});
  EXPECT_EQ(bytes_of(q.rowwise_scale_inv)[5 * 2 + 1], 0);
  EXPECT_EQ(nv::block_encode_scale(0, 1.0f / 448.0f), kFltMax);  // 1/0 capped
  for (int k = 16; k < 32; ++k)
    EXPECT_EQ(dequantize_nvfp4(q, true).data<float>()[5 * 32 + k], 0.0f);
}

TEST(Nvfp4Quantize, GlobalScaleEdges) {
  EXPECT_EQ(nv::global_encode_scale(kInf), 1.0f);       // 2688/inf = 0 -> 1
  EXPECT_EQ(nv::global_encode_scale(1e-39f), kFltMax);  // quotient overflows
  EXPECT_EQ(nv::global_encode_scale(6.0f), 448.0f);
  // amax FLT_MAX: S_enc = fp32(2688 / FLT_MAX), a normal number; the largest element takes
  // scale 448 and code 6, and decodes to fp32(fp32(6 * 448) * gds): within 2^-23 of FLT_MAX
  // relative, or +inf if that product rounds past FLT_MAX (it must not be NaN or small).
  std::vector<float> v = normal(16 * 16, 4);
  v[17] = kFltMax;
  v[40] = -kFltMax;
  const QuantizedTensor q = quantize_nvfp4(make(16, 16, v), {}, {true, false});
  const float s = nv::global_encode_scale(kFltMax);
  EXPECT_TRUE(std::isnormal(s));
  EXPECT_EQ(bytes_of(q.rowwise_scale_inv)[1], 0x7E);
  EXPECT_EQ(code_at(q.rowwise_data, 17), 7);
  EXPECT_EQ(code_at(q.rowwise_data, 40), 15);
  const float big = dequantize_nvfp4(q, true).data<float>()[17];
  EXPECT_TRUE(std::isinf(big) || std::abs(big / kFltMax - 1.0f) < 1.2e-7f) << big;
  // The small values of that tensor underflow to zero blocks: their dec rounds to code 0.
  EXPECT_EQ(bytes_of(q.rowwise_scale_inv)[5], 0);
}

TEST(Nvfp4Quantize, SubnormalBlocks) {
  // Global amax 1 and a block of fp32 subnormals: block_amax * mult ~ 1e-40 * 74.7 is far below
  // the smallest E4M3 (2^-9): scale code 0, the block decodes to zeros of the same sign class.
  std::vector<float> v = normal(16 * 32, 5, 0.25f);
  v[0] = 1.0f;
  for (int k = 16; k < 32; ++k)
    v[static_cast<size_t>(2 * 32 + k)] = (k % 2 ? -1.0f : 1.0f) * 1e-40f;
  const QuantizedTensor q = quantize_nvfp4(make(16, 32, v), {}, {true, false});
  EXPECT_EQ(bytes_of(q.rowwise_scale_inv)[2 * 2 + 1], 0);
  for (int k = 16; k < 32; ++k)
    EXPECT_EQ(dequantize_nvfp4(q, true).data<float>()[2 * 32 + k], 0.0f);
  // A tensor entirely subnormal: S_enc caps at FLT_MAX, gds = 1/FLT_MAX is itself subnormal; the
  // block scales are E4M3 of amax * FLT_MAX/6 and the values keep their E2M1 codes' signs.
  std::vector<float> s(16 * 16);
  for (size_t i = 0; i < s.size(); ++i)
    s[i] = (i % 3 ? 1.0f : -1.0f) * 1e-39f * static_cast<float>(i % 7);
  const QuantizedTensor t = quantize_nvfp4(make(16, 16, s), {}, {true, false});
  EXPECT_EQ(nv::global_encode_scale(t.amax.data<float>()[0]), kFltMax);
  for (size_t i = 0; i < s.size(); ++i) {
    const uint8_t c = code_at(t.rowwise_data, static_cast<int64_t>(i));
    if (s[i] < 0.0f) {
      EXPECT_EQ(c & 8, 8) << i;
    }
    if (s[i] == 0.0f) {
      EXPECT_EQ(c, 0) << i;
    }
  }
}

TEST(Nvfp4Quantize, BlockScaleSaturatesAt448) {
  // A global amax 4x below the block's amax (as when a shard's scale were not reduced): the
  // block's amax * mult = 4 * 448 clamps to 448 (code 0x7E) and its large elements clamp to +-6.
  std::vector<float> v = normal(16 * 16, 6);
  v[3] = 8.0f;
  const Tensor x = make(16, 16, v);
  const Tensor amax = Tensor::from_vector<float>({2}, {2.0f, 2.0f});
  const QuantizedTensor q = quantize_nvfp4(x, {}, {true, false}, amax);
  EXPECT_EQ(bytes_of(q.rowwise_scale_inv)[0], 0x7E);
  EXPECT_EQ(code_at(q.rowwise_data, 3), 7);
  EXPECT_EQ(nv::block_scale_code(kFltMax, kFltMax), 0x7E);  // overflowed product -> FLT_MAX -> 448
}

TEST(Nvfp4Quantize, TilesShareOneScalePerTile) {
  std::vector<float> v = normal(32 * 32, 7);
  v[5 * 32 + 20] = 40.0f;  // tile (0, 1)
  Nvfp4Options o;
  o.tile16x16 = true;
  const QuantizedTensor q = quantize_nvfp4(make(32, 32, v), o, {true, true});
  const auto rs = bytes_of(q.rowwise_scale_inv);     // [32, 2]
  const auto cs = bytes_of(q.columnwise_scale_inv);  // [32, 2]
  for (int r = 0; r < 16; ++r) {
    EXPECT_EQ(rs[static_cast<size_t>(r * 2 + 1)], rs[2 + 1]) << r;  // tile (0,1) on each row
    EXPECT_EQ(cs[static_cast<size_t>((16 + r) * 2)], rs[1]) << r;   // same tile, transposed
  }
  EXPECT_NE(rs[1], rs[0]);
}

TEST(Nvfp4Quantize, ShapeErrorsNameTheTensor) {
  try {
    quantize_nvfp4(make(24, 16, std::vector<float>(24 * 16, 1.0f)), {}, {true, false}, "x.weight");
    FAIL() << "no error";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInput);
    EXPECT_NE(std::string(e.what()).find("x.weight has shape [24, 16]"), std::string::npos)
        << e.what();
  }
  Nvfp4Options o;
  o.tile16x16 = true;
  o.rht = true;
  EXPECT_THROW(quantize_nvfp4(make(16, 16, std::vector<float>(256, 1.0f)), o, {true, true}), Error);
}

// ---- RHT -------------------------------------------------------------------------------------

TEST(Nvfp4Rht, TransformIsOrthogonal) {
  // The transform of the unit vectors e_i is row i of T = diag(d) H16 / 4; T T^T must be I.
  std::vector<float> eye(16 * 16, 0.0f);
  for (int i = 0; i < 16; ++i) eye[static_cast<size_t>(i * 16 + i)] = 1.0f;
  const Tensor t = nvfp4_rht_transpose(make(16, 16, eye));  // t[k, j] = T[k][j]
  for (int a = 0; a < 16; ++a) {
    for (int b = 0; b < 16; ++b) {
      double s = 0.0;
      for (int j = 0; j < 16; ++j)
        s += double(t.data<float>()[a * 16 + j]) * t.data<float>()[b * 16 + j];
      EXPECT_EQ(s, a == b ? 1.0 : 0.0) << a << "," << b;
    }
  }
  EXPECT_EQ(t.data<float>()[3 * 16 + 0], -0.25f);  // d_3 = -1, H[3][0] = 1
}

TEST(Nvfp4Rht, WgradProductIsUnchanged) {
  // wgrad = dy^T x = sum_m dy[m, n] x[m, k]. With both columnwise copies transformed along m, the
  // product is dy^T T_blk^T T_blk x = dy^T x. Each transformed value is the float64 sum rounded
  // once, a relative error <= 2^-24, so |sum_m dyt xt - sum_m dy x| <= 2 * 2^-24 * sum_m |dyt||xt|
  // (plus the float64 accumulation, negligible); the bound below is that, times 1.01.
  const int64_t M = 64, N = 16, K = 32;
  const std::vector<float> dy = normal(M * N, 8), x = normal(M * K, 9);
  const Tensor dyt = nvfp4_rht_transpose(make(M, N, dy));  // [N, M]
  const Tensor xt = nvfp4_rht_transpose(make(M, K, x));    // [K, M]
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) {
      double ref = 0.0, got = 0.0, mag = 0.0;
      for (int64_t m = 0; m < M; ++m) {
        ref += double(dy[static_cast<size_t>(m * N + n)]) * x[static_cast<size_t>(m * K + k)];
        const double p = double(dyt.data<float>()[n * M + m]) * xt.data<float>()[k * M + m];
        got += p;
        mag += std::abs(p);
      }
      ASSERT_LE(std::abs(got - ref), 1.01 * 2 * 0x1.0p-24 * mag) << n << "," << k;
    }
  }
}

// A NaN transform output (a NaN input, or +inf and -inf in one group) is stored as 0x7FC00000
// whatever the inputs' NaN payloads and signs: x86 and a GPU make different NaN bits, and the
// columnwise amax is a max over these bits (kernels/quantize/nvfp4_rules.h, rht16).
TEST(Nvfp4Rht, NanOutputsHaveOneBitPattern) {
  const float inf = std::numeric_limits<float>::infinity();
  std::vector<float> g(16, 0.5f);
  g[3] = inf;
  g[9] = -inf;
  float y[16];
  rules::nvfp4::rht16(g.data(), false, 0, 1, y);
  int nans = 0;
  for (float v : y) {
    if (std::isnan(v)) {
      ++nans;
      EXPECT_EQ(fmt8::float_bits(v), 0x7FC00000u);
    }
  }
  EXPECT_GT(nans, 0);   // inf - inf in the outputs where d_3 H[3][j] and d_9 H[9][j] agree
  EXPECT_LT(nans, 16);  // and +-inf where they differ
  g[9] = fmt8::bits_float(0xFFC00123u);  // a NaN with sign and payload: every output NaN
  rules::nvfp4::rht16(g.data(), false, 0, 1, y);
  for (float v : y) EXPECT_EQ(fmt8::float_bits(v), 0x7FC00000u);
}

TEST(Nvfp4Rht, ColumnwiseAmaxIsTakenAfterTheTransform) {
  std::vector<float> v(32 * 16, 0.0f);
  v[0] = 4.0f;  // one spike: its group's transform is +-1 everywhere
  const Tensor x = make(32, 16, v);
  const Tensor a = nvfp4_global_amax(x, true);
  EXPECT_EQ(a.data<float>()[0], 4.0f);
  EXPECT_EQ(a.data<float>()[1], 1.0f);
  Nvfp4Options o;
  o.rht = true;
  const QuantizedTensor q = quantize_nvfp4(x, o, {true, true});
  EXPECT_TRUE(q.columnwise_rht);
  EXPECT_EQ(q.columnwise_amax.data<float>()[0], 1.0f);
  const Tensor d = dequantize_nvfp4(q, false);  // [16, 32], transformed domain, exact here
  for (int j = 0; j < 16; ++j) EXPECT_EQ(std::abs(d.data<float>()[j]), 1.0f) << j;
}

// ---- stochastic rounding --------------------------------------------------------------------

TEST(Nvfp4StochasticRounding, UnbiasedOverManyDraws) {
  // Each draw is lo or hi = lo + step, up with probability f (to 2^-24): the per-draw standard
  // deviation is step * sqrt(f (1 - f)) <= step / 2, so the mean of N draws has standard deviation
  // <= step / (2 sqrt(N)). Bound: 6 of those plus the 2^-24 * step quantization of the draw
  // (a false failure would need a 6-sigma deviation; the draws are fixed, so the test is
  // deterministic). The round-to-nearest control misses the same bound by orders of magnitude.
  const int64_t N = 200000;
  const uint64_t stream = nv::sr_stream(3, 77);
  for (const float v : {0.3f, 0.7f, 1.1f, 1.6f, 2.6f, 3.9f, 4.9f, -0.2f, -3.3f, -5.5f}) {
    const float a = std::abs(v);
    int lo = 0;
    while (lo < 7 && kE2M1[lo + 1] <= a) ++lo;
    const double step = kE2M1[lo + 1] - kE2M1[lo];
    double sum = 0.0;
    for (int64_t i = 0; i < N; ++i) {
      const uint8_t c =
          nv::e2m1_stochastic(v, nv::sr_uniform(42, stream, static_cast<uint64_t>(i)));
      const double q = e2m1_value(c);
      ASSERT_TRUE(std::abs(q) == kE2M1[lo] || std::abs(q) == kE2M1[lo + 1]) << v << " -> " << q;
      sum += q;
    }
    const double bound = 6.0 * step / (2.0 * std::sqrt(double(N))) + step * 0x1.0p-24;
    EXPECT_LE(std::abs(sum / N - v), bound) << v;
    EXPECT_GT(std::abs(e2m1_value(nv::e2m1_rne(v)) - v), bound) << "control " << v;
  }
  // Exact E2M1 values never move; beyond 6 clamps.
  for (float u : {0.0f, 0.5f, 0.99999994f}) {
    EXPECT_EQ(nv::e2m1_stochastic(1.5f, u), 3);
    EXPECT_EQ(nv::e2m1_stochastic(-6.0f, u), 15);
  }
}

TEST(Nvfp4StochasticRounding, ReproducibleAndShardIndependent) {
  const int64_t M = 64, K = 48;
  const Tensor x = make(M, K, normal(M * K, 10));
  Nvfp4Options o;
  o.rht = true;
  o.rounding = {true, 1234, 7, 99, 0, 0, 0};
  const QuantizedTensor a = quantize_nvfp4(x, o, {true, true});
  const QuantizedTensor b = quantize_nvfp4(x, o, {true, true});
  EXPECT_EQ(bytes_of(a.rowwise_data), bytes_of(b.rowwise_data));
  EXPECT_EQ(bytes_of(a.columnwise_data), bytes_of(b.columnwise_data));
  Nvfp4Options next = o;
  next.rounding.step = 8;
  EXPECT_NE(bytes_of(quantize_nvfp4(x, next, {true, false}).rowwise_data),
            bytes_of(a.rowwise_data));
  Nvfp4Options rne = o;
  rne.rounding.stochastic = false;
  EXPECT_NE(bytes_of(quantize_nvfp4(x, rne, {true, false}).rowwise_data), bytes_of(a.rowwise_data));
  // The lower half of the rows as a shard at row0 = M/2 with the whole tensor's global amax
  // gives the bytes of the whole tensor's lower half (rowwise).
  const Tensor amax = nvfp4_global_amax(x, true);
  std::vector<float> lower(x.data<float>() + M / 2 * K, x.data<float>() + M * K);
  Nvfp4Options shard = o;
  shard.rounding.row0 = M / 2;
  shard.rounding.ld = K;
  const QuantizedTensor s = quantize_nvfp4(make(M / 2, K, lower), shard, {true, false}, amax);
  const auto whole = bytes_of(a.rowwise_data);
  EXPECT_EQ(bytes_of(s.rowwise_data),
            std::vector<uint8_t>(whole.begin() + M / 2 * K / 2, whole.end()));
}

TEST(Nvfp4Quantize, DecodeErrorWithinTheBlockStep) {
  // Each decoded element is within half an E2M1 step (3 at most, 1 near the top, in units of the
  // block's dec * gds) of the input, for 1x16, tiles and bf16 inputs.
  const int64_t M = 32, K = 64;
  const std::vector<float> v = normal(M * K, 11, 5.0f);
  for (bool tile : {false, true}) {
    Nvfp4Options o;
    o.tile16x16 = tile;
    const QuantizedTensor q = quantize_nvfp4(make(M, K, v), o, {true, false});
    const Tensor d = dequantize_nvfp4(q, true);
    const float gds = nv::global_decode_scale(nv::global_encode_scale(q.amax.data<float>()[0]));
    for (int64_t i = 0; i < M * K; ++i) {
      const float s = fmt8::e4m3_to_float(
          bytes_of(q.rowwise_scale_inv)[static_cast<size_t>(i / K * (K / 16) + i % K / 16)]);
      // Half the widest step (2 -> 1) times the block scale, plus the scale's own E4M3 rounding
      // (relative 2^-4) applied to the value: |d - x| <= s*gds + |x| / 16.
      ASSERT_LE(std::abs(d.data<float>()[i] - v[static_cast<size_t>(i)]),
                s * gds * 1.0001f + std::abs(v[static_cast<size_t>(i)]) / 16.0f)
          << i << " tile " << tile;
    }
  }
}

// ---- GEMMs on NVFP4 operands ------------------------------------------------------------------

// The CPU GEMM decodes NVFP4 operands with the quantizer's decode and sums in the fixed order, so
// it equals the same GEMM on the dequantized fp32 tensors bit for bit, for every role (wgrad on
// the RHT-domain columnwise copies of dY and X).
TEST(Nvfp4Gemm, EqualsTheGemmOfTheDecodedOperands) {
  const int64_t M = 32, N = 48, K = 64;
  const Tensor x = make(M, K, normal(M * K, 12)), w = make(N, K, normal(N * K, 13, 0.1f));
  const Tensor dy = make(M, N, normal(M * N, 14, 0.01f));
  Nvfp4Options act, wt, grad;
  act.rht = true;
  wt.tile16x16 = true;
  grad.rht = true;
  grad.rounding = {true, 5, 1, 2, 0, 0, 0};
  const QuantizedTensor qx = quantize_nvfp4(x, act, {true, true});
  const QuantizedTensor qw = quantize_nvfp4(w, wt, {true, true});
  const QuantizedTensor qdy = quantize_nvfp4(dy, grad, {true, true});
  const auto dq = [](const QuantizedTensor& q, bool row) {
    return dequantize(q, row ? QuantizedCopy::kRowwise : QuantizedCopy::kColumnwise);
  };
  Tensor y = Tensor::zeros({M, N}, DType::kFloat32), y2 = y.clone();
  gemm_fprop(&qx, &qw, y);
  const Tensor fx = dq(qx, true), fw = dq(qw, true);
  gemm_fprop(&fx, &fw, y2);
  EXPECT_EQ(bytes_of(y), bytes_of(y2));
  Tensor dx = Tensor::zeros({M, K}, DType::kFloat32), dx2 = dx.clone();
  gemm_dgrad(&qdy, &qw, dx);
  const Tensor fdy = dq(qdy, true), fwc = dq(qw, false);
  gemm_dgrad(&fdy, &fwc, dx2);
  EXPECT_EQ(bytes_of(dx), bytes_of(dx2));
  Tensor dw = Tensor::zeros({N, K}, DType::kFloat32), dw2 = dw.clone();
  gemm_wgrad(&qdy, &qx, dw);
  const Tensor fdyc = dq(qdy, false), fxc = dq(qx, false);
  gemm_wgrad(&fdyc, &fxc, dw2);
  EXPECT_EQ(bytes_of(dw), bytes_of(dw2));
  // And the RHT leaves wgrad close to the unquantized dY^T X: each operand element carries at
  // most half an E2M1 step (relative 1/4 at 1.5 -> 2, 1/6 elsewhere) plus its E4M3 scale's
  // rounding, so |dW - dY^T X| <= 0.25 * sum_m |dy||x| elementwise is a safe bound; the measured
  // worst ratio is recorded (worst_ratio: 0.18 on this data, 2026-11-24) and asserted below that.
  double worst = 0;
  for (int64_t n = 0; n < N; ++n) {
    for (int64_t k = 0; k < K; ++k) {
      double ref = 0, mag = 0;
      for (int64_t m = 0; m < M; ++m) {
        const double p = double(dy.data<float>()[m * N + n]) * x.data<float>()[m * K + k];
        ref += p;
        mag += std::abs(p);
      }
      worst = std::max(worst, std::abs(dw.data<float>()[n * K + k] - ref) / mag);
    }
  }
  EXPECT_LE(worst, 0.25);
  RecordProperty("worst_ratio", std::to_string(worst));
}

// ---- 16x16 tiles on the wire (the NVFP4 all-gather, docs/design.md section 28) ---------------

// A weight-like tensor with a wide range: N(0, 0.02) with one tile scaled up 40x and a few zeros,
// so tile codes differ and some tiles are near the global amax.
Tensor tiled_input(int64_t M, int64_t K, uint32_t seed) {
  std::vector<float> v = normal(M * K, seed, 0.02f);
  for (int64_t m = 16; m < 32 && m < M; ++m)
    for (int64_t k = 0; k < 16; ++k) v[static_cast<size_t>(m * K + k)] *= 40.0f;
  v[3] = 0.0f;
  v[static_cast<size_t>(K + 5)] = -0.0f;
  return make(M, K, v);
}

TEST(Nvfp4Tiles, RowwiseDataAndTileCodesRebuildBothCopies) {
  // The all-gather sends the rowwise data and one code per tile; the rebuilt tensor must be
  // byte-equal to quantizing with tiles and both copies, with the recipe's rounding and with the
  // nvfp4_block_scale_pow2 fault's scales alike (the columnwise copy is the transpose of the
  // rowwise copy whatever the scale rule, as long as both copies share tiles and global amax).
  for (const auto& [M, K] : {std::pair<int64_t, int64_t>{16, 16}, {48, 32}, {64, 128}}) {
    for (bool pow2 : {false, true}) {
      const Tensor x = tiled_input(M, K, static_cast<uint32_t>(M + K));
      Nvfp4Options o;
      o.tile16x16 = true;
      o.pow2_block_scales = pow2;
      const QuantizedTensor want = quantize_nvfp4(x, o, {.rowwise = true, .columnwise = true});
      const QuantizedTensor row = quantize_nvfp4(x, o, {.rowwise = true, .columnwise = false});
      const Tensor tiles = nvfp4_tile_scales(row);
      ASSERT_EQ(tiles.shape(), Shape({M / 16, K / 16}));
      const QuantizedTensor got = nvfp4_tiled_from_rowwise(row.rowwise_data, tiles, row.amax);
      const std::string ctx = fmt::format("[{}, {}] pow2={}", M, K, pow2);
      EXPECT_EQ(got.mode, ScalingMode::kNvfp4) << ctx;
      EXPECT_EQ(got.format, DType::kE2M1) << ctx;
      EXPECT_EQ(got.logical_shape, want.logical_shape) << ctx;
      EXPECT_EQ(bytes_of(got.rowwise_data), bytes_of(want.rowwise_data)) << ctx;
      EXPECT_EQ(bytes_of(got.rowwise_scale_inv), bytes_of(want.rowwise_scale_inv)) << ctx;
      EXPECT_EQ(bytes_of(got.columnwise_data), bytes_of(want.columnwise_data)) << ctx;
      EXPECT_EQ(bytes_of(got.columnwise_scale_inv), bytes_of(want.columnwise_scale_inv)) << ctx;
      EXPECT_EQ(bytes_of(got.amax), bytes_of(want.amax)) << ctx;
      EXPECT_EQ(bytes_of(got.columnwise_amax), bytes_of(want.columnwise_amax)) << ctx;
      // Not vacuous: the tiles do not all share one code (where there are several).
      const auto* t = static_cast<const uint8_t*>(tiles.raw_data());
      if (tiles.numel().value > 1) {
        EXPECT_NE(std::count(t, t + tiles.numel().value, t[0]), tiles.numel().value) << ctx;
      }
    }
  }
}

TEST(Nvfp4Tiles, OneByteBlocksAreNotTiles) {
  // With 1x16 blocks the codes differ within a tile's rows and the rebuilt tensor is not the
  // quantization: the rebuild is for tiled tensors only (its callers quantize weights with tiles).
  const Tensor x = tiled_input(32, 32, 7);
  const QuantizedTensor blocks =
      quantize_nvfp4(x, Nvfp4Options{}, {.rowwise = true, .columnwise = true});
  const QuantizedTensor got =
      nvfp4_tiled_from_rowwise(blocks.rowwise_data, nvfp4_tile_scales(blocks), blocks.amax);
  EXPECT_NE(bytes_of(got.rowwise_scale_inv), bytes_of(blocks.rowwise_scale_inv));
}

TEST(Nvfp4Tiles, BadShapesAreInputErrors) {
  const Tensor data = Tensor::empty({32, 24}, DType::kE2M1, Device::cpu());
  const Tensor tiles = Tensor::empty({2, 2}, DType::kE4M3, Device::cpu());
  const Tensor amax = Tensor::from_vector<float>({1}, {1.0f});
  try {
    (void)nvfp4_tiled_from_rowwise(data, tiles, amax);
    FAIL() << "K = 24 was accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInput);
    EXPECT_NE(e.message().find("[32, 24]"), std::string::npos) << e.message();
  }
  const Tensor data32 = Tensor::empty({32, 32}, DType::kE2M1, Device::cpu());
  const Tensor tiles_bad = Tensor::empty({2, 1}, DType::kE4M3, Device::cpu());
  try {
    (void)nvfp4_tiled_from_rowwise(data32, tiles_bad, amax);
    FAIL() << "tile codes [2, 1] for data [32, 32] were accepted";
  } catch (const Error& e) {
    EXPECT_EQ(e.kind(), ErrorKind::kInput);
    EXPECT_NE(e.message().find("e4m3 [2, 2]"), std::string::npos) << e.message();
  }
}

}  // namespace
}  // namespace meshproof::kernels
