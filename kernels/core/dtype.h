// Element types. Precision is runtime data on the tensor (TE's design), never a template
// parameter of the model code: a Tensor carries its DType and every op dispatches on it.
#pragma once

#include <cstdint>
#include <string_view>

#include "kernels/core/units.h"

namespace meshproof::kernels {

enum class DType : uint8_t {
  kFloat32,
  kFloat64,  // reference math and finite-difference checks only
  kBFloat16,
  kFloat16,
  kE4M3,  // FP8 "fn": max 448, no inf, NaN 0x7F/0xFF
  kE5M2,  // FP8: max 57344, inf 0x7C
  kE8M0,  // exponent-only scale, bias 127, 0xFF NaN
  kE2M1,  // FP4, packed two per byte (low nibble = even element)
  kInt32,
  kInt64,
  kUInt8,
};

std::string_view dtype_name(DType t);  // "float32", "bfloat16", "e4m3", ...
// Parses a dtype name as written by dtype_name; throws an input error naming `what` otherwise.
DType parse_dtype(std::string_view name, std::string_view what);
bool is_fp8(DType t);
bool is_floating(DType t);  // has a float interpretation (all but int32/int64/uint8)
// Bits per element (4 for e2m1).
int dtype_bits(DType t);
// Bytes needed to store n elements (rounds packed types up to whole bytes).
Bytes storage_bytes(DType t, Elements n);

// Maps a C++ element type to its DType, for typed data access checks.
template <typename T>
struct DTypeOf;
template <>
struct DTypeOf<float> {
  static constexpr DType value = DType::kFloat32;
};
template <>
struct DTypeOf<double> {
  static constexpr DType value = DType::kFloat64;
};
template <>
struct DTypeOf<int32_t> {
  static constexpr DType value = DType::kInt32;
};
template <>
struct DTypeOf<int64_t> {
  static constexpr DType value = DType::kInt64;
};
template <>
struct DTypeOf<uint8_t> {
  static constexpr DType value = DType::kUInt8;
};

}  // namespace meshproof::kernels
