// LayerNorm and RMSNorm over the last dimension (docs/design.md section 3: eps 1e-5, biased
// variance).
//   x, y, dy, dx: [M, H]; weight, bias, dweight, dbias: [H]; mean, rstd: [M] (saved statistics,
//   same dtype as x). Row reductions accumulate in double. Weight/bias gradients (float32/float64,
//   whatever x's dtype) are ACCUMULATED
//   into dweight/dbias (callers zero them), so micro-batches and recompute add up naturally.
#pragma once

#include "kernels/core/tensor.h"

namespace meshproof::kernels {

// y = (x - mean) * rstd * weight + bias, rstd = 1/sqrt(var + eps).
void layernorm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                       Tensor& y, Tensor& mean, Tensor& rstd);
void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& mean,
                        const Tensor& rstd, Tensor& dx, Tensor& dweight, Tensor& dbias);

// y = x * rstd * weight, rstd = 1/sqrt(mean(x^2) + eps); no bias.
void rmsnorm_forward(const Tensor& x, const Tensor& weight, double eps, Tensor& y, Tensor& rstd);
void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                      Tensor& dx, Tensor& dweight);

}  // namespace meshproof::kernels
