// Device kernels of the CUDA GEMM path and their launchers (host logic: gemm_cublaslt.cc).
// Kept simple and element-wise so that each is obviously right: the decode uses formats.h exactly
// as gemm.cc's CPU decode does, the swizzle is docs/design.md section 4's byte formula verbatim.
#include <algorithm>

#include "kernels/formats.h"
#include "kernels/gemm_cuda_kernels.h"

namespace meshproof::kernels::detail {
namespace {

__device__ float bits_as_float(uint32_t u) { return __uint_as_float(u); }

__device__ float dev_decode_fp8(bool e4m3, uint8_t b) {
  return e4m3 ? fmt8::e4m3_to_float(b) : fmt8::e5m2_to_float(b);
}

__device__ float dev_decode_at(const DecodeArgs& a, int64_t r, int64_t c) {
  const float q = dev_decode_fp8(a.e4m3, a.codes[r * a.cols + c]);
  switch (a.mode) {
    case DecodeScaling::kPerTensor:
      return q * *static_cast<const float*>(a.scale);
    case DecodeScaling::kMxfp8: {
      const auto* e8 = static_cast<const uint8_t*>(a.scale);
      const uint8_t e =
          a.mx_columnwise ? e8[(r / 32) * a.scale_cols + c] : e8[r * a.scale_cols + c / 32];
      return e == 0xFF ? bits_as_float(0x7FC00000u) : ldexpf(q, static_cast<int>(e) - 127);
    }
    case DecodeScaling::kBlock: {
      const auto* s = static_cast<const float*>(a.scale);
      return q * s[(r / a.block_rows) * a.scale_cols + c / 128];
    }
  }
  return bits_as_float(0x7FC00000u);  // unreachable: every DecodeScaling is handled above
}

__global__ void decode_to_f32_kernel(DecodeArgs a, float* out) {
  const int64_t n = a.rows * a.cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = dev_decode_at(a, i / a.cols, i % a.cols);
  }
}

__global__ void decode_to_bf16_kernel(DecodeArgs a, uint16_t* out) {
  const int64_t n = a.rows * a.cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = fmt8::float_to_bf16(dev_decode_at(a, i / a.cols, i % a.cols));
  }
}

__global__ void bf16_to_f32_kernel(const uint16_t* in, float* out, int64_t n) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = __uint_as_float(static_cast<uint32_t>(in[i]) << 16);
  }
}

// dst[c, r] = src[r, c] for bytes (FP8 codes).
__global__ void transpose_u8_kernel(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t cols) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / cols, c = i % cols;
    dst[c * rows + r] = src[i];
  }
}

// Pads and swizzles an E8M0 scale matrix S[r, c] (r: the operand's non-reduction index, c: the
// index of its 32-block along K; S[r, c] = src[r * stride_r + c * stride_c]) into cuBLASLt's
// 128x4 tiles (docs/design.md section 4): padded to [roundup(R,128), roundup(C,4)] with zeros, and
//   byte = ((r/128) * ceil(C/4) + c/4) * 512 + (r%32) * 16 + ((r%128)/32) * 4 + c%4.
// One thread per destination byte, so padding is written too.
__global__ void swizzle_e8m0_kernel(const uint8_t* src, int64_t rows, int64_t cols,
                                    int64_t stride_r, int64_t stride_c, uint8_t* dst) {
  const int64_t prow = (rows + 127) / 128 * 128;
  const int64_t tiles_c = (cols + 3) / 4;
  const int64_t pcol = tiles_c * 4;
  const int64_t n = prow * pcol;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / pcol, c = i % pcol;
    const uint8_t v = (r < rows && c < cols) ? src[r * stride_r + c * stride_c] : uint8_t{0};
    const int64_t byte =
        ((r / 128) * tiles_c + c / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 + c % 4;
    dst[byte] = v;
  }
}

unsigned grid_for(int64_t n) {
  const int64_t blocks = (n + 255) / 256;
  return static_cast<unsigned>(std::min<int64_t>(std::max<int64_t>(blocks, 1), 65535));
}

}  // namespace

cudaError_t launch_decode_to_f32(const DecodeArgs& a, float* out, cudaStream_t stream) {
  decode_to_f32_kernel<<<grid_for(a.rows * a.cols), 256, 0, stream>>>(a, out);
  return cudaGetLastError();
}

cudaError_t launch_decode_to_bf16(const DecodeArgs& a, uint16_t* out, cudaStream_t stream) {
  decode_to_bf16_kernel<<<grid_for(a.rows * a.cols), 256, 0, stream>>>(a, out);
  return cudaGetLastError();
}

cudaError_t launch_bf16_to_f32(const uint16_t* in, float* out, int64_t n, cudaStream_t stream) {
  bf16_to_f32_kernel<<<grid_for(n), 256, 0, stream>>>(in, out, n);
  return cudaGetLastError();
}

cudaError_t launch_transpose_u8(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t cols,
                                cudaStream_t stream) {
  transpose_u8_kernel<<<grid_for(rows * cols), 256, 0, stream>>>(src, dst, rows, cols);
  return cudaGetLastError();
}

int64_t swizzled_e8m0_bytes(int64_t rows, int64_t cols) {
  return (rows + 127) / 128 * 128 * ((cols + 3) / 4 * 4);
}

cudaError_t launch_swizzle_e8m0(const uint8_t* src, int64_t rows, int64_t cols, int64_t stride_r,
                                int64_t stride_c, uint8_t* dst, cudaStream_t stream) {
  swizzle_e8m0_kernel<<<grid_for(swizzled_e8m0_bytes(rows, cols)), 256, 0, stream>>>(
      src, rows, cols, stride_r, stride_c, dst);
  return cudaGetLastError();
}

}  // namespace meshproof::kernels::detail
