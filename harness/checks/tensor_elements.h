// One element of a host tensor of any checkpoint dtype, as a value and on an ordered integer line
// whose distance is the ULP distance: what `ckpt diff` and the state check report of a
// difference (one definition, so that both name the same figures).
#pragma once

#include <cstdint>

#include "kernels/core/tensor.h"

namespace meshproof::harness {

struct Element {
  double value;
  int64_t ordered;  // floats: sign-magnitude mapped onto a monotone line; integers: the value
};

// Element i of a host tensor (every dtype a checkpoint stores; E2M1 is an input error).
Element element(const kernels::Tensor& t, int64_t i);

// |x - y| of two values on the ordered line, exactly (the signed difference may overflow): the
// ULP distance of two floats of one dtype, the difference of two integers.
uint64_t distance(int64_t x, int64_t y);

}  // namespace meshproof::harness
