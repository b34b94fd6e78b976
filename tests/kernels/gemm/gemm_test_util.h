// Test-side builders for GEMM operands and an independent fp64 reference.
//
// Quantized operands are built from random VALID byte codes and random scales, independently of
// the quantizers, and every copy (rowwise, columnwise) gets its own independent codes: a GEMM that
// reads the wrong copy then fails the comparison. The reference decodes the codes with its own
// fp64 formulas written from the bit layouts (not the library's decoders).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "kernels/core/tensor.h"
#include "kernels/gemm/gemm.h"
#include "kernels/quantize/quantized_tensor.h"

namespace meshproof::kernels::gemm_test {

enum class Recipe { kFp32, kBf16, kDelayed, kCurrent, kMxfp8, kBlock };

inline const char* recipe_name(Recipe r) {
  switch (r) {
    case Recipe::kFp32:
      return "fp32";
    case Recipe::kBf16:
      return "bf16";
    case Recipe::kDelayed:
      return "delayed";
    case Recipe::kCurrent:
      return "current";
    case Recipe::kMxfp8:
      return "mxfp8";
    case Recipe::kBlock:
      return "block";
  }
  return "?";
}

// ---- independent fp64 decodes: value = (-1)^s * 2^(E - bias) * (1 + m / 2^mbits), or the
// subnormal form 2^(1 - bias) * m / 2^mbits when E == 0 ----
inline double decode_minifloat(uint32_t bits, int ebits, int mbits, int bias) {
  const uint32_t m = bits & ((1u << mbits) - 1);
  const uint32_t e = (bits >> mbits) & ((1u << ebits) - 1);
  const bool neg = (bits >> (ebits + mbits)) & 1u;
  const double frac = static_cast<double>(m) / static_cast<double>(1u << mbits);
  const double v =
      e == 0 ? std::ldexp(frac, 1 - bias) : std::ldexp(1.0 + frac, static_cast<int>(e) - bias);
  return neg ? -v : v;
}
inline double ref_e4m3(uint8_t b) { return decode_minifloat(b, 4, 3, 7); }
inline double ref_e5m2(uint8_t b) { return decode_minifloat(b, 5, 2, 15); }
inline double ref_bf16(uint16_t h) { return decode_minifloat(h, 8, 7, 127); }
inline double ref_fp8(DType f, uint8_t b) { return f == DType::kE4M3 ? ref_e4m3(b) : ref_e5m2(b); }

// A random finite code of `format` (no NaN/inf codes).
inline uint8_t random_fp8_code(DType format, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> byte(0, 255);
  for (;;) {
    const auto b = static_cast<uint8_t>(byte(rng));
    if (format == DType::kE4M3 && (b & 0x7F) == 0x7F) continue;
    if (format == DType::kE5M2 && (b & 0x7C) == 0x7C) continue;
    return b;
  }
}

// An operand plus its decoded logical values as seen through each copy.
struct TestOperand {
  bool quantized = false;
  Tensor hp;
  QuantizedTensor q;
  int64_t rows = 0, cols = 0;
  std::vector<double> row_ref;  // [rows, cols]: values the rowwise copy decodes to
  std::vector<double> col_ref;  // [rows, cols]: values the columnwise copy decodes to (logical)

