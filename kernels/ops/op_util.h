// Shared plumbing of the model's op families (internal to kernels/): device dispatch and shape
// checks. Every op dispatches on the device of its tensors; the CPU reference is implemented for
// float32, bfloat16 (bf16 recipe; math in float/double, one rounding on store) and float64
// (finite-difference checks). Gradients of parameters (dweight, dbias, dtok, dpos) are float32 or
// float64 whatever the activation dtype (docs/design.md: weight gradients accumulate in fp32).
// CUDA tensors run the family's kernel (kernels/<family>.cu, launchers in kernels/ops/ops_cuda.h)
// on the rank's stream, for float32 and bfloat16; float64 on CUDA and CUDA tensors in a build
// without the backend are clear runtime errors, never a silent host fallback.
#pragma once

#include <initializer_list>
#include <string_view>

#include "kernels/core/error.h"
#include "kernels/core/runtime.h"
#include "kernels/core/tensor.h"
#include "kernels/ops/cast.h"

#if MESHPROOF_HAVE_CUDA
#include "kernels/core/cuda_check.h"
#include "kernels/ops/ops_cuda.h"
#endif

namespace meshproof::kernels::detail {

// Checks that `t` is defined and has `numel` elements (pass -1 to skip). The device is checked
// once per op by on_cuda().
inline void check_operand(const Tensor& t, std::string_view op, std::string_view name,
                          int64_t numel = -1) {
  MP_CHECK(t.defined(), "{}: tensor '{}' is undefined", op, name);
  MP_CHECK(numel < 0 || t.numel().value == numel, "{}: '{}' is {}, expected {} elements", op, name,
           t.describe(), numel);
}

// Checks that every (defined) operand lives on the first one's device and returns whether that is
// a CUDA device. A CUDA operand needs the CUDA backend, and the CUDA kernels do not compute in
// float64 (float64 is the CPU's finite-difference dtype).
inline bool on_cuda(std::string_view op, std::initializer_list<const Tensor*> operands) {
  const Tensor& first = **operands.begin();
  for (const Tensor* t : operands)
    MP_CHECK(t->device() == first.device(), "{}: operands on different devices: {} and {}", op,
             first.describe(), t->describe());
  if (!first.device().is_cuda()) return false;
  MP_CHECK(MESHPROOF_HAVE_CUDA,
           "{}: {} is on a CUDA device but meshproof was built without the CUDA backend", op,
           first.describe());
  for (const Tensor* t : operands)
    MP_CHECK(t->dtype() != DType::kFloat64,
             "{}: {} is float64, which the CUDA kernels do not support (float64 is CPU-only)", op,
             t->describe());
  return true;
}

// The stream CUDA launches go to: the current rank's.
inline void* cuda_stream() { return current_context().stream; }

[[noreturn]] inline void no_cuda_backend(std::string_view op) {
  MP_FAIL("{}: CUDA tensor but meshproof was built without the CUDA backend", op);
}

// Checks the input of a quantizer (per-tensor, MXFP8, block, NVFP4): defined, float32 or bfloat16,
// not empty. Returns whether it is bfloat16.
inline bool check_quantizer_input(const Tensor& x, std::string_view what) {
  MP_CHECK_INPUT(x.defined(), "{}: input tensor is undefined", what);
  MP_CHECK_INPUT(x.dtype() == DType::kFloat32 || x.dtype() == DType::kBFloat16,
                 "{}: input {} must be float32 or bfloat16", what, x.describe());
  MP_CHECK_INPUT(x.shape().rank() >= 1 && x.numel().value > 0, "{}: input {} must be non-empty",
                 what, x.describe());
  return x.dtype() == DType::kBFloat16;
}

// Calls the launcher `cuda::call` and checks its cudaError_t (only reached when on_cuda() is true,
// so the non-CUDA build never gets here).
#if MESHPROOF_HAVE_CUDA
#define MP_OP_CUDA(op, call) MP_CUDA_CHECK(::meshproof::kernels::cuda::call)
#else
#define MP_OP_CUDA(op, call) ::meshproof::kernels::detail::no_cuda_backend(op)
#endif

// The value of a one-element float64 tensor: on a device, one 8-byte download (a counted scalar,
// kernels/core/runtime.h CopyCounter; synchronises the rank's stream).
double download_scalar(const Tensor& t);

// Input check of int32 ids (token ids, targets) on a CUDA device without downloading them: a
// device scan finds the first id outside [0, limit) and one 8-byte word comes back; an id outside
// is reported as "{op}: {what} {id} at {where} {index} outside [0, {limit})" (the CPU kernels'
// message), exit code 2.
void check_ids_on_device(std::string_view op, std::string_view what, std::string_view where,
                         const Tensor& ids, int64_t limit);

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
