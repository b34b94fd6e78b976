// The formats under test and their probe values, shared by the host tests (formats_test.cc,
// against an independent fp64 model) and the device tests (formats_gpu_test.cc, device bits
// against host bits): every format's spec, an fp64 decode by the textbook formula, the table of
// finite values, and the conversion probes around every representable value.
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/core/formats.h"

namespace meshproof::kernels::fmt8 {

struct FormatSpec {
  std::string name;
  int ebits;
  int mbits;
  int bias;
  bool saturating;  // true: beyond max -> max; false: IEEE (overflow -> inf)
  // Is this magnitude code (sign stripped) a NaN / an infinity?
  std::function<bool(uint32_t)> is_nan;
  std::function<bool(uint32_t)> is_inf;
  std::function<uint32_t(float)> encode;
  std::function<float(uint32_t)> decode;
  uint32_t inf_code;  // IEEE formats only
};

inline int total_bits(const FormatSpec& f) { return 1 + f.ebits + f.mbits; }

// Independent fp64 decode: (-1)^s * 2^(e-bias) * (1 + m/2^mb), or 2^(1-bias) * m/2^mb for e == 0.
inline double reference_decode(const FormatSpec& f, uint32_t mag) {
  const uint32_t e = mag >> f.mbits;
  const uint32_t m = mag & ((1u << f.mbits) - 1);
  if (e == 0) return std::ldexp(static_cast<double>(m), 1 - f.bias - f.mbits);
  return std::ldexp(1.0 + std::ldexp(static_cast<double>(m), -f.mbits),
                    static_cast<int>(e) - f.bias);
}

inline std::vector<FormatSpec> all_formats() {
  std::vector<FormatSpec> v;
  v.push_back({"e4m3", 4, 3, 7, true, [](uint32_t m) { return m == 0x7F; },
               [](uint32_t) { return false; }, [](float x) { return float_to_e4m3(x); },
               [](uint32_t c) { return e4m3_to_float(static_cast<uint8_t>(c)); }, 0});
  v.push_back({"e5m2", 5, 2, 15, true, [](uint32_t m) { return m > 0x7C; },
               [](uint32_t m) { return m == 0x7C; }, [](float x) { return float_to_e5m2(x); },
               [](uint32_t c) { return e5m2_to_float(static_cast<uint8_t>(c)); }, 0x7C});
  v.push_back({"e2m1", 2, 1, 1, true, [](uint32_t) { return false; },
               [](uint32_t) { return false; }, [](float x) { return float_to_e2m1(x); },
               [](uint32_t c) { return e2m1_to_float(static_cast<uint8_t>(c)); }, 0});
  v.push_back({"fp16", 5, 10, 15, false, [](uint32_t m) { return m > 0x7C00; },
               [](uint32_t m) { return m == 0x7C00; }, [](float x) { return float_to_fp16(x); },
               [](uint32_t c) { return fp16_to_float(static_cast<uint16_t>(c)); }, 0x7C00});
  v.push_back({"bf16", 8, 7, 127, false, [](uint32_t m) { return m > 0x7F80; },
               [](uint32_t m) { return m == 0x7F80; }, [](float x) { return float_to_bf16(x); },
               [](uint32_t c) { return bf16_to_float(static_cast<uint16_t>(c)); }, 0x7F80});
  return v;
}

struct Entry {
  double value;
  uint32_t code;
};

// Finite non-negative magnitudes in increasing order. For IEEE formats the infinity code is
// appended at 2^(emax+1), which is where round-to-nearest-even sends overflowing values.
inline std::vector<Entry> finite_table(const FormatSpec& f) {
  std::vector<Entry> t;
  const uint32_t n = 1u << (f.ebits + f.mbits);
  for (uint32_t c = 0; c < n; ++c) {
    if (f.is_nan(c) || f.is_inf(c)) continue;
    t.push_back({reference_decode(f, c), c});
  }
  if (!f.saturating) {
    const int emax = static_cast<int>((f.inf_code >> f.mbits) - 1) - f.bias;
    t.push_back({std::ldexp(1.0, emax + 1), f.inf_code});
  }
  return t;
}

// Conversion probes of format f (non-negative; callers add the negations): every representable
// value, its fp32 neighbours, the midpoints to the adjacent representable values and the midpoints
// +- 1 fp32 ulp, plus fp32's denorm_min, min normal and max. A midpoint has mbits+1 significant
// bits, exact in fp32 for every format here (checked: std::logic_error otherwise), except bf16's
// midpoint between its max and 2^128, which is beyond fp32's range and left out.
inline std::vector<float> probes_around_every_value(const FormatSpec& f) {
  const std::vector<Entry> table = finite_table(f);
  std::vector<float> probes;
  for (size_t i = 0; i < table.size(); ++i) {
    const auto v = static_cast<float>(table[i].value);
    probes.push_back(v);
    probes.push_back(std::nextafter(v, 0.0f));
    probes.push_back(std::nextafter(v, std::numeric_limits<float>::infinity()));
    const double next = i + 1 < table.size() ? table[i + 1].value : 2.0 * table[i].value;
    if ((table[i].value + next) / 2 > std::numeric_limits<float>::max()) continue;
    const auto mid = static_cast<float>((table[i].value + next) / 2);
    if (static_cast<double>(mid) != (table[i].value + next) / 2) {
      throw std::logic_error(f.name + ": a midpoint is not exact in fp32");
    }
    probes.push_back(mid);
    probes.push_back(std::nextafter(mid, 0.0f));
    probes.push_back(std::nextafter(mid, std::numeric_limits<float>::infinity()));
  }
  probes.push_back(std::numeric_limits<float>::denorm_min());
  probes.push_back(std::numeric_limits<float>::min());
  probes.push_back(std::numeric_limits<float>::max());
  return probes;
}

}  // namespace meshproof::kernels::fmt8
