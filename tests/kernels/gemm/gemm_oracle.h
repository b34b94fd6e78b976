// The CPU GEMM as it was before the packed kernels (main 39e0ea6, then kernels/gemm.cc), kept
// verbatim as the oracle: the packed GEMM must be BITWISE equal to it (docs/design.md section 21),
// and the benchmarks measure their speed against it in the same run. Decode every operand to fp32
// with the per-element formats.h decoders and std::ldexp, transpose as a separate copy, then sum
// each c[i][j] = +0 + a[i][0] b[0][j] + ... in k order with tiles of 4 x 64 accumulators.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/core/formats.h"
#include "kernels/gemm/gemm_internal.h"

namespace meshproof::kernels::gemm_oracle {

using detail::GemmSide;

inline float decode_fp8(DType format, uint8_t b) {
  return format == DType::kE4M3 ? fmt8::e4m3_to_float(b) : fmt8::e5m2_to_float(b);
}

// Decodes the stored matrix (`rows` x `cols`, row-major) of one quantized copy to fp32.
inline std::vector<float> decode_stored(const QuantizedTensor& q, const Tensor& data,
                                        const Tensor& sinv, bool columnwise) {
  const int64_t rows = data.shape().leading();
  const int64_t cols = data.shape().last();
  const auto* codes = static_cast<const uint8_t*>(data.raw_data());
  std::vector<float> out(static_cast<size_t>(rows * cols));
  auto at = [&](int64_t r, int64_t c) { return decode_fp8(q.format, codes[r * cols + c]); };
  switch (q.mode) {
    case ScalingMode::kDelayedTensor:
    case ScalingMode::kCurrentTensor: {
      const float s = *sinv.data<float>();
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c) out[r * cols + c] = at(r, c) * s;
      break;
    }
    case ScalingMode::kMxfp8: {
      const auto* e8 = static_cast<const uint8_t*>(sinv.raw_data());
      const int64_t scols = sinv.shape()[1];
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) {
          const uint8_t e = columnwise ? e8[(r / 32) * scols + c] : e8[r * scols + c / 32];
          out[r * cols + c] = e == 0xFF ? std::numeric_limits<float>::quiet_NaN()
                                        : std::ldexp(at(r, c), static_cast<int>(e) - 127);
        }
      }
      break;
    }
    case ScalingMode::kBlock1x128:
    case ScalingMode::kBlock128x128: {
      const float* s = sinv.data<float>();
      const int64_t scols = sinv.shape()[1];
      const int64_t rdiv = q.mode == ScalingMode::kBlock1x128 ? 1 : 128;
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t c = 0; c < cols; ++c)
          out[r * cols + c] = at(r, c) * s[(r / rdiv) * scols + c / 128];
      break;
    }
    case ScalingMode::kNvfp4:
      break;
  }
  return out;
}

inline std::vector<float> transpose(const std::vector<float>& v, int64_t rows, int64_t cols) {
  std::vector<float> t(v.size());
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = v[r * cols + c];
  return t;
}

// The side's canonical matrix ([rows, k]), or its transpose when `want_k_major` is false.
inline std::vector<float> decode_side(const GemmSide& side, bool want_k_major) {
  std::vector<float> v;
  int64_t rows = 0;
  int64_t cols = 0;
  bool v_is_logical = true;
  if (const auto* tp = std::get_if<const Tensor*>(&side.op)) {
    const Tensor& t = **tp;
    rows = t.shape().leading();
    cols = t.shape().last();
    v.resize(static_cast<size_t>(rows * cols));
    if (t.dtype() == DType::kFloat32) {
      std::copy_n(t.data<float>(), v.size(), v.begin());
    } else {
      const auto* h = static_cast<const uint16_t*>(t.raw_data());
      for (size_t i = 0; i < v.size(); ++i) v[i] = fmt8::bf16_to_float(h[i]);
    }
  } else {
    const QuantizedTensor& q = *std::get<const QuantizedTensor*>(side.op);
    const Tensor& data = side.transposed ? q.columnwise_data : q.rowwise_data;
    const Tensor& sinv = side.transposed ? q.columnwise_scale_inv : q.rowwise_scale_inv;
    v = decode_stored(q, data, sinv, side.transposed);
    rows = data.shape().leading();
    cols = data.shape().last();
    v_is_logical = !(side.transposed && q.mode != ScalingMode::kMxfp8);
  }
  const bool v_is_canonical = side.transposed ? !v_is_logical : v_is_logical;
  const bool want_v = want_k_major ? v_is_canonical : !v_is_canonical;
  return want_v ? v : transpose(v, rows, cols);
}

