// Dtype conversion between the compute types float32, float64 and bfloat16 (bf16 recipe compute
// copies of the fp32 master weights; float64 for finite-difference checks). Rounding to bf16 is
// round-to-nearest-even via kernels/core/formats.h (float64 goes through float32 first).
//   src, dst: same element count; dst's dtype selects the conversion.
#pragma once

#include <cstdint>

#include "kernels/core/formats.h"
#include "kernels/core/tensor.h"

namespace meshproof::kernels {

// A bf16 element as the CPU ops see it: stored as its 16 bits, read as float, written with RNE.
// Arithmetic promotes to float/double, so the op templates compute in higher precision and round
// once on store.
struct BFloat16 {
  uint16_t bits = 0;
  BFloat16() = default;
  BFloat16(float f) : bits(fmt8::float_to_bf16(f)) {}  // NOLINT: implicit like a builtin float type
  BFloat16(double d) : BFloat16(static_cast<float>(d)) {}
  BFloat16(int i) : BFloat16(static_cast<float>(i)) {}
  operator float() const { return fmt8::bf16_to_float(bits); }
  BFloat16& operator+=(float v) { return *this = BFloat16(static_cast<float>(*this) + v); }
};
static_assert(sizeof(BFloat16) == 2);

template <>
struct DTypeOf<BFloat16> {
  static constexpr DType value = DType::kBFloat16;
};

void cast(const Tensor& src, Tensor& dst);
// A new tensor on src's device holding src converted to `dtype` (a clone when equal).
Tensor cast_to(const Tensor& src, DType dtype);

}  // namespace meshproof::kernels
