// CUDA quantization kernels and their launchers. Each kernel calls the same scalar rules
// (kernels/quantize/quantize_rules.h, kernels/core/formats.h) as the CPU reference in
// quantize_*.cc, with the same fp32 operations in the same order, so the bytes are identical; only
// the loop structure differs. No fast-math: the build never passes -use_fast_math/-ftz, so fp32
// division and subnormals follow IEEE like the host, and no expression here has an add that could
// be contracted into an FMA.
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/core/cuda_check.h"
#include "kernels/quantize/quantize_cuda.h"
#include "kernels/quantize/quantize_rules.h"

namespace meshproof::kernels::cuda {
namespace {

constexpr int kThreads = 256;

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

// Grid size for a grid-stride loop over n items.
unsigned grid_for(int64_t n, int threads = kThreads) {
  const int64_t blocks = (n + threads - 1) / threads;
  return static_cast<unsigned>(std::clamp<int64_t>(blocks, 1, 65535LL * 16));
}

__global__ void amax_kernel(const void* x, bool bf16, int64_t n, unsigned* out) {
  uint32_t a = 0;
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const uint32_t b = rules::abs_bits(rules::load_input(x, bf16, i));
    a = b > a ? b : a;
  }
  // Unsigned max is associative and commutative: any reduction order gives the CPU's answer.
  for (int off = 16; off > 0; off >>= 1) {
    const uint32_t o = __shfl_down_sync(0xFFFFFFFFu, a, off);
    a = o > a ? o : a;
  }
  if ((threadIdx.x & 31) == 0) atomicMax(out, a);
}

__global__ void current_scale_kernel(const float* amax, float* scale, float fp8max, float eps,
                                     bool pow2) {
  scale[0] = rules::current_scale(amax[0], fp8max, eps, pow2);
}

__global__ void record_amax_kernel(float* history, const float* amax) {
  const uint32_t a = rules::abs_bits(history[0]);
  const uint32_t b = rules::abs_bits(amax[0]);
  history[0] = fmt8::bits_float(a > b ? a : b);
}

__global__ void delayed_update_kernel(float* history, int64_t len, float* scale, bool algo_max,
                                      float fp8max, float two_pow_margin) {
  rules::delayed_update(history, len, scale, algo_max, fp8max, two_pow_margin);
}

// Per-tensor: one 32x32 tile per block (32x8 threads). Rowwise bytes are written coalesced as
// they are produced; the tile goes through shared memory so the transposed copy is also written
// coalesced. The element rule is cast_block's: rules::cast_element(x, scale).
__global__ void per_tensor_kernel(const void* x, bool bf16, int64_t M, int64_t K,
                                  const float* scale, bool e5m2, uint8_t* row, uint8_t* col,
                                  float* scale_inv_out) {
  __shared__ uint8_t tile[32][33];
  const float s = scale[0];
  if (blockIdx.x == 0 && blockIdx.y == 0 && threadIdx.x == 0 && threadIdx.y == 0) {
    scale_inv_out[0] = rules::reciprocal(s);
  }
  const int64_t tiles_m = (M + 31) / 32;
  const int64_t k0 = static_cast<int64_t>(blockIdx.x) * 32;
  for (int64_t tm = blockIdx.y; tm < tiles_m; tm += gridDim.y) {
    const int64_t m0 = tm * 32;
    for (int j = 0; j < 32; j += 8) {
      const int64_t m = m0 + threadIdx.y + j;
      const int64_t k = k0 + threadIdx.x;
      if (m < M && k < K) {
        const uint8_t v = rules::cast_element(rules::load_input(x, bf16, m * K + k), s, e5m2);
        if (row) row[m * K + k] = v;
        tile[threadIdx.y + j][threadIdx.x] = v;
      }
    }
    __syncthreads();
    if (col) {
      for (int j = 0; j < 32; j += 8) {
        const int64_t k = k0 + threadIdx.y + j;
        const int64_t m = m0 + threadIdx.x;
        if (m < M && k < K) col[k * M + m] = tile[threadIdx.x][threadIdx.y + j];
      }
    }
    __syncthreads();
  }
}

// MXFP8 rowwise: one thread per 1x32 block (m, kb).
__global__ void mxfp8_row_kernel(const void* x, bool bf16, int64_t M, int64_t K, bool e5m2,
                                 uint8_t* row, uint8_t* row_s) {
  const int64_t nkb = K / 32;
  for (int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; b < M * nkb;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t m = b / nkb;
    const int64_t kb = b % nkb;
    const int64_t base = m * K + kb * 32;
    const float amax = fmt8::bits_float(rules::block_amax_bits(x, bf16, base, 1, 32));
    const uint8_t e = rules::mxfp8_scale_exponent(amax, e5m2);
    row_s[b] = e;
    rules::cast_block(x, bf16, base, 1, 32, fmt8::e8m0_reciprocal(e), e5m2, row, base, 1);
  }
}

// MXFP8 columnwise: one thread per 32x1 block (mb, k); neighbouring threads read neighbouring k.
__global__ void mxfp8_col_kernel(const void* x, bool bf16, int64_t M, int64_t K, bool e5m2,
                                 uint8_t* col, uint8_t* col_s) {
  for (int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; b < (M / 32) * K;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t mb = b / K;
    const int64_t k = b % K;
    const int64_t base = mb * 32 * K + k;
    const float amax = fmt8::bits_float(rules::block_amax_bits(x, bf16, base, K, 32));
    const uint8_t e = rules::mxfp8_scale_exponent(amax, e5m2);
    col_s[b] = e;
    rules::cast_block(x, bf16, base, K, 32, fmt8::e8m0_reciprocal(e), e5m2, col, base, K);
  }
}

// Block 1x128 rowwise: one thread per (m, j) block.
__global__ void block1d_row_kernel(const void* x, bool bf16, int64_t M, int64_t K, bool e5m2,
                                   float eps, bool pow2, uint8_t* row, float* row_s) {
  const int64_t kb = (K + 127) / 128;
  for (int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; b < M * kb;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t m = b / kb;
    const int64_t j = b % kb;
    const int64_t base = m * K + j * 128;
    const int64_t n = K - j * 128 < 128 ? K - j * 128 : 128;
    const float s = rules::block_scale(
        fmt8::bits_float(rules::block_amax_bits(x, bf16, base, 1, n)), e5m2, eps, pow2);
    row_s[b] = rules::reciprocal(s);
    rules::cast_block(x, bf16, base, 1, n, s, e5m2, row, base, 1);
  }
}

// Block 1x128 of the transpose: one thread per (i, k): rows [128i, 128i+128) of column k.
__global__ void block1d_col_kernel(const void* x, bool bf16, int64_t M, int64_t K, bool e5m2,
                                   float eps, bool pow2, uint8_t* col, float* col_s) {
  const int64_t mb = (M + 127) / 128;
  for (int64_t b = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; b < mb * K;
       b += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t i = b / K;
    const int64_t k = b % K;
    const int64_t base = i * 128 * K + k;
    const int64_t n = M - i * 128 < 128 ? M - i * 128 : 128;
    const float s = rules::block_scale(
        fmt8::bits_float(rules::block_amax_bits(x, bf16, base, K, n)), e5m2, eps, pow2);
    col_s[k * mb + i] = rules::reciprocal(s);
    rules::cast_block(x, bf16, base, K, n, s, e5m2, col, k * M + i * 128, 1);
  }
}

// Block 128x128: one CUDA block (128 threads) per tile; thread t owns column k0+t of the tile.
__global__ void block2d_kernel(const void* x, bool bf16, int64_t M, int64_t K, bool e5m2, float eps,
                               bool pow2, uint8_t* row, float* row_s, uint8_t* col, float* col_s) {
  __shared__ unsigned tile_amax;
  const int64_t mb = (M + 127) / 128;
  const int64_t kb = (K + 127) / 128;
  for (int64_t t = blockIdx.x; t < mb * kb; t += gridDim.x) {
    const int64_t bi = t / kb;
    const int64_t bj = t % kb;
    const int64_t m0 = bi * 128;
    const int64_t k0 = bj * 128;
    const int64_t rows = M - m0 < 128 ? M - m0 : 128;
    const int64_t cols = K - k0 < 128 ? K - k0 : 128;
    if (threadIdx.x == 0) tile_amax = 0;
    __syncthreads();
    const int64_t k = k0 + threadIdx.x;
    if (threadIdx.x < cols)
      atomicMax(&tile_amax, rules::block_amax_bits(x, bf16, m0 * K + k, K, rows));
    __syncthreads();
    const float s = rules::block_scale(fmt8::bits_float(tile_amax), e5m2, eps, pow2);
    if (threadIdx.x == 0) {
      if (row_s) row_s[bi * kb + bj] = rules::reciprocal(s);
      if (col_s) col_s[bj * mb + bi] = rules::reciprocal(s);
    }
    if (threadIdx.x < cols) {
      if (row) rules::cast_block(x, bf16, m0 * K + k, K, rows, s, e5m2, row, m0 * K + k, K);
      if (col) rules::cast_block(x, bf16, m0 * K + k, K, rows, s, e5m2, col, k * M + m0, 1);
    }
    __syncthreads();  // tile_amax is reused by the next tile
  }
}

__global__ void dequantize_kernel(int layout, bool e5m2, const uint8_t* data, const void* scale,
                                  int64_t M, int64_t K, float* out) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < M * K;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    out[i] = rules::dequant_at(static_cast<rules::QLayout>(layout), e5m2, data, scale, M, K, i / K,
                               i % K);
  }
}

