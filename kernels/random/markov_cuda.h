// Launcher of the Markov token kernel (markov.cu), called by kernels/random/markov.cc. Plain
// pointers and sizes only, so this header has no CUDA dependency; `stream` is the rank's
// cudaStream_t.
#pragma once

#include <cstdint>

namespace meshproof::kernels::cuda {

// out [rows, width]: row i filled by markov_fill_row with first index
// (step * batch + row_begin + i) * width; one thread per row.
void launch_markov_rows(const double* cdf, const int32_t* ranked, int64_t vocab, int64_t order,
                        int64_t batch, int64_t width, uint64_t seed, uint64_t stream_id,
                        int64_t step, int64_t row_begin, int64_t rows, int32_t* out, void* stream);

}  // namespace meshproof::kernels::cuda
