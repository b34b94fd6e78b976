// The CPU quantizers as they were before vectorisation (main 39e0ea6,
// then kernels/quantize.cc): the element-wise rules:: loops, kept as the oracle that the
// vectorised quantizers must equal byte for byte (docs/design.md section 21) and as the benchmarks'
// same-run baseline. CPU only; the input checks are the library's (the oracle is only called on
// valid inputs).
#pragma once

#include <algorithm>
#include <cstdint>

#include "kernels/quantize/quantize.h"
#include "kernels/quantize/quantize_rules.h"

namespace meshproof::kernels::quantize_oracle {

inline uint8_t* bytes(Tensor& t) { return static_cast<uint8_t*>(t.raw_data()); }

inline Tensor compute_amax(const Tensor& x) {
  Tensor out = Tensor::empty({1}, DType::kFloat32, Device::cpu());
  const uint32_t a =
      rules::block_amax_bits(x.raw_data(), x.dtype() == DType::kBFloat16, 0, 1, x.numel().value);
  out.data<float>()[0] = fmt8::bits_float(a);
  return out;
}

inline QuantizedTensor quantize_per_tensor(const Tensor& x, const Tensor& scale, DType format,
                                           Usage usage, ScalingMode mode) {
  const bool bf16 = x.dtype() == DType::kBFloat16;
  const bool e5m2 = format == DType::kE5M2;
  const int64_t M = x.shape().leading();
  const int64_t K = x.shape().last();
  QuantizedTensor q;
  q.mode = mode;
  q.format = format;
  q.logical_shape = Shape{M, K};
  Tensor scale_inv = Tensor::empty({1}, DType::kFloat32, Device::cpu());
  if (usage.rowwise) q.rowwise_data = Tensor::empty({M, K}, format, Device::cpu());
  if (usage.columnwise) q.columnwise_data = Tensor::empty({K, M}, format, Device::cpu());
  uint8_t* row = usage.rowwise ? bytes(q.rowwise_data) : nullptr;
  uint8_t* col = usage.columnwise ? bytes(q.columnwise_data) : nullptr;
  const float s = scale.data<float>()[0];
  scale_inv.data<float>()[0] = rules::reciprocal(s);
  const void* xp = x.raw_data();
  for (int64_t m = 0; m < M; ++m) {
    if (row) rules::cast_block(xp, bf16, m * K, 1, K, s, e5m2, row, m * K, 1);
    if (col) rules::cast_block(xp, bf16, m * K, 1, K, s, e5m2, col, m, M);
  }
  if (usage.rowwise) q.rowwise_scale_inv = scale_inv;
  if (usage.columnwise) q.columnwise_scale_inv = scale_inv;
  return q;
}

inline QuantizedTensor quantize_mxfp8(const Tensor& x, DType format, Usage usage) {
  const bool bf16 = x.dtype() == DType::kBFloat16;
  const bool e5m2 = format == DType::kE5M2;
  const int64_t M = x.shape().leading();
  const int64_t K = x.shape().last();
  QuantizedTensor q;
  q.mode = ScalingMode::kMxfp8;
  q.format = format;
  q.logical_shape = Shape{M, K};
  const void* xp = x.raw_data();
  if (usage.rowwise) {
    q.rowwise_data = Tensor::empty({M, K}, format, Device::cpu());
    q.rowwise_scale_inv = Tensor::empty({M, K / 32}, DType::kE8M0, Device::cpu());
    uint8_t* row = bytes(q.rowwise_data);
    uint8_t* row_s = bytes(q.rowwise_scale_inv);
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t kb = 0; kb < K / 32; ++kb) {
        const int64_t base = m * K + kb * 32;
        const float amax = fmt8::bits_float(rules::block_amax_bits(xp, bf16, base, 1, 32));
        const uint8_t e = rules::mxfp8_scale_exponent(amax, e5m2);
        row_s[m * (K / 32) + kb] = e;
        rules::cast_block(xp, bf16, base, 1, 32, fmt8::e8m0_reciprocal(e), e5m2, row, base, 1);
      }
    }
  }
  if (usage.columnwise) {
    q.columnwise_data = Tensor::empty({M, K}, format, Device::cpu());
    q.columnwise_scale_inv = Tensor::empty({M / 32, K}, DType::kE8M0, Device::cpu());
    uint8_t* col = bytes(q.columnwise_data);
    uint8_t* col_s = bytes(q.columnwise_scale_inv);
    for (int64_t mb = 0; mb < M / 32; ++mb) {
      for (int64_t k = 0; k < K; ++k) {
        const int64_t base = mb * 32 * K + k;
        const float amax = fmt8::bits_float(rules::block_amax_bits(xp, bf16, base, K, 32));
        const uint8_t e = rules::mxfp8_scale_exponent(amax, e5m2);
        col_s[mb * K + k] = e;
        rules::cast_block(xp, bf16, base, K, 32, fmt8::e8m0_reciprocal(e), e5m2, col, base, K);
      }
    }
  }
  return q;
}

