// CUDA kernels of the MoE router (kernels/moe/moe_route.h): the host's row functions
// (kernels/moe/moe_row.h) one thread per token, so the choices, weights and gradients are the
// host's given the same probabilities; counts by integer atomics (order-free), probability sums one
// thread per expert in token order.
#include <cuda_runtime.h>

#include "kernels/moe/moe_cuda.h"
#include "kernels/moe/moe_row.h"
#include "kernels/ops/ops_cuda_util.cuh"

namespace meshproof::kernels::cuda {
namespace {

__global__ void route_kernel(const float* logits, int64_t tokens, int64_t experts, int64_t top_k,
                             bool sigmoid, double* probs, int32_t* expert, double* weight) {
  const int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (t >= tokens) return;
  moe_row::route_row(logits + t * experts, experts, top_k, sigmoid, false, probs + t * experts,
                     expert + t * top_k, weight + t * top_k);
}

__global__ void counts_kernel(const int32_t* expert, int64_t pairs, int64_t experts,
                              unsigned long long* counts) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < pairs;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int32_t e = expert[i];
    if (e >= 0 && e < experts) atomicAdd(counts + e, 1ull);
  }
}

__global__ void prob_sums_kernel(const double* probs, int64_t tokens, int64_t experts,
                                 double* sums) {
  const int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (e >= experts) return;
  double s = 0.0;
  for (int64_t t = 0; t < tokens; ++t) s = moe_row::mp_add(s, probs[t * experts + e]);
  sums[e] = s;
}

template <typename O>
__global__ void route_backward_kernel(const double* probs, const int32_t* expert,
                                      const double* weight, const double* d_weight,
                                      const double* aux, int64_t tokens, int64_t experts,
                                      int64_t top_k, bool sigmoid, double* scratch, O* out) {
  const int64_t t = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (t >= tokens) return;
  double* o = scratch + t * experts;
  moe_row::route_backward_row(probs + t * experts, expert + t * top_k, weight + t * top_k,
                              d_weight + t * top_k, aux, experts, top_k, sigmoid, o);
  for (int64_t e = 0; e < experts; ++e) detail::store_d(out, t * experts + e, o[e]);
}

constexpr int kRowThreads = 128;

unsigned row_blocks(int64_t n) {
  return static_cast<unsigned>((n + kRowThreads - 1) / kRowThreads);
}

}  // namespace

int launch_moe_route(const float* logits, int64_t tokens, int64_t experts, int64_t top_k,
                     bool sigmoid, double* probs, int32_t* expert, double* weight, void* stream) {
  if (tokens == 0) return cudaSuccess;
  route_kernel<<<row_blocks(tokens), kRowThreads, 0, detail::as_stream(stream)>>>(
      logits, tokens, experts, top_k, sigmoid, probs, expert, weight);
  return cudaGetLastError();
}

int launch_moe_expert_counts(const int32_t* expert, int64_t pairs, int64_t experts, int64_t* counts,
                             void* stream) {
  const cudaStream_t s = detail::as_stream(stream);
  const cudaError_t z =
      cudaMemsetAsync(counts, 0, static_cast<size_t>(experts) * sizeof(int64_t), s);
  if (z != cudaSuccess || pairs == 0) return z;
  static_assert(sizeof(unsigned long long) == sizeof(int64_t));
  counts_kernel<<<detail::grid_1d(pairs), detail::kThreads, 0, s>>>(
      expert, pairs, experts, reinterpret_cast<unsigned long long*>(counts));
  return cudaGetLastError();
}

int launch_moe_prob_sums(const double* probs, int64_t tokens, int64_t experts, double* sums,
                         void* stream) {
  if (experts == 0) return cudaSuccess;
  prob_sums_kernel<<<row_blocks(experts), kRowThreads, 0, detail::as_stream(stream)>>>(
      probs, tokens, experts, sums);
  return cudaGetLastError();
}

int launch_moe_route_backward(const double* probs, const int32_t* expert, const double* weight,
                              const double* d_weight, const double* aux, int64_t tokens,
                              int64_t experts, int64_t top_k, bool sigmoid, double* scratch,
                              void* out, bool bf16, void* stream) {
  if (tokens == 0) return cudaSuccess;
  const cudaStream_t s = detail::as_stream(stream);
  if (bf16)
    route_backward_kernel<<<row_blocks(tokens), kRowThreads, 0, s>>>(
        probs, expert, weight, d_weight, aux, tokens, experts, top_k, sigmoid, scratch,
        static_cast<uint16_t*>(out));
  else
    route_backward_kernel<<<row_blocks(tokens), kRowThreads, 0, s>>>(
        probs, expert, weight, d_weight, aux, tokens, experts, top_k, sigmoid, scratch,
        static_cast<float*>(out));
  return cudaGetLastError();
}

}  // namespace meshproof::kernels::cuda
