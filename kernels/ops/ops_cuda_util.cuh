// Device helpers shared by the op-family .cu files (CUDA-only; included by .cu files alone).
// Storage types: float for float32, uint16_t for bfloat16 bits (formats.h RNE conversion, the
// same code as the CPU BFloat16).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/core/formats.h"

namespace meshproof::kernels::cuda::detail {

constexpr int kThreads = 256;

inline cudaStream_t as_stream(void* s) { return static_cast<cudaStream_t>(s); }

inline unsigned grid_1d(int64_t n) {
  const int64_t blocks = (n + kThreads - 1) / kThreads;
  return static_cast<unsigned>(blocks < 65535 * 16 ? (blocks > 0 ? blocks : 1) : 65535 * 16);
}

// Loads as float (bf16 widens exactly).
__device__ inline float load(const float* p, int64_t i) { return p[i]; }
__device__ inline float load(const uint16_t* p, int64_t i) { return fmt8::bf16_to_float(p[i]); }

// Stores a float: float32 as is, bf16 with RNE (the CPU's BFloat16(float)).
__device__ inline void store(float* p, int64_t i, float v) { p[i] = v; }
__device__ inline void store(uint16_t* p, int64_t i, float v) { p[i] = fmt8::float_to_bf16(v); }

// Stores a double the way the CPU's static_cast<T>(double) does: float32 rounds once (RN); bf16
// goes double -> float -> bf16 (BFloat16(double) casts to float first).
__device__ inline void store_d(float* p, int64_t i, double v) { p[i] = __double2float_rn(v); }
__device__ inline void store_d(uint16_t* p, int64_t i, double v) {
  p[i] = fmt8::float_to_bf16(__double2float_rn(v));
}

// Block-wide sum of a double (blockDim.x a multiple of 32, at most 1024). Fixed tree order, so
// the result is deterministic. Every thread gets the total. `shared` holds 32 doubles.
__device__ inline double block_sum(double v, double* shared) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();  // `shared` may still be read by a previous call
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int warps = (blockDim.x + 31) >> 5;
  double total = 0;
  if (warp == 0) {
    total = lane < warps ? shared[lane] : 0.0;
    for (int off = 16; off > 0; off >>= 1) total += __shfl_down_sync(0xffffffffu, total, off);
    if (lane == 0) shared[0] = total;
  }
  __syncthreads();
  return shared[0];
}

// Block-wide max of a double (same contract as block_sum).
__device__ inline double block_max(double v, double* shared) {
  for (int off = 16; off > 0; off >>= 1) v = fmax(v, __shfl_down_sync(0xffffffffu, v, off));
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __syncthreads();
  if (lane == 0) shared[warp] = v;
  __syncthreads();
  const int warps = (blockDim.x + 31) >> 5;
  if (warp == 0) {
    double m = lane < warps ? shared[lane] : -INFINITY;
    for (int off = 16; off > 0; off >>= 1) m = fmax(m, __shfl_down_sync(0xffffffffu, m, off));
    if (lane == 0) shared[0] = m;
  }
  __syncthreads();
  return shared[0];
}

}  // namespace meshproof::kernels::cuda::detail
