#include "harness/checks/tensor_elements.h"

#include <cstring>

#include "kernels/core/error.h"
#include "kernels/core/formats.h"

namespace meshproof::harness {
namespace {

using kernels::DType;

int64_t sign_magnitude_order(uint64_t bits, int width) {
  const uint64_t sign = uint64_t{1} << (width - 1);
  const auto mag = static_cast<int64_t>(bits & (sign - 1));
  return (bits & sign) ? -mag : mag;
}

}  // namespace

Element element(const kernels::Tensor& t, int64_t i) {
  namespace f8 = kernels::fmt8;
  const auto* p = static_cast<const uint8_t*>(t.raw_data());
  switch (t.dtype()) {
    case DType::kFloat32: {
      uint32_t b;
      std::memcpy(&b, p + 4 * i, 4);
      return {f8::bits_float(b), sign_magnitude_order(b, 32)};
    }
    case DType::kFloat64: {
      uint64_t b;
      double v;
      std::memcpy(&b, p + 8 * i, 8);
      std::memcpy(&v, &b, 8);
      return {v, sign_magnitude_order(b, 64)};
    }
    case DType::kBFloat16: {
      uint16_t b;
      std::memcpy(&b, p + 2 * i, 2);
      return {f8::bf16_to_float(b), sign_magnitude_order(b, 16)};
    }
    case DType::kFloat16: {
      uint16_t b;
      std::memcpy(&b, p + 2 * i, 2);
      return {f8::fp16_to_float(b), sign_magnitude_order(b, 16)};
    }
    case DType::kE4M3:
      return {f8::e4m3_to_float(p[i]), sign_magnitude_order(p[i], 8)};
    case DType::kE5M2:
      return {f8::e5m2_to_float(p[i]), sign_magnitude_order(p[i], 8)};
    case DType::kE8M0:
      return {f8::e8m0_to_float(p[i]), p[i]};
    case DType::kUInt8:
      return {static_cast<double>(p[i]), p[i]};
    case DType::kInt32: {
      int32_t v;
      std::memcpy(&v, p + 4 * i, 4);
      return {static_cast<double>(v), v};
    }
    case DType::kInt64: {
      int64_t v;
      std::memcpy(&v, p + 8 * i, 8);
      return {static_cast<double>(v), v};
    }
    case DType::kE2M1:
      break;
  }
  MP_FAIL_INPUT("dtype {} is not compared element by element", kernels::dtype_name(t.dtype()));
}

uint64_t distance(int64_t x, int64_t y) {
  return x >= y ? static_cast<uint64_t>(x) - static_cast<uint64_t>(y)
                : static_cast<uint64_t>(y) - static_cast<uint64_t>(x);
}

}  // namespace meshproof::harness
