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
  const bool cuda = dlogits ? detail::on_cuda(op, {&logits, &targets, dlogits})
                            : detail::on_cuda(op, {&logits, &targets});
  if (cuda) {
    // Targets are validated on the host (m int32 values) before the kernel reads them.
    const std::vector<int32_t> tg = targets.to_vector<int32_t>();
    for (int64_t r = 0; r < m; ++r)
      MP_CHECK_INPUT(tg[r] >= 0 && tg[r] < v, "{}: target {} at row {} outside [0, {})", op, tg[r],
                     r, v);
    Tensor row_loss = Tensor::empty({m}, DType::kFloat64, logits.device());
    MP_OP_CUDA(
        op, launch_cross_entropy(logits.raw_data(), targets.data<int32_t>(),
                                 logits.dtype() == DType::kBFloat16, m, v, grad_scale,
                                 row_loss.data<double>(), dlogits ? dlogits->raw_data() : nullptr,
                                 detail::cuda_stream()));
    // Summed on the host in row order, like the CPU (to_vector synchronises the stream).
    double total = 0;
    for (double l : row_loss.to_vector<double>()) total += l;
    return total;
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

namespace {

// The logits and targets as host tensors (copies of CUDA ones), checked for the shard pieces.
struct HostShard {
  Tensor logits, targets;
  int64_t m = 0, v = 0;
};
HostShard host_shard(std::string_view op, const Tensor& logits, const Tensor& targets,
                     int64_t vocab_begin, int64_t vocab) {
  detail::check_operand(logits, op, "logits");
  detail::check_float(logits, op, "logits");
  MP_CHECK(logits.shape().rank() == 2, "{}: logits must be [M, V], got {}", op, logits.describe());
  const int64_t m = logits.shape()[0], v = logits.shape()[1];
  detail::check_operand(targets, op, "targets", m);
  MP_CHECK(targets.dtype() == DType::kInt32, "{}: targets must be int32, got {}", op,
           targets.describe());
  MP_CHECK(vocab_begin >= 0 && vocab_begin + v <= vocab,
           "{}: logits {} hold columns [{}, {}) outside the vocabulary of {}", op,
           logits.describe(), vocab_begin, vocab_begin + v, vocab);
  const auto host = Device::cpu();
  HostShard h{logits.device().is_cpu() ? logits : logits.to(host),
              targets.device().is_cpu() ? targets : targets.to(host), m, v};
  const int32_t* tg = h.targets.data<int32_t>();
  for (int64_t r = 0; r < m; ++r)
    MP_CHECK_INPUT(tg[r] >= 0 && tg[r] < vocab, "{}: target {} at row {} outside [0, {})", op,
                   tg[r], r, vocab);
  return h;
}

}  // namespace

std::vector<double> cross_entropy_shard_max(const Tensor& logits) {
  constexpr std::string_view op = "cross_entropy_shard_max";
  detail::check_operand(logits, op, "logits");
  detail::check_float(logits, op, "logits");
  MP_CHECK(logits.shape().rank() == 2, "{}: logits must be [M, V], got {}", op, logits.describe());
  const Tensor host = logits.device().is_cpu() ? logits : logits.to(Device::cpu());
  const int64_t m = host.shape()[0], v = host.shape()[1];
  std::vector<double> out(static_cast<size_t>(m), -INFINITY);
  detail::dispatch_float(host.dtype(), op, [&](auto t) {
    using T = decltype(t);
    const T* lp = host.data<T>();
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < v; ++c)
        out[static_cast<size_t>(r)] =
            std::max(out[static_cast<size_t>(r)], static_cast<double>(lp[r * v + c]));
  });
  return out;
}

CrossEntropyShardSums cross_entropy_shard_sums(const Tensor& logits, const Tensor& targets,
                                               int64_t vocab_begin, int64_t vocab,
                                               const std::vector<double>& row_max) {
  constexpr std::string_view op = "cross_entropy_shard_sums";
  const HostShard h = host_shard(op, logits, targets, vocab_begin, vocab);
  MP_CHECK(static_cast<int64_t>(row_max.size()) == h.m, "{}: {} row maxima for {} rows", op,
           row_max.size(), h.m);
  CrossEntropyShardSums out{std::vector<double>(static_cast<size_t>(h.m), 0.0),
                            std::vector<double>(static_cast<size_t>(h.m), 0.0)};
  detail::dispatch_float(h.logits.dtype(), op, [&](auto t) {
    using T = decltype(t);
    const T* lp = h.logits.data<T>();
    const int32_t* tg = h.targets.data<int32_t>();
    for (int64_t r = 0; r < h.m; ++r) {
      const T* row = lp + r * h.v;
      const size_t ri = static_cast<size_t>(r);
      double sum = 0;
      for (int64_t c = 0; c < h.v; ++c) sum += std::exp(row[c] - row_max[ri]);
      out.sum_exp[ri] = sum;
      const int64_t col = tg[r] - vocab_begin;
      if (col >= 0 && col < h.v) out.target_logit[ri] = static_cast<double>(row[col]);
    }
  });
  return out;
}

void cross_entropy_shard_grad(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                              int64_t vocab, const std::vector<double>& log_z, double grad_scale,
                              Tensor& dlogits) {
  constexpr std::string_view op = "cross_entropy_shard_grad";
  const HostShard h = host_shard(op, logits, targets, vocab_begin, vocab);
  MP_CHECK(static_cast<int64_t>(log_z.size()) == h.m, "{}: {} log-partition values for {} rows", op,
           log_z.size(), h.m);
  detail::check_operand(dlogits, op, "dlogits", h.m * h.v);
  detail::check_same_dtype(logits, dlogits, op);
  MP_CHECK(dlogits.device() == logits.device(), "{}: dlogits {} not on the logits' device", op,
           dlogits.describe());
  Tensor out = dlogits.device().is_cpu()
                   ? dlogits
                   : Tensor::empty(dlogits.shape(), dlogits.dtype(), Device::cpu());
  detail::dispatch_float(h.logits.dtype(), op, [&](auto t) {
    using T = decltype(t);
    const T* lp = h.logits.data<T>();
    const int32_t* tg = h.targets.data<int32_t>();
    T* dp = out.data<T>();
    for (int64_t r = 0; r < h.m; ++r) {
      const T* row = lp + r * h.v;
      const int64_t col = tg[r] - vocab_begin;
      for (int64_t c = 0; c < h.v; ++c) {
        const double prob = std::exp(row[c] - log_z[static_cast<size_t>(r)]);
        dp[r * h.v + c] = static_cast<T>(grad_scale * (prob - (c == col ? 1.0 : 0.0)));
      }
    }
  });
  if (!dlogits.device().is_cpu()) dlogits.copy_from(out.to(dlogits.device()));
}

}  // namespace meshproof::kernels
