// Per-tensor FP8 scaling (delayed and current), CPU reference and dispatch to the CUDA launchers
// (quantize.cu): the tensor amax, the current scale, the delayed-scaling state (amax history,
// scale) and its update, and the per-tensor cast into the rowwise copy and the transposed
// columnwise copy (the same codes, cast in bands of rows and byte-transposed). The CPU loops are
// the vectorisable blocks of quantize_cast.cc, bitwise equal to the rules of quantize_rules.h.
#include <algorithm>
#include <cmath>

#include "kernels/ops/op_util.h"
#include "kernels/quantize/quantize.h"
#include "kernels/quantize/quantize_internal.h"
#include "kernels/quantize/quantize_rules.h"

namespace meshproof::kernels {

namespace {

using detail::amax_contiguous;
using detail::cast_contiguous;
using detail::is_e5m2;
using detail::scratch_bytes;
using detail::transpose_bytes;

void check_scalar(const Tensor& t, const Tensor& x, std::string_view what) {
  MP_CHECK_INPUT(t.defined() && t.dtype() == DType::kFloat32 && t.numel().value == 1,
                 "{} must be float32[1], got {}", what, t.defined() ? t.describe() : "undefined");
  MP_CHECK_INPUT(!x.defined() || t.device() == x.device(), "{} {} is not on the input's device {}",
                 what, t.describe(), x.device().str());
}

}  // namespace

Tensor compute_amax(const Tensor& x) {
  const bool bf16 = detail::check_quantizer_input(x, "compute_amax");
  Tensor out = Tensor::empty({1}, DType::kFloat32, x.device());
  if (x.device().is_cuda()) {
    MP_CUDA_DISPATCH(
        launch_amax(x.raw_data(), bf16, x.numel().value, out.data<float>(), detail::cuda_stream()));
    return out;
  }
  const uint32_t a = amax_contiguous(x.raw_data(), bf16, 0, x.numel().value);
  out.data<float>()[0] = fmt8::bits_float(a);
  return out;
}

Tensor compute_current_scale(const Tensor& amax, DType format, float eps, bool pow2) {
  check_scalar(amax, Tensor(), "compute_current_scale: amax");
  MP_CHECK_INPUT(eps >= 0.0f, "compute_current_scale: eps must be >= 0, got {}", eps);
  const float max = fp8_max(format);
  Tensor out = Tensor::empty({1}, DType::kFloat32, amax.device());
  if (amax.device().is_cuda()) {
    MP_CUDA_DISPATCH(launch_current_scale(amax.data<float>(), out.data<float>(), max, eps, pow2,
                                          detail::cuda_stream()));
    return out;
  }
  out.data<float>()[0] = rules::current_scale(amax.data<float>()[0], max, eps, pow2);
  return out;
}

DelayedScalingState make_delayed_scaling_state(int64_t history_len, Device device) {
  MP_CHECK_INPUT(history_len >= 1, "delayed scaling: amax history length must be >= 1, got {}",
                 history_len);
  DelayedScalingState s;
  s.scale = Tensor::from_vector<float>({1}, {1.0f}).to(device);
  s.amax_history = Tensor::zeros({history_len}, DType::kFloat32, device);
  return s;
}

void record_amax(DelayedScalingState& state, const Tensor& amax) {
  check_scalar(amax, state.amax_history, "record_amax: amax");
  float* hist = state.amax_history.data<float>();
  if (amax.device().is_cuda()) {
    MP_CUDA_DISPATCH(launch_record_amax(hist, amax.data<float>(), detail::cuda_stream()));
    return;
  }
  const uint32_t a = rules::abs_bits(hist[0]);
  const uint32_t b = rules::abs_bits(amax.data<float>()[0]);
  hist[0] = fmt8::bits_float(a > b ? a : b);
}

void update_delayed_scaling(DelayedScalingState& state, AmaxAlgo algo, int margin,
                            float fp8_max_value) {
  check_scalar(state.scale, state.amax_history, "update_delayed_scaling: scale");
  MP_CHECK_INPUT(
      state.amax_history.dtype() == DType::kFloat32 && state.amax_history.shape().rank() == 1,
      "update_delayed_scaling: amax_history must be float32[L], got {}",
      state.amax_history.describe());
  MP_CHECK_INPUT(margin >= 0 && margin < 127, "update_delayed_scaling: margin {} out of [0, 127)",
                 margin);
  const float two_pow_margin = std::ldexp(1.0f, margin);
  const int64_t len = state.amax_history.numel().value;
  if (state.scale.device().is_cuda()) {
    MP_CUDA_DISPATCH(launch_delayed_update(state.amax_history.data<float>(), len,
                                           state.scale.data<float>(), algo == AmaxAlgo::kMax,
                                           fp8_max_value, two_pow_margin, detail::cuda_stream()));
    return;
  }
  rules::delayed_update(state.amax_history.data<float>(), len, state.scale.data<float>(),
                        algo == AmaxAlgo::kMax, fp8_max_value, two_pow_margin);
}

QuantizedTensor quantize_per_tensor(const Tensor& x, const Tensor& scale, DType format, Usage usage,
                                    ScalingMode mode, const Tensor& amax) {
  const bool bf16 = detail::check_quantizer_input(x, "quantize_per_tensor");
  const bool e5m2 = is_e5m2(format);
  check_scalar(scale, x, "quantize_per_tensor: scale");
  MP_CHECK_INPUT(mode == ScalingMode::kDelayedTensor || mode == ScalingMode::kCurrentTensor,
                 "quantize_per_tensor: mode must be per-tensor, got {}", scaling_mode_name(mode));
  MP_CHECK_INPUT(usage.rowwise || usage.columnwise, "quantize_per_tensor: no copy requested");
  const int64_t M = x.shape().leading();
  const int64_t K = x.shape().last();
  const Device dev = x.device();
  QuantizedTensor q;
  q.mode = mode;
  q.format = format;
  q.logical_shape = Shape{M, K};
  q.scale = scale;
  if (amax.defined()) q.amax = amax;
  Tensor scale_inv = Tensor::empty({1}, DType::kFloat32, dev);
  if (usage.rowwise) q.rowwise_data = Tensor::empty({M, K}, format, dev);
  if (usage.columnwise) q.columnwise_data = Tensor::empty({K, M}, format, dev);
  auto* row = usage.rowwise ? static_cast<uint8_t*>(q.rowwise_data.raw_data()) : nullptr;
  auto* col = usage.columnwise ? static_cast<uint8_t*>(q.columnwise_data.raw_data()) : nullptr;
  if (dev.is_cuda()) {
    MP_CUDA_DISPATCH(launch_quantize_per_tensor(x.raw_data(), bf16, M, K, scale.data<float>(), e5m2,
                                                row, col, scale_inv.data<float>(),
                                                detail::cuda_stream()));
  } else {
    const float s = scale.data<float>()[0];
    scale_inv.data<float>()[0] = rules::reciprocal(s);
    const void* xp = x.raw_data();
    // The transposed copy holds the same codes as the rowwise one (same scale): cast bands of
    // 32 rows in row order (into the rowwise copy, or scratch) and transpose each band.
    constexpr int64_t kBand = 32;
    uint8_t* band = row ? nullptr : scratch_bytes(static_cast<size_t>(kBand * K));
    for (int64_t m0 = 0; m0 < M; m0 += kBand) {
      const int64_t rows = std::min(kBand, M - m0);
      uint8_t* codes = row ? row + m0 * K : band;
      for (int64_t m = m0; m < m0 + rows; ++m)
        cast_contiguous(xp, bf16, m * K, K, &s, false, e5m2, codes + (m - m0) * K);
      if (col) transpose_bytes(codes, K, rows, K, col + m0, M);
    }
  }
  if (usage.rowwise) q.rowwise_scale_inv = scale_inv;
  if (usage.columnwise) q.columnwise_scale_inv = scale_inv;
  return q;
}

QuantizedTensor quantize_current(const Tensor& x, DType format, Usage usage, float eps, bool pow2) {
  const Tensor amax = compute_amax(x);
  const Tensor scale = compute_current_scale(amax, format, eps, pow2);
  return quantize_per_tensor(x, scale, format, usage, ScalingMode::kCurrentTensor, amax);
}

}  // namespace meshproof::kernels
