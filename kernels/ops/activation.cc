#include "kernels/ops/activation.h"

#include <cmath>

#include "kernels/ops/op_util.h"

namespace meshproof::kernels {
namespace {

constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kGeluCoeff = 0.044715;

// Checks every tensor against the first: CPU, float dtype, same dtype and element count.
template <typename... Ts>
int64_t check_elementwise(std::string_view op, const Tensor& first, const Ts&... rest) {
  detail::check_operand(first, op, "input");
  detail::check_float(first, op, "input");
  const int64_t n = first.numel().value;
  (detail::check_operand(rest, op, "operand", n), ...);
  (detail::check_same_dtype(first, rest, op), ...);
  return n;
}

// Checks the saved tanh(u) of a GELU, if any: CPU, float64, n elements (after on_cuda() has ruled
// out a device operand, so the message names the real problem).
void check_saved_tanh(std::string_view op, const Tensor* tanh_u, int64_t n) {
  if (tanh_u == nullptr) return;
  detail::check_operand(*tanh_u, op, "tanh_u", n);
  MP_CHECK(tanh_u->device().is_cpu() && tanh_u->dtype() == DType::kFloat64,
           "{}: the saved tanh(u) must be a CPU float64 tensor, got {}", op, tanh_u->describe());
}

}  // namespace

void gelu_forward(const Tensor& x, Tensor& y, Tensor* tanh_u) {
  const int64_t n = check_elementwise("gelu_forward", x, y);
  if (detail::on_cuda("gelu_forward", {&x, &y})) {
    MP_CHECK(tanh_u == nullptr, "gelu_forward: the saved tanh(u) is a CPU-only buffer");
    MP_OP_CUDA("gelu_forward",
               launch_gelu_forward(x.raw_data(), y.raw_data(), x.dtype() == DType::kBFloat16, n,
                                   detail::cuda_stream()));
    return;
  }
  detail::dispatch_float(x.dtype(), "gelu_forward", [&](auto t) {
    using T = decltype(t);
    const T* xp = x.data<T>();
    T* yp = y.data<T>();
    check_saved_tanh("gelu_forward", tanh_u, n);
    double* saved = tanh_u != nullptr ? tanh_u->data<double>() : nullptr;
    for (int64_t i = 0; i < n; ++i) {
      const double v = xp[i];
      const double th = std::tanh(kSqrt2OverPi * (v + kGeluCoeff * v * v * v));
      if (saved != nullptr) saved[i] = th;
      yp[i] = static_cast<T>(0.5 * v * (1.0 + th));
    }
  });
}

void gelu_backward(const Tensor& dy, const Tensor& x, Tensor& dx, const Tensor* tanh_u) {
  const int64_t n = check_elementwise("gelu_backward", x, dy, dx);
  if (detail::on_cuda("gelu_backward", {&x, &dy, &dx})) {
    MP_CHECK(tanh_u == nullptr, "gelu_backward: the saved tanh(u) is a CPU-only buffer");
    MP_OP_CUDA("gelu_backward",
               launch_gelu_backward(dy.raw_data(), x.raw_data(), dx.raw_data(),
                                    x.dtype() == DType::kBFloat16, n, detail::cuda_stream()));
    return;
  }
  detail::dispatch_float(x.dtype(), "gelu_backward", [&](auto t) {
    using T = decltype(t);
    const T* xp = x.data<T>();
    const T* dyp = dy.data<T>();
    T* dxp = dx.data<T>();
    check_saved_tanh("gelu_backward", tanh_u, n);
    const double* saved = tanh_u != nullptr ? tanh_u->data<double>() : nullptr;
    for (int64_t i = 0; i < n; ++i) {
      const double v = xp[i];
      const double th =
          saved != nullptr ? saved[i] : std::tanh(kSqrt2OverPi * (v + kGeluCoeff * v * v * v));
      const double du = kSqrt2OverPi * (1.0 + 3.0 * kGeluCoeff * v * v);
      const double grad = 0.5 * (1.0 + th) + 0.5 * v * (1.0 - th * th) * du;
      dxp[i] = static_cast<T>(dyp[i] * grad);
    }
  });
}

void relu_forward(const Tensor& x, Tensor& y) {
  const int64_t n = check_elementwise("relu_forward", x, y);
  if (detail::on_cuda("relu_forward", {&x, &y})) {
    MP_OP_CUDA("relu_forward",
               launch_relu_forward(x.raw_data(), y.raw_data(), x.dtype() == DType::kBFloat16, n,
                                   detail::cuda_stream()));
    return;
  }
  detail::dispatch_float(x.dtype(), "relu_forward", [&](auto t) {
    using T = decltype(t);
    const T* xp = x.data<T>();
    T* yp = y.data<T>();
    for (int64_t i = 0; i < n; ++i) yp[i] = xp[i] > T(0) ? xp[i] : T(0);
  });
}

void relu_backward(const Tensor& dy, const Tensor& x, Tensor& dx) {
  const int64_t n = check_elementwise("relu_backward", x, dy, dx);
  if (detail::on_cuda("relu_backward", {&x, &dy, &dx})) {
    MP_OP_CUDA("relu_backward",
               launch_relu_backward(dy.raw_data(), x.raw_data(), dx.raw_data(),
                                    x.dtype() == DType::kBFloat16, n, detail::cuda_stream()));
    return;
  }
  detail::dispatch_float(x.dtype(), "relu_backward", [&](auto t) {
    using T = decltype(t);
    const T* xp = x.data<T>();
    const T* dyp = dy.data<T>();
    T* dxp = dx.data<T>();
    for (int64_t i = 0; i < n; ++i) dxp[i] = xp[i] > T(0) ? dyp[i] : T(0);
  });
}

void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& y) {
  const int64_t n = check_elementwise("swiglu_forward", gate, up, y);
  if (detail::on_cuda("swiglu_forward", {&gate, &up, &y})) {
    MP_OP_CUDA("swiglu_forward",
               launch_swiglu_forward(gate.raw_data(), up.raw_data(), y.raw_data(),
                                     gate.dtype() == DType::kBFloat16, n, detail::cuda_stream()));
    return;
  }
  detail::dispatch_float(gate.dtype(), "swiglu_forward", [&](auto t) {
    using T = decltype(t);
    const T* g = gate.data<T>();
    const T* u = up.data<T>();
    T* yp = y.data<T>();
    for (int64_t i = 0; i < n; ++i) {
      const double s = 1.0 / (1.0 + std::exp(-static_cast<double>(g[i])));
      yp[i] = static_cast<T>(g[i] * s * u[i]);
    }
  });
}

