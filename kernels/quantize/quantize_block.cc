// Block-scaled FP8 quantization (1x128 blocks, and 128x128 tiles whose one scale the rowwise and
// the transposed columnwise copy share), CPU reference and dispatch to the CUDA launchers
// (quantize.cu): block amaxes, rules::block_scale per block, the cast in row order and the byte
// transpose of the columnwise copy's bands and tiles. The CPU loops are the vectorisable blocks
// of quantize_cast.cc, bitwise equal to the rules of quantize_rules.h.
#include <algorithm>
#include <cmath>
#include <vector>

#include "kernels/ops/op_util.h"
#include "kernels/quantize/quantize.h"
#include "kernels/quantize/quantize_internal.h"
#include "kernels/quantize/quantize_rules.h"

namespace meshproof::kernels {

namespace {

using detail::amax_contiguous;
using detail::block_amaxes;
using detail::cast_blocks;
using detail::cast_contiguous;
using detail::col_amax_row;
using detail::is_e5m2;
using detail::scratch_bytes;
using detail::transpose_bytes;

}  // namespace

QuantizedTensor quantize_block(const Tensor& x, ScalingMode mode, DType format, Usage usage,
                               bool pow2, float eps) {
  const bool bf16 = detail::check_quantizer_input(x, "quantize_block");
  const bool e5m2 = is_e5m2(format);
  MP_CHECK_INPUT(std::isfinite(eps) && eps >= 0.0f, "quantize_block: eps must be >= 0, got {}",
                 eps);
  MP_CHECK_INPUT(mode == ScalingMode::kBlock1x128 || mode == ScalingMode::kBlock128x128,
                 "quantize_block: mode must be block_1x128 or block_128x128, got {}",
                 scaling_mode_name(mode));
  MP_CHECK_INPUT(usage.rowwise || usage.columnwise, "quantize_block: no copy requested");
  const bool tile = mode == ScalingMode::kBlock128x128;
  const int64_t M = x.shape().leading();
  const int64_t K = x.shape().last();
  const int64_t mb = (M + 127) / 128;
  const int64_t kb = (K + 127) / 128;
  const Device dev = x.device();
  QuantizedTensor q;
  q.mode = mode;
  q.format = format;
  q.logical_shape = Shape{M, K};
  uint8_t* row = nullptr;
  float* row_s = nullptr;
  uint8_t* col = nullptr;
  float* col_s = nullptr;
  if (usage.rowwise) {
    q.rowwise_data = Tensor::empty({M, K}, format, dev);
    q.rowwise_scale_inv = Tensor::empty(tile ? Shape{mb, kb} : Shape{M, kb}, DType::kFloat32, dev);
    row = static_cast<uint8_t*>(q.rowwise_data.raw_data());
    row_s = q.rowwise_scale_inv.data<float>();
  }
  if (usage.columnwise) {
    q.columnwise_data = Tensor::empty({K, M}, format, dev);
    q.columnwise_scale_inv =
        Tensor::empty(tile ? Shape{kb, mb} : Shape{K, mb}, DType::kFloat32, dev);
    col = static_cast<uint8_t*>(q.columnwise_data.raw_data());
    col_s = q.columnwise_scale_inv.data<float>();
  }
  const void* xp = x.raw_data();
  if (dev.is_cuda()) {
    MP_CUDA_DISPATCH(launch_quantize_block(xp, bf16, M, K, tile, e5m2, eps, pow2, row, row_s, col,
                                           col_s, detail::cuda_stream()));
    return q;
  }
  if (tile) {
    // One scale per 128x128 tile, shared by the rowwise copy and the transposed copy.
    for (int64_t bi = 0; bi < mb; ++bi) {
      for (int64_t bj = 0; bj < kb; ++bj) {
        const int64_t m0 = bi * 128;
        const int64_t k0 = bj * 128;
        const int64_t rows = std::min<int64_t>(128, M - m0);
        const int64_t cols = std::min<int64_t>(128, K - k0);
        uint32_t a = 0;
        for (int64_t m = m0; m < m0 + rows; ++m) {
          const uint32_t b = amax_contiguous(xp, bf16, m * K + k0, cols);
          a = b > a ? b : a;
        }
        const float s = rules::block_scale(fmt8::bits_float(a), e5m2, eps, pow2);
        const float s_inv = rules::reciprocal(s);
        if (row) row_s[bi * kb + bj] = s_inv;
        if (col) col_s[bj * mb + bi] = s_inv;
        // Both copies share the tile's scale, so the transposed copy is the tile's codes
        // transposed: cast in row order (into the rowwise copy, or a 128x128 scratch tile).
        uint8_t* tile_codes = row ? row + m0 * K + k0 : scratch_bytes(128 * 128);
        const int64_t stride = row ? K : 128;
        for (int64_t m = m0; m < m0 + rows; ++m)
          cast_contiguous(xp, bf16, m * K + k0, cols, &s, false, e5m2,
                          tile_codes + (m - m0) * stride);
        if (col) transpose_bytes(tile_codes, stride, rows, cols, col + k0 * M + m0, M);
      }
    }
    return q;
  }
  if (row) {
    std::vector<uint32_t> amax(static_cast<size_t>(kb));
    std::vector<float> mult(static_cast<size_t>(kb));
    for (int64_t m = 0; m < M; ++m) {
      block_amaxes(xp, bf16, m * K, K, 128, amax.data());
      for (int64_t j = 0; j < kb; ++j) {
        mult[j] = rules::block_scale(fmt8::bits_float(amax[j]), e5m2, eps, pow2);
        row_s[m * kb + j] = rules::reciprocal(mult[j]);
      }
      cast_blocks(xp, bf16, m * K, K, 128, mult.data(), e5m2, row + m * K);
    }
  }
  if (col) {
    // 1x128 blocks of the transpose: 128 consecutive rows m of one column k. Per band of 128
    // rows: per-column running maxima, the column scales, the band cast in row order with its
    // column's multiplier into scratch, then transposed into the [K, M] copy.
    std::vector<uint32_t> amax(static_cast<size_t>(K));
    std::vector<float> mult(static_cast<size_t>(K));
    uint8_t* band = scratch_bytes(static_cast<size_t>(128 * K));
    for (int64_t i = 0; i < mb; ++i) {
      const int64_t m0 = i * 128;
      const int64_t n = std::min<int64_t>(128, M - m0);
      std::fill(amax.begin(), amax.end(), 0u);
      for (int64_t r = 0; r < n; ++r) col_amax_row(xp, bf16, (m0 + r) * K, K, amax.data());
      for (int64_t k = 0; k < K; ++k) {
        mult[k] = rules::block_scale(fmt8::bits_float(amax[k]), e5m2, eps, pow2);
        col_s[k * mb + i] = rules::reciprocal(mult[k]);
      }
      for (int64_t r = 0; r < n; ++r)
        cast_contiguous(xp, bf16, (m0 + r) * K, K, mult.data(), true, e5m2, band + r * K);
      transpose_bytes(band, K, n, K, col + m0, M);
    }
  }
  return q;
}

}  // namespace meshproof::kernels