// c[R, S] = a[R, K] · bt[K, S]: the 4 x 64 tile loop, each c[i][j] summed over k in order.
__attribute__((target_clones("avx2", "default"))) inline void gemm_tiles_f32(const float* a,
                                                                             const float* bt,
                                                                             float* c, int64_t R,
                                                                             int64_t S, int64_t K) {
  constexpr int64_t kRowBlock = 4, kColBlock = 64;
  float acc[kRowBlock][kColBlock];
  for (int64_t i0 = 0; i0 < R; i0 += kRowBlock) {
    const int64_t rows = std::min(R - i0, kRowBlock);
    for (int64_t j0 = 0; j0 < S; j0 += kColBlock) {
      const int64_t cols = std::min(S - j0, kColBlock);
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < cols; ++j) acc[i][j] = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        const float* brow = bt + k * S + j0;
        for (int64_t i = 0; i < rows; ++i) {
          const float av = a[(i0 + i) * K + k];
          float* arow = acc[i];
          for (int64_t j = 0; j < cols; ++j) arow[j] += av * brow[j];
        }
      }
      for (int64_t i = 0; i < rows; ++i) std::copy_n(acc[i], cols, c + (i0 + i) * S + j0);
    }
  }
}

// The old gemm_cpu: out (fp32, fp32 += or bf16 RNE) for the validated problem.
inline void gemm_cpu(const detail::GemmProblem& p, Tensor& out, bool accumulate) {
  const int64_t R = p.r, S = p.s, K = p.k;
  const std::vector<float> a = decode_side(p.a, true);
  const std::vector<float> bt = decode_side(p.b, false);
  std::vector<float> c(static_cast<size_t>(R * S), 0.0f);
  gemm_tiles_f32(a.data(), bt.data(), c.data(), R, S, K);
  const size_t n = c.size();
  if (out.dtype() == DType::kFloat32) {
    float* o = out.data<float>();
    if (accumulate) {
      for (size_t i = 0; i < n; ++i) o[i] += c[i];
    } else {
      std::copy(c.begin(), c.end(), o);
    }
  } else {
    auto* o = static_cast<uint16_t*>(out.raw_data());
    for (size_t i = 0; i < n; ++i) o[i] = fmt8::float_to_bf16(c[i]);
  }
}

// The canonical problem of each role (as gemm_fprop/dgrad/wgrad build it), for 2-D operands.
inline detail::GemmProblem problem(GemmRole role, GemmOperand a, int64_t a_rows, int64_t a_cols,
                                   GemmOperand b, int64_t b_rows, int64_t b_cols) {
  switch (role) {
    case GemmRole::kFprop:  // X[M,K], W[N,K]
      return {role, {a, false, "X"}, {b, false, "W"}, a_rows, b_rows, a_cols};
    case GemmRole::kDgrad:  // dY[M,N], W[N,K]
      return {role, {a, false, "dY"}, {b, true, "W"}, a_rows, b_cols, a_cols};
    case GemmRole::kWgrad:  // dY[M,N], X[M,K]
      return {role, {a, true, "dY"}, {b, true, "X"}, a_cols, b_cols, a_rows};
  }
  return {};
}

}  // namespace meshproof::kernels::gemm_oracle
