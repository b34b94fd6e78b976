// CUDA kernels of the MoE token rows (kernels/moe/moe_rows.h). Dispatch: one block per expert scans
// the pairs in order with a block prefix sum (ballots), so each expert's rows are its pairs in
// (token, choice) order, the host's counting sort. Permute: a row gather. Combine and its
// backward: one thread per output element, the host's sums in the host's order with explicitly
// rounded double operations (no FMA), rounded once on store like the host's cast.
#include <cuda_runtime.h>

#include "kernels/moe/moe_cuda.h"
#include "kernels/moe/moe_row.h"
#include "kernels/ops/ops_cuda_util.cuh"

namespace meshproof::kernels::cuda {
namespace {

constexpr int kDispatchThreads = 256;  // a multiple of 32: whole warps take part in the ballots

__global__ void dispatch_kernel(const int32_t* expert, int64_t pairs, int64_t top_k,
                                const int64_t* counts, int64_t align, bool keep_empty,
                                int64_t* token, int64_t* slot) {
  __shared__ int warp_total[kDispatchThreads / 32];
  const int e = static_cast<int>(blockIdx.x);
  int64_t base = 0;  // the block start of expert e
  for (int q = 0; q < e; ++q) base += moe_row::padded_block(counts[q], align, keep_empty);
  const int lane = static_cast<int>(threadIdx.x & 31), warp = static_cast<int>(threadIdx.x >> 5);
  const unsigned below = (1u << lane) - 1u;  // lanes before this one
  int64_t placed = 0;
  for (int64_t start = 0; start < pairs; start += kDispatchThreads) {
    const int64_t c = start + threadIdx.x;
    const bool mine = c < pairs && expert[c] == e;
    const unsigned ballot = __ballot_sync(0xffffffffu, mine);
    if (lane == 0) warp_total[warp] = __popc(ballot);
    __syncthreads();
    int before = __popc(ballot & below), total = 0;
    for (int w = 0; w < kDispatchThreads / 32; ++w) {
      if (w < warp) before += warp_total[w];
      total += warp_total[w];
    }
    if (mine) {
      const int64_t row = base + placed + before;
      token[row] = c / top_k;
      slot[c] = row;
    }
    placed += total;
    __syncthreads();  // warp_total is rewritten by the next chunk
  }
}

template <typename W>
__global__ void permute_kernel(const W* x, int64_t row_words, const int64_t* token, int64_t padded,
                               W* out) {
  const int64_t n = padded * row_words;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t row = i / row_words, w = i % row_words;
    const int64_t t = token[row];
    out[i] = t >= 0 ? x[t * row_words + w] : W{};
  }
}

// float32 / bfloat16 element as a double (exact).
__device__ inline double load_d(const float* p, int64_t i) { return static_cast<double>(p[i]); }
__device__ inline double load_d(const uint16_t* p, int64_t i) {
  return static_cast<double>(fmt8::bf16_to_float(p[i]));
}

template <typename Y, typename O>
__global__ void combine_kernel(const Y* y, const int64_t* slot, const double* weight,
                               int64_t tokens, int64_t top_k, int64_t width, O* out) {
  const int64_t n = tokens * width;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / width, h = i % width;
    double acc = 0;
    for (int64_t j = 0; j < top_k; ++j) {
      const int64_t c = t * top_k + j;
      const double v = load_d(y, slot[c] * width + h);
      const double term = weight != nullptr ? moe_row::mp_mul(weight[c], v) : v;
      acc = j == 0 ? term : moe_row::mp_add(acc, term);
    }
    detail::store_d(out, i, acc);
  }
}

template <typename D, typename G>
__global__ void combine_dy_kernel(const D* dout, const int64_t* slot, const double* weight,
                                  int64_t tokens, int64_t top_k, int64_t width, G* dy) {
  const int64_t n = tokens * top_k * width;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n;
       i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t c = i / width, h = i % width, t = c / top_k;
    detail::store_d(dy, slot[c] * width + h,
                    moe_row::mp_mul(weight[c], load_d(dout, t * width + h)));
  }
}

template <typename D, typename Y>
__global__ void combine_dweight_kernel(const D* dout, const Y* y, const int64_t* slot,
                                       int64_t pairs, int64_t top_k, int64_t width,
                                       double* d_weight) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= pairs) return;
  const int64_t t = c / top_k, row = slot[c];
  double dot = 0;
  for (int64_t h = 0; h < width; ++h)
    dot = moe_row::mp_add(dot,
                          moe_row::mp_mul(load_d(dout, t * width + h), load_d(y, row * width + h)));
  d_weight[c] = dot;
}

template <typename Y, typename O>
int combine_typed(const void* y, const int64_t* slot, const double* weight, int64_t tokens,
                  int64_t top_k, int64_t width, void* out, cudaStream_t s) {
  combine_kernel<<<detail::grid_1d(tokens * width), detail::kThreads, 0, s>>>(
      static_cast<const Y*>(y), slot, weight, tokens, top_k, width, static_cast<O*>(out));
  return cudaGetLastError();
}

