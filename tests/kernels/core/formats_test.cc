// Exhaustive tests of kernels/core/formats.h against an independent fp64 model of each format:
// every code is decoded with the textbook formula in double, and every float->format conversion is
// compared with "nearest representable value (from the enumerated code table), ties to the even
// code, then the format's overflow rule", which shares no code with the bit-level encoder.
#include "kernels/core/formats.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "tests/kernels/core/format_probes.h"

namespace meshproof::kernels::fmt8 {
namespace {

// Reference conversion of a finite double: nearest entry, ties to the even code; saturation
// clamps to the largest finite value first.
uint32_t reference_encode(const FormatSpec& f, const std::vector<Entry>& table, double x) {
  const uint32_t sign = std::signbit(x) ? (1u << (total_bits(f) - 1)) : 0u;
  double a = std::fabs(x);
  const double max_finite = f.saturating ? table.back().value : table[table.size() - 2].value;
  if (f.saturating && a > max_finite) a = max_finite;
  if (!f.saturating && a >= table.back().value) return sign | f.inf_code;
  auto it = std::lower_bound(table.begin(), table.end(), a,
                             [](const Entry& e, double v) { return e.value < v; });
  if (it == table.end()) return sign | table.back().code;
  if (it->value == a || it == table.begin()) return sign | it->code;
  const Entry& hi = *it;
  const Entry& lo = *(it - 1);
  const double dlo = a - lo.value;
  const double dhi = hi.value - a;
  if (dlo < dhi) return sign | lo.code;
  if (dhi < dlo) return sign | hi.code;
  return sign | ((lo.code & 1u) == 0 ? lo.code : hi.code);
}

TEST(FormatsTest, DecodeEveryCodeMatchesFp64Formula) {
  for (const FormatSpec& f : all_formats()) {
    const uint32_t n = 1u << total_bits(f);
    for (uint32_t c = 0; c < n; ++c) {
      const uint32_t mag = c & ((1u << (total_bits(f) - 1)) - 1);
      const bool neg = (c >> (total_bits(f) - 1)) != 0;
      const float got = f.decode(c);
      if (f.is_nan(mag)) {
        EXPECT_TRUE(std::isnan(got)) << f.name << " code " << c;
        continue;
      }
      if (f.is_inf(mag)) {
        EXPECT_TRUE(std::isinf(got)) << f.name << " code " << c;
        EXPECT_EQ(std::signbit(got), neg);
        continue;
      }
      const double want = neg ? -reference_decode(f, mag) : reference_decode(f, mag);
      EXPECT_EQ(static_cast<double>(got), want) << f.name << " code " << c;
      EXPECT_EQ(std::signbit(got), neg) << f.name << " code " << c << " (signed zero)";
    }
  }
}

TEST(FormatsTest, KnownLimits) {
  EXPECT_EQ(e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(e4m3_to_float(0x01), std::ldexp(1.0f, -9));  // smallest subnormal
  EXPECT_EQ(e5m2_to_float(0x7B), 57344.0f);
  EXPECT_EQ(e5m2_to_float(0x01), std::ldexp(1.0f, -16));
  EXPECT_EQ(e2m1_to_float(0x7), 6.0f);
  EXPECT_EQ(e2m1_to_float(0x1), 0.5f);
  EXPECT_EQ(fp16_to_float(0x7BFF), 65504.0f);
  EXPECT_EQ(float_to_e4m3(1e30f), 0x7E);
  EXPECT_EQ(float_to_e4m3(-std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(float_to_e5m2(std::numeric_limits<float>::infinity()), 0x7B);  // saturates
  EXPECT_EQ(float_to_e5m2(-1e30f), 0xFB);
  EXPECT_EQ(float_to_e4m3(std::nanf("")), 0x7F);
  EXPECT_EQ(float_to_e4m3(-std::nanf("")), 0xFF);
  EXPECT_EQ(float_to_e5m2(std::nanf("")) & 0x7F, 0x7F);
  EXPECT_EQ(float_to_e2m1(std::nanf("")), 0x7);  // no NaN in e2m1: documented +max
  EXPECT_EQ(float_to_fp16(1e30f), 0x7C00);
  EXPECT_EQ(float_to_bf16(std::numeric_limits<float>::max()), 0x7F80);  // IEEE overflow
  EXPECT_EQ(float_to_e4m3(-0.0f), 0x80);
  EXPECT_EQ(float_to_e5m2(-0.0f), 0x80);
  EXPECT_EQ(float_to_e2m1(-0.0f), 0x8);
  EXPECT_EQ(float_to_bf16(-0.0f), 0x8000);
  EXPECT_EQ(float_to_fp16(-0.0f), 0x8000);
  // Ties to even: 464 is halfway between 448 (0x7E, even) and the non-existent 480 -> 448 either
  // way by saturation; 17 is halfway between 16 (0x58, even) and 18 (0x59) in e4m3.
  EXPECT_EQ(float_to_e4m3(17.0f), 0x58);
  EXPECT_EQ(float_to_e4m3(19.0f), 0x5A);  // between 18 (0x59, odd) and 20 (0x5A, even)
  // Smallest e4m3 subnormal is 2^-9; half of it ties to zero (even), just above rounds up.
  EXPECT_EQ(float_to_e4m3(std::ldexp(1.0f, -10)), 0x00);
  EXPECT_EQ(float_to_e4m3(std::nextafter(std::ldexp(1.0f, -10), 1.0f)), 0x01);
  EXPECT_EQ(float_to_e4m3(std::ldexp(3.0f, -10)), 0x02);  // 1.5 * 2^-9 ties to 2 * 2^-9
}

// The value, its fp32 neighbours, the midpoints to the adjacent representable values and the
// midpoints +- 1 fp32 ulp, for every representable value of every format, both signs.
TEST(FormatsTest, ConversionAroundEveryRepresentableValue) {
  for (const FormatSpec& f : all_formats()) {
    const std::vector<Entry> table = finite_table(f);
    for (float p : probes_around_every_value(f)) {
      for (float x : {p, -p}) {
        if (std::isinf(x)) continue;
        ASSERT_EQ(f.encode(x), reference_encode(f, table, x))
            << f.name << " x=" << x << " (" << std::hexfloat << x << ")";
      }
    }
  }
}

TEST(FormatsTest, RandomFloatsMatchReference) {
  std::mt19937 rng(1234);
  for (const FormatSpec& f : all_formats()) {
    const std::vector<Entry> table = finite_table(f);
    for (int i = 0; i < 300000; ++i) {
      const float x = bits_float(rng());
      if (std::isnan(x)) {
        EXPECT_TRUE(std::isnan(f.decode(f.encode(x))) || f.name == "e2m1") << f.name;
        continue;
      }
      if (std::isinf(x)) continue;
      ASSERT_EQ(f.encode(x), reference_encode(f, table, x))
          << f.name << " x=" << std::hexfloat << x;
    }
  }
}

TEST(FormatsTest, InfinityRules) {
  const float inf = std::numeric_limits<float>::infinity();
  EXPECT_EQ(float_to_e4m3(inf), 0x7E);
  EXPECT_EQ(float_to_e5m2(-inf), 0xFB);
  EXPECT_EQ(float_to_e2m1(inf), 0x7);
  EXPECT_EQ(float_to_fp16(-inf), 0xFC00);
  EXPECT_EQ(float_to_bf16(inf), 0x7F80);
}

TEST(FormatsTest, Bf16MatchesTruncationPlusRoundingBitTrick) {
  // Second independent reference for bf16: the widely used "add 0x7FFF + lsb" trick, over a
  // stride of all fp32 bit patterns (every 251st pattern: covers all exponents and many
  // mantissas; 17M conversions, well under a second).
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += 251) {
    const auto bits = static_cast<uint32_t>(u);
    const float x = bits_float(bits);
    if (std::isnan(x)) continue;
    const uint32_t lsb = (bits >> 16) & 1u;
    const auto want = static_cast<uint16_t>((bits + 0x7FFFu + lsb) >> 16);
    ASSERT_EQ(float_to_bf16(x), want) << std::hex << bits;
  }
  EXPECT_TRUE(std::isnan(bf16_to_float(float_to_bf16(std::nanf("")))));
}

#if defined(__FLT16_MAX__)
TEST(FormatsTest, Fp16MatchesCompilerFloat16) {
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += 251) {
    const float x = bits_float(static_cast<uint32_t>(u));
    if (std::isnan(x)) continue;
    const auto h = static_cast<_Float16>(x);
    uint16_t want;
    memcpy(&want, &h, 2);
    ASSERT_EQ(float_to_fp16(x), want) << std::hexfloat << x;
  }
  for (uint32_t c = 0; c < 0x10000; ++c) {
    _Float16 h;
    const auto c16 = static_cast<uint16_t>(c);
    memcpy(&h, &c16, 2);
    const auto want = static_cast<float>(h);
    const float got = fp16_to_float(c16);
    if (std::isnan(want)) {
      EXPECT_TRUE(std::isnan(got));
    } else {
      ASSERT_EQ(float_bits(got), float_bits(want)) << std::hex << c;
    }
  }
}
#endif

TEST(FormatsTest, E2m1PackingLowNibbleFirst) {
  const uint8_t b = pack_e2m1(1.0f, -6.0f);
  EXPECT_EQ(b & 0xF, 0x2);
  EXPECT_EQ(b >> 4, 0xF);
  const uint8_t buf[2] = {b, pack_e2m1(0.5f, 3.0f)};
  EXPECT_EQ(e2m1_packed_get(buf, 0), 1.0f);
  EXPECT_EQ(e2m1_packed_get(buf, 1), -6.0f);
  EXPECT_EQ(e2m1_packed_get(buf, 2), 0.5f);
  EXPECT_EQ(e2m1_packed_get(buf, 3), 3.0f);
}

TEST(FormatsTest, E8m0DecodeEveryCode) {
  for (uint32_t e = 0; e < 256; ++e) {
    const float got = e8m0_to_float(static_cast<uint8_t>(e));
    if (e == 255) {
      EXPECT_TRUE(std::isnan(got));
      continue;
    }
    EXPECT_EQ(static_cast<double>(got), std::ldexp(1.0, static_cast<int>(e) - 127)) << e;
    // The reciprocal multiplier is exactly 2^(127-e).
    EXPECT_EQ(static_cast<double>(e8m0_reciprocal(static_cast<uint8_t>(e))),
              std::ldexp(1.0, 127 - static_cast<int>(e)))
        << e;
  }
  EXPECT_TRUE(std::isnan(e8m0_reciprocal(0xFF)));
}

// fp64 re-derivation of the MXFP8 rounding-up rule: the smallest e with 2^(e-127) >= v, clamped
// to [0, 254]; design.md's subnormal exception means v <= 2^-127 gives 0.
uint8_t reference_e8m0_round_up(float v) {
  if (std::isnan(v)) return 0xFF;
  if (std::isinf(v)) return 0xFE;
  if (v == 0) return 0;
  const double d = v;
  for (int e = 0; e <= 254; ++e) {
    if (std::ldexp(1.0, e - 127) >= d) return static_cast<uint8_t>(e);
  }
  return 254;
}

TEST(FormatsTest, E8m0RoundUpRule) {
  std::mt19937 rng(7);
  std::vector<float> probes = {std::numeric_limits<float>::denorm_min(),
                               std::ldexp(1.0f, -127),
                               std::nextafter(std::ldexp(1.0f, -127), 1.0f),
                               std::ldexp(1.0f, -126),
                               1.0f,
                               std::nextafter(1.0f, 2.0f),
                               std::ldexp(1.0f, 127),
                               std::nextafter(std::ldexp(1.0f, 127), 0.0f),
                               std::numeric_limits<float>::max()};
  for (int i = 0; i < 200000; ++i) probes.push_back(bits_float(rng() & 0x7FFFFFFFu));
  for (float v : probes) {
    if (std::isnan(v)) continue;
    EXPECT_EQ(float_to_e8m0_round_up(v), reference_e8m0_round_up(v)) << std::hexfloat << v;
  }
  EXPECT_EQ(float_to_e8m0_round_up(std::nanf("")), 0xFF);
  EXPECT_EQ(float_to_e8m0_round_up(std::numeric_limits<float>::infinity()), 0xFE);
  EXPECT_EQ(float_to_e8m0_round_up(0.0f), 0);
  // Exponent 254 with nonzero mantissa stays 254 (no room to round up; TE's satfinite).
  EXPECT_EQ(float_to_e8m0_round_up(std::numeric_limits<float>::max()), 254);
}

}  // namespace
}  // namespace meshproof::kernels::fmt8
