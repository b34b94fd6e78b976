// Quantizers of every recipe: the recipe names, the element-format check, fp8_max, dequantize (any
// recipe's copy back to fp32) and transpose_2d, as CPU reference and dispatch to the CUDA launchers
// (quantize.cu). The quantizers sit beside this file, one per recipe family:
// quantize_per_tensor.cc (amax, current and delayed scaling, the per-tensor cast),
// quantize_mxfp8.cc (MXFP8 and its scale layouts), quantize_block.cc (1x128 and 128x128 blocks)
// and nvfp4.cc. Their CPU loops are built from the vectorisable blocks of quantize_cast.cc
// (quantize_internal.h), bitwise equal to the scalar rules of quantize_rules.h that the CUDA
// kernels call.
#include "kernels/quantize/quantize.h"

#include <cstring>

#include "kernels/ops/op_util.h"
#include "kernels/quantize/nvfp4.h"
#include "kernels/quantize/quantize_internal.h"
#include "kernels/quantize/quantize_rules.h"

namespace meshproof::kernels {

std::string_view scaling_mode_name(ScalingMode m) {
  switch (m) {
    case ScalingMode::kDelayedTensor:
      return "delayed_tensor";
    case ScalingMode::kCurrentTensor:
      return "current_tensor";
    case ScalingMode::kMxfp8:
      return "mxfp8";
    case ScalingMode::kBlock1x128:
      return "block_1x128";
    case ScalingMode::kBlock128x128:
      return "block_128x128";
    case ScalingMode::kNvfp4:
      return "nvfp4";
  }
  MP_FAIL("unknown ScalingMode {}", static_cast<int>(m));
}

std::string_view amax_algo_name(AmaxAlgo a) { return a == AmaxAlgo::kMax ? "max" : "most_recent"; }

namespace {

using rules::QLayout;

using detail::is_e5m2;

}  // namespace

namespace detail {

bool is_e5m2(DType format) {
  MP_CHECK_INPUT(format == DType::kE4M3 || format == DType::kE5M2,
                 "quantization format must be e4m3 or e5m2, got {}", dtype_name(format));
  return format == DType::kE5M2;
}

}  // namespace detail

float fp8_max(DType format) { return rules::fp8_max(is_e5m2(format)); }

Tensor dequantize(const QuantizedTensor& q, QuantizedCopy which) {
  const bool rowwise = which == QuantizedCopy::kRowwise;
  const Tensor& data = rowwise ? q.rowwise_data : q.columnwise_data;
  const Tensor& scale = rowwise ? q.rowwise_scale_inv : q.columnwise_scale_inv;
  MP_CHECK_INPUT(
      data.defined() && scale.defined(), "dequantize: the {} copy of a {} tensor {} is absent",
      rowwise ? "rowwise" : "columnwise", scaling_mode_name(q.mode), q.logical_shape.str());
  if (q.mode == ScalingMode::kNvfp4) {
    // Stored [K, M] columnwise: transposed back to the logical layout like the other modes.
    const Tensor d = dequantize_nvfp4(q, rowwise);
    return rowwise ? d : transpose_2d(d);
  }
  const bool e5m2 = is_e5m2(q.format);
  QLayout layout;
  switch (q.mode) {
    case ScalingMode::kDelayedTensor:
    case ScalingMode::kCurrentTensor:
      layout = rowwise ? QLayout::kPerTensorRow : QLayout::kPerTensorCol;
      break;
    case ScalingMode::kMxfp8:
      layout = rowwise ? QLayout::kMxfp8Row : QLayout::kMxfp8Col;
      break;
    case ScalingMode::kBlock1x128:
      layout = rowwise ? QLayout::kBlock1dRow : QLayout::kBlock1dCol;
      break;
    case ScalingMode::kBlock128x128:
      layout = rowwise ? QLayout::kBlock2dRow : QLayout::kBlock2dCol;
      break;
    default:
      MP_FAIL_INPUT("dequantize: scaling mode {} is not supported", scaling_mode_name(q.mode));
  }
  const int64_t M = q.rows();
  const int64_t K = q.cols();
  Tensor out = Tensor::empty({M, K}, DType::kFloat32, data.device());
  const auto* d = static_cast<const uint8_t*>(data.raw_data());
  if (data.device().is_cuda()) {
    MP_CUDA_DISPATCH(launch_dequantize(static_cast<int>(layout), e5m2, d, scale.raw_data(), M, K,
                                       out.data<float>(), detail::cuda_stream()));
    return out;
  }
  float* o = out.data<float>();
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t k = 0; k < K; ++k) {
      o[m * K + k] = rules::dequant_at(layout, e5m2, d, scale.raw_data(), M, K, m, k);
    }
  }
  return out;
}

Tensor transpose_2d(const Tensor& t) {
  MP_CHECK_INPUT(t.defined() && t.shape().rank() == 2, "transpose_2d: {} is not 2-D",
                 t.defined() ? t.describe() : "undefined tensor");
  const int bits = dtype_bits(t.dtype());
  MP_CHECK_INPUT(bits == 8 || bits == 32, "transpose_2d: {} must have 1- or 4-byte elements",
                 t.describe());
  const int64_t R = t.shape()[0];
  const int64_t C = t.shape()[1];
  Tensor out = Tensor::empty({C, R}, t.dtype(), t.device());
  if (t.device().is_cuda()) {
    MP_CUDA_DISPATCH(
        launch_transpose(t.raw_data(), out.raw_data(), R, C, bits / 8, detail::cuda_stream()));
    return out;
  }
  const auto* in = static_cast<const uint8_t*>(t.raw_data());
  auto* o = static_cast<uint8_t*>(out.raw_data());
  const size_t eb = static_cast<size_t>(bits / 8);
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) {
      std::memcpy(o + (c * R + r) * eb, in + (r * C + c) * eb, eb);
    }
  }
  return out;
}

}  // namespace meshproof::kernels
