#include "kernels/core/dtype.h"

#include <array>

#include "kernels/core/error.h"

namespace meshproof::kernels {
namespace {

struct DTypeInfo {
  DType type;
  std::string_view name;
  int bits;
  bool floating;
};

constexpr std::array<DTypeInfo, 11> kInfo = {{
    {DType::kFloat32, "float32", 32, true},
    {DType::kFloat64, "float64", 64, true},
    {DType::kBFloat16, "bfloat16", 16, true},
    {DType::kFloat16, "float16", 16, true},
    {DType::kE4M3, "e4m3", 8, true},
    {DType::kE5M2, "e5m2", 8, true},
    {DType::kE8M0, "e8m0", 8, true},
    {DType::kE2M1, "e2m1", 4, true},
    {DType::kInt32, "int32", 32, false},
    {DType::kInt64, "int64", 64, false},
    {DType::kUInt8, "uint8", 8, false},
}};

const DTypeInfo& info(DType t) {
  for (const auto& i : kInfo) {
    if (i.type == t) return i;
  }
  MP_FAIL("unknown dtype value {}", static_cast<int>(t));
}

}  // namespace

std::string_view dtype_name(DType t) { return info(t).name; }

DType parse_dtype(std::string_view name, std::string_view what) {
  for (const auto& i : kInfo) {
    if (i.name == name) return i.type;
  }
  MP_FAIL_INPUT(
      "{}: unknown dtype '{}' (expected one of float32, float64, bfloat16, float16, e4m3, "
      "e5m2, e8m0, e2m1, int32, int64, uint8)",
      what, name);
}

bool is_fp8(DType t) { return t == DType::kE4M3 || t == DType::kE5M2; }
bool is_floating(DType t) { return info(t).floating; }
int dtype_bits(DType t) { return info(t).bits; }

Bytes storage_bytes(DType t, Elements n) {
  MP_CHECK(n.value >= 0, "negative element count {}", n.value);
  return Bytes((n.value * dtype_bits(t) + 7) / 8);
}

}  // namespace meshproof::kernels