  GemmOperand op() const {
    if (quantized) return &q;
    return &hp;
  }
  // Host operand -> operand on `device` (copies of every defined tensor).
  TestOperand to(Device device) const {
    TestOperand t = *this;
    auto mv = [&](Tensor& x) {
      if (x.defined()) x = x.to(device);
    };
    mv(t.hp);
    mv(t.q.rowwise_data);
    mv(t.q.rowwise_scale_inv);
    mv(t.q.columnwise_data);
    mv(t.q.columnwise_scale_inv);
    return t;
  }
};

inline Tensor u8_tensor(const Shape& shape, DType dtype, const std::vector<uint8_t>& bytes) {
  Tensor t = Tensor::empty(shape, dtype, Device::cpu());
  std::memcpy(t.raw_data(), bytes.data(), bytes.size());
  return t;
}

// fp32 operand: N(0,1) values.
inline TestOperand make_fp32(int64_t rows, int64_t cols, std::mt19937_64& rng) {
  TestOperand t;
  t.rows = rows;
  t.cols = cols;
  std::normal_distribution<float> nd(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (auto& x : v) x = nd(rng);
  t.hp = Tensor::from_vector<float>(Shape{rows, cols}, v);
  t.row_ref.assign(v.begin(), v.end());
  t.col_ref = t.row_ref;
  return t;
}

// bf16 operand: random sign, exponent in [2^-8, 2^8), random mantissa.
inline TestOperand make_bf16(int64_t rows, int64_t cols, std::mt19937_64& rng) {
  TestOperand t;
  t.rows = rows;
  t.cols = cols;
  std::uniform_int_distribution<int> mant(0, 127), ex(127 - 8, 127 + 7), sign(0, 1);
  std::vector<uint16_t> h(static_cast<size_t>(rows * cols));
  t.row_ref.resize(h.size());
  for (size_t i = 0; i < h.size(); ++i) {
    h[i] = static_cast<uint16_t>((sign(rng) << 15) | (ex(rng) << 7) | mant(rng));
    t.row_ref[i] = ref_bf16(h[i]);
  }
  t.hp = Tensor::empty(Shape{rows, cols}, DType::kBFloat16, Device::cpu());
  std::memcpy(t.hp.raw_data(), h.data(), h.size() * 2);
  t.col_ref = t.row_ref;
  return t;
}

// Per-tensor (delayed/current) operand with independent rowwise [R,C] and columnwise [C,R] codes
// and scale_invs.
inline TestOperand make_per_tensor(ScalingMode mode, DType format, int64_t rows, int64_t cols,
                                   std::mt19937_64& rng) {
  TestOperand t;
  t.quantized = true;
  t.rows = rows;
  t.cols = cols;
  t.q.mode = mode;
  t.q.format = format;
  t.q.logical_shape = Shape{rows, cols};
  std::uniform_real_distribution<float> sd(0.01f, 0.2f);
  const size_t n = static_cast<size_t>(rows * cols);
  std::vector<uint8_t> rc(n), cc(n);
  for (auto& b : rc) b = random_fp8_code(format, rng);
  for (auto& b : cc) b = random_fp8_code(format, rng);
  const float rs = sd(rng), cs = sd(rng);
  t.q.rowwise_data = u8_tensor(Shape{rows, cols}, format, rc);
  t.q.rowwise_scale_inv = Tensor::from_vector<float>(Shape{1}, {rs});
  t.q.columnwise_data = u8_tensor(Shape{cols, rows}, format, cc);  // transposed [C, R]
  t.q.columnwise_scale_inv = Tensor::from_vector<float>(Shape{1}, {cs});
  t.row_ref.resize(n);
  t.col_ref.resize(n);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      t.row_ref[r * cols + c] = ref_fp8(format, rc[r * cols + c]) * static_cast<double>(rs);
      t.col_ref[r * cols + c] = ref_fp8(format, cc[c * rows + r]) * static_cast<double>(cs);
    }
  }
  return t;
}

