// Bit-level conversions between float32 and the low-precision formats of docs/design.md section 4:
// bf16, fp16, e4m3 ("fn"), e5m2, e8m0 and e2m1, on raw bit patterns (uint16_t / uint8_t).
//
// Header-only and usable from host and device code (MP_HOST_DEVICE), with no reliance on
// cuda_fp8.h / cuda_bf16.h, so the CPU reference and the CUDA kernels produce identical bytes.
//
// Rules:
//   - float -> narrow: round to nearest, ties to even, on the exact binary value (no double
//     rounding), subnormals of the target produced exactly, signed zero preserved.
//   - e4m3 / e5m2 / e2m1 SATURATE: any finite value or infinity beyond the largest finite value
//     becomes +-max (e4m3 448, e5m2 57344, e2m1 6). This is the "satfinite" cast TE uses.
//   - bf16 / fp16 follow IEEE 754 (overflow -> inf, inf -> inf): they are compute dtypes, not
//     scaled storage formats.
//   - NaN -> the format's NaN with the input's sign (bf16 keeps the top payload bits, quieted;
//     fp16 likewise; e4m3 0x7F|s; e5m2 0x7F|s). e2m1 has no NaN: NaN -> +6 (0x7), documented and
//     tested; the quantizers never feed NaN to e2m1 without a NaN scale check upstream.
//   - e8m0 (exponent only, value 2^(e-127), 0xFF NaN) is only ever produced from a block amax
//     quotient; float_to_e8m0_round_up implements the MXFP8 scale rule of docs/design.md exactly.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MP_HOST_DEVICE __host__ __device__
#else
#define MP_HOST_DEVICE
#endif

namespace meshproof::kernels::fmt8 {

MP_HOST_DEVICE inline uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof(u));
  return u;
}

MP_HOST_DEVICE inline float bits_float(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof(f));
  return f;
}

// Description of a small binary float format: 1 sign bit, `ebits` exponent bits, `mbits`
// mantissa bits, exponent bias `bias`. `max_code` is the magnitude code of the largest finite
// value; `overflow_code` the magnitude code produced by values beyond it (max_code when the cast
// saturates, the infinity code otherwise); `nan_code` the magnitude code produced for NaN.
struct SmallFormat {
  int mbits;
  int bias;
  uint32_t max_code;
  uint32_t overflow_code;
  uint32_t nan_code;
  int total_bits;  // position of the sign bit + 1
};

// Rounds `sig` right by `shift` bits, ties to even. `sig` < 2^25, any shift >= 0.
MP_HOST_DEVICE inline uint32_t shift_round_nearest_even(uint32_t sig, int shift) {
  if (shift == 0) return sig;
  if (shift > 26) return 0;  // sig < 2^25 <= half ulp of the result: rounds to zero
  const uint32_t q = sig >> shift;
  const uint32_t rem = sig & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1);
  if (rem > half || (rem == half && (q & 1u))) return q + 1u;
  return q;
}

// Encodes |x| (fp32 bits, sign cleared, finite) into the magnitude code of `fmt`, rounding to
// nearest even and handling the target's subnormals. Codes are monotonic in the value, so a
// carry out of the mantissa correctly increments the exponent.
MP_HOST_DEVICE inline uint32_t encode_magnitude(uint32_t abs_bits, const SmallFormat& fmt) {
  int e = static_cast<int>(abs_bits >> 23);  // biased fp32 exponent
  uint32_t sig = abs_bits & 0x7FFFFFu;
  if (e == 0) {
    if (sig == 0) return 0;
    e = 1;  // fp32 subnormal: value = sig * 2^(1-127-23)
  } else {
    sig |= 0x800000u;  // implicit bit
  }
  const int unbiased = e - 127;             // value = sig * 2^(unbiased - 23)
  const int min_normal_exp = 1 - fmt.bias;  // smallest normal exponent of the target
  const int target_exp = unbiased > min_normal_exp ? unbiased : min_normal_exp;
  const int shift = 23 - fmt.mbits + (target_exp - unbiased);
  const uint32_t r = shift_round_nearest_even(sig, shift);
  // For normals r carries the implicit bit at position mbits: (te + bias - 1) << mbits + r equals
  // ((te + bias) << mbits) | fraction. For subnormals te + bias - 1 == 0 and the code is r.
  const int64_t code = (static_cast<int64_t>(target_exp + fmt.bias - 1) << fmt.mbits) + r;
  if (code > static_cast<int64_t>(fmt.max_code)) return fmt.overflow_code;
  return static_cast<uint32_t>(code);
}

