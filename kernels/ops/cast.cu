// CUDA cast between float32 and bfloat16 (kernels/ops/cast.h): bf16 -> float is exact, float
// -> bf16 is RNE through the formats.h code the CPU uses, so the result is bitwise the CPU's.
#include <type_traits>

#include "kernels/ops/ops_cuda.h"
#include "kernels/ops/ops_cuda_util.cuh"

namespace meshproof::kernels::cuda {
namespace {

// A same-type "cast" copies the stored bits, as the CPU does: through fp32, float_to_bf16 would
// quiet a signalling bf16 NaN.
template <typename S, typename D>
__global__ void cast_kernel(const S* src, D* dst, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    if constexpr (std::is_same_v<S, D>)
      dst[i] = src[i];
    else
      detail::store(dst, i, detail::load(src, i));
  }
}

template <typename S, typename D>
cudaError_t run(const void* src, void* dst, int64_t n, void* stream) {
  if (n == 0) return cudaSuccess;
  cast_kernel<S, D><<<detail::grid_1d(n), detail::kThreads, 0, detail::as_stream(stream)>>>(
      static_cast<const S*>(src), static_cast<D*>(dst), n);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_cast(const void* src, bool src_bf16, void* dst, bool dst_bf16, int64_t n,
                        void* stream) {
  if (src_bf16)
    return dst_bf16 ? run<uint16_t, uint16_t>(src, dst, n, stream)
                    : run<uint16_t, float>(src, dst, n, stream);
  return dst_bf16 ? run<float, uint16_t>(src, dst, n, stream)
                  : run<float, float>(src, dst, n, stream);
}

}  // namespace meshproof::kernels::cuda