// MXFP8: rowwise [R,C] codes with E8M0 scales [R, C/32]; columnwise [R,C] codes with [R/32, C].
inline TestOperand make_mxfp8(DType format, int64_t rows, int64_t cols, std::mt19937_64& rng) {
  TestOperand t;
  t.quantized = true;
  t.rows = rows;
  t.cols = cols;
  t.q.mode = ScalingMode::kMxfp8;
  t.q.format = format;
  t.q.logical_shape = Shape{rows, cols};
  std::uniform_int_distribution<int> ed(127 - 10, 127 + 3);  // block scales 2^-10 .. 2^3
  const size_t n = static_cast<size_t>(rows * cols);
  std::vector<uint8_t> rc(n), cc(n), rs(n / 32), cs(n / 32);
  for (auto& b : rc) b = random_fp8_code(format, rng);
  for (auto& b : cc) b = random_fp8_code(format, rng);
  for (auto& e : rs) e = static_cast<uint8_t>(ed(rng));
  for (auto& e : cs) e = static_cast<uint8_t>(ed(rng));
  t.q.rowwise_data = u8_tensor(Shape{rows, cols}, format, rc);
  t.q.rowwise_scale_inv = u8_tensor(Shape{rows, cols / 32}, DType::kE8M0, rs);
  t.q.columnwise_data = u8_tensor(Shape{rows, cols}, format, cc);  // NOT transposed
  t.q.columnwise_scale_inv = u8_tensor(Shape{rows / 32, cols}, DType::kE8M0, cs);
  t.row_ref.resize(n);
  t.col_ref.resize(n);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      const size_t i = static_cast<size_t>(r * cols + c);
      t.row_ref[i] = std::ldexp(ref_fp8(format, rc[i]), rs[r * (cols / 32) + c / 32] - 127);
      t.col_ref[i] = std::ldexp(ref_fp8(format, cc[i]), cs[(r / 32) * cols + c] - 127);
    }
  }
  return t;
}

// Block scaling: 1x128 (activations/gradients) or 128x128 (weights) blocks with power-of-2 fp32
// scales; the columnwise copy is the transpose [C, R] with blocks of the transpose.
inline TestOperand make_block(bool blk128x128, DType format, int64_t rows, int64_t cols,
                              std::mt19937_64& rng) {
  TestOperand t;
  t.quantized = true;
  t.rows = rows;
  t.cols = cols;
  t.q.mode = blk128x128 ? ScalingMode::kBlock128x128 : ScalingMode::kBlock1x128;
  t.q.format = format;
  t.q.logical_shape = Shape{rows, cols};
  std::uniform_int_distribution<int> ed(-10, 3);
  const size_t n = static_cast<size_t>(rows * cols);
  std::vector<uint8_t> rc(n), cc(n);
  for (auto& b : rc) b = random_fp8_code(format, rng);
  for (auto& b : cc) b = random_fp8_code(format, rng);
  auto scales = [&](int64_t sr, int64_t sc) {
    const int64_t a = blk128x128 ? (sr + 127) / 128 : sr;
    const int64_t b = (sc + 127) / 128;
    std::vector<float> s(static_cast<size_t>(a * b));
    for (auto& x : s) x = std::ldexp(1.0f, ed(rng));
    return std::make_pair(Shape{a, b}, s);
  };
  auto [rshape, rs] = scales(rows, cols);
  auto [cshape, cs] = scales(cols, rows);
  t.q.rowwise_data = u8_tensor(Shape{rows, cols}, format, rc);
  t.q.rowwise_scale_inv = Tensor::from_vector<float>(rshape, rs);
  t.q.columnwise_data = u8_tensor(Shape{cols, rows}, format, cc);
  t.q.columnwise_scale_inv = Tensor::from_vector<float>(cshape, cs);
  const int64_t rdiv = blk128x128 ? 128 : 1;
  t.row_ref.resize(n);
  t.col_ref.resize(n);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      t.row_ref[r * cols + c] =
          ref_fp8(format, rc[r * cols + c]) * rs[(r / rdiv) * rshape[1] + c / 128];
      // columnwise stored [C, R]: element (c, r) in block (c / rdiv, r / 128)
      t.col_ref[r * cols + c] =
          ref_fp8(format, cc[c * rows + r]) * cs[(c / rdiv) * cshape[1] + r / 128];
    }
  }
  return t;
}

// An operand of `recipe`; `weight` selects 128x128 blocks for block scaling; `format` is the FP8
// element format (HYBRID: e4m3 for X and W, e5m2 for dY).
inline TestOperand make_operand(Recipe recipe, DType format, bool weight, int64_t rows,
                                int64_t cols, std::mt19937_64& rng) {
  switch (recipe) {
    case Recipe::kFp32:
      return make_fp32(rows, cols, rng);
    case Recipe::kBf16:
      return make_bf16(rows, cols, rng);
    case Recipe::kDelayed:
      return make_per_tensor(ScalingMode::kDelayedTensor, format, rows, cols, rng);
    case Recipe::kCurrent:
      return make_per_tensor(ScalingMode::kCurrentTensor, format, rows, cols, rng);
    case Recipe::kMxfp8:
      return make_mxfp8(format, rows, cols, rng);
    case Recipe::kBlock:
      return make_block(weight, format, rows, cols, rng);
  }
  return {};
}

