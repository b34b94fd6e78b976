// MLP activations (docs/design.md section 3), elementwise over same-shape tensors.
//   GELU (tanh approximation): y = 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
//   ReLU: y = max(x, 0) (gradient 0 at x = 0)
//   SwiGLU: y = silu(gate) * up, silu(g) = g * sigmoid(g); gate/up are the logical fc1_gate and
//   fc1_up outputs [M, F].
// Backward ops write (not accumulate) the input gradients.
#pragma once

#include "kernels/core/tensor.h"

namespace meshproof::kernels {

// `tanh_u` (CPU only, optional): a float64 tensor of x's element count that the forward fills
// with each element's tanh(u), u = sqrt(2/pi) (x + 0.044715 x^3), and the backward reads instead
// of computing tanh(u) again: the same double, so the same bits, at half the tanh calls per step
// (tanh was about a third of a small GELU model's CPU step, docs/design.md section 36). Given to
// the backward, it must hold the forward's values for this x.
void gelu_forward(const Tensor& x, Tensor& y, Tensor* tanh_u = nullptr);
void gelu_backward(const Tensor& dy, const Tensor& x, Tensor& dx, const Tensor* tanh_u = nullptr);
void relu_forward(const Tensor& x, Tensor& y);
void relu_backward(const Tensor& dy, const Tensor& x, Tensor& dx);
void swiglu_forward(const Tensor& gate, const Tensor& up, Tensor& y);
void swiglu_backward(const Tensor& dy, const Tensor& gate, const Tensor& up, Tensor& dgate,
                     Tensor& dup);

}  // namespace meshproof::kernels
