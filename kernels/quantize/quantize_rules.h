// Scalar scaling rules shared by the CPU reference quantizers (quantize_*.cc) and the CUDA kernels
// (quantize.cu): one definition, the same fp32 operations in the same order, so both backends
// produce identical bytes. docs/design.md section 4 is the contract these implement.
#pragma once

#include <cstdint>

#include "kernels/core/formats.h"

namespace meshproof::kernels::rules {

inline constexpr float kFltMax = 3.40282346638528859812e+38f;

// |x| as fp32 bits with the sign cleared. amax is the max of these as UNSIGNED integers: for
// non-negative floats the integer order is the value order, and every NaN sorts above inf, so
// the amax is NaN when any element is NaN (and the reduction is order-independent, hence
// identical on CPU and GPU whatever the reduction tree).
MP_HOST_DEVICE inline uint32_t abs_bits(float x) { return fmt8::float_bits(x) & 0x7FFFFFFFu; }

MP_HOST_DEVICE inline bool is_finite(float x) { return abs_bits(x) < 0x7F800000u; }
MP_HOST_DEVICE inline bool is_nan(float x) { return abs_bits(x) > 0x7F800000u; }

// Input element as fp32: fp32 directly, bf16 widened exactly.
MP_HOST_DEVICE inline float load_input(const void* x, bool is_bf16, int64_t i) {
  if (is_bf16) return fmt8::bf16_to_float(static_cast<const uint16_t*>(x)[i]);
  return static_cast<const float*>(x)[i];
}

// Element cast to the fp8 storage format (e4m3 when !e5m2).
MP_HOST_DEVICE inline uint8_t cast_fp8(float v, bool e5m2) {
  return e5m2 ? fmt8::float_to_e5m2(v) : fmt8::float_to_e4m3(v);
}
MP_HOST_DEVICE inline float decode_fp8(uint8_t q, bool e5m2) {
  return e5m2 ? fmt8::e5m2_to_float(q) : fmt8::e4m3_to_float(q);
}
MP_HOST_DEVICE inline float fp8_max(bool e5m2) { return e5m2 ? fmt8::kE5M2Max : fmt8::kE4M3Max; }

// Clears the mantissa bits: the largest power of two <= scale (scale > 0, finite).
MP_HOST_DEVICE inline float pow2_floor(float scale) {
  return fmt8::bits_float(fmt8::float_bits(scale) & 0xFF800000u);
}

// Current scaling (Float8CurrentScaling) and the block scales of Float8BlockScaling, TE's
// compute_scale_from_amax: amax is first clamped below by eps (amax < eps -> eps), then
// scale = fp8_max / amax, correctly rounded fp32 division. A NaN amax, or a clamped amax of 0 or
// inf, gives 1 (so with eps > 0 an all-zero tensor gets fp8_max / eps, as in TE); an infinite
// quotient -> FLT_MAX; pow2 clears the mantissa last (the largest power of two <= scale).
MP_HOST_DEVICE inline float current_scale(float amax, float fp8max, float eps, bool pow2) {
  if (is_nan(amax)) return 1.0f;
  if (amax < eps) amax = eps;
  if (!(amax > 0.0f) || !is_finite(amax)) return 1.0f;  // 0 or inf after the clamp
  float scale = fp8max / amax;
  if (!is_finite(scale)) scale = kFltMax;  // quotient overflowed (tiny amax)
  if (pow2) scale = pow2_floor(scale);
  return scale;
}

// scale_inv = 1/scale, correctly rounded (the same division on host and device).
MP_HOST_DEVICE inline float reciprocal(float scale) { return 1.0f / scale; }

// Delayed scaling update of one scale (TE's DelayedScaling):
// amax finite and > 0: (fp8_max / amax) / 2^margin, inf -> FLT_MAX; otherwise the old scale.
MP_HOST_DEVICE inline float delayed_scale(float amax, float old_scale, float fp8max,
                                          float two_pow_margin) {
  if (!(amax > 0.0f) || !is_finite(amax)) return old_scale;
  float scale = (fp8max / amax) / two_pow_margin;
  if (!is_finite(scale)) scale = kFltMax;
  return scale;
}

// MXFP8 block scale (docs/design.md): v = amax * (1/fp8_max as fp32), e = round-up exponent of v.
MP_HOST_DEVICE inline uint8_t mxfp8_scale_exponent(float block_amax, bool e5m2) {
  const float inv_max = e5m2 ? 1.0f / fmt8::kE5M2Max : 1.0f / fmt8::kE4M3Max;  // constant-folded
  return fmt8::float_to_e8m0_round_up(block_amax * inv_max);
}

// Block scaling (TE Float8BlockScaling): the current-scaling rule on the block amax with the
// recipe's eps and power-of-2 option (TE's default: pow2, eps 0).
MP_HOST_DEVICE inline float block_scale(float block_amax, bool e5m2, float eps, bool pow2) {
  return current_scale(block_amax, fp8_max(e5m2), eps, pow2);
}

}  // namespace meshproof::kernels::rules

namespace meshproof::kernels::rules {

// ---- block workers: the same loops run in a CPU loop and in one CUDA thread -----------------

// Max of abs_bits over n elements x[base + i*stride].
MP_HOST_DEVICE inline uint32_t block_amax_bits(const void* x, bool bf16, int64_t base,
                                               int64_t stride, int64_t n) {
  uint32_t a = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = abs_bits(load_input(x, bf16, base + i * stride));
    a = b > a ? b : a;
  }
  return a;
}