// fp64 reference C[R,S] and sum|a||b| per element (for the error bound), from the copies each
// role reads: fprop X.row, W.row; dgrad dY.row, W.col; wgrad dY.col, X.col.
struct Reference {
  int64_t rows = 0, cols = 0;
  std::vector<double> value;
  std::vector<double> abs_sum;
};

inline Reference reference(GemmRole role, const TestOperand& a, const TestOperand& b) {
  Reference ref;
  // Express every role as C[i,j] = sum_k A(i,k) B(j,k) over logical values.
  int64_t R = 0, S = 0, K = 0;
  std::function<double(int64_t, int64_t)> fa, fb;
  switch (role) {
    case GemmRole::kFprop:  // a = X[M,K], b = W[N,K]
      R = a.rows, S = b.rows, K = a.cols;
      fa = [&](int64_t i, int64_t k) { return a.row_ref[i * a.cols + k]; };
      fb = [&](int64_t j, int64_t k) { return b.row_ref[j * b.cols + k]; };
      break;
    case GemmRole::kDgrad:  // a = dY[M,N], b = W[N,K]: dX[m,k] = sum_n dY[m,n] W[n,k]
      R = a.rows, S = b.cols, K = a.cols;
      fa = [&](int64_t i, int64_t k) { return a.row_ref[i * a.cols + k]; };
      fb = [&](int64_t j, int64_t k) { return b.col_ref[k * b.cols + j]; };
      break;
    case GemmRole::kWgrad:  // a = dY[M,N], b = X[M,K]: dW[n,k] = sum_m dY[m,n] X[m,k]
      R = a.cols, S = b.cols, K = a.rows;
      fa = [&](int64_t i, int64_t k) { return a.col_ref[k * a.cols + i]; };
      fb = [&](int64_t j, int64_t k) { return b.col_ref[k * b.cols + j]; };
      break;
  }
  ref.rows = R;
  ref.cols = S;
  ref.value.assign(static_cast<size_t>(R * S), 0.0);
  ref.abs_sum.assign(static_cast<size_t>(R * S), 0.0);
  for (int64_t i = 0; i < R; ++i) {
    for (int64_t j = 0; j < S; ++j) {
      double s = 0.0, as = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const double p = fa(i, k) * fb(j, k);
        s += p;
        as += std::fabs(p);
      }
      ref.value[i * S + j] = s;
      ref.abs_sum[i * S + j] = as;
    }
  }
  return ref;
}

inline void run_role(GemmRole role, const TestOperand& a, const TestOperand& b, Tensor& out,
                     const GemmOptions& opt = {}) {
  switch (role) {
    case GemmRole::kFprop:
      gemm_fprop(a.op(), b.op(), out, opt);
      break;
    case GemmRole::kDgrad:
      gemm_dgrad(a.op(), b.op(), out, opt);
      break;
    case GemmRole::kWgrad:
      gemm_wgrad(a.op(), b.op(), out, opt);
      break;
  }
}

// Output values as double (fp32 or bf16 output, any device).
inline std::vector<double> output_values(const Tensor& out) {
  Tensor h = out.device().is_cpu() ? out : out.to(Device::cpu());
  std::vector<double> v(static_cast<size_t>(h.numel().value));
  if (h.dtype() == DType::kFloat32) {
    const float* p = h.data<float>();
    for (size_t i = 0; i < v.size(); ++i) v[i] = p[i];
  } else {
    const auto* p = static_cast<const uint16_t*>(h.raw_data());
    for (size_t i = 0; i < v.size(); ++i) v[i] = ref_bf16(p[i]);
  }
  return v;
}

}  // namespace meshproof::kernels::gemm_test
