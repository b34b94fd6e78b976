// Device kernels of the CUDA GEMM path and their launchers (host logic: gemm_cublaslt.cc).
// Kept simple and element-wise so that each is obviously right: the decode uses formats.h exactly
// as the CPU decode (gemm_cpu_pack.cc) does, the swizzle and the block-scale layouts are the index
// functions of kernels/gemm/cublaslt_layout.h.
#include <algorithm>

#include "kernels/core/formats.h"
#include "kernels/gemm/cublaslt_layout.h"
#include "kernels/gemm/gemm_cuda_kernels.h"
#include "kernels/quantize/nvfp4_rules.h"

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

// Pads and swizzles a byte scale matrix S[r, c] (E8M0 or E4M3 codes; r: the operand's outer index,
// c: its block index along K; S[r, c] = src[r * stride_r + c * stride_c]) into cuBLASLt's 128x4
// tiles (lt::swizzled_128x4_offset, docs/design.md sections 4 and 30), padded with zeros. One
// thread per padded source position, so every destination byte (padding too) is written once.
__global__ void swizzle_128x4_kernel(const uint8_t* src, int64_t rows, int64_t cols,
                                     int64_t stride_r, int64_t stride_c, uint8_t* dst) {
  const int64_t pcol = lt::round_up(cols, 4);
  const int64_t n = lt::swizzled_128x4_bytes(rows, cols);
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / pcol, c = i % pcol;
    const uint8_t v = (r < rows && c < cols) ? src[r * stride_r + c * stride_c] : uint8_t{0};
    dst[lt::swizzled_128x4_offset(r, c, cols)] = v;
  }
}

// Block-scaling scales of one K-major operand into cuBLASLt's layout. src is the stored fp32
// scale matrix, row-major with k_blocks columns: [outer, k_blocks] (1x128 blocks) or
// [ceil(outer/128), k_blocks] (128x128 tiles). One thread per destination float, padding zeroed.
__global__ void block_scales_kernel(const float* src, int64_t outer, int64_t k_blocks, bool tiles,
                                    float* dst) {
  if (tiles) {
    const int64_t kb4 = lt::round_up(k_blocks, 4);
    const int64_t n = lt::blk128_scale_elems(outer, k_blocks);
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const int64_t ob = i / kb4, kb = i % kb4;
      dst[lt::blk128_scale_offset(ob, kb, k_blocks)] =
          kb < k_blocks ? src[ob * k_blocks + kb] : 0.0f;
    }
  } else {
    const int64_t o4 = lt::round_up(outer, 4);
    const int64_t n = lt::vec128_scale_elems(outer, k_blocks);
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
      const int64_t kb = i / o4, o = i % o4;
      dst[lt::vec128_scale_offset(o, kb, outer)] = o < outer ? src[o * k_blocks + kb] : 0.0f;
    }
  }
}

// alpha_beta[0] = gds(amax_a) * gds(amax_b): the two NVFP4 global decode scales (section 25's
// rules, the quantizer's own functions) that cuBLASLt applies once to the product of the
// block-scaled sums; alpha_beta[1] = beta (device pointer mode takes both from the device).
__global__ void nvfp4_alpha_kernel(const float* amax_a, const float* amax_b, float beta,
                                   float* alpha_beta) {
  namespace nv = rules::nvfp4;
  const float gds_a = nv::global_decode_scale(nv::global_encode_scale(*amax_a));
  const float gds_b = nv::global_decode_scale(nv::global_encode_scale(*amax_b));
  alpha_beta[0] = gds_a * gds_b;
  alpha_beta[1] = beta;
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
  return lt::swizzled_128x4_bytes(rows, cols);
}

cudaError_t launch_swizzle_e8m0(const uint8_t* src, int64_t rows, int64_t cols, int64_t stride_r,
                                int64_t stride_c, uint8_t* dst, cudaStream_t stream) {
  swizzle_128x4_kernel<<<grid_for(lt::swizzled_128x4_bytes(rows, cols)), 256, 0, stream>>>(
      src, rows, cols, stride_r, stride_c, dst);
  return cudaGetLastError();
}

cudaError_t launch_block_scales(const float* src, int64_t outer, int64_t k_blocks, bool tiles,
                                float* dst, cudaStream_t stream) {
  const int64_t n =
      tiles ? lt::blk128_scale_elems(outer, k_blocks) : lt::vec128_scale_elems(outer, k_blocks);
  block_scales_kernel<<<grid_for(n), 256, 0, stream>>>(src, outer, k_blocks, tiles, dst);
  return cudaGetLastError();
}

cudaError_t launch_nvfp4_alpha(const float* amax_a, const float* amax_b, float beta,
                               float* alpha_beta, cudaStream_t stream) {
  nvfp4_alpha_kernel<<<1, 1, 0, stream>>>(amax_a, amax_b, beta, alpha_beta);
  return cudaGetLastError();
}

}  // namespace meshproof::kernels::detail