// One element: fp8(v * mult), except that a NaN input is cast unscaled, so it gives the format's
// NaN with its own sign whatever the multiplier. The rule is explicit because the hardware's is
// not portable: x86 returns the NaN operand of v * mult (its sign kept), a GPU returns its
// canonical NaN 0x7FFFFFFF for any NaN result, so -NaN would encode as 0xFF on one and 0x7F on
// the other. The CPU's cast loops (quantize_cast.cc) apply the same rule. A finite v times a NaN
// multiplier (an MXFP8 NaN block) encodes as +NaN (0x7F) on both; inf x 0 cannot arise, since no
// scale rule gives a zero scale.
MP_HOST_DEVICE inline uint8_t cast_element(float v, float mult, bool e5m2) {
  return cast_fp8(is_nan(v) ? v : v * mult, e5m2);
}

// out[obase + i*ostride] = cast_element(x[base + i*stride], mult) for i in [0, n).
MP_HOST_DEVICE inline void cast_block(const void* x, bool bf16, int64_t base, int64_t stride,
                                      int64_t n, float mult, bool e5m2, uint8_t* out, int64_t obase,
                                      int64_t ostride) {
  for (int64_t i = 0; i < n; ++i) {
    out[obase + i * ostride] = cast_element(load_input(x, bf16, base + i * stride), mult, e5m2);
  }
}

// Delayed scaling update on the raw state (TE's DelayedScaling, docs/design.md section 4):
// amax = max(history) (algo_max) or history[0] (the current slot, "most_recent"); scale updated by
// delayed_scale; then the window rolls by one (torch.roll(history, -1): the current slot becomes
// the newest entry at index L-1, the oldest entry is dropped) and the new current slot 0 is zeroed.
MP_HOST_DEVICE inline void delayed_update(float* history, int64_t len, float* scale, bool algo_max,
                                          float fp8max, float two_pow_margin) {
  float amax = history[0];
  if (algo_max) {
    uint32_t a = 0;  // NaN-propagating max, like the amax reduction
    for (int64_t i = 0; i < len; ++i) {
      const uint32_t b = abs_bits(history[i]);
      a = b > a ? b : a;
    }
    amax = fmt8::bits_float(a);
  }
  scale[0] = delayed_scale(amax, scale[0], fp8max, two_pow_margin);
  const float current = history[0];
  for (int64_t i = 0; i + 1 < len; ++i) history[i] = history[i + 1];
  history[len - 1] = current;
  history[0] = 0.0f;
}

// Where each quantized element and its scale live (the layouts of QuantizedTensor).
enum class QLayout : int {
  kPerTensorRow,  // data [M, K], scale fp32 [1]
  kPerTensorCol,  // data [K, M] (transpose), scale fp32 [1]
  kMxfp8Row,      // data [M, K], scale e8m0 [M, K/32]
  kMxfp8Col,      // data [M, K], scale e8m0 [M/32, K]
  kBlock1dRow,    // data [M, K], scale fp32 [M, ceil(K/128)]
  kBlock1dCol,    // data [K, M], scale fp32 [K, ceil(M/128)]
  kBlock2dRow,    // data [M, K], scale fp32 [ceil(M/128), ceil(K/128)]
  kBlock2dCol,    // data [K, M], scale fp32 [ceil(K/128), ceil(M/128)]
};

// decode * scale with x86's NaN rule made explicit: a NaN code's value (decode keeps the code's
// sign), else a NaN scale (an MXFP8 NaN block), else the correctly rounded product. A GPU would
// return its canonical NaN 0x7FFFFFFF for either, and a compiler may order the two operands of a
// multiply either way, so without the rule the NaN bits of a dequantized tensor would depend on
// the backend and the build.
MP_HOST_DEVICE inline float scaled_value(float decoded, float scale) {
  if (is_nan(decoded)) return decoded;
  if (is_nan(scale)) return scale;
  return decoded * scale;
}

// Decoded value of logical element (m, k): decode(q) * scale_inv (scaled_value). Exact for mxfp8
// and power-of-2 block scales; one correctly rounded fp32 multiply for per-tensor scales and
// non-power-of-2 block scales.
MP_HOST_DEVICE inline float dequant_at(QLayout layout, bool e5m2, const uint8_t* data,
                                       const void* scale, int64_t M, int64_t K, int64_t m,
                                       int64_t k) {
  const float* sf = static_cast<const float*>(scale);
  const uint8_t* s8 = static_cast<const uint8_t*>(scale);
  const int64_t kb = (K + 127) / 128;
  const int64_t mb = (M + 127) / 128;
  switch (layout) {
    case QLayout::kPerTensorRow:
      return scaled_value(decode_fp8(data[m * K + k], e5m2), sf[0]);
    case QLayout::kPerTensorCol:
      return scaled_value(decode_fp8(data[k * M + m], e5m2), sf[0]);
    case QLayout::kMxfp8Row:
      return scaled_value(decode_fp8(data[m * K + k], e5m2),
                          fmt8::e8m0_to_float(s8[m * (K / 32) + k / 32]));
    case QLayout::kMxfp8Col:
      return scaled_value(decode_fp8(data[m * K + k], e5m2),
                          fmt8::e8m0_to_float(s8[(m / 32) * K + k]));
    case QLayout::kBlock1dRow:
      return scaled_value(decode_fp8(data[m * K + k], e5m2), sf[m * kb + k / 128]);
    case QLayout::kBlock1dCol:
      return scaled_value(decode_fp8(data[k * M + m], e5m2), sf[k * mb + m / 128]);
    case QLayout::kBlock2dRow:
      return scaled_value(decode_fp8(data[m * K + k], e5m2), sf[(m / 128) * kb + k / 128]);
    case QLayout::kBlock2dCol:
      return scaled_value(decode_fp8(data[k * M + m], e5m2), sf[(k / 128) * mb + m / 128]);
  }
  return 0.0f;
}

}  // namespace meshproof::kernels::rules
