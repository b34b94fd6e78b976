// Device version of reduce_rank_order_host (mesh/core/communicator.cc): one thread per element, the
// same fp32 operations in the same order, so that the local device backend is bitwise equal to
// the host reference. Used by the in-process communicator for virtual ranks sharing a GPU.
#include <cuda_runtime.h>

#include "mesh/core/reduce_kernel.h"

namespace meshproof::mesh::detail {
namespace {

struct DeviceInputs {
  const float* ptr[kMaxReduceInputs];
};

__global__ void reduce_rank_order_kernel(float* out, DeviceInputs in, int n, int64_t count,
                                         int op) {
  const float divisor = static_cast<float>(n);
  for (int64_t k = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; k < count;
       k += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    float acc = in.ptr[0][k];
    for (int s = 1; s < n; ++s) {
      const float x = in.ptr[s][k];
      if (op == static_cast<int>(ReduceKernelOp::kMax)) {
        acc = (x > acc || x != x) ? x : acc;  // NaN propagates, as on the host
      } else {
        acc = __fadd_rn(acc, x);  // a plain rounded add, never contracted
      }
    }
    if (op == static_cast<int>(ReduceKernelOp::kAvg)) acc = __fdiv_rn(acc, divisor);
    out[k] = acc;
  }
}

}  // namespace

int launch_reduce_rank_order(float* out, const float* const* inputs, int n, int64_t count,
                             ReduceKernelOp op, void* stream) {
  if (n < 1 || n > kMaxReduceInputs) return static_cast<int>(cudaErrorInvalidValue);
  if (count == 0) return static_cast<int>(cudaSuccess);
  DeviceInputs in{};
  for (int s = 0; s < n; ++s) in.ptr[s] = inputs[s];
  const int threads = 256;
  const int64_t blocks64 = (count + threads - 1) / threads;
  const int blocks = static_cast<int>(blocks64 < 65535 ? blocks64 : 65535);
  reduce_rank_order_kernel<<<blocks, threads, 0, static_cast<cudaStream_t>(stream)>>>(
      out, in, n, count, static_cast<int>(op));
  return static_cast<int>(cudaGetLastError());
}

}  // namespace meshproof::mesh::detail
