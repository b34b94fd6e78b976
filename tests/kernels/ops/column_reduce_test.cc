// The CUDA per-column reductions' order (kernels/ops/column_reduce.h), proven on the host: every
// row is summed exactly once for any m (chunk and lane edges included), and the fixed-order result
// of bias_grad and of the LayerNorm/RMSNorm weight gradients stays within column_reduce_bound of
// the CPU reference (whose serial row sums it replaces on the device). The device's bits against
// this same host order are checked in tests/kernels/ops/ops_cuda_test.cc (label gpu).
#include <gtest/gtest.h>

#include <random>

#include "kernels/ops/elementwise.h"
#include "kernels/ops/layernorm.h"
#include "tests/kernels/ops/column_reduce_oracle.h"

namespace meshproof::kernels {
namespace {

using column_oracle::ColumnGrads;
using column_oracle::random_tensor;

TEST(ColumnReduce, EveryRowOnceForAnyRowCount) {
  // Integers below 2^53 sum exactly in any order: the fixed order must give sum r and the count.
  for (int64_t m : {0, 1, 7, 8, 9, 255, 256, 257, 511, 512, 1000, 2049}) {
    EXPECT_EQ(detail::column_sum_fixed_order(m, [](int64_t) { return 1.0; }),
              static_cast<double>(m));
    EXPECT_EQ(detail::column_sum_fixed_order(m, [](int64_t r) { return static_cast<double>(r); }),
              static_cast<double>(m * (m - 1) / 2));
    EXPECT_EQ(detail::column_chunks(m), (m + 255) / 256);
  }
}

// The order really differs from the serial sum (so the bound is needed, not decoration): with
// 1 + 2^-53 terms the serial sum from 1.0 never moves, while lanes of small terms do.
TEST(ColumnReduce, OrderDiffersFromTheSerialSum) {
  const int64_t m = 300;
  auto term = [](int64_t r) { return r == 0 ? 1.0 : std::ldexp(1.0, -53); };
  double serial = 0;
  for (int64_t r = 0; r < m; ++r) serial += term(r);
  EXPECT_EQ(serial, 1.0);
  EXPECT_GT(detail::column_sum_fixed_order(m, term), 1.0);
}

// m = 777 rows: three full chunks and a partial one, lanes of unequal length.
TEST(ColumnReduce, BiasGradWithinTheBoundOfTheCpu) {
  const int64_t m = 777, n = 45;
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    const Tensor dy = random_tensor({m, n}, dt, 21, 3.0);
    const Tensor g0 = random_tensor({n}, DType::kFloat32, 22);
    Tensor cpu = g0.clone();
    bias_grad(dy, cpu);
    const std::vector<float> g0v = g0.to_vector<float>();
    const ColumnGrads fixed = column_oracle::bias_grad(dy, g0v);
    column_oracle::expect_within_bound(cpu.to_vector<float>(), fixed.grad, g0v, fixed, m,
                                       "bias_grad");
  }
}

TEST(ColumnReduce, NormWeightGradsWithinTheBoundOfTheCpu) {
  const int64_t m = 600, h = 70;
  for (DType dt : {DType::kFloat32, DType::kBFloat16}) {
    const Tensor x = random_tensor({m, h}, dt, 23, 2.0), w = random_tensor({h}, dt, 24);
    const Tensor b = random_tensor({h}, dt, 25), dy = random_tensor({m, h}, dt, 26);
    Tensor y = Tensor::empty({m, h}, dt, Device::cpu()),
           mean = Tensor::empty({m}, dt, Device::cpu()),
           rstd = Tensor::empty({m}, dt, Device::cpu()),
           dx = Tensor::empty({m, h}, dt, Device::cpu());
    layernorm_forward(x, w, b, 1e-5, y, mean, rstd);
    const Tensor dw0 = random_tensor({h}, DType::kFloat32, 27),
                 db0 = random_tensor({h}, DType::kFloat32, 28);
    Tensor dw = dw0.clone(), db = db0.clone();
    layernorm_backward(dy, x, w, mean, rstd, dx, dw, db);
    const std::vector<float> dw0v = dw0.to_vector<float>(), db0v = db0.to_vector<float>();
    const ColumnGrads fw = column_oracle::norm_grad(dy, x, &mean, rstd, dw0v, 0);
    const ColumnGrads fb = column_oracle::norm_grad(dy, x, &mean, rstd, db0v, 1);
    column_oracle::expect_within_bound(dw.to_vector<float>(), fw.grad, dw0v, fw, m, "ln dweight");
    column_oracle::expect_within_bound(db.to_vector<float>(), fb.grad, db0v, fb, m, "ln dbias");

    rmsnorm_forward(x, w, 1e-5, y, rstd);
    dw = dw0.clone();
    rmsnorm_backward(dy, x, w, rstd, dx, dw);
    const ColumnGrads fr = column_oracle::norm_grad(dy, x, nullptr, rstd, dw0v, 0);
    column_oracle::expect_within_bound(dw.to_vector<float>(), fr.grad, dw0v, fr, m, "rms dweight");
  }
}

}  // namespace
}  // namespace meshproof::kernels
