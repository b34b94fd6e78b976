// CUDA AdamW (kernels/ops/adamw.h): the CPU's float32 update, operation for operation with
// explicitly rounded intrinsics (no FMA contraction, IEEE sqrt/div), so the result is bitwise the
// CPU's. sum_of_squares: one block, per-thread strided partial sums in double, fixed tree order
// (deterministic; differs from the CPU's serial double sum by ~1e-15 relative).
// sum_of_squares_in_order: the CPU's serial double sums, operation for operation (bitwise).
#include "kernels/ops/ops_cuda.h"
#include "kernels/ops/ops_cuda_util.cuh"

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

// Tensors per launch of the serial kernel: the spans travel as a kernel parameter (no upload),
// 128 x 16 bytes, well inside the 4 KiB parameter limit of every CUDA version.
constexpr int kMaxSpans = 128;
struct Spans {
  const float* ptr[kMaxSpans];
  int64_t n[kMaxSpans];
  int count;
};

// Block k (one warp): partial[k] = sum of squares of tensor k, added serially in index order from
// 0.0, as the host does. The additions are one dependent chain whatever the hardware, but the
// loads need not be: each round the 32 lanes load kDepth x 32 consecutive elements (coalesced) and
// square them, and every lane then adds the round's squares in index order, taken one by one from
// their lanes by shuffles. Every lane computes the same sum; lane 0 stores it. One thread loading
// element by element left each load's latency on the chain: about 1 s per step for issue 16's
// 58.7M-element FFN weights, against about 0.2 s for the chain itself.
constexpr int kSquareLanes = 32;
constexpr int kDepth = 4;
__global__ void serial_sum_of_squares_kernel(Spans spans, double* partial) {
  const int k = static_cast<int>(blockIdx.x);
  if (k >= spans.count) return;  // the whole block: the shuffles below need all 32 lanes
  const float* x = spans.ptr[k];
  const int64_t n = spans.n[k];
  const int lane = static_cast<int>(threadIdx.x);
  double acc = 0.0;
  for (int64_t base = 0; base < n; base += kSquareLanes * kDepth) {
    double sq[kDepth];
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      const int64_t i = base + d * kSquareLanes + lane;
      const double v = i < n ? static_cast<double>(x[i]) : 0.0;
      sq[d] = __dmul_rn(v, v);
    }
#pragma unroll
    for (int d = 0; d < kDepth; ++d) {
      const int64_t left = n - (base + d * kSquareLanes);  // elements of this row of 32 in range
#pragma unroll
      for (int j = 0; j < kSquareLanes; ++j) {
        const double t = __shfl_sync(0xFFFFFFFFu, sq[d], j);
        if (j < left) acc = __dadd_rn(acc, t);  // never adds the padding: the sum stays exact
      }
    }
  }
  if (lane == 0) partial[k] = acc;
}

// out[0] = partial[0] + partial[1] + ... in order, from 0.0 (the host's running sum).
__global__ void ordered_total_kernel(const double* partial, int64_t count, double* out) {
  if (blockIdx.x != 0 || threadIdx.x != 0) return;
  double acc = 0.0;
  for (int64_t k = 0; k < count; ++k) acc = __dadd_rn(acc, partial[k]);
  out[0] = acc;
}

}  // namespace

cudaError_t launch_sum_of_squares_in_order(const float* const* x, const int64_t* n, int64_t count,
                                           double* partial, double* out, void* stream) {
  auto s = detail::as_stream(stream);
  for (int64_t first = 0; first < count; first += kMaxSpans) {
    Spans spans{};
    spans.count = static_cast<int>(count - first < kMaxSpans ? count - first : kMaxSpans);
    for (int k = 0; k < spans.count; ++k) {
      spans.ptr[k] = x[first + k];
      spans.n[k] = n[first + k];
    }
    serial_sum_of_squares_kernel<<<static_cast<unsigned>(spans.count), kSquareLanes, 0, s>>>(
        spans, partial + first);
    if (const cudaError_t e = cudaGetLastError(); e != cudaSuccess) return e;
  }
  ordered_total_kernel<<<1, 1, 0, s>>>(partial, count, out);
  return cudaGetLastError();
}

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
