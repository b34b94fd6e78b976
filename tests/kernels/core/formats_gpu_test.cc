// kernels/core/formats.h on the device: every conversion (fp32 -> e4m3/e5m2/e2m1/fp16/bf16/e8m0
// and back, e8m0 reciprocal) runs in a CUDA kernel over the same probes and code tables as the host
// tests (format_probes.h) and must give the host's bits exactly, NaN payloads and signed zeros
// included. The host conversions are checked against an fp64 model in formats_test.cc; this test
// closes the gap between host and device compilation (FTZ, contraction, intrinsics). Skips with
// the reason when no CUDA device is usable or the build has no CUDA.
#include <gtest/gtest.h>

#include <cstdint>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "kernels/core/device.h"
#include "tests/gpu_test.h"
#include "tests/kernels/core/format_conversions.h"
#include "tests/kernels/core/format_probes.h"

namespace meshproof::kernels::fmt8 {
namespace {

// Runs `c` on the device over `in` and expects the host's bits for every input; reports the
// first few mismatches and their count.
void expect_device_matches_host(Conversion c, const std::vector<uint32_t>& in,
                                const std::string& what) {
#if MESHPROOF_HAVE_CUDA
  const std::vector<uint32_t> dev = convert_on_device(c, in);
  ASSERT_EQ(dev.size(), in.size());
  int64_t mismatches = 0;
  for (size_t i = 0; i < in.size(); ++i) {
    const uint32_t host = convert(c, in[i]);
    if (dev[i] != host) {
      if (++mismatches <= 5) {
        ADD_FAILURE() << what << ": input 0x" << std::hex << in[i] << " host 0x" << host
                      << " device 0x" << dev[i];
      }
    }
  }
  EXPECT_EQ(mismatches, 0) << what << " (" << in.size() << " inputs)";
#else
  (void)c;
  (void)in;
  (void)what;
#endif
}

struct Pair {
  Conversion to;    // fp32 -> format
  Conversion from;  // format -> fp32
};
Pair conversions_of(const FormatSpec& f) {
  if (f.name == "e4m3") return {Conversion::kToE4m3, Conversion::kFromE4m3};
  if (f.name == "e5m2") return {Conversion::kToE5m2, Conversion::kFromE5m2};
  if (f.name == "e2m1") return {Conversion::kToE2m1, Conversion::kFromE2m1};
  if (f.name == "fp16") return {Conversion::kToFp16, Conversion::kFromFp16};
  return {Conversion::kToBf16, Conversion::kFromBf16};
}

// fp32 NaNs (quiet and signalling payloads, both signs) and infinities.
std::vector<uint32_t> special_bits() {
  return {0x7FC00000u, 0xFFC00000u, 0x7F800001u, 0xFF800001u, 0x7FBFFFFFu,
          0x7FE12345u, 0xFFFFFFFFu, 0x7F800000u, 0xFF800000u};
}

TEST(FormatsGpuTest, DecodeEveryCodeOnDevice) {
  MP_SKIP_WITHOUT_GPU();
  for (const FormatSpec& f : all_formats()) {
    std::vector<uint32_t> codes(1u << total_bits(f));
    for (uint32_t c = 0; c < codes.size(); ++c) codes[c] = c;
    expect_device_matches_host(conversions_of(f).from, codes, f.name + " decode");
  }
  std::vector<uint32_t> e8m0(256);
  for (uint32_t e = 0; e < 256; ++e) e8m0[e] = e;
  expect_device_matches_host(Conversion::kFromE8m0, e8m0, "e8m0 decode");
  expect_device_matches_host(Conversion::kE8m0Reciprocal, e8m0, "e8m0 reciprocal");
}

TEST(FormatsGpuTest, ConversionAroundEveryRepresentableValueOnDevice) {
  MP_SKIP_WITHOUT_GPU();
  for (const FormatSpec& f : all_formats()) {
    std::vector<uint32_t> in = special_bits();
    for (float p : probes_around_every_value(f)) {
      in.push_back(float_bits(p));
      in.push_back(float_bits(-p));
    }
    expect_device_matches_host(conversions_of(f).to, in, f.name + " encode");
  }
}

// Every 251st fp32 bit pattern (17M inputs: all exponents, many mantissas, NaNs included) through
// each encoder and the E8M0 round-up rule.
TEST(FormatsGpuTest, StridedFp32SweepOnDevice) {
  MP_SKIP_WITHOUT_GPU();
  std::vector<uint32_t> in;
  in.reserve((0x100000000ull + 250) / 251);
  for (uint64_t u = 0; u <= 0xFFFFFFFFull; u += 251) in.push_back(static_cast<uint32_t>(u));
  for (const FormatSpec& f : all_formats()) {
    expect_device_matches_host(conversions_of(f).to, in, f.name + " encode sweep");
  }
  expect_device_matches_host(Conversion::kToE8m0RoundUp, in, "e8m0 round-up sweep");
}

TEST(FormatsGpuTest, E8m0RoundUpEdgesOnDevice) {
  MP_SKIP_WITHOUT_GPU();
  std::vector<uint32_t> in = special_bits();
  for (float v : {0.0f, -0.0f, std::numeric_limits<float>::denorm_min(), std::ldexp(1.0f, -127),
                  std::nextafter(std::ldexp(1.0f, -127), 1.0f), std::ldexp(1.0f, -126), 1.0f,
                  std::nextafter(1.0f, 2.0f), std::ldexp(1.0f, 127),
                  std::nextafter(std::ldexp(1.0f, 127), 0.0f), std::numeric_limits<float>::max()}) {
    in.push_back(float_bits(v));
  }
  std::mt19937 rng(7);
  for (int i = 0; i < 200000; ++i) in.push_back(rng() & 0x7FFFFFFFu);
  expect_device_matches_host(Conversion::kToE8m0RoundUp, in, "e8m0 round-up");
}

}  // namespace
}  // namespace meshproof::kernels::fmt8
