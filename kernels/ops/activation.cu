// CUDA activations (kernels/ops/activation.h): the CPU formulas evaluated in double and rounded
// once on store. The device tanh/exp (and nvcc's FMA contraction) differ from glibc's by a few ulp
// of double, so an output can differ from the CPU's by 1 ulp of the stored dtype (when the double
// result lies next to a rounding boundary of float/bf16), plus ~1e-16 * |x| absolute where the
// formula cancels (0.5 x (1 + tanh) for x << 0); ReLU is exact.
#include "kernels/ops/ops_cuda.h"
#include "kernels/ops/ops_cuda_util.cuh"

namespace meshproof::kernels::cuda {
namespace {

constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kGeluCoeff = 0.044715;

#define MP_GRID_STRIDE(i, n)                                                \
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < (n); \
       i += int64_t{gridDim.x} * blockDim.x)

template <typename T>
__global__ void gelu_forward_kernel(const T* x, T* y, int64_t n) {
  MP_GRID_STRIDE(i, n) {
    const double v = detail::load(x, i);
    detail::store_d(y, i, 0.5 * v * (1.0 + tanh(kSqrt2OverPi * (v + kGeluCoeff * v * v * v))));
  }
}

template <typename T>
__global__ void gelu_backward_kernel(const T* dy, const T* x, T* dx, int64_t n) {
  MP_GRID_STRIDE(i, n) {
    const double v = detail::load(x, i);
    const double u = kSqrt2OverPi * (v + kGeluCoeff * v * v * v);
    const double th = tanh(u);
    const double du = kSqrt2OverPi * (1.0 + 3.0 * kGeluCoeff * v * v);
    const double grad = 0.5 * (1.0 + th) + 0.5 * v * (1.0 - th * th) * du;
    detail::store_d(dx, i, static_cast<double>(detail::load(dy, i)) * grad);
  }
}

template <typename T>
__global__ void relu_forward_kernel(const T* x, T* y, int64_t n) {
  MP_GRID_STRIDE(i, n) {
    const float v = detail::load(x, i);
    y[i] = v > 0.0f ? x[i] : T(0);  // copies the stored bits, like the CPU
  }
}

template <typename T>
__global__ void relu_backward_kernel(const T* dy, const T* x, T* dx, int64_t n) {
  MP_GRID_STRIDE(i, n) { dx[i] = detail::load(x, i) > 0.0f ? dy[i] : T(0); }
}

// CPU: T(g * s * u) with g, u promoted to double; dgate = T(dy * u * dsilu), dup = T(dy * silu).
template <typename T>
__global__ void swiglu_forward_kernel(const T* gate, const T* up, T* y, int64_t n) {
  MP_GRID_STRIDE(i, n) {
    const double g = detail::load(gate, i);
    const double s = 1.0 / (1.0 + exp(-g));
    detail::store_d(y, i, g * s * static_cast<double>(detail::load(up, i)));
  }
}

template <typename T>
__global__ void swiglu_backward_kernel(const T* dy, const T* gate, const T* up, T* dgate, T* dup,
                                       int64_t n) {
  MP_GRID_STRIDE(i, n) {
    const double g = detail::load(gate, i);
    const double s = 1.0 / (1.0 + exp(-g));
    const double silu = g * s;
    const double dsilu = s * (1.0 + g * (1.0 - s));
    const double d = detail::load(dy, i);
    detail::store_d(dgate, i, d * static_cast<double>(detail::load(up, i)) * dsilu);
    detail::store_d(dup, i, d * silu);
  }
}

#undef MP_GRID_STRIDE

template <typename T>
const T* in(const void* p) {
  return static_cast<const T*>(p);
}
template <typename T>
T* out(void* p) {
  return static_cast<T*>(p);
}

}  // namespace

// Expands the launch for T = uint16_t (bf16) or float.
#define MP_LAUNCH_BOTH(kernel, n, ...)                          \
  do {                                                          \
    if ((n) == 0) return cudaSuccess;                           \
    const auto grid = detail::grid_1d(n);                       \
    auto s = detail::as_stream(stream);                         \
    if (bf16) {                                                 \
      using T = uint16_t;                                       \
      kernel<T><<<grid, detail::kThreads, 0, s>>>(__VA_ARGS__); \
    } else {                                                    \
      using T = float;                                          \
      kernel<T><<<grid, detail::kThreads, 0, s>>>(__VA_ARGS__); \
    }                                                           \
    return cudaGetLastError();                                  \
  } while (0)

cudaError_t launch_gelu_forward(const void* x, void* y, bool bf16, int64_t n, void* stream) {
  MP_LAUNCH_BOTH(gelu_forward_kernel, n, in<T>(x), out<T>(y), n);
}
cudaError_t launch_gelu_backward(const void* dy, const void* x, void* dx, bool bf16, int64_t n,
                                 void* stream) {
  MP_LAUNCH_BOTH(gelu_backward_kernel, n, in<T>(dy), in<T>(x), out<T>(dx), n);
}
cudaError_t launch_relu_forward(const void* x, void* y, bool bf16, int64_t n, void* stream) {
  MP_LAUNCH_BOTH(relu_forward_kernel, n, in<T>(x), out<T>(y), n);
}
cudaError_t launch_relu_backward(const void* dy, const void* x, void* dx, bool bf16, int64_t n,
                                 void* stream) {
  MP_LAUNCH_BOTH(relu_backward_kernel, n, in<T>(dy), in<T>(x), out<T>(dx), n);
}
cudaError_t launch_swiglu_forward(const void* gate, const void* up, void* y, bool bf16, int64_t n,
                                  void* stream) {
  MP_LAUNCH_BOTH(swiglu_forward_kernel, n, in<T>(gate), in<T>(up), out<T>(y), n);
}
cudaError_t launch_swiglu_backward(const void* dy, const void* gate, const void* up, void* dgate,
                                   void* dup, bool bf16, int64_t n, void* stream) {
  MP_LAUNCH_BOTH(swiglu_backward_kernel, n, in<T>(dy), in<T>(gate), in<T>(up), out<T>(dgate),
                 out<T>(dup), n);
}

#undef MP_LAUNCH_BOTH

}  // namespace meshproof::kernels::cuda
