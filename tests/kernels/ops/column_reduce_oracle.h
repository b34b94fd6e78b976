// The CUDA per-column reductions' fixed order (kernels/ops/column_reduce.h) on the host: what the
// device must produce bit for bit, and the bound against the CPU reference's serial sums. Used by
// the CPU test (column_reduce_test.cc) and the gpu test (ops_cuda_test.cc).
#pragma once

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "kernels/core/dtype.h"
#include "kernels/core/tensor.h"
#include "kernels/ops/cast.h"
#include "kernels/ops/column_reduce.h"

namespace meshproof::kernels::column_oracle {

// Random N(0, stddev) values in `dtype` on the CPU (bf16 rounded from float32 by cast_to): the
// inputs of the column-reduction tests on both backends.
inline Tensor random_tensor(const Shape& shape, DType dtype, uint32_t seed, double stddev = 1.0) {
  std::mt19937 gen(seed);
  std::normal_distribution<float> dist(0.0f, static_cast<float>(stddev));
  std::vector<float> v(static_cast<size_t>(shape.numel().value));
  for (float& x : v) x = dist(gen);
  return cast_to(Tensor::from_vector<float>(shape, v), dtype);
}

// Host values of a CPU tensor as double (bf16 and float32 widen exactly).
inline std::vector<double> doubles(const Tensor& t) {
  const Tensor f = t.dtype() == DType::kFloat32 ? t : cast_to(t, DType::kFloat32);
  const std::vector<float> v = f.to_vector<float>();
  return std::vector<double>(v.begin(), v.end());
}

struct ColumnGrads {
  std::vector<float> grad;      // float(g0 + fixed-order sum), the device's bits
  std::vector<double> abs_sum;  // sum_r |t_r| per column (for the bound)
};

// g[c] = float(double(g0[c]) + sum_r term(r, c)) in the fixed order.
template <typename Term>
ColumnGrads fixed_order(const std::vector<float>& g0, int64_t m, int64_t n, const Term& term) {
  ColumnGrads out{std::vector<float>(g0.size()), std::vector<double>(g0.size())};
  for (int64_t c = 0; c < n; ++c) {
    const double s = detail::column_sum_fixed_order(m, [&](int64_t r) { return term(r, c); });
    double a = 0;
    for (int64_t r = 0; r < m; ++r) a += std::fabs(term(r, c));
    out.grad[static_cast<size_t>(c)] =
        static_cast<float>(static_cast<double>(g0[static_cast<size_t>(c)]) + s);
    out.abs_sum[static_cast<size_t>(c)] = a;
  }
  return out;
}

// bias_grad's terms: dy[r, c].
inline ColumnGrads bias_grad(const Tensor& dy, const std::vector<float>& g0) {
  const int64_t n = dy.shape().last(), m = dy.shape().leading();
  const std::vector<double> d = doubles(dy);
  return fixed_order(g0, m, n, [&](int64_t r, int64_t c) { return d[size_t(r * n + c)]; });
}

// The norm's weight (which == 0) or bias (which == 1) gradient terms: dy * n and dy with
// n = (x - mean) * rstd; mean undefined for RMSNorm.
inline ColumnGrads norm_grad(const Tensor& dy, const Tensor& x, const Tensor* mean,
                             const Tensor& rstd, const std::vector<float>& g0, int which) {
  const int64_t h = x.shape().last(), m = x.shape().leading();
  const std::vector<double> d = doubles(dy), xs = doubles(x), rs = doubles(rstd);
  const std::vector<double> mu = mean ? doubles(*mean) : std::vector<double>(size_t(m), 0.0);
  return fixed_order(g0, m, h, [&](int64_t r, int64_t c) {
    const double dv = d[size_t(r * h + c)];
    if (which == 1) return dv;
    const double nv = (xs[size_t(r * h + c)] - mu[size_t(r)]) * rs[size_t(r)];
    return dv * nv;
  });
}

// Every element of `got` within column_reduce_bound of the CPU reference `cpu`.
inline void expect_within_bound(const std::vector<float>& cpu, const std::vector<float>& got,
                                const std::vector<float>& g0, const ColumnGrads& terms, int64_t m,
                                const std::string& what) {
  ASSERT_EQ(cpu.size(), got.size());
  int bad = 0;
  for (size_t c = 0; c < cpu.size(); ++c) {
    const double tol = detail::column_reduce_bound(cpu[c], g0[c], terms.abs_sum[c], m);
    if (!(std::fabs(static_cast<double>(cpu[c]) - got[c]) <= tol) && ++bad <= 5)
      ADD_FAILURE() << what << "[" << c << "]: cpu " << cpu[c] << " got " << got[c] << " tol "
                    << tol;
  }
  EXPECT_EQ(bad, 0) << what << ": " << bad << " columns outside the bound";
}

}  // namespace meshproof::kernels::column_oracle