template <typename T>
__global__ void transpose_kernel(const T* in, T* out, int64_t R, int64_t C) {
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < R * C;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t c = i / R;  // output [C, R], written coalesced
    const int64_t r = i % R;
    out[i] = in[r * C + c];
  }
}

}  // namespace

void launch_amax(const void* x, bool bf16, int64_t n, float* amax_out, void* stream) {
  MP_CUDA_CHECK(cudaMemsetAsync(amax_out, 0, sizeof(float), as_stream(stream)));
  const unsigned grid = std::min<unsigned>(grid_for(n), 1024);
  amax_kernel<<<grid, kThreads, 0, as_stream(stream)>>>(x, bf16, n,
                                                        reinterpret_cast<unsigned*>(amax_out));
  MP_CUDA_CHECK_LAUNCH();
}

void launch_current_scale(const float* amax, float* scale_out, float fp8max, float eps, bool pow2,
                          void* stream) {
  current_scale_kernel<<<1, 1, 0, as_stream(stream)>>>(amax, scale_out, fp8max, eps, pow2);
  MP_CUDA_CHECK_LAUNCH();
}

void launch_record_amax(float* history, const float* amax, void* stream) {
  record_amax_kernel<<<1, 1, 0, as_stream(stream)>>>(history, amax);
  MP_CUDA_CHECK_LAUNCH();
}