MP_HOST_DEVICE inline uint32_t encode_small(float x, const SmallFormat& fmt) {
  const uint32_t u = float_bits(x);
  const uint32_t sign = (u >> 31) << (fmt.total_bits - 1);
  const uint32_t abs_bits = u & 0x7FFFFFFFu;
  if (abs_bits > 0x7F800000u) return sign | fmt.nan_code;
  if (abs_bits == 0x7F800000u) return sign | fmt.overflow_code;
  return sign | encode_magnitude(abs_bits, fmt);
}

// Decodes a finite magnitude code (no sign, not inf/NaN) exactly into fp32.
MP_HOST_DEVICE inline float decode_magnitude(uint32_t code, int mbits, int bias) {
  const uint32_t e = code >> mbits;
  const uint32_t m = code & ((1u << mbits) - 1u);
  if (e == 0) {
    // m * 2^(1 - bias - mbits): m and the power of two are exact in fp32 and so is the product
    // for every format here (smallest result 2^-24 for fp16, 2^-133 for bf16 handled by caller).
    const int p = 1 - bias - mbits;
    return static_cast<float>(m) * bits_float(static_cast<uint32_t>(p + 127) << 23);
  }
  return bits_float((static_cast<uint32_t>(static_cast<int>(e) - bias + 127) << 23) |
                    (m << (23 - mbits)));
}

MP_HOST_DEVICE inline float apply_sign(float v, uint32_t negative) {
  return negative ? bits_float(float_bits(v) | 0x80000000u) : v;
}

// ---- formats -------------------------------------------------------------------------------

// E4M3 "fn": bias 7, max 448 (0x7E), no infinity, NaN 0x7F / 0xFF.
MP_HOST_DEVICE inline SmallFormat e4m3_format() {
  return SmallFormat{3, 7, 0x7Eu, 0x7Eu, 0x7Fu, 8};
}
// E5M2: bias 15, max 57344 (0x7B), inf 0x7C, NaN 0x7D-0x7F. Casts saturate (inf -> max).
MP_HOST_DEVICE inline SmallFormat e5m2_format() {
  return SmallFormat{2, 15, 0x7Bu, 0x7Bu, 0x7Fu, 8};
}
// E2M1: bias 1, max 6 (0x7), no inf, no NaN (NaN -> +max, see header comment).
MP_HOST_DEVICE inline SmallFormat e2m1_format() { return SmallFormat{1, 1, 0x7u, 0x7u, 0x7u, 4}; }
// fp16: bias 15, max 65504 (0x7BFF), overflow -> inf 0x7C00 (IEEE).
MP_HOST_DEVICE inline SmallFormat fp16_format() {
  return SmallFormat{10, 15, 0x7BFFu, 0x7C00u, 0x7E00u, 16};
}

inline constexpr float kE4M3Max = 448.0f;
inline constexpr float kE5M2Max = 57344.0f;
inline constexpr float kE2M1Max = 6.0f;

MP_HOST_DEVICE inline uint8_t float_to_e4m3(float x) {
  return static_cast<uint8_t>(encode_small(x, e4m3_format()));
}
MP_HOST_DEVICE inline uint8_t float_to_e5m2(float x) {
  return static_cast<uint8_t>(encode_small(x, e5m2_format()));
}
// One E2M1 code in the low nibble.
MP_HOST_DEVICE inline uint8_t float_to_e2m1(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0x7u;  // NaN -> +6
  return static_cast<uint8_t>(encode_small(x, e2m1_format()));
}
// Two E2M1 values packed into a byte: `even` (element 2i) in the low nibble.
MP_HOST_DEVICE inline uint8_t pack_e2m1(float even, float odd) {
  return static_cast<uint8_t>(float_to_e2m1(even) | (float_to_e2m1(odd) << 4));
}

