// Internal to the GEMM family: the device kernels of the CUDA GEMM path (gemm.cu) and their
// launchers, called by the cuBLASLt host code (gemm_cublaslt.cc). Launchers enqueue on `stream`
// and return the launch status (cudaGetLastError) for the caller to check: gemm.cu stays free of
// the fmt-based error macros (nvcc rejects fmt's consteval format strings).
#pragma once

#if MESHPROOF_HAVE_CUDA
#include <cuda_runtime.h>

#include <cstdint>

namespace meshproof::kernels::detail {

// How a stored copy is scaled (mirrors ScalingMode; mapped in gemm_cublaslt.cc).
enum class DecodeScaling : uint8_t { kPerTensor, kMxfp8, kBlock };

// One stored copy of a quantized operand, decoded element-wise exactly as the CPU path
// (gemm_cpu_pack.cc).
struct DecodeArgs {
  const uint8_t* codes = nullptr;  // stored [rows, cols] FP8 codes
  int64_t rows = 0;
  int64_t cols = 0;
  bool e4m3 = true;  // else e5m2
  DecodeScaling mode = DecodeScaling::kPerTensor;
  const void* scale = nullptr;  // float32 (per-tensor [1], block) or e8m0 bytes (mxfp8)
  int64_t scale_cols = 1;       // row stride of the scale matrix
  bool mx_columnwise = false;   // mxfp8: 32x1 blocks (scale [rows/32, cols]) instead of 1x32
  int64_t block_rows = 1;       // block modes: 1 (1x128) or 128 (128x128)
};

// out[r, c] = decode(codes[r, c]) as fp32 / as bf16 bits (round to nearest even).
cudaError_t launch_decode_to_f32(const DecodeArgs& a, float* out, cudaStream_t stream);
cudaError_t launch_decode_to_bf16(const DecodeArgs& a, uint16_t* out, cudaStream_t stream);
// out[i] = bf16 bits in[i] widened to fp32 (exact).
cudaError_t launch_bf16_to_f32(const uint16_t* in, float* out, int64_t n, cudaStream_t stream);
// dst[c, r] = src[r, c] for a [rows, cols] byte matrix.
cudaError_t launch_transpose_u8(const uint8_t* src, uint8_t* dst, int64_t rows, int64_t cols,
                                cudaStream_t stream);
// Pads and swizzles a byte scale matrix (E8M0 for MXFP8, E4M3 codes for NVFP4) S[r, c] = src[r *
// stride_r + c * stride_c] (r < rows: the operand's non-reduction index; c < cols: its 32-block
// index along K) into cuBLASLt's 128x4 tiles of 512 bytes (docs/design.md section 4); dst holds
// swizzled_e8m0_bytes(rows, cols) bytes, padding zeroed.
int64_t swizzled_e8m0_bytes(int64_t rows, int64_t cols);
cudaError_t launch_swizzle_e8m0(const uint8_t* src, int64_t rows, int64_t cols, int64_t stride_r,
                                int64_t stride_c, uint8_t* dst, cudaStream_t stream);
// Block-scaling scales of one K-major operand (`outer` rows, k_blocks = ceil(K/128)) from the
// stored fp32 matrix (row-major, k_blocks columns; [outer, k_blocks] for 1x128 blocks,
// [ceil(outer/128), k_blocks] for 128x128 tiles when `tiles`) into cuBLASLt's VEC128_32F /
// BLK128x128_32F layout (kernels/gemm/cublaslt_layout.h); dst holds vec128_scale_elems /
// blk128_scale_elems floats, padding zeroed.
cudaError_t launch_block_scales(const float* src, int64_t outer, int64_t k_blocks, bool tiles,
                                float* dst, cudaStream_t stream);
// alpha_beta[0] = gds(*amax_a) * gds(*amax_b) (NVFP4 global decode scales), alpha_beta[1] = beta.
cudaError_t launch_nvfp4_alpha(const float* amax_a, const float* amax_b, float beta,
                               float* alpha_beta, cudaStream_t stream);

}  // namespace meshproof::kernels::detail
#endif
