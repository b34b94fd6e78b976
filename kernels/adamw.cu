// CUDA AdamW (kernels/adamw.h): the CPU's float32 update, operation for operation with explicitly
// rounded intrinsics (no FMA contraction, IEEE sqrt/div), so the result is bitwise the CPU's.
// sum_of_squares: one block, per-thread strided partial sums in double, fixed tree order
// (deterministic; differs from the CPU's serial double sum by ~1e-15 relative).
#include "kernels/ops_cuda.h"
#include "kernels/ops_cuda_util.cuh"

namespace meshproof::kernels::cuda {
namespace {

struct AdamScalars {
  bool decay_on;
  float decay, b1, b2, one_minus_b1, one_minus_b2, step_size, bc2_sqrt, eps;
};

__global__ void adamw_kernel(float* p, const float* g, float* m, float* v, int64_t n,
                             AdamScalars k) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    float pi = p[i];
    const float gi = g[i];
    if (k.decay_on) pi = __fmul_rn(pi, k.decay);
    const float mi = __fadd_rn(__fmul_rn(m[i], k.b1), __fmul_rn(gi, k.one_minus_b1));
    const float vi = __fadd_rn(__fmul_rn(v[i], k.b2), __fmul_rn(k.one_minus_b2, __fmul_rn(gi, gi)));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), k.bc2_sqrt), k.eps);
    pi = __fadd_rn(pi, __fmul_rn(-k.step_size, __fdiv_rn(mi, denom)));
    m[i] = mi;
    v[i] = vi;
    p[i] = pi;
  }
}

constexpr int kSumThreads = 1024;

template <typename T>
__global__ void sum_of_squares_kernel(const T* x, int64_t n, double* out) {
  __shared__ double shared[32];
  double part = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) {
    const double v = detail::load(x, i);
    part += v * v;
  }
  const double total = detail::block_sum(part, shared);
  if (threadIdx.x == 0) out[0] = total;
}

}  // namespace

cudaError_t launch_adamw(float* param, const float* grad, float* exp_avg, float* exp_avg_sq,
                         int64_t n, bool decay_on, float decay, float beta1, float beta2,
                         float one_minus_beta1, float one_minus_beta2, float step_size,
                         float bc2_sqrt, float eps, void* stream) {
  if (n == 0) return cudaSuccess;
  const AdamScalars k{decay_on,        decay,     beta1,    beta2, one_minus_beta1,
                      one_minus_beta2, step_size, bc2_sqrt, eps};
  adamw_kernel<<<detail::grid_1d(n), detail::kThreads, 0, detail::as_stream(stream)>>>(
      param, grad, exp_avg, exp_avg_sq, n, k);
  return cudaGetLastError();
}

cudaError_t launch_sum_of_squares(const void* x, bool bf16, int64_t n, double* out, void* stream) {
  auto s = detail::as_stream(stream);
  if (bf16)
    sum_of_squares_kernel<<<1, kSumThreads, 0, s>>>(static_cast<const uint16_t*>(x), n, out);
  else
    sum_of_squares_kernel<<<1, kSumThreads, 0, s>>>(static_cast<const float*>(x), n, out);
  return cudaGetLastError();
}

}  // namespace meshproof::kernels::cuda
