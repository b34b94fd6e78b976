// Per-column reductions of the CUDA backend (bias gradients, LayerNorm/RMSNorm weight and bias
// gradients): the fixed summation order the device kernels use (kernels/ops/column_reduce.cuh), and
// the same order on the host so that tests can check the device's bits without a device-side
// oracle and prove the bound against the CPU reference on any machine.
//
// Order, for each column c over the m rows (all in double, every addition rounded, no FMA):
//   rows are cut into chunks of kColumnChunkRows; in chunk k, lane y (0 <= y < kColumnLanes) sums
//   the rows begin + y, begin + y + kColumnLanes, ... in increasing order from 0.0; the chunk's
//   partial is 0.0 + lane 0 + lane 1 + ... + lane 7; the total is 0.0 + chunk 0 + chunk 1 + ...;
//   the gradient becomes float(double(g[c]) + total).
// The order depends on m alone (never on the device or the launch), so reruns are bitwise equal.
// The CPU reference sums the rows serially instead; both are within (m - 1) * 2^-53 * sum|t_r| of
// the exact sum, so the two float results differ by at most
//   column_reduce_bound = 1 ulp of float32 at the result + 2 * m * 2^-53 * (|g[c]| + sum_r |t_r|).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace meshproof::kernels::detail {

inline constexpr int kColumnTile = 32;              // columns per block (threadIdx.x)
inline constexpr int kColumnLanes = 8;              // row lanes per block (threadIdx.y)
inline constexpr int64_t kColumnChunkRows = 256;    // rows per chunk (blockIdx.y)
inline constexpr int64_t kColumnMaxChunks = 65535;  // gridDim.y limit: m <= 16,776,960 rows

inline int64_t column_chunks(int64_t m) { return (m + kColumnChunkRows - 1) / kColumnChunkRows; }

// The device's sum over rows 0..m-1 of term(r) (a double), in the order above.
template <typename Term>
double column_sum_fixed_order(int64_t m, const Term& term) {
  double total = 0.0;
  for (int64_t begin = 0; begin < m; begin += kColumnChunkRows) {
    const int64_t end = std::min(m, begin + kColumnChunkRows);
    double chunk = 0.0;
    for (int y = 0; y < kColumnLanes; ++y) {
      double lane = 0.0;
      for (int64_t r = begin + y; r < end; r += kColumnLanes) lane += term(r);
      chunk += lane;
    }
    total += chunk;
  }
  return total;
}

// The largest |device - CPU| of one float32 gradient element (derivation above): `result` the CPU
// value, `g0` the gradient before the call, `abs_sum` = sum_r |t_r|.
inline double column_reduce_bound(float result, float g0, double abs_sum, int64_t m) {
  const double ulp = std::ldexp(1.0, std::ilogb(std::fmax(std::fabs(result), 1e-38f)) - 23);
  return ulp + 2.0 * static_cast<double>(m) * std::ldexp(1.0, -53) *
                   (std::fabs(static_cast<double>(g0)) + abs_sum);
}

}  // namespace meshproof::kernels::detail