void launch_delayed_update(float* history, int64_t len, float* scale, bool algo_max, float fp8max,
                           float two_pow_margin, void* stream) {
  delayed_update_kernel<<<1, 1, 0, as_stream(stream)>>>(history, len, scale, algo_max, fp8max,
                                                        two_pow_margin);
  MP_CUDA_CHECK_LAUNCH();
}

void launch_quantize_per_tensor(const void* x, bool bf16, int64_t M, int64_t K, const float* scale,
                                bool e5m2, uint8_t* row, uint8_t* col, float* scale_inv_out,
                                void* stream) {
  const int64_t tiles_k = (K + 31) / 32;
  const int64_t tiles_m = (M + 31) / 32;
  MP_CHECK(tiles_k <= 0x7FFFFFFF, "per-tensor quantize: K={} too large for the grid", K);
  const dim3 grid(static_cast<unsigned>(tiles_k),
                  static_cast<unsigned>(std::min<int64_t>(tiles_m, 65535)));
  per_tensor_kernel<<<grid, dim3(32, 8), 0, as_stream(stream)>>>(x, bf16, M, K, scale, e5m2, row,
                                                                 col, scale_inv_out);
  MP_CUDA_CHECK_LAUNCH();
}

void launch_quantize_mxfp8(const void* x, bool bf16, int64_t M, int64_t K, bool e5m2, uint8_t* row,
                           uint8_t* row_scale, uint8_t* col, uint8_t* col_scale, void* stream) {
  if (row) {
    mxfp8_row_kernel<<<grid_for(M * (K / 32)), kThreads, 0, as_stream(stream)>>>(
        x, bf16, M, K, e5m2, row, row_scale);
    MP_CUDA_CHECK_LAUNCH();
  }
  if (col) {
    mxfp8_col_kernel<<<grid_for((M / 32) * K), kThreads, 0, as_stream(stream)>>>(
        x, bf16, M, K, e5m2, col, col_scale);
    MP_CUDA_CHECK_LAUNCH();
  }
}

