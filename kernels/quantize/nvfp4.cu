// NVFP4 CUDA kernels and their launchers: one thread per 1x16 block (rowwise) or per columnwise
// 16-group, each running the same block worker as the CPU loop (kernels/quantize/nvfp4_rules.h), so
// the bytes are identical. No fast-math: fp32 division, float64 sums and subnormals follow IEEE
// like the host, and no floating-point expression in nvfp4_rules.h adds a product (the RHT adds
// signed inputs, then scales once), so nvcc has nothing to contract into an FMA.
#include <cuda_runtime.h>

#include <algorithm>

#include "kernels/core/cuda_check.h"
#include "kernels/quantize/nvfp4_cuda.h"
#include "kernels/quantize/nvfp4_rules.h"

namespace meshproof::kernels::cuda {
namespace {

namespace nv = rules::nvfp4;

constexpr int kThreads = 256;

cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

unsigned grid_for(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(std::clamp<int64_t>(blocks, 1, 65535LL * 16));
}

__global__ void nvfp4_amax_kernel(const void* x, bool bf16, int64_t M, int64_t K, bool rht,
                                  unsigned* out) {
  const int64_t groups = K * (M / nv::kBlock);
  uint32_t row = 0;
  uint32_t col = 0;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < groups;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t k = t % K;
    const int64_t g = t / K;
    const uint32_t a = rules::block_amax_bits(x, bf16, g * nv::kBlock * K + k, K, nv::kBlock);
    row = a > row ? a : row;
    if (rht) {
      const uint32_t b = nv::rht_group_amax_bits(x, bf16, K, k, g);
      col = b > col ? b : col;
    }
  }
  // Unsigned max is order-independent: any reduction tree gives the CPU's answer.
  for (int off = 16; off > 0; off >>= 1) {
    const uint32_t o = __shfl_down_sync(0xFFFFFFFFu, row, off);
    row = o > row ? o : row;
    const uint32_t c = __shfl_down_sync(0xFFFFFFFFu, col, off);
    col = c > col ? c : col;
  }
  if ((threadIdx.x & 31) == 0) {
    atomicMax(out, row);
    atomicMax(out + 1, rht ? col : row);
  }
}

__global__ void nvfp4_row_kernel(nv::Job j, const float* amax, uint8_t* data, uint8_t* scale) {
  j.s_enc_row = nv::global_encode_scale(amax[0]);
  const int64_t nb = j.K / nv::kBlock;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < j.M * nb;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    nv::row_block(j, t / nb, t % nb, data, scale);
  }
}

__global__ void nvfp4_col_kernel(nv::Job j, const float* amax, uint8_t* data, uint8_t* scale) {
  j.s_enc_col = nv::global_encode_scale(amax[1]);
  const int64_t ng = j.M / nv::kBlock;
  for (int64_t t = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; t < j.K * ng;
       t += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    nv::col_group(j, t / ng, t % ng, data, scale);
  }
}

__global__ void nvfp4_dequant_kernel(const uint8_t* data, const uint8_t* scale, const float* amax,
                                     int64_t R, int64_t C, float* out) {
  const float gds = nv::global_decode_scale(nv::global_encode_scale(amax[0]));
  for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < R * C;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = i / C;
    const int64_t c = i % C;
    const uint8_t byte = data[i / 2];
    const uint8_t code = static_cast<uint8_t>((c & 1) ? byte >> 4 : byte & 0xFu);
    out[i] = nv::decode(code, scale[r * (C / nv::kBlock) + c / nv::kBlock], gds);
  }
}

