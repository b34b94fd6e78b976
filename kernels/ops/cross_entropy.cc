#include "kernels/ops/cross_entropy.h"

#include <algorithm>
#include <cmath>

#include "kernels/ops/op_util.h"

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
    // Row losses and their row-order sum on the device: one 8-byte download. A target outside
    // [0, v) makes its row's loss NaN without a read; a NaN total is then told apart from a NaN
    // logit by a scan of the targets on the device (a second scalar, only on that path).
    Tensor row_loss = Tensor::empty({m}, DType::kFloat64, logits.device());
    Tensor total = Tensor::empty({1}, DType::kFloat64, logits.device());
    MP_OP_CUDA(
        op, launch_cross_entropy(logits.raw_data(), targets.data<int32_t>(),
                                 logits.dtype() == DType::kBFloat16, m, v, grad_scale,
                                 row_loss.data<double>(), dlogits ? dlogits->raw_data() : nullptr,
                                 detail::cuda_stream()));
    MP_OP_CUDA(op, launch_row_sum(row_loss.data<double>(), m, total.data<double>(),
                                  detail::cuda_stream()));
    const double loss = detail::download_scalar(total);
    if (std::isnan(loss)) detail::check_ids_on_device(op, "target", "row", targets, v);
    return loss;
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

// Checks the shard pieces' operands: logits [M, Vl] holding columns [vocab_begin, vocab_begin + Vl)
// of `vocab`, int32 targets [M]. Returns whether they are on a CUDA device.
bool check_shard(std::string_view op, const Tensor& logits, const Tensor& targets,
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
  return detail::on_cuda(op, {&logits, &targets});
}

// The host targets' range check of the CPU pieces.
void check_host_targets(std::string_view op, const Tensor& targets, int64_t vocab) {
  const int32_t* tg = targets.data<int32_t>();
  const int64_t m = targets.numel().value;
  for (int64_t r = 0; r < m; ++r)
    MP_CHECK_INPUT(tg[r] >= 0 && tg[r] < vocab, "{}: target {} at row {} outside [0, {})", op,
                   tg[r], r, vocab);
}

// A per-row float64 operand [m] on `device`.
void check_rows(std::string_view op, std::string_view name, const Tensor& t, int64_t m,
                Device device) {
  detail::check_operand(t, op, name, m);
  MP_CHECK(t.dtype() == DType::kFloat64 && t.device() == device,
           "{}: '{}' must be float64 [{}] on {}, got {}", op, name, m, device.str(), t.describe());
}

}  // namespace

Tensor cross_entropy_shard_max(const Tensor& logits) {
  constexpr std::string_view op = "cross_entropy_shard_max";
  detail::check_operand(logits, op, "logits");
  detail::check_float(logits, op, "logits");
  MP_CHECK(logits.shape().rank() == 2, "{}: logits must be [M, V], got {}", op, logits.describe());
  const int64_t m = logits.shape()[0], v = logits.shape()[1];
  Tensor out = Tensor::empty({m}, DType::kFloat64, logits.device());
  if (detail::on_cuda(op, {&logits})) {
    MP_OP_CUDA(
        op, launch_cross_entropy_shard_max(logits.raw_data(), logits.dtype() == DType::kBFloat16, m,
                                           v, out.data<double>(), detail::cuda_stream()));
    return out;
  }
  double* o = out.data<double>();
  for (int64_t r = 0; r < m; ++r) o[r] = -INFINITY;
  detail::dispatch_float(logits.dtype(), op, [&](auto t) {
    using T = decltype(t);
    const T* lp = logits.data<T>();
    for (int64_t r = 0; r < m; ++r)
      for (int64_t c = 0; c < v; ++c) o[r] = std::max(o[r], static_cast<double>(lp[r * v + c]));
  });
  return out;
}

