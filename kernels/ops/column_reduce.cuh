// Device side of the per-column reductions (kernels/ops/column_reduce.h gives the order and the
// bound). Two kernels, no atomics:
//   stage 1, grid (ceil(n / kColumnTile), chunks), block (kColumnTile, kColumnLanes): thread
//     (x, y) sums its lane of the chunk's rows for column blockIdx.x * kColumnTile + x (a warp
//     reads 32 neighbouring columns of one row: coalesced); row y == 0 adds the 8 lanes in order
//     from shared memory and writes the chunk's partial to `partial` [K][chunks][n];
//   stage 2, one thread per column: adds the chunk partials in chunk order and folds the total
//     into the float32 gradient.
// Term: a functor with `static constexpr int K` (1 or 2 quantities) and
//   __device__ void operator()(int64_t r, int64_t c, double* t) const  writing t[0..K).
#pragma once

#include "kernels/ops/column_reduce.h"
#include "kernels/ops/ops_cuda_util.cuh"

namespace meshproof::kernels::cuda::detail {

using ::meshproof::kernels::detail::column_chunks;
using ::meshproof::kernels::detail::kColumnChunkRows;
using ::meshproof::kernels::detail::kColumnLanes;
using ::meshproof::kernels::detail::kColumnMaxChunks;
using ::meshproof::kernels::detail::kColumnTile;

template <typename Term>
__global__ void __launch_bounds__(kColumnTile* kColumnLanes)
    column_partial_kernel(Term term, int64_t m, int64_t n, double* partial) {
  constexpr int K = Term::K;
  __shared__ double lanes[K][kColumnLanes][kColumnTile];
  const int tx = static_cast<int>(threadIdx.x), ty = static_cast<int>(threadIdx.y);
  const int64_t c = static_cast<int64_t>(blockIdx.x) * kColumnTile + tx;
  const int64_t chunk = blockIdx.y, chunks = gridDim.y;
  const int64_t begin = chunk * kColumnChunkRows;
  const int64_t end = begin + kColumnChunkRows < m ? begin + kColumnChunkRows : m;
  double acc[K];
  for (int k = 0; k < K; ++k) acc[k] = 0.0;
  if (c < n) {
    for (int64_t r = begin + ty; r < end; r += kColumnLanes) {
      double t[K];
      term(r, c, t);
      for (int k = 0; k < K; ++k) acc[k] = __dadd_rn(acc[k], t[k]);
    }
  }
  for (int k = 0; k < K; ++k) lanes[k][ty][tx] = acc[k];
  __syncthreads();
  if (ty == 0 && c < n) {
    for (int k = 0; k < K; ++k) {
      double s = 0.0;
      for (int y = 0; y < kColumnLanes; ++y) s = __dadd_rn(s, lanes[k][y][tx]);
      partial[(k * chunks + chunk) * n + c] = s;
    }
  }
}

// out_k[c] = float(double(out_k[c]) + sum over chunks of partial[k][chunk][c]); out1 is unused
// (may be nullptr) when K == 1.
template <int K>
__global__ void column_finish_kernel(const double* partial, int64_t chunks, int64_t n, float* out0,
                                     float* out1) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= n) return;
  for (int k = 0; k < K; ++k) {
    double s = 0.0;
    for (int64_t ch = 0; ch < chunks; ++ch) s = __dadd_rn(s, partial[(k * chunks + ch) * n + c]);
    float* out = k == 0 ? out0 : out1;
    out[c] = __double2float_rn(__dadd_rn(static_cast<double>(out[c]), s));
  }
}

// Enqueues both stages on `stream`. `partial` holds Term::K * column_chunks(m) * n doubles.
template <typename Term>
cudaError_t column_reduce(const Term& term, int64_t m, int64_t n, double* partial, float* out0,
                          float* out1, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  const int64_t chunks = column_chunks(m);
  if (chunks > kColumnMaxChunks) return cudaErrorInvalidValue;  // the dispatch checks it first
  if (chunks > 0) {
    const dim3 grid(static_cast<unsigned>((n + kColumnTile - 1) / kColumnTile),
                    static_cast<unsigned>(chunks));
    const dim3 block(kColumnTile, kColumnLanes);
    column_partial_kernel<Term><<<grid, block, 0, stream>>>(term, m, n, partial);
    const cudaError_t e = cudaGetLastError();
    if (e != cudaSuccess) return e;
  }
  column_finish_kernel<Term::K>
      <<<static_cast<unsigned>((n + kThreads - 1) / kThreads), kThreads, 0, stream>>>(
          partial, chunks, n, out0, out1);
  return cudaGetLastError();
}

}  // namespace meshproof::kernels::cuda::detail
