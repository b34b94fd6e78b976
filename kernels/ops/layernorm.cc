#include "kernels/ops/layernorm.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/ops/column_reduce.h"
#include "kernels/ops/op_util.h"

namespace meshproof::kernels {
namespace {

template <typename T>
void ln_forward_cpu(const T* x, const T* w, const T* b, double eps, int64_t m, int64_t h, T* y,
                    T* mean_out, T* rstd_out) {
  for (int64_t r = 0; r < m; ++r) {
    const T* xr = x + r * h;
    double sum = 0;
    for (int64_t c = 0; c < h; ++c) sum += xr[c];
    const double mean = sum / static_cast<double>(h);
    double sq = 0;
    for (int64_t c = 0; c < h; ++c) sq += (xr[c] - mean) * (xr[c] - mean);
    const double rstd = 1.0 / std::sqrt(sq / static_cast<double>(h) + eps);
    for (int64_t c = 0; c < h; ++c) {
      const double n = (xr[c] - mean) * rstd;
      y[r * h + c] = static_cast<T>(n * w[c] + (b ? static_cast<double>(b[c]) : 0.0));
    }
    if (mean_out) mean_out[r] = static_cast<T>(mean);
    rstd_out[r] = static_cast<T>(rstd);
  }
}

// The CUDA weight-gradient reductions' chunk partials: `k` quantities (dw, db) x column_chunks(m)
// x h doubles (kernels/ops/column_reduce.h), freed stream-ordered after the launch.
Tensor column_partials(std::string_view op, int64_t m, int64_t h, int64_t k, Device device) {
  const int64_t chunks = detail::column_chunks(m);
  MP_CHECK(chunks <= detail::kColumnMaxChunks, "{}: {} rows exceed the CUDA column reduction's {}",
           op, m, detail::kColumnMaxChunks * detail::kColumnChunkRows);
  return Tensor::empty({std::max<int64_t>(1, k * chunks * h)}, DType::kFloat64, device);
}

// dx = rstd * (g - mean(g) - n * mean(g * n)), g = dy * w, n = normalised x (for RMSNorm the
// mean(g) term is absent and mean is 0). dw += sum_rows dy * n, db += sum_rows dy.
template <typename T, typename G>
void ln_backward_cpu(const T* dy, const T* x, const T* w, const T* mean_in, const T* rstd_in,
                     int64_t m, int64_t h, T* dx, G* dw, G* db) {
  std::vector<double> dw_acc(h, 0.0), db_acc(h, 0.0);
  for (int64_t r = 0; r < m; ++r) {
    const double mean = mean_in ? static_cast<double>(mean_in[r]) : 0.0;
    const double rstd = rstd_in[r];
    double sum_g = 0, sum_gn = 0;
    for (int64_t c = 0; c < h; ++c) {
      const double n = (x[r * h + c] - mean) * rstd;
      const double g = static_cast<double>(dy[r * h + c]) * w[c];
      sum_g += g;
      sum_gn += g * n;
      dw_acc[c] += static_cast<double>(dy[r * h + c]) * n;
      db_acc[c] += dy[r * h + c];
    }
    const double mean_g = mean_in ? sum_g / static_cast<double>(h) : 0.0;
    const double mean_gn = sum_gn / static_cast<double>(h);
    for (int64_t c = 0; c < h; ++c) {
      const double n = (x[r * h + c] - mean) * rstd;
      const double g = static_cast<double>(dy[r * h + c]) * w[c];
      dx[r * h + c] = static_cast<T>(rstd * (g - mean_g - n * mean_gn));
    }
  }
  for (int64_t c = 0; c < h; ++c) {
    dw[c] = static_cast<G>(dw[c] + dw_acc[c]);
    if (db) db[c] = static_cast<G>(db[c] + db_acc[c]);
  }
}

void check_norm_args(std::string_view op, const Tensor& x, const Tensor& weight) {
  detail::check_operand(x, op, "x");
  detail::check_float(x, op, "x");
  MP_CHECK(x.shape().rank() >= 1, "{}: x is {}", op, x.describe());
  detail::check_operand(weight, op, "weight", x.shape().last());
  detail::check_same_dtype(x, weight, op);
}

}  // namespace

void layernorm_forward(const Tensor& x, const Tensor& weight, const Tensor& bias, double eps,
                       Tensor& y, Tensor& mean, Tensor& rstd) {
  constexpr std::string_view op = "layernorm_forward";
  check_norm_args(op, x, weight);
  const int64_t m = x.shape().leading(), h = x.shape().last();
  detail::check_operand(bias, op, "bias", h);
  detail::check_operand(y, op, "y", m * h);
  detail::check_operand(mean, op, "mean", m);
  detail::check_operand(rstd, op, "rstd", m);
  if (detail::on_cuda(op, {&x, &weight, &bias, &y, &mean, &rstd})) {
    MP_OP_CUDA(op, launch_norm_forward(x.raw_data(), weight.raw_data(), bias.raw_data(),
                                       x.dtype() == DType::kBFloat16, /*rms=*/false, eps, m, h,
                                       y.raw_data(), mean.raw_data(), rstd.raw_data(),
                                       detail::cuda_stream()));
    return;
  }
  detail::dispatch_float(x.dtype(), op, [&](auto t) {
    using T = decltype(t);
    ln_forward_cpu<T>(x.data<T>(), weight.data<T>(), bias.data<T>(), eps, m, h, y.data<T>(),
                      mean.data<T>(), rstd.data<T>());
  });
}

void layernorm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& mean,
                        const Tensor& rstd, Tensor& dx, Tensor& dweight, Tensor& dbias) {
  constexpr std::string_view op = "layernorm_backward";
  check_norm_args(op, x, weight);
  const int64_t m = x.shape().leading(), h = x.shape().last();
  detail::check_operand(dy, op, "dy", m * h);
  detail::check_operand(dx, op, "dx", m * h);
  detail::check_operand(mean, op, "mean", m);
  detail::check_operand(rstd, op, "rstd", m);
  detail::check_grad(dweight, op, "dweight", h);
  detail::check_grad(dbias, op, "dbias", h);
  detail::check_same_dtype(dweight, dbias, op);
  if (detail::on_cuda(op, {&dy, &x, &weight, &mean, &rstd, &dx, &dweight, &dbias})) {
    Tensor partial = column_partials(op, m, h, 2, x.device());
    MP_OP_CUDA(op,
               launch_norm_backward(dy.raw_data(), x.raw_data(), weight.raw_data(), mean.raw_data(),
                                    rstd.raw_data(), x.dtype() == DType::kBFloat16, m, h,
                                    dx.raw_data(), partial.data<double>(), dweight.data<float>(),
                                    dbias.data<float>(), detail::cuda_stream()));
    return;
  }
  detail::dispatch_float(x.dtype(), op, [&](auto t) {
    using T = decltype(t);
    detail::dispatch_grad(dweight.dtype(), op, [&](auto g) {
      using G = decltype(g);
      ln_backward_cpu<T, G>(dy.data<T>(), x.data<T>(), weight.data<T>(), mean.data<T>(),
                            rstd.data<T>(), m, h, dx.data<T>(), dweight.data<G>(), dbias.data<G>());
    });
  });
}