CrossEntropyShardSums cross_entropy_shard_sums(const Tensor& logits, const Tensor& targets,
                                               int64_t vocab_begin, int64_t vocab,
                                               const Tensor& row_max) {
  constexpr std::string_view op = "cross_entropy_shard_sums";
  const bool cuda = check_shard(op, logits, targets, vocab_begin, vocab);
  const int64_t m = logits.shape()[0], v = logits.shape()[1];
  check_rows(op, "row_max", row_max, m, logits.device());
  CrossEntropyShardSums out{Tensor::empty({m}, DType::kFloat64, logits.device()),
                            Tensor::empty({m}, DType::kFloat64, logits.device())};
  if (cuda) {
    MP_OP_CUDA(
        op, launch_cross_entropy_shard_sums(
                logits.raw_data(), targets.data<int32_t>(), logits.dtype() == DType::kBFloat16, m,
                v, vocab_begin, vocab, row_max.data<double>(), out.sum_exp.data<double>(),
                out.target_logit.data<double>(), detail::cuda_stream()));
    return out;
  }
  check_host_targets(op, targets, vocab);
  detail::dispatch_float(logits.dtype(), op, [&](auto t) {
    using T = decltype(t);
    const T* lp = logits.data<T>();
    const int32_t* tg = targets.data<int32_t>();
    const double* mx = row_max.data<double>();
    double* se = out.sum_exp.data<double>();
    double* tl = out.target_logit.data<double>();
    for (int64_t r = 0; r < m; ++r) {
      const T* row = lp + r * v;
      double sum = 0;
      for (int64_t c = 0; c < v; ++c) sum += std::exp(row[c] - mx[r]);
      se[r] = sum;
      const int64_t col = tg[r] - vocab_begin;
      tl[r] = col >= 0 && col < v ? static_cast<double>(row[col]) : 0.0;
    }
  });
  return out;
}

Tensor cross_entropy_combine_ranks(const Tensor& every, int ranks, bool max) {
  constexpr std::string_view op = "cross_entropy_combine_ranks";
  detail::check_operand(every, op, "every");
  MP_CHECK(ranks >= 1 && every.dtype() == DType::kFloat64 && every.shape().rank() == 1 &&
               every.numel().value % ranks == 0,
           "{}: 'every' must be float64 [ranks * M] for {} ranks, got {}", op, ranks,
           every.describe());
  const int64_t m = every.numel().value / ranks;
  Tensor out = Tensor::empty({m}, DType::kFloat64, every.device());
  if (every.device().is_cuda()) {
    MP_CHECK(MESHPROOF_HAVE_CUDA, "{}: {} is on a CUDA device but this build has no CUDA backend",
             op, every.describe());
    MP_OP_CUDA(op, launch_combine_ranks(every.data<double>(), ranks, m, max, out.data<double>(),
                                        detail::cuda_stream()));
    return out;
  }
  const double* e = every.data<double>();
  double* o = out.data<double>();
  for (int64_t r = 0; r < m; ++r) o[r] = e[r];
  for (int t = 1; t < ranks; ++t)
    for (int64_t r = 0; r < m; ++r) o[r] = max ? std::max(o[r], e[t * m + r]) : o[r] + e[t * m + r];
  return out;
}

