// Every conversion of kernels/core/formats.h behind one host+device dispatch on raw bits, so
// the device test runs exactly the code the host runs and compares the bits (formats_gpu_test.cc).
// Included by format_conversions.cu (nvcc, C++17) and the gtest file (C++20).
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/core/formats.h"

namespace meshproof::kernels::fmt8 {

enum class Conversion : int {
  kToE4m3,          // fp32 bits -> e4m3 code
  kToE5m2,          // fp32 bits -> e5m2 code
  kToE2m1,          // fp32 bits -> e2m1 code (low nibble)
  kToFp16,          // fp32 bits -> fp16 bits
  kToBf16,          // fp32 bits -> bf16 bits
  kToE8m0RoundUp,   // fp32 bits -> e8m0 code (the MXFP8 scale rule)
  kFromE4m3,        // e4m3 code -> fp32 bits
  kFromE5m2,        // e5m2 code -> fp32 bits
  kFromE2m1,        // e2m1 code -> fp32 bits
  kFromFp16,        // fp16 bits -> fp32 bits
  kFromBf16,        // bf16 bits -> fp32 bits
  kFromE8m0,        // e8m0 code -> fp32 bits (2^(e-127))
  kE8m0Reciprocal,  // e8m0 code -> fp32 bits (2^(127-e))
};

MP_HOST_DEVICE inline uint32_t convert(Conversion c, uint32_t x) {
  switch (c) {
    case Conversion::kToE4m3:
      return float_to_e4m3(bits_float(x));
    case Conversion::kToE5m2:
      return float_to_e5m2(bits_float(x));
    case Conversion::kToE2m1:
      return float_to_e2m1(bits_float(x));
    case Conversion::kToFp16:
      return float_to_fp16(bits_float(x));
    case Conversion::kToBf16:
      return float_to_bf16(bits_float(x));
    case Conversion::kToE8m0RoundUp:
      return float_to_e8m0_round_up(bits_float(x));
    case Conversion::kFromE4m3:
      return float_bits(e4m3_to_float(static_cast<uint8_t>(x)));
    case Conversion::kFromE5m2:
      return float_bits(e5m2_to_float(static_cast<uint8_t>(x)));
    case Conversion::kFromE2m1:
      return float_bits(e2m1_to_float(static_cast<uint8_t>(x)));
    case Conversion::kFromFp16:
      return float_bits(fp16_to_float(static_cast<uint16_t>(x)));
    case Conversion::kFromBf16:
      return float_bits(bf16_to_float(static_cast<uint16_t>(x)));
    case Conversion::kFromE8m0:
      return float_bits(e8m0_to_float(static_cast<uint8_t>(x)));
    case Conversion::kE8m0Reciprocal:
      return float_bits(e8m0_reciprocal(static_cast<uint8_t>(x)));
  }
  return 0xDEADBEEFu;  // unreachable: every enumerator is handled above
}

// Runs `c` over `in` on the current CUDA device and returns the results (one uint32 per input).
// Defined in format_conversions.cu (CUDA builds only); throws kernels::Error on CUDA errors.
std::vector<uint32_t> convert_on_device(Conversion c, const std::vector<uint32_t>& in);

}  // namespace meshproof::kernels::fmt8
