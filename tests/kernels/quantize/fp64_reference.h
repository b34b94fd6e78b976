// Independent fp64 models of the fp8 formats and of each recipe's scale rule, for the quantizer
// tests. Nothing here calls kernels/core/formats.h or kernels/quantize/quantize_rules.h:
// element casts use the "nearest value in the enumerated code table, ties to the even code,
// saturate" definition, and scale rules are re-derived in double from docs/design.md section 4.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

namespace meshproof::kernels::testref {

struct Fp8Model {
  int mbits;
  int bias;
  double max;
  std::vector<double> values;  // value of magnitude code c (NaN codes excluded: values.size())

  static Fp8Model make(bool e5m2) {
    Fp8Model f;
    f.mbits = e5m2 ? 2 : 3;
    f.bias = e5m2 ? 15 : 7;
    const int n_finite = e5m2 ? 0x7C : 0x7F;  // e5m2: 0x7C is inf; e4m3: 0x7F is NaN
    for (int c = 0; c < n_finite; ++c) {
      const int e = c >> f.mbits;
      const int m = c & ((1 << f.mbits) - 1);
      f.values.push_back(
          e == 0 ? std::ldexp(static_cast<double>(m), 1 - f.bias - f.mbits)
                 : std::ldexp(1.0 + std::ldexp(static_cast<double>(m), -f.mbits), e - f.bias));
    }
    f.max = f.values.back();
    return f;
  }

  // Round-to-nearest-even with saturation of a value already rounded to fp32 (the kernels cast
  // fp32 products). NaN -> 0x7F with sign.
  uint8_t encode(float xf) const {
    const double x = xf;
    const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
    if (std::isnan(x)) return sign | 0x7F;
    const double a = std::min(std::fabs(x), max);
    const auto it = std::lower_bound(values.begin(), values.end(), a);
    const int hi = static_cast<int>(it - values.begin());
    if (values[hi] == a || hi == 0) return static_cast<uint8_t>(sign | hi);
    const int lo = hi - 1;
    const double dlo = a - values[lo];
    const double dhi = values[hi] - a;
    if (dlo < dhi) return static_cast<uint8_t>(sign | lo);
    if (dhi < dlo) return static_cast<uint8_t>(sign | hi);
    return static_cast<uint8_t>(sign | ((lo & 1) == 0 ? lo : hi));
  }

  double decode(uint8_t q) const {
    const int mag = q & 0x7F;
    if (mag >= static_cast<int>(values.size())) {
      return mbits == 2 && mag == 0x7C ? ((q & 0x80) ? -INFINITY : INFINITY) : NAN;
    }
    return (q & 0x80) ? -values[mag] : values[mag];
  }
};

// fp32 product of two floats, correctly rounded: the exact product fits in a double (48 bits).
inline float mul32(float a, float b) {
  return static_cast<float>(static_cast<double>(a) * static_cast<double>(b));
}
// fp32 quotient, correctly rounded: double division then rounding to float never double-rounds
// for fp32 operands (53 >= 2*24 + 2).
inline float div32(float a, float b) {
  return static_cast<float>(static_cast<double>(a) / static_cast<double>(b));
}

// max |x| with NaN propagation.
inline float amax_of(const std::vector<float>& x, size_t begin, size_t stride, size_t n) {
  double a = 0;
  for (size_t i = 0; i < n; ++i) {
    const float v = x[begin + i * stride];
    if (std::isnan(v)) return NAN;
    a = std::max(a, std::fabs(static_cast<double>(v)));
  }
  return static_cast<float>(a);
}

// docs/design.md current scaling, with TE's amax_epsilon: NaN -> 1; amax clamped below by eps
// first; then a (clamped) amax of 0 or inf -> 1.
inline float current_scale(float amax, float fp8max, float eps, bool pow2) {
  if (std::isnan(amax)) return 1.0f;
  amax = std::max(amax, eps);
  if (!(amax > 0) || std::isinf(amax)) return 1.0f;
  float s = div32(fp8max, amax);
  if (std::isinf(s)) s = std::numeric_limits<float>::max();
  if (pow2) s = static_cast<float>(std::exp2(std::floor(std::log2(static_cast<double>(s)))));
  return s;
}

// docs/design.md MXFP8 exponent: v = amax * fl32(1/fp8_max); smallest e with 2^(e-127) >= v,
// clamped to [0, 254]; NaN -> 255, inf -> 254, 0 -> 0.
inline int mxfp8_exponent(float amax, float fp8max) {
  if (std::isnan(amax)) return 255;
  if (std::isinf(amax)) return 254;
  const float v = mul32(amax, static_cast<float>(1.0 / fp8max));
  if (v == 0) return 0;
  for (int e = 0; e <= 254; ++e) {
    if (std::ldexp(1.0, e - 127) >= static_cast<double>(v)) return e;
  }
  return 254;
}

}  // namespace meshproof::kernels::testref
