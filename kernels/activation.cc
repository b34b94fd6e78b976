#include "kernels/activation.h"

#include <cmath>

#include "kernels/op_util.h"

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

}  // namespace

void gelu_forward(const Tensor& x, Tensor& y) {
  const int64_t n = check_elementwise("gelu_forward", x, y);
  detail::dispatch_float(x.dtype(), "gelu_forward", [&](auto t) {
    using T = decltype(t);
    const T* xp = x.data<T>();
    T* yp = y.data<T>();
    for (int64_t i = 0; i < n; ++i) {
      const double v = xp[i];
      yp[i] =
          static_cast<T>(0.5 * v * (1.0 + std::tanh(kSqrt2OverPi * (v + kGeluCoeff * v * v * v))));
    }
  });
}

void gelu_backward(const Tensor& dy, const Tensor& x, Tensor& dx) {
  const int64_t n = check_elementwise("gelu_backward", x, dy, dx);
  detail::dispatch_float(x.dtype(), "gelu_backward", [&](auto t) {
    using T = decltype(t);
    const T* xp = x.data<T>();
    const T* dyp = dy.data<T>();
    T* dxp = dx.data<T>();
    for (int64_t i = 0; i < n; ++i) {
      const double v = xp[i];
      const double u = kSqrt2OverPi * (v + kGeluCoeff * v * v * v);
      const double th = std::tanh(u);
      const double du = kSqrt2OverPi * (1.0 + 3.0 * kGeluCoeff * v * v);
      const double grad = 0.5 * (1.0 + th) + 0.5 * v * (1.0 - th * th) * du;
      dxp[i] = static_cast<T>(dyp[i] * grad);
    }
  });
}

void relu_forward(const Tensor& x, Tensor& y) {
  const int64_t n = check_elementwise("relu_forward", x, y);
  detail::dispatch_float(x.dtype(), "relu_forward", [&](auto t) {
    using T = decltype(t);
    const T* xp = x.data<T>();
    T* yp = y.data<T>();
    for (int64_t i = 0; i < n; ++i) yp[i] = xp[i] > T(0) ? xp[i] : T(0);
  });
}

void relu_backward(const Tensor& dy, const Tensor& x, Tensor& dx) {
  const int64_t n = check_elementwise("relu_backward", x, dy, dx);
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