double cross_entropy_shard_loss(const Tensor& row_max, const Tensor& sum_exp,
                                const Tensor& target_logit, const Tensor& targets, int64_t vocab,
                                int64_t seq, int sp_size, int sp_rank, Tensor& log_z) {
  constexpr std::string_view op = "cross_entropy_shard_loss";
  detail::check_operand(row_max, op, "row_max");
  const int64_t m = row_max.numel().value;
  const Device dev = row_max.device();
  check_rows(op, "row_max", row_max, m, dev);
  check_rows(op, "sum_exp", sum_exp, m, dev);
  check_rows(op, "target_logit", target_logit, m, dev);
  detail::check_operand(targets, op, "targets", m);
  MP_CHECK(targets.dtype() == DType::kInt32 && targets.device() == dev,
           "{}: targets must be int32 [{}] on {}, got {}", op, m, dev.str(), targets.describe());
  MP_CHECK(sp_size >= 1 && 0 <= sp_rank && sp_rank < sp_size && seq >= 1 &&
               (sp_size == 1 || (seq % sp_size == 0 && m % seq == 0)),
           "{}: {} rows do not split into sequences of {} over {} sequence shards (rank {})", op, m,
           seq, sp_size, sp_rank);
  log_z = Tensor::empty({m}, DType::kFloat64, dev);
  if (dev.is_cuda()) {
    MP_CHECK(MESHPROOF_HAVE_CUDA, "{}: {} is on a CUDA device but this build has no CUDA backend",
             op, row_max.describe());
    Tensor total = Tensor::empty({1}, DType::kFloat64, dev);
    const auto launch = [&](bool nan_on_bad_target) {
      MP_OP_CUDA(op, launch_cross_entropy_shard_loss(
                         row_max.data<double>(), sum_exp.data<double>(),
                         target_logit.data<double>(), m, seq, sp_size, sp_rank, nan_on_bad_target,
                         log_z.data<double>(), total.data<double>(), detail::cuda_stream()));
      return detail::download_scalar(total);
    };
    const double loss = launch(true);
    if (!std::isnan(loss)) return loss;
    // A NaN target logit: a target outside the vocabulary (an input error, reported), or a NaN
    // logit at a valid target, whose loss is the counted rows' sum as on the CPU.
    detail::check_ids_on_device(op, "target", "row", targets, vocab);
    return launch(false);
  }
  const double* mx = row_max.data<double>();
  const double* se = sum_exp.data<double>();
  const double* tl = target_logit.data<double>();
  double* lz = log_z.data<double>();
  const int64_t sl = seq / sp_size;
  double total = 0;
  for (int64_t r = 0; r < m; ++r) {
    lz[r] = mx[r] + std::log(se[r]);
    if (sp_size == 1 || (r % seq) / sl == sp_rank) total += lz[r] - tl[r];
  }
  return total;
}

void cross_entropy_shard_grad(const Tensor& logits, const Tensor& targets, int64_t vocab_begin,
                              int64_t vocab, const Tensor& log_z, double grad_scale,
                              Tensor& dlogits) {
  constexpr std::string_view op = "cross_entropy_shard_grad";
  const bool cuda = check_shard(op, logits, targets, vocab_begin, vocab);
  const int64_t m = logits.shape()[0], v = logits.shape()[1];
  check_rows(op, "log_z", log_z, m, logits.device());
  detail::check_operand(dlogits, op, "dlogits", m * v);
  detail::check_same_dtype(logits, dlogits, op);
  MP_CHECK(dlogits.device() == logits.device(), "{}: dlogits {} not on the logits' device", op,
           dlogits.describe());
  if (cuda) {
    // Targets were checked by the loss piece of the same rows (a target outside the vocabulary
    // matches no column here: no read out of bounds).
    MP_OP_CUDA(op, launch_cross_entropy_shard_grad(logits.raw_data(), targets.data<int32_t>(),
                                                   logits.dtype() == DType::kBFloat16, m, v,
                                                   vocab_begin, log_z.data<double>(), grad_scale,
                                                   dlogits.raw_data(), detail::cuda_stream()));
    return;
  }
  check_host_targets(op, targets, vocab);
  detail::dispatch_float(logits.dtype(), op, [&](auto t) {
    using T = decltype(t);
    const T* lp = logits.data<T>();
    const int32_t* tg = targets.data<int32_t>();
    const double* lz = log_z.data<double>();
    T* dp = dlogits.data<T>();
    for (int64_t r = 0; r < m; ++r) {
      const T* row = lp + r * v;
      const int64_t col = tg[r] - vocab_begin;
      for (int64_t c = 0; c < v; ++c) {
        const double prob = std::exp(row[c] - lz[r]);
        dp[r * v + c] = static_cast<T>(grad_scale * (prob - (c == col ? 1.0 : 0.0)));
      }
    }
  });
}

}  // namespace meshproof::kernels
