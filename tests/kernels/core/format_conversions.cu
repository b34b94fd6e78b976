// Device side of formats_gpu_test.cc: one thread per input runs the same convert() dispatch the
// host runs (format_conversions.h), so any difference is the device compiler's or hardware's.
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/core/cuda_check.h"
#include "tests/kernels/core/format_conversions.h"

namespace meshproof::kernels::fmt8 {
namespace {

__global__ void convert_kernel(Conversion c, const uint32_t* in, uint32_t* out, size_t n) {
  const size_t stride = static_cast<size_t>(gridDim.x) * blockDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride) {
    out[i] = convert(c, in[i]);
  }
}

}  // namespace

std::vector<uint32_t> convert_on_device(Conversion c, const std::vector<uint32_t>& in) {
  std::vector<uint32_t> out(in.size());
  if (in.empty()) return out;
  const size_t bytes = in.size() * sizeof(uint32_t);
  uint32_t* d_in = nullptr;
  uint32_t* d_out = nullptr;
  MP_CUDA_CHECK(cudaMalloc(&d_in, bytes));
  MP_CUDA_CHECK(cudaMalloc(&d_out, bytes));
  MP_CUDA_CHECK(cudaMemcpy(d_in, in.data(), bytes, cudaMemcpyHostToDevice));
  const unsigned blocks = static_cast<unsigned>(std::min<size_t>((in.size() + 255) / 256, 65535));
  convert_kernel<<<blocks, 256>>>(c, d_in, d_out, in.size());
  MP_CUDA_CHECK_LAUNCH();
  MP_CUDA_CHECK(cudaMemcpy(out.data(), d_out, bytes, cudaMemcpyDeviceToHost));
  MP_CUDA_CHECK(cudaFree(d_in));
  MP_CUDA_CHECK(cudaFree(d_out));
  return out;
}

}  // namespace meshproof::kernels::fmt8