// One thread per output byte of the three outputs (the host loops of nvfp4_tiled_from_rowwise,
// element by element): i < M * kb row codes, then K * mb column codes, then K * M / 2 data bytes.
__global__ void nvfp4_tiled_kernel(const uint8_t* rd, const uint8_t* tiles, int64_t M, int64_t K,
                                   uint8_t* row_s, uint8_t* cd, uint8_t* col_s) {
  const int64_t kb = K / nv::kBlock, mb = M / nv::kBlock;
  const int64_t n_row = M * kb, n_col = K * mb, n_data = K * M / 2;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n_row + n_col + n_data;
       i += int64_t{gridDim.x} * blockDim.x) {
    if (i < n_row) {
      const int64_t m = i / kb, b = i % kb;
      row_s[i] = tiles[(m / nv::kBlock) * kb + b];
    } else if (i < n_row + n_col) {
      const int64_t j = i - n_row, k = j / mb, g = j % mb;
      col_s[j] = tiles[g * kb + k / nv::kBlock];
    } else {
      const int64_t j = i - n_row - n_col, k = j / (M / 2), m = (j % (M / 2)) * 2;
      const auto code = [&](int64_t r) {
        const uint8_t byte = rd[(r * K + k) / 2];
        return static_cast<uint8_t>((k & 1) ? byte >> 4 : byte & 0xFu);
      };
      cd[j] = static_cast<uint8_t>(code(m) | (code(m + 1) << 4));
    }
  }
}

}  // namespace

void launch_nvfp4_tiled_from_rowwise(const uint8_t* rowwise, const uint8_t* tiles, int64_t M,
                                     int64_t K, uint8_t* row_scale, uint8_t* col_data,
                                     uint8_t* col_scale, void* stream) {
  const int64_t n = M * (K / nv::kBlock) + K * (M / nv::kBlock) + K * M / 2;
  if (n == 0) return;
  nvfp4_tiled_kernel<<<grid_for(n), kThreads, 0, as_stream(stream)>>>(
      rowwise, tiles, M, K, row_scale, col_data, col_scale);
  MP_CUDA_CHECK_LAUNCH();
}

void launch_nvfp4_global_amax(const void* x, bool bf16, int64_t M, int64_t K, bool rht,
                              float* amax_out, void* stream) {
  MP_CUDA_CHECK(cudaMemsetAsync(amax_out, 0, 2 * sizeof(float), as_stream(stream)));
  const unsigned grid = std::min<unsigned>(grid_for(K * (M / nv::kBlock)), 1024);
  nvfp4_amax_kernel<<<grid, kThreads, 0, as_stream(stream)>>>(
      x, bf16, M, K, rht, reinterpret_cast<unsigned*>(amax_out));
  MP_CUDA_CHECK_LAUNCH();
}

void launch_quantize_nvfp4(const void* x, bool bf16, int64_t M, int64_t K, bool tile, bool rht,
                           bool pow2, bool sr_on, uint64_t sr_seed, uint64_t sr_stream,
                           int64_t sr_row0, int64_t sr_col0, int64_t sr_ld,
                           const float* global_amax, uint8_t* row, uint8_t* row_scale, uint8_t* col,
                           uint8_t* col_scale, void* stream) {
  nv::Job j;
  j.x = x;
  j.bf16 = bf16;
  j.M = M;
  j.K = K;
  j.tile = tile;
  j.rht = rht;
  j.pow2 = pow2;
  j.sr.on = sr_on;
  j.sr.seed = sr_seed;
  j.sr.stream = sr_stream;
  j.sr.row0 = sr_row0;
  j.sr.col0 = sr_col0;
  j.sr.ld = sr_ld;
  if (row) {
    nvfp4_row_kernel<<<grid_for(M * (K / nv::kBlock)), kThreads, 0, as_stream(stream)>>>(
        j, global_amax, row, row_scale);
    MP_CUDA_CHECK_LAUNCH();
  }
  if (col) {
    nvfp4_col_kernel<<<grid_for(K * (M / nv::kBlock)), kThreads, 0, as_stream(stream)>>>(
        j, global_amax, col, col_scale);
    MP_CUDA_CHECK_LAUNCH();
  }
}

void launch_dequantize_nvfp4(const uint8_t* data, const uint8_t* scale, const float* amax,
                             int64_t R, int64_t C, float* out, void* stream) {
  nvfp4_dequant_kernel<<<grid_for(R * C), kThreads, 0, as_stream(stream)>>>(data, scale, amax, R, C,
                                                                            out);
  MP_CUDA_CHECK_LAUNCH();
}

}  // namespace meshproof::kernels::cuda