inline QuantizedTensor quantize_block(const Tensor& x, ScalingMode mode, DType format, Usage usage,
                                      bool pow2, float eps) {
  const bool bf16 = x.dtype() == DType::kBFloat16;
  const bool e5m2 = format == DType::kE5M2;
  const bool tile = mode == ScalingMode::kBlock128x128;
  const int64_t M = x.shape().leading();
  const int64_t K = x.shape().last();
  const int64_t mb = (M + 127) / 128;
  const int64_t kb = (K + 127) / 128;
  QuantizedTensor q;
  q.mode = mode;
  q.format = format;
  q.logical_shape = Shape{M, K};
  uint8_t* row = nullptr;
  float* row_s = nullptr;
  uint8_t* col = nullptr;
  float* col_s = nullptr;
  if (usage.rowwise) {
    q.rowwise_data = Tensor::empty({M, K}, format, Device::cpu());
    q.rowwise_scale_inv =
        Tensor::empty(tile ? Shape{mb, kb} : Shape{M, kb}, DType::kFloat32, Device::cpu());
    row = bytes(q.rowwise_data);
    row_s = q.rowwise_scale_inv.data<float>();
  }
  if (usage.columnwise) {
    q.columnwise_data = Tensor::empty({K, M}, format, Device::cpu());
    q.columnwise_scale_inv =
        Tensor::empty(tile ? Shape{kb, mb} : Shape{K, mb}, DType::kFloat32, Device::cpu());
    col = bytes(q.columnwise_data);
    col_s = q.columnwise_scale_inv.data<float>();
  }
  const void* xp = x.raw_data();
  if (tile) {
    for (int64_t bi = 0; bi < mb; ++bi) {
      for (int64_t bj = 0; bj < kb; ++bj) {
        const int64_t m0 = bi * 128;
        const int64_t k0 = bj * 128;
        const int64_t rows = std::min<int64_t>(128, M - m0);
        const int64_t cols = std::min<int64_t>(128, K - k0);
        uint32_t a = 0;
        for (int64_t m = m0; m < m0 + rows; ++m) {
          const uint32_t b = rules::block_amax_bits(xp, bf16, m * K + k0, 1, cols);
          a = b > a ? b : a;
        }
        const float s = rules::block_scale(fmt8::bits_float(a), e5m2, eps, pow2);
        const float s_inv = rules::reciprocal(s);
        if (row) row_s[bi * kb + bj] = s_inv;
        if (col) col_s[bj * mb + bi] = s_inv;
        for (int64_t m = m0; m < m0 + rows; ++m) {
          if (row) rules::cast_block(xp, bf16, m * K + k0, 1, cols, s, e5m2, row, m * K + k0, 1);
          if (col) rules::cast_block(xp, bf16, m * K + k0, 1, cols, s, e5m2, col, k0 * M + m, M);
        }
      }
    }
    return q;
  }
  if (row) {
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t j = 0; j < kb; ++j) {
        const int64_t base = m * K + j * 128;
        const int64_t n = std::min<int64_t>(128, K - j * 128);
        const float s = rules::block_scale(
            fmt8::bits_float(rules::block_amax_bits(xp, bf16, base, 1, n)), e5m2, eps, pow2);
        row_s[m * kb + j] = rules::reciprocal(s);
        rules::cast_block(xp, bf16, base, 1, n, s, e5m2, row, base, 1);
      }
    }
  }
  if (col) {
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t i = 0; i < mb; ++i) {
        const int64_t base = i * 128 * K + k;
        const int64_t n = std::min<int64_t>(128, M - i * 128);
        const float s = rules::block_scale(
            fmt8::bits_float(rules::block_amax_bits(xp, bf16, base, K, n)), e5m2, eps, pow2);
        col_s[k * mb + i] = rules::reciprocal(s);
        rules::cast_block(xp, bf16, base, K, n, s, e5m2, col, k * M + i * 128, 1);
      }
    }
  }
  return q;
}

}  // namespace meshproof::kernels::quantize_oracle