void launch_quantize_block(const void* x, bool bf16, int64_t M, int64_t K, bool tile128, bool e5m2,
                           float eps, bool pow2, uint8_t* row, float* row_scale_inv, uint8_t* col,
                           float* col_scale_inv, void* stream) {
  const int64_t mb = (M + 127) / 128;
  const int64_t kb = (K + 127) / 128;
  if (tile128) {
    const auto grid = static_cast<unsigned>(std::min<int64_t>(mb * kb, 65535LL * 16));
    block2d_kernel<<<grid, 128, 0, as_stream(stream)>>>(x, bf16, M, K, e5m2, eps, pow2, row,
                                                        row_scale_inv, col, col_scale_inv);
    MP_CUDA_CHECK_LAUNCH();
    return;
  }
  if (row) {
    block1d_row_kernel<<<grid_for(M * kb), kThreads, 0, as_stream(stream)>>>(
        x, bf16, M, K, e5m2, eps, pow2, row, row_scale_inv);
    MP_CUDA_CHECK_LAUNCH();
  }
  if (col) {
    block1d_col_kernel<<<grid_for(mb * K), kThreads, 0, as_stream(stream)>>>(
        x, bf16, M, K, e5m2, eps, pow2, col, col_scale_inv);
    MP_CUDA_CHECK_LAUNCH();
  }
}

void launch_dequantize(int layout, bool e5m2, const uint8_t* data, const void* scale, int64_t M,
                       int64_t K, float* out, void* stream) {
  dequantize_kernel<<<grid_for(M * K), kThreads, 0, as_stream(stream)>>>(layout, e5m2, data, scale,
                                                                         M, K, out);
  MP_CUDA_CHECK_LAUNCH();
}

void launch_transpose(const void* in, void* out, int64_t R, int64_t C, int elem_bytes,
                      void* stream) {
  if (elem_bytes == 1) {
    transpose_kernel<<<grid_for(R * C), kThreads, 0, as_stream(stream)>>>(
        static_cast<const uint8_t*>(in), static_cast<uint8_t*>(out), R, C);
  } else {
    MP_CHECK(elem_bytes == 4, "transpose: unsupported element size {}", elem_bytes);
    transpose_kernel<<<grid_for(R * C), kThreads, 0, as_stream(stream)>>>(
        static_cast<const uint32_t*>(in), static_cast<uint32_t*>(out), R, C);
  }
  MP_CUDA_CHECK_LAUNCH();
}

}  // namespace meshproof::kernels::cuda