void swiglu_backward(const Tensor& dy, const Tensor& gate, const Tensor& up, Tensor& dgate,
                     Tensor& dup) {
  const int64_t n = check_elementwise("swiglu_backward", gate, up, dy, dgate, dup);
  if (detail::on_cuda("swiglu_backward", {&gate, &up, &dy, &dgate, &dup})) {
    MP_OP_CUDA("swiglu_backward",
               launch_swiglu_backward(dy.raw_data(), gate.raw_data(), up.raw_data(),
                                      dgate.raw_data(), dup.raw_data(),
                                      gate.dtype() == DType::kBFloat16, n, detail::cuda_stream()));
    return;
  }
  detail::dispatch_float(gate.dtype(), "swiglu_backward", [&](auto t) {
    using T = decltype(t);
    const T* g = gate.data<T>();
    const T* u = up.data<T>();
    const T* dyp = dy.data<T>();
    T* dg = dgate.data<T>();
    T* du = dup.data<T>();
    for (int64_t i = 0; i < n; ++i) {
      const double gv = g[i];
      const double s = 1.0 / (1.0 + std::exp(-gv));
      const double silu = gv * s;
      const double dsilu = s * (1.0 + gv * (1.0 - s));
      dg[i] = static_cast<T>(dyp[i] * u[i] * dsilu);
      du[i] = static_cast<T>(dyp[i] * silu);
    }
  });
}

}  // namespace meshproof::kernels
