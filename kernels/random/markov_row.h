// The Markov source's row function (kernels/random/markov.h), __host__ __device__ so the CUDA
// kernel (markov.cu) and the host run the same code. No tensor types: included by the .cu file.
#pragma once

#include <cstdint>

#include "kernels/random/philox.h"

namespace meshproof::kernels {

// Fills `row` with `width` tokens over a vocabulary of `vocab`: token s draws
// u = philox_uniform(seed, stream, first_index + s); the first `order` tokens are uniform
// (min(vocab - 1, floor(u * vocab))); token s >= order is ranked[context * vocab + r] with
// context = the previous `order` tokens read as base-vocab digits and r the first rank with
// u < cdf[r] (vocab - 1 when there is none).
MP_PHILOX_HD inline void markov_fill_row(int32_t* row, int64_t width, int64_t order, int64_t vocab,
                                         uint64_t seed, uint64_t stream, uint64_t first_index,
                                         const double* cdf, const int32_t* ranked) {
  for (int64_t s = 0; s < width; ++s) {
    const double u = philox_uniform(seed, stream, first_index + static_cast<uint64_t>(s));
    if (s < order) {  // no full context yet: uniform
      const auto pick = static_cast<int64_t>(u * static_cast<double>(vocab));
      row[s] = static_cast<int32_t>(pick < vocab - 1 ? pick : vocab - 1);
      continue;
    }
    int64_t context = 0;
    for (int64_t j = s - order; j < s; ++j) context = context * vocab + row[j];
    int64_t rank = 0;
    while (rank < vocab - 1 && u >= cdf[rank]) ++rank;
    row[s] = ranked[context * vocab + rank];
  }
}

}  // namespace meshproof::kernels
