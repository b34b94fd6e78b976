// Dtype conversion between the high-precision compute types: float32 <-> float64 (finite-difference
// checks run the model in float64). Low-precision formats go through kernels/formats.h.
//   src, dst: same element count; dst's dtype selects the conversion.
#pragma once

#include "kernels/tensor.h"

namespace meshproof::kernels {

void cast(const Tensor& src, Tensor& dst);
// A new tensor on src's device holding src converted to `dtype` (a clone when equal).
Tensor cast_to(const Tensor& src, DType dtype);

}  // namespace meshproof::kernels