void rmsnorm_forward(const Tensor& x, const Tensor& weight, double eps, Tensor& y, Tensor& rstd) {
  constexpr std::string_view op = "rmsnorm_forward";
  check_norm_args(op, x, weight);
  const int64_t m = x.shape().leading(), h = x.shape().last();
  detail::check_operand(y, op, "y", m * h);
  detail::check_operand(rstd, op, "rstd", m);
  if (detail::on_cuda(op, {&x, &weight, &y, &rstd})) {
    MP_OP_CUDA(op,
               launch_norm_forward(x.raw_data(), weight.raw_data(), nullptr,
                                   x.dtype() == DType::kBFloat16, /*rms=*/true, eps, m, h,
                                   y.raw_data(), nullptr, rstd.raw_data(), detail::cuda_stream()));
    return;
  }
  detail::dispatch_float(x.dtype(), op, [&](auto t) {
    using T = decltype(t);
    const T* xp = x.data<T>();
    const T* w = weight.data<T>();
    T* yp = y.data<T>();
    T* rp = rstd.data<T>();
    for (int64_t r = 0; r < m; ++r) {
      double sq = 0;
      for (int64_t c = 0; c < h; ++c) sq += static_cast<double>(xp[r * h + c]) * xp[r * h + c];
      const double rs = 1.0 / std::sqrt(sq / static_cast<double>(h) + eps);
      for (int64_t c = 0; c < h; ++c) yp[r * h + c] = static_cast<T>(xp[r * h + c] * rs * w[c]);
      rp[r] = static_cast<T>(rs);
    }
  });
}

void rmsnorm_backward(const Tensor& dy, const Tensor& x, const Tensor& weight, const Tensor& rstd,
                      Tensor& dx, Tensor& dweight) {
  constexpr std::string_view op = "rmsnorm_backward";
  check_norm_args(op, x, weight);
  const int64_t m = x.shape().leading(), h = x.shape().last();
  detail::check_operand(dy, op, "dy", m * h);
  detail::check_operand(dx, op, "dx", m * h);
  detail::check_operand(rstd, op, "rstd", m);
  detail::check_grad(dweight, op, "dweight", h);
  if (detail::on_cuda(op, {&dy, &x, &weight, &rstd, &dx, &dweight})) {
    Tensor partial = column_partials(op, m, h, 1, x.device());
    MP_OP_CUDA(op, launch_norm_backward(dy.raw_data(), x.raw_data(), weight.raw_data(), nullptr,
                                        rstd.raw_data(), x.dtype() == DType::kBFloat16, m, h,
                                        dx.raw_data(), partial.data<double>(),
                                        dweight.data<float>(), nullptr, detail::cuda_stream()));
    return;
  }
  detail::dispatch_float(x.dtype(), op, [&](auto t) {
    using T = decltype(t);
    detail::dispatch_grad(dweight.dtype(), op, [&](auto g) {
      using G = decltype(g);
      ln_backward_cpu<T, G>(dy.data<T>(), x.data<T>(), weight.data<T>(), nullptr, rstd.data<T>(), m,
                            h, dx.data<T>(), dweight.data<G>(), nullptr);
    });
  });
}

}  // namespace meshproof::kernels
