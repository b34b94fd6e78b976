// MXFP8 quantization (1x32 blocks of the rowwise copy, 32x1 blocks of the columnwise copy, one
// E8M0 scale per block), CPU reference and dispatch to the CUDA launchers (quantize.cu), and the
// MXFP8 scale layouts of cuBLASLt: the compact scales zero-padded to 128x4 tiles and swizzled
// within each tile. The CPU loops are the vectorisable blocks of quantize_cast.cc, bitwise equal
// to the rules of quantize_rules.h.
#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/ops/op_util.h"
#include "kernels/quantize/quantize.h"
#include "kernels/quantize/quantize_internal.h"
#include "kernels/quantize/quantize_rules.h"

namespace meshproof::kernels {

namespace {

using detail::block_amaxes;
using detail::cast_blocks;
using detail::cast_contiguous;
using detail::col_amax_row;
using detail::is_e5m2;

int64_t roundup(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
}  // namespace

QuantizedTensor quantize_mxfp8(const Tensor& x, DType format, Usage usage) {
  const bool bf16 = detail::check_quantizer_input(x, "quantize_mxfp8");
  const bool e5m2 = is_e5m2(format);
  MP_CHECK_INPUT(usage.rowwise || usage.columnwise, "quantize_mxfp8: no copy requested");
  const int64_t M = x.shape().leading();
  const int64_t K = x.shape().last();
  MP_CHECK_INPUT(K % 32 == 0 && M % 32 == 0,
                 "quantize_mxfp8: tensor {} (M={}, K={}) is not MXFP8-quantizable: needs the last "
                 "dim K and the product of the leading dims M to be multiples of 32",
                 x.describe(), M, K);
  const Device dev = x.device();
  QuantizedTensor q;
  q.mode = ScalingMode::kMxfp8;
  q.format = format;
  q.logical_shape = Shape{M, K};
  uint8_t* row = nullptr;
  uint8_t* row_s = nullptr;
  uint8_t* col = nullptr;
  uint8_t* col_s = nullptr;
  if (usage.rowwise) {
    q.rowwise_data = Tensor::empty({M, K}, format, dev);
    q.rowwise_scale_inv = Tensor::empty({M, K / 32}, DType::kE8M0, dev);
    row = static_cast<uint8_t*>(q.rowwise_data.raw_data());
    row_s = static_cast<uint8_t*>(q.rowwise_scale_inv.raw_data());
  }
  if (usage.columnwise) {
    q.columnwise_data = Tensor::empty({M, K}, format, dev);
    q.columnwise_scale_inv = Tensor::empty({M / 32, K}, DType::kE8M0, dev);
    col = static_cast<uint8_t*>(q.columnwise_data.raw_data());
    col_s = static_cast<uint8_t*>(q.columnwise_scale_inv.raw_data());
  }
  const void* xp = x.raw_data();
  if (dev.is_cuda()) {
    MP_CUDA_DISPATCH(
        launch_quantize_mxfp8(xp, bf16, M, K, e5m2, row, row_s, col, col_s, detail::cuda_stream()));
    return q;
  }
  if (row) {
    std::vector<uint32_t> amax(static_cast<size_t>(K / 32));
    std::vector<float> mult(static_cast<size_t>(K / 32));
    for (int64_t m = 0; m < M; ++m) {
      block_amaxes(xp, bf16, m * K, K, 32, amax.data());
      for (int64_t kb = 0; kb < K / 32; ++kb) {
        const uint8_t e = rules::mxfp8_scale_exponent(fmt8::bits_float(amax[kb]), e5m2);
        row_s[m * (K / 32) + kb] = e;
        mult[kb] = fmt8::e8m0_reciprocal(e);
      }
      cast_blocks(xp, bf16, m * K, K, 32, mult.data(), e5m2, row + m * K);
    }
  }
  if (col) {
    // 32x1 blocks: per-column running maxima over the band's 32 rows, then each row cast with
    // its column's multiplier (the data is not transposed, so every pass is contiguous).
    std::vector<uint32_t> amax(static_cast<size_t>(K));
    std::vector<float> mult(static_cast<size_t>(K));
    for (int64_t mb = 0; mb < M / 32; ++mb) {
      std::fill(amax.begin(), amax.end(), 0u);
      for (int64_t r = 0; r < 32; ++r) col_amax_row(xp, bf16, (mb * 32 + r) * K, K, amax.data());
      for (int64_t k = 0; k < K; ++k) {
        const uint8_t e = rules::mxfp8_scale_exponent(fmt8::bits_float(amax[k]), e5m2);
        col_s[mb * K + k] = e;
        mult[k] = fmt8::e8m0_reciprocal(e);
      }
      for (int64_t r = 0; r < 32; ++r) {
        const int64_t base = (mb * 32 + r) * K;
        cast_contiguous(xp, bf16, base, K, mult.data(), true, e5m2, col + base);
      }
    }
  }
  return q;
}

Tensor mxfp8_pad_scales(const Tensor& compact, QuantizedCopy which) {
  MP_CHECK_INPUT(compact.defined() && compact.shape().rank() == 2 &&
                     (compact.dtype() == DType::kE8M0 || compact.dtype() == DType::kUInt8),
                 "mxfp8_pad_scales: scales must be e8m0 2-D, got {}",
                 compact.defined() ? compact.describe() : "undefined");
  const Tensor host = compact.on(Device::cpu());
  const int64_t R = host.shape()[0];
  const int64_t C = host.shape()[1];
  const bool rowwise = which == QuantizedCopy::kRowwise;
  const int64_t PR = rowwise ? roundup(R, 128) : roundup(R, 4);
  const int64_t PC = rowwise ? roundup(C, 4) : roundup(C, 128);
  Tensor out = Tensor::zeros({PR, PC}, compact.dtype(), Device::cpu());
  const auto* in = static_cast<const uint8_t*>(host.raw_data());
  auto* o = static_cast<uint8_t*>(out.raw_data());
  for (int64_t r = 0; r < R; ++r) std::memcpy(o + r * PC, in + r * C, static_cast<size_t>(C));
  return out.on(compact.device());
}

int64_t mxfp8_swizzle_offset(int64_t r, int64_t c, int64_t cols) {
  return ((r / 128) * ((cols + 3) / 4) + c / 4) * 512 + (r % 32) * 16 + ((r % 128) / 32) * 4 +
         c % 4;
}

Tensor mxfp8_swizzle_scales(const Tensor& padded, QuantizedCopy which) {
  MP_CHECK_INPUT(padded.defined() && padded.shape().rank() == 2 &&
                     (padded.dtype() == DType::kE8M0 || padded.dtype() == DType::kUInt8),
                 "mxfp8_swizzle_scales: scales must be e8m0 2-D, got {}",
                 padded.defined() ? padded.describe() : "undefined");
  const bool rowwise = which == QuantizedCopy::kRowwise;
  const Tensor host = padded.on(Device::cpu());
  // (r, c) in the formula's orientation: r along the 128-padded dim, c along the 4-padded one.
  const int64_t R = rowwise ? host.shape()[0] : host.shape()[1];
  const int64_t C = rowwise ? host.shape()[1] : host.shape()[0];
  MP_CHECK_INPUT(R % 128 == 0 && C % 4 == 0,
                 "mxfp8_swizzle_scales: {} scales {} are not padded to 128x4 tiles",
                 rowwise ? "rowwise" : "columnwise", host.describe());
  Tensor out = Tensor::empty({R * C}, padded.dtype(), Device::cpu());
  const auto* in = static_cast<const uint8_t*>(host.raw_data());
  auto* o = static_cast<uint8_t*>(out.raw_data());
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) {
      const int64_t src = rowwise ? r * C + c : c * R + r;
      o[mxfp8_swizzle_offset(r, c, C)] = in[src];
    }
  }
  return out.on(padded.device());
}

}  // namespace meshproof::kernels
