// Shared plumbing of the model's op families (internal to kernels/): device dispatch and shape
// checks. Every op dispatches on the device of its tensors; the CPU reference is implemented for
// float32, bfloat16 (bf16 recipe; math in float/double, one rounding on store) and float64
// (finite-difference checks). Gradients of parameters (dweight, dbias, dtok, dpos) are float32 or
// float64 whatever the activation dtype (DESIGN.md: weight gradients accumulate in fp32). CUDA
// kernels are added per op family later and until then a CUDA tensor is a clear runtime error,
// never a silent host fallback.
#pragma once

#include <string_view>

#include "kernels/cast.h"
#include "kernels/error.h"
#include "kernels/tensor.h"

namespace meshproof::kernels::detail {

// Checks that `t` is defined, on the CPU, of a float dtype this CPU op computes in, and has
// `numel` elements (pass -1 to skip).
inline void check_operand(const Tensor& t, std::string_view op, std::string_view name,
                          int64_t numel = -1) {
  MP_CHECK(t.defined(), "{}: tensor '{}' is undefined", op, name);
  MP_CHECK(t.device().is_cpu(), "{}: '{}' is {}; the CUDA kernel of this op family is not built",
           op, name, t.describe());
  MP_CHECK(numel < 0 || t.numel().value == numel, "{}: '{}' is {}, expected {} elements", op, name,
           t.describe(), numel);
}

inline void check_float(const Tensor& t, std::string_view op, std::string_view name) {
  MP_CHECK(
      t.dtype() == DType::kFloat32 || t.dtype() == DType::kFloat64 || t.dtype() == DType::kBFloat16,
      "{}: '{}' is {}; the CPU op computes in float32, bfloat16 or float64", op, name,
      t.describe());
}

inline void check_same_dtype(const Tensor& a, const Tensor& b, std::string_view op) {
  MP_CHECK(a.dtype() == b.dtype(), "{}: dtype mismatch {} vs {}", op, a.describe(), b.describe());
}

// Calls f(T{}) with T = float, double or BFloat16 according to `dtype`.
template <typename F>
decltype(auto) dispatch_float(DType dtype, std::string_view op, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      return f(float{});
    case DType::kFloat64:
      return f(double{});
    case DType::kBFloat16:
      return f(BFloat16{});
    default:
      MP_FAIL("{}: unsupported dtype {}", op, dtype_name(dtype));
  }
}

// Parameter-gradient tensors: float32 or float64 only.
inline void check_grad(const Tensor& t, std::string_view op, std::string_view name, int64_t numel) {
  check_operand(t, op, name, numel);
  MP_CHECK(t.dtype() == DType::kFloat32 || t.dtype() == DType::kFloat64,
           "{}: gradient '{}' is {}; parameter gradients are float32 or float64", op, name,
           t.describe());
}

// Calls f(G{}) with G = float or double for a parameter-gradient dtype.
template <typename F>
decltype(auto) dispatch_grad(DType dtype, std::string_view op, F&& f) {
  switch (dtype) {
    case DType::kFloat32:
      return f(float{});
    case DType::kFloat64:
      return f(double{});
    default:
      MP_FAIL("{}: unsupported gradient dtype {}", op, dtype_name(dtype));
  }
}

}  // namespace meshproof::kernels::detail