MP_HOST_DEVICE inline float e4m3_to_float(uint8_t q) {
  const uint32_t mag = q & 0x7Fu;
  if (mag == 0x7Fu) return bits_float(0x7FC00000u | (static_cast<uint32_t>(q >> 7) << 31));
  return apply_sign(decode_magnitude(mag, 3, 7), q >> 7);
}
MP_HOST_DEVICE inline float e5m2_to_float(uint8_t q) {
  const uint32_t mag = q & 0x7Fu;
  const uint32_t s = static_cast<uint32_t>(q >> 7) << 31;
  if (mag == 0x7Cu) return bits_float(0x7F800000u | s);
  if (mag > 0x7Cu) return bits_float(0x7FC00000u | s);
  return apply_sign(decode_magnitude(mag, 2, 15), q >> 7);
}
// Decodes the low nibble.
MP_HOST_DEVICE inline float e2m1_to_float(uint8_t q) {
  return apply_sign(decode_magnitude(q & 0x7u, 1, 1), (q >> 3) & 1u);
}
// Element i of a packed E2M1 buffer.
MP_HOST_DEVICE inline float e2m1_packed_get(const uint8_t* packed, int64_t i) {
  const uint8_t byte = packed[i >> 1];
  return e2m1_to_float(static_cast<uint8_t>((i & 1) ? (byte >> 4) : (byte & 0xFu)));
}

// bf16: the top half of fp32. RNE on the 16 dropped bits; overflow -> inf; NaN quieted.
MP_HOST_DEVICE inline uint16_t float_to_bf16(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);
  const uint32_t lower = u & 0xFFFFu;
  uint32_t upper = u >> 16;
  if (lower > 0x8000u || (lower == 0x8000u && (upper & 1u))) ++upper;  // carries into exponent
  return static_cast<uint16_t>(upper);
}
MP_HOST_DEVICE inline float bf16_to_float(uint16_t h) {
  return bits_float(static_cast<uint32_t>(h) << 16);
}

MP_HOST_DEVICE inline uint16_t float_to_fp16(float x) {
  const uint32_t u = float_bits(x);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) {
    // Quiet NaN keeping the sign and the top 9 payload bits.
    return static_cast<uint16_t>(((u >> 16) & 0x8000u) | 0x7E00u | ((u >> 13) & 0x1FFu));
  }
  return static_cast<uint16_t>(encode_small(x, fp16_format()));
}
MP_HOST_DEVICE inline float fp16_to_float(uint16_t h) {
  const uint32_t mag = h & 0x7FFFu;
  const uint32_t s = static_cast<uint32_t>(h >> 15) << 31;
  if (mag >= 0x7C00u) {
    if (mag == 0x7C00u) return bits_float(0x7F800000u | s);
    return bits_float(0x7FC00000u | s | ((mag & 0x3FFu) << 13));
  }
  return apply_sign(decode_magnitude(mag, 10, 15), h >> 15);
}

// E8M0: value 2^(e-127), e in [0, 254]; 0xFF is NaN. e == 0 is 2^-127, an fp32 subnormal.
MP_HOST_DEVICE inline float e8m0_to_float(uint8_t e) {
  if (e == 0xFFu) return bits_float(0x7FC00000u);
  if (e == 0) return bits_float(0x00400000u);
  return bits_float(static_cast<uint32_t>(e) << 23);
}

// The MXFP8 scale rule (docs/design.md section 4, TE's float_to_e8m0): for v >= 0 the E8M0 exponent
// is v's fp32 exponent field, plus one when the mantissa is nonzero (round up so that the block
// max never exceeds the format max), except at exponent 254 (no room: stays 254) and for
// subnormal v <= 2^-127 (exponent 0, mantissa <= 0x400000: stays 0). NaN -> 0xFF, inf -> 0xFE,
// 0 -> 0.
MP_HOST_DEVICE inline uint8_t float_to_e8m0_round_up(float v) {
  const uint32_t u = float_bits(v) & 0x7FFFFFFFu;
  if (u > 0x7F800000u) return 0xFFu;
  if (u == 0x7F800000u) return 0xFEu;
  if (u == 0) return 0;
  uint32_t exponent = u >> 23;
  const uint32_t mantissa = u & 0x7FFFFFu;
  if (mantissa > 0 && exponent != 0xFEu && !(exponent == 0 && mantissa <= 0x400000u)) ++exponent;
  return static_cast<uint8_t>(exponent);
}

// 2^(127-e) as fp32: the multiplier that maps a block onto the element format (exact; 2^127 for
// e == 0, 2^-127 for e == 254). NaN for e == 0xFF so a NaN block decodes to NaN.
MP_HOST_DEVICE inline float e8m0_reciprocal(uint8_t e) {
  if (e == 0xFFu) return bits_float(0x7FC00000u);
  if (e == 254) return bits_float(0x00400000u);
  return bits_float(static_cast<uint32_t>(254 - e) << 23);
}

}  // namespace meshproof::kernels::fmt8
