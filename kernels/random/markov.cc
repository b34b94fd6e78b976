#include "kernels/random/markov.h"

#include "kernels/core/error.h"

#if MESHPROOF_HAVE_CUDA
#include "kernels/random/markov_cuda.h"
#endif

namespace meshproof::kernels {

void markov_rows(const MarkovTables& tables, const MarkovShape& shape, int64_t step,
                 int64_t row_begin, Tensor& out) {
  const int64_t v = shape.vocab, w = shape.width;
  MP_CHECK(v >= 1 && shape.order >= 0 && w >= 0 && shape.batch >= 0,
           "markov_rows: vocab {}, order {}, width {}, batch {}", v, shape.order, w, shape.batch);
  MP_CHECK(tables.cdf.defined() && tables.cdf.dtype() == DType::kFloat64 &&
               tables.cdf.numel().value == v,
           "markov_rows: cdf must be float64 [{}], got {}", v,
           tables.cdf.defined() ? tables.cdf.describe() : "undefined");
  const Device dev = tables.cdf.device();
  MP_CHECK(tables.ranked.defined() && tables.ranked.dtype() == DType::kInt32 &&
               tables.ranked.device() == dev,
           "markov_rows: ranked must be int32 on {}, got {}", dev.str(),
           tables.ranked.defined() ? tables.ranked.describe() : "undefined");
  MP_CHECK(out.defined() && out.dtype() == DType::kInt32 && out.shape().rank() == 2 &&
               out.shape()[1] == w && out.device() == dev,
           "markov_rows: out must be int32 [rows, {}] on {}, got {}", w, dev.str(),
           out.defined() ? out.describe() : "undefined");
  const int64_t rows = out.shape()[0];
  MP_CHECK(0 <= row_begin && row_begin + rows <= shape.batch && step >= 0,
           "markov_rows: rows [{}, {}) of step {} outside the global batch of {}", row_begin,
           row_begin + rows, step, shape.batch);
  if (dev.is_cuda()) {
#if MESHPROOF_HAVE_CUDA
    cuda::launch_markov_rows(tables.cdf.data<double>(), tables.ranked.data<int32_t>(), v,
                             shape.order, shape.batch, w, shape.seed, shape.stream, step, row_begin,
                             rows, out.data<int32_t>(), current_context().stream);
    return;
#else
    MP_FAIL("markov_rows: {} is a CUDA device but meshproof was built without CUDA", dev.str());
#endif
  }
  const double* cdf = tables.cdf.data<double>();
  const int32_t* ranked = tables.ranked.data<int32_t>();
  int32_t* o = out.data<int32_t>();
  for (int64_t i = 0; i < rows; ++i)
    markov_fill_row(o + i * w, w, shape.order, v, shape.seed, shape.stream,
                    static_cast<uint64_t>((step * shape.batch + row_begin + i) * w), cdf, ranked);
}

}  // namespace meshproof::kernels
