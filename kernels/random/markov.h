// Token rows of the seeded order-k Markov source (engine/model/data.h), produced where the rank
// computes: on the host, or on a CUDA device by one thread per row running the same row function
// (markov_fill_row in kernels/random/markov_row.h), so a CUDA step makes its tokens on the device
// and uploads nothing per micro-batch (docs/design.md, "Host-device traffic per step"). The tokens
// are bitwise the host's: Philox, an exact uint64 -> double conversion, one rounded multiply and
// comparisons against the same cdf doubles.
#pragma once

#include <cstdint>

#include "kernels/core/tensor.h"
#include "kernels/random/markov_row.h"

namespace meshproof::kernels {

// The source's tables, on the device the rows are made on.
struct MarkovTables {
  Tensor cdf;     // float64 [V]: cumulative probabilities by rank
  Tensor ranked;  // int32 [V^k, V]: the token of rank r for each context
};

// The source's parameters besides its tables.
struct MarkovShape {
  int64_t vocab = 0, order = 0, batch = 0, width = 0;  // width = seq_len + 1
  uint64_t seed = 0, stream = 0;
};

// out: int32 [rows, width] on the tables' device. Its row i is global row row_begin + i of step
// `step`'s batch, whose token s draws index (step * batch + row_begin + i) * width + s.
void markov_rows(const MarkovTables& tables, const MarkovShape& shape, int64_t step,
                 int64_t row_begin, Tensor& out);

}  // namespace meshproof::kernels