template <typename D, typename Y, typename G>
int combine_backward_typed(const void* dout, const void* y, const int64_t* slot,
                           const double* weight, int64_t tokens, int64_t top_k, int64_t width,
                           void* dy, double* d_weight, cudaStream_t s) {
  combine_dy_kernel<<<detail::grid_1d(tokens * top_k * width), detail::kThreads, 0, s>>>(
      static_cast<const D*>(dout), slot, weight, tokens, top_k, width, static_cast<G*>(dy));
  const cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) return e;
  constexpr int kThreads = 128;
  const auto blocks = static_cast<unsigned>((tokens * top_k + kThreads - 1) / kThreads);
  combine_dweight_kernel<<<blocks, kThreads, 0, s>>>(static_cast<const D*>(dout),
                                                     static_cast<const Y*>(y), slot, tokens * top_k,
                                                     top_k, width, d_weight);
  return cudaGetLastError();
}

}  // namespace

int launch_moe_dispatch(const int32_t* expert, int64_t pairs, int64_t top_k, int64_t experts,
                        const int64_t* counts, int64_t align, bool keep_empty, int64_t padded,
                        int64_t* token, int64_t* slot, void* stream) {
  const cudaStream_t s = detail::as_stream(stream);
  // All bits set: -1 in every int64 (the padding rows' token).
  const cudaError_t z =
      cudaMemsetAsync(token, 0xFF, static_cast<size_t>(padded) * sizeof(int64_t), s);
  if (z != cudaSuccess || pairs == 0 || experts == 0) return z;
  dispatch_kernel<<<static_cast<unsigned>(experts), kDispatchThreads, 0, s>>>(
      expert, pairs, top_k, counts, align, keep_empty, token, slot);
  return cudaGetLastError();
}

int launch_moe_permute(const void* x, int64_t row_bytes, const int64_t* token, int64_t padded,
                       void* out, void* stream) {
  if (padded == 0 || row_bytes == 0) return cudaSuccess;
  const cudaStream_t s = detail::as_stream(stream);
  const auto aligned = [&](int64_t w) {
    return row_bytes % w == 0 && reinterpret_cast<uintptr_t>(x) % w == 0 &&
           reinterpret_cast<uintptr_t>(out) % w == 0;
  };
  if (aligned(16)) {
    permute_kernel<<<detail::grid_1d(padded * row_bytes / 16), detail::kThreads, 0, s>>>(
        static_cast<const uint4*>(x), row_bytes / 16, token, padded, static_cast<uint4*>(out));
  } else if (aligned(4)) {
    permute_kernel<<<detail::grid_1d(padded * row_bytes / 4), detail::kThreads, 0, s>>>(
        static_cast<const uint32_t*>(x), row_bytes / 4, token, padded, static_cast<uint32_t*>(out));
  } else {
    permute_kernel<<<detail::grid_1d(padded * row_bytes), detail::kThreads, 0, s>>>(
        static_cast<const uint8_t*>(x), row_bytes, token, padded, static_cast<uint8_t*>(out));
  }
  return cudaGetLastError();
}

int launch_moe_combine(const void* y, int y_type, const int64_t* slot, const double* weight,
                       int64_t tokens, int64_t top_k, int64_t width, void* out, int out_type,
                       void* stream) {
  if (tokens == 0 || width == 0) return cudaSuccess;
  const cudaStream_t s = detail::as_stream(stream);
  if (y_type == 1)
    return out_type == 1
               ? combine_typed<uint16_t, uint16_t>(y, slot, weight, tokens, top_k, width, out, s)
               : combine_typed<uint16_t, float>(y, slot, weight, tokens, top_k, width, out, s);
  return out_type == 1
             ? combine_typed<float, uint16_t>(y, slot, weight, tokens, top_k, width, out, s)
             : combine_typed<float, float>(y, slot, weight, tokens, top_k, width, out, s);
}

int launch_moe_combine_backward(const void* dout, int dout_type, const void* y, int y_type,
                                const int64_t* slot, const double* weight, int64_t tokens,
                                int64_t top_k, int64_t width, int64_t padded, void* dy, int dy_type,
                                double* d_weight, void* stream) {
  const cudaStream_t s = detail::as_stream(stream);
  // Padding rows stay zero (+0 in float32 and bfloat16 alike).
  const size_t dy_bytes = static_cast<size_t>(padded * width) * (dy_type == 1 ? 2 : 4);
  const cudaError_t z = cudaMemsetAsync(dy, 0, dy_bytes, s);
  if (z != cudaSuccess) return z;
  if (tokens == 0) return cudaSuccess;
  const int key = dout_type * 4 + y_type * 2 + dy_type;
  const auto run = [&](auto d, auto yy, auto g) {
    using D = decltype(d);
    using Y = decltype(yy);
    using G = decltype(g);
    return combine_backward_typed<D, Y, G>(dout, y, slot, weight, tokens, top_k, width, dy,
                                           d_weight, s);
  };
  switch (key) {
    case 0:
      return run(float{}, float{}, float{});
    case 1:
      return run(float{}, float{}, uint16_t{});
    case 2:
      return run(float{}, uint16_t{}, float{});
    case 3:
      return run(float{}, uint16_t{}, uint16_t{});
    case 4:
      return run(uint16_t{}, float{}, float{});
    case 5:
      return run(uint16_t{}, float{}, uint16_t{});
    case 6:
      return run(uint16_t{}, uint16_t{}, float{});
    default:
      return run(uint16_t{}, uint16_t{}, uint16_t{});
  }
}

}  // namespace meshproof::kernels::cuda
