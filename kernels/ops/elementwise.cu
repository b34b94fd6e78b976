// CUDA elementwise ops (kernels/ops/elementwise.h), bitwise equal to the CPU reference: every
// rounding step of the CPU expression is one explicit round-to-nearest intrinsic here (no FMA
// contraction), bf16 is read as float and stored with the CPU's RNE code, and dropout draws the
// same Philox counter (seed, stream, first_index + i) through the shared philox.h. bias_grad is
// a parallel per-column reduction in a fixed order (kernels/ops/column_reduce.h): deterministic,
// and within that header's bound of the CPU's serial sum (not bitwise).
#include "kernels/ops/column_reduce.cuh"
#include "kernels/ops/ops_cuda.h"
#include "kernels/ops/ops_cuda_util.cuh"
#include "kernels/random/philox.h"

namespace meshproof::kernels::cuda {
namespace {

#define MP_GRID_STRIDE(i, n)                                                \
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < (n); \
       i += int64_t{gridDim.x} * blockDim.x)

// CPU: y += b with T float (float add) or BFloat16 (float(y) + float(b), RNE on store).
template <typename T>
__global__ void add_bias_kernel(T* y, const T* bias, int64_t m, int64_t n) {
  MP_GRID_STRIDE(i, m * n) {
    detail::store(y, i, __fadd_rn(detail::load(y, i), detail::load(bias, i % n)));
  }
}

// bias_grad's term: dy[r, c] widened to double (kernels/ops/column_reduce.cuh sums it per column).
template <typename T>
struct BiasGradTerm {
  static constexpr int K = 1;
  const T* dy;
  int64_t n;
  __device__ void operator()(int64_t r, int64_t c, double* t) const {
    t[0] = static_cast<double>(detail::load(dy, r * n + c));
  }
};

template <typename T>
__global__ void add_kernel(T* x, const T* y, int64_t n) {
  MP_GRID_STRIDE(i, n) { detail::store(x, i, __fadd_rn(detail::load(x, i), detail::load(y, i))); }
}

// CPU: T(x * alpha) with the product in double.
template <typename T>
__global__ void scale_kernel(T* x, int64_t n, double alpha) {
  MP_GRID_STRIDE(i, n) {
    detail::store_d(x, i, __dmul_rn(static_cast<double>(detail::load(x, i)), alpha));
  }
}

template <typename T>
__global__ void dropout_kernel(const T* in, T* out, int64_t n, double p, uint64_t seed,
                               uint64_t stream_id, uint64_t first_index) {
  MP_GRID_STRIDE(i, n) {
    if (p == 0.0) {
      out[i] = in[i];
      continue;
    }
    const double keep_scale = 1.0 / (1.0 - p);  // IEEE division, same as the host's
    const bool keep = philox_uniform(seed, stream_id, first_index + static_cast<uint64_t>(i)) >= p;
    if (keep)
      detail::store_d(out, i, __dmul_rn(static_cast<double>(detail::load(in, i)), keep_scale));
    else
      detail::store(out, i, 0.0f);
  }
}

#undef MP_GRID_STRIDE

}  // namespace

cudaError_t launch_add_bias(void* y, const void* bias, bool bf16, int64_t m, int64_t n,
                            void* stream) {
  if (m * n == 0) return cudaSuccess;
  const auto g = detail::grid_1d(m * n);
  if (bf16)
    add_bias_kernel<<<g, detail::kThreads, 0, detail::as_stream(stream)>>>(
        static_cast<uint16_t*>(y), static_cast<const uint16_t*>(bias), m, n);
  else
    add_bias_kernel<<<g, detail::kThreads, 0, detail::as_stream(stream)>>>(
        static_cast<float*>(y), static_cast<const float*>(bias), m, n);
  return cudaGetLastError();
}

cudaError_t launch_bias_grad(const void* dy, bool bf16, int64_t m, int64_t n, double* partial,
                             float* dbias, void* stream) {
  auto s = detail::as_stream(stream);
  if (bf16)
    return detail::column_reduce(BiasGradTerm<uint16_t>{static_cast<const uint16_t*>(dy), n}, m, n,
                                 partial, dbias, nullptr, s);
  return detail::column_reduce(BiasGradTerm<float>{static_cast<const float*>(dy), n}, m, n, partial,
                               dbias, nullptr, s);
}

cudaError_t launch_add(void* x, const void* y, bool bf16, int64_t n, void* stream) {
  if (n == 0) return cudaSuccess;
  const auto g = detail::grid_1d(n);
  if (bf16)
    add_kernel<<<g, detail::kThreads, 0, detail::as_stream(stream)>>>(
        static_cast<uint16_t*>(x), static_cast<const uint16_t*>(y), n);
  else
    add_kernel<<<g, detail::kThreads, 0, detail::as_stream(stream)>>>(
        static_cast<float*>(x), static_cast<const float*>(y), n);
  return cudaGetLastError();
}

cudaError_t launch_scale(void* x, bool bf16, int64_t n, double alpha, void* stream) {
  if (n == 0) return cudaSuccess;
  const auto g = detail::grid_1d(n);
  if (bf16)
    scale_kernel<<<g, detail::kThreads, 0, detail::as_stream(stream)>>>(static_cast<uint16_t*>(x),
                                                                        n, alpha);
  else
    scale_kernel<<<g, detail::kThreads, 0, detail::as_stream(stream)>>>(static_cast<float*>(x), n,
                                                                        alpha);
  return cudaGetLastError();
}

cudaError_t launch_dropout(const void* in, void* out, bool bf16, int64_t n, double p, uint64_t seed,
                           uint64_t stream_id, uint64_t first_index, void* stream) {
  if (n == 0) return cudaSuccess;
  const auto g = detail::grid_1d(n);
  if (bf16)
    dropout_kernel<<<g, detail::kThreads, 0, detail::as_stream(stream)>>>(
        static_cast<const uint16_t*>(in), static_cast<uint16_t*>(out), n, p, seed, stream_id,
        first_index);
  else
    dropout_kernel<<<g, detail::kThreads, 0, detail::as_stream(stream)>>>(
        static_cast<const float*>(in), static_cast<float*>(out), n, p, seed, stream_id,
        first_index);
  return cudaGetLastError();
}

}  // namespace meshproof::kernels::cuda
