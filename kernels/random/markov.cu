// The Markov source's token rows on a CUDA device (kernels/random/markov.h): one thread per row
// runs the host's row function, so the tokens are bitwise the host's.
#include <cuda_runtime.h>

#include "kernels/core/cuda_check.h"
#include "kernels/random/markov_cuda.h"
#include "kernels/random/markov_row.h"

namespace meshproof::kernels::cuda {
namespace {

__global__ void markov_rows_kernel(const double* cdf, const int32_t* ranked, int64_t vocab,
                                   int64_t order, int64_t batch, int64_t width, uint64_t seed,
                                   uint64_t stream_id, int64_t step, int64_t row_begin,
                                   int64_t rows, int32_t* out) {
  const int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (i >= rows) return;
  const auto first = static_cast<uint64_t>((step * batch + row_begin + i) * width);
  markov_fill_row(out + i * width, width, order, vocab, seed, stream_id, first, cdf, ranked);
}

}  // namespace

void launch_markov_rows(const double* cdf, const int32_t* ranked, int64_t vocab, int64_t order,
                        int64_t batch, int64_t width, uint64_t seed, uint64_t stream_id,
                        int64_t step, int64_t row_begin, int64_t rows, int32_t* out, void* stream) {
  if (rows == 0 || width == 0) return;
  constexpr int kThreads = 64;
  const auto blocks = static_cast<unsigned>((rows + kThreads - 1) / kThreads);
  markov_rows_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(
      cdf, ranked, vocab, order, batch, width, seed, stream_id, step, row_begin, rows, out);
  MP_CUDA_CHECK(cudaGetLastError());
}

}  // namespace meshproof::kernels::cuda
