#include "kernels/cross_entropy.h"

#include <cmath>
#include <vector>

#include "kernels/op_util.h"

namespace meshproof::kernels {
namespace {

double run(const Tensor& logits, const Tensor& targets, double grad_scale, Tensor* dlogits) {
  constexpr std::string_view op = "cross_entropy";
  detail::check_operand(logits, op, "logits");
  detail::check_float(logits, op, "logits");
  const int64_t m = logits.shape().leading(), v = logits.shape().last();
  detail::check_operand(targets, op, "targets", m);
  MP_CHECK(targets.dtype() == DType::kInt32, "{}: targets must be int32, got {}", op,
           targets.describe());
  if (dlogits) {
    detail::check_operand(*dlogits, op, "dlogits", m * v);
    detail::check_same_dtype(logits, *dlogits, op);
  }
  return detail::dispatch_float(logits.dtype(), op, [&](auto t) -> double {
    using T = decltype(t);
    const T* lp = logits.data<T>();
    const int32_t* tg = targets.data<int32_t>();
    T* dp = dlogits ? dlogits->data<T>() : nullptr;
    double total = 0;
    for (int64_t r = 0; r < m; ++r) {
      const T* row = lp + r * v;
      MP_CHECK_INPUT(tg[r] >= 0 && tg[r] < v, "{}: target {} at row {} outside [0, {})", op, tg[r],
                     r, v);
      double mx = -INFINITY;
      for (int64_t c = 0; c < v; ++c) mx = std::max(mx, static_cast<double>(row[c]));
      double sum = 0;
      for (int64_t c = 0; c < v; ++c) sum += std::exp(row[c] - mx);
      const double log_z = mx + std::log(sum);
      total += log_z - row[tg[r]];
      if (dp) {
        for (int64_t c = 0; c < v; ++c) {
          const double prob = std::exp(row[c] - log_z);
          dp[r * v + c] = static_cast<T>(grad_scale * (prob - (c == tg[r] ? 1.0 : 0.0)));
        }
      }
    }
    return total;
  });
}

}  // namespace

double cross_entropy_forward_backward(const Tensor& logits, const Tensor& targets,
                                      double grad_scale, Tensor& dlogits) {
  return run(logits, targets, grad_scale, &dlogits);
}

double cross_entropy_forward(const Tensor& logits, const Tensor& targets) {
  return run(logits, targets, 0.0, nullptr);
}

}  // namespace meshproof::kernels
