// AdamW with PyTorch semantics (torch.optim.AdamW, single-tensor path), docs/design.md section 3:
//   p *= 1 - lr*wd                         (decoupled decay; callers pass wd = 0 for ndim < 2)
//   m = beta1*m + (1-beta1)*g;  v = beta2*v + (1-beta2)*g*g
//   p -= (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
// param, grad, exp_avg, exp_avg_sq: float32 tensors of equal size (the local shard); step t >= 1.
// Elementwise in float32 in PyTorch's operation order, so a sharded update equals the unsharded
// one bit for bit.
#pragma once

#include <cstdint>
#include <vector>

#include "kernels/core/tensor.h"

namespace meshproof::kernels {

struct AdamWHyper {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

void adamw_step(Tensor& param, const Tensor& grad, Tensor& exp_avg, Tensor& exp_avg_sq,
                int64_t step, const AdamWHyper& hyper);

// Sum of squares of a float32/float64 tensor, accumulated in double in index order.
double sum_of_squares(const Tensor& t);

// The sum over `tensors` (float32, all on the host or all on one device) of sum_of_squares(t),
// accumulated in list order from 0: exactly `double s = 0; for (t : tensors) s +=
// sum_of_squares(*t);` on the host. On a device the same serial double operations run as
// kernels (bitwise equal to the host's) and only the 8-byte result comes back (one
// device-to-host copy, whatever the number of tensors): the global grad norm's per-rank part.
double sum_of_squares_total(const std::vector<const Tensor*>& tensors);

}  // namespace meshproof::kernels
