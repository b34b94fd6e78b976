// Elementwise pieces of the layer around the GEMMs: bias add and bias gradient of a linear layer,
// residual add, dropout with counter-based masks, and scaling.
//   y: [M, N], bias / dbias: [N]; residual operands any equal shapes.
#pragma once

#include <cstdint>

#include "kernels/core/tensor.h"

namespace meshproof::kernels {

// y[r, c] += bias[c]
void add_bias_(Tensor& y, const Tensor& bias);
// dbias[c] += sum_r dy[r, c] (accumulated in double, added into dbias: float32/float64)
void bias_grad(const Tensor& dy, Tensor& dbias);
// x += y
void add_(Tensor& x, const Tensor& y);
// x *= alpha
void scale_(Tensor& x, double alpha);

// Inverted dropout with probability p: element i (global element index first_index + i) is kept
// when philox_uniform(seed, stream, first_index + i) >= p and then scaled by 1/(1-p). The mask is a
// pure function of (seed, stream, index), so backward and activation recompute regenerate it.
// p == 0 copies x.
struct DropoutKey {
  uint64_t seed = 0;
  uint64_t stream = 0;
  uint64_t first_index = 0;
};
void dropout_forward(const Tensor& x, double p, const DropoutKey& key, Tensor& y);
void dropout_backward(const Tensor& dy, double p, const DropoutKey& key, Tensor& dx);

}  // namespace meshproof::kernels
