// Quantizers of every recipe (docs/design.md section 4), CPU reference and CUDA backend behind one
// interface: each function runs on the device of its input tensor and returns tensors on that
// device. The CPU backend defines the bytes; the CUDA kernels (quantize.cu) produce identical
// bytes because both run the scalar rules of kernels/quantize/quantize_rules.h.
//
// Per-tensor recipes are split so that the engine owns the amax reduction group:
//   amax = compute_amax(x)                      // float32[1], this rank's amax
//   (engine MAX-reduces amax over the amax group)
//   scale = compute_current_scale(amax, fmt)    // or the delayed-scaling state's scale
//   q = quantize_per_tensor(x, scale, fmt, usage, mode, amax)
// Inputs are float32 or bfloat16 tensors of any rank >= 1; leading dims are flattened into M.
#pragma once

#include <cstdint>
#include <string_view>

#include "kernels/core/tensor.h"
#include "kernels/quantize/quantized_tensor.h"

namespace meshproof::kernels {

// Largest finite value of an fp8 element format (448 for e4m3, 57344 for e5m2); input error for
// any other dtype.
float fp8_max(DType format);

// max|x| over all elements as float32[1] on x's device. NaN if any element is NaN (the max is taken
// on the sign-cleared bit patterns, which sort NaN above inf), so a NaN cannot hide.
Tensor compute_amax(const Tensor& x);

// Current scaling (TE compute_scale_from_amax): amax clamped below by eps, then
// scale = fp8_max(format) / amax (correctly rounded fp32 division); a NaN amax, or a clamped amax
// of 0 or inf, -> 1; an infinite quotient -> FLT_MAX; pow2 clears the mantissa bits.
// amax: float32[1]; returns float32[1] on amax's device.
Tensor compute_current_scale(const Tensor& amax, DType format, float eps = 0.0f, bool pow2 = false);

// Delayed scaling state of one quantized tensor (checkpoint state).
struct DelayedScalingState {
  Tensor scale;         // float32 [1]: the scale used by the next quantization (1 at first)
  Tensor amax_history;  // float32 [L]: [0] is the current slot, [1..L) older steps, newest last
};
enum class AmaxAlgo : uint8_t { kMax, kMostRecent };
std::string_view amax_algo_name(AmaxAlgo a);

// scale 1, history all zeros, on `device`. history_len >= 1 (input error otherwise).
DelayedScalingState make_delayed_scaling_state(int64_t history_len, Device device);
// history[0] = max(history[0], amax): max-accumulates within a step. amax: float32[1].
void record_amax(DelayedScalingState& state, const Tensor& amax);
// After the current slot was MAX-reduced over the amax group: amax = max(history) (kMax) or
// history[0] (kMostRecent); scale = (fp8_max / amax) / 2^margin when amax is finite and > 0,
// else unchanged; inf -> FLT_MAX; then the window rolls and the new current slot is 0.
void update_delayed_scaling(DelayedScalingState& state, AmaxAlgo algo, int margin, float fp8_max);

// Per-tensor quantization (kDelayedTensor or kCurrentTensor): q = fp8(x * scale) rowwise [M, K]
// and/or columnwise TRANSPOSED [K, M], both with scale_inv = 1/scale (float32 [1]).
// scale: float32[1] on x's device. `amax` (float32[1], optional) is stored in the result.
QuantizedTensor quantize_per_tensor(const Tensor& x, const Tensor& scale, DType format, Usage usage,
                                    ScalingMode mode, const Tensor& amax = Tensor());

// Convenience for a single rank (no reduction group): amax -> current scale -> quantize.
QuantizedTensor quantize_current(const Tensor& x, DType format, Usage usage, float eps = 0.0f,
                                 bool pow2 = false);

// MXFP8: 1x32 rowwise blocks (scale e8m0 [M, K/32]) and 32x1 columnwise blocks (data [M, K] NOT
// transposed, scale e8m0 [M/32, K]), compact layouts. Input error naming the tensor and shape
// unless K % 32 == 0 and M % 32 == 0.
QuantizedTensor quantize_mxfp8(const Tensor& x, DType format = DType::kE4M3, Usage usage = {});

// Float8BlockScaling: mode kBlock1x128 or kBlock128x128; any M, K >= 1 (partial edge blocks).
// fp32 scales by the current-scaling rule on each block's amax: scale = fp8_max / max(amax, eps),
// rounded down to a power of two when pow2 (TE's default; NVTE_FP8_BLOCK_SCALING_FP32_SCALES
// turns it off); scale_inv = 1/scale stored (layouts in quantized_tensor.h). eps >= 0.
QuantizedTensor quantize_block(const Tensor& x, ScalingMode mode, DType format = DType::kE4M3,
                               Usage usage = {}, bool pow2 = true, float eps = 0.0f);

// Which copy of a QuantizedTensor to read.
enum class QuantizedCopy : uint8_t { kRowwise, kColumnwise };

// Decodes one copy to float32 in the LOGICAL layout [M, K] (columnwise copies are transposed
// back), on q's device. Input error if the copy is absent.
Tensor dequantize(const QuantizedTensor& q, QuantizedCopy which);

// 2-D transpose [R, C] -> [C, R] of a tensor with 1- or 4-byte elements, on its device.
Tensor transpose_2d(const Tensor& t);

// ---- MXFP8 scale layouts for GEMMs (cuBLASLt VEC32_UE8M0) -------------------------------------

// Compact e8m0 scales -> zero-padded: rowwise [M, K/32] -> [roundup(M,128), roundup(K/32,4)];
// columnwise [M/32, K] -> [roundup(M/32,4), roundup(K,128)]. CPU or CUDA (copied via host).
Tensor mxfp8_pad_scales(const Tensor& compact, QuantizedCopy which);
// Offset of element (r, c) of a scale matrix with `cols` columns in the cuBLASLt 128x4 tiled
// layout: ((r/128)*ceil(cols/4) + c/4)*512 + (r%32)*16 + ((r%128)/32)*4 + c%4. Here r runs along
// the 128-padded dimension and c along the 4-padded one.
int64_t mxfp8_swizzle_offset(int64_t r, int64_t c, int64_t cols);
// Padded scales -> swizzled bytes (same byte count, uint8/e8m0 1-D [rows*cols]). For rowwise
// padded [R128, C4] r = row, c = col; for columnwise padded [C4, R128] the formula is applied to
// its transpose (r = the K index, c = the M/32 index), which is how cuBLASLt reads 32x1 scales.
Tensor mxfp8_swizzle_scales(const Tensor& padded, QuantizedCopy which);

}  // namespace meshproof::kernels
