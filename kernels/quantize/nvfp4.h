// NVFP4 quantization (docs/design.md section 25): E2M1 elements with two-level scaling, an fp32
// global scale per copy and E4M3 scales per 1x16 block (activations, gradients) or 16x16 tile
// (weights), the random Hadamard transform on the wgrad operands' columnwise copies and stochastic
// rounding of gradients. CPU reference and CUDA backend behind one interface; both run the scalar
// rules of kernels/quantize/nvfp4_rules.h, so their bytes are identical.
//
// The engine owns the global amax reduction, as for per-tensor recipes:
//   amax = nvfp4_global_amax(x, rht)     // float32[2]: rowwise, columnwise (after the RHT)
//   (engine MAX-reduces amax over the amax group)
//   q = quantize_nvfp4(x, options, usage, amax)
// Inputs are float32 or bfloat16 of any rank >= 1; leading dims are flattened into M. M and K must
// be multiples of 16 (input error naming the tensor and shape otherwise).
#pragma once

#include <cstdint>
#include <string_view>

#include "kernels/core/tensor.h"
#include "kernels/quantize/quantized_tensor.h"

namespace meshproof::kernels {

// Stochastic rounding of the elements (gradients): the draw of element (m, k) comes from Philox
// keyed by (seed, step, tensor_id, element index), the index taken in the unsharded tensor:
// a shard starting at (row0, col0) of a tensor with `ld` columns (0 = this tensor's K).
struct Nvfp4Rounding {
  bool stochastic = false;
  uint64_t seed = 0;
  uint64_t step = 0;
  uint32_t tensor_id = 0;
  int64_t row0 = 0;
  int64_t col0 = 0;
  int64_t ld = 0;
};

struct Nvfp4Options {
  bool tile16x16 = false;  // 16x16 tiles shared by both copies (weights)
  bool rht = false;        // random Hadamard transform of the columnwise copy (not with tiles)
  Nvfp4Rounding rounding;
  bool pow2_block_scales = false;  // fault nvfp4_block_scale_pow2 only: never the recipe
};

// Input error unless M and K are multiples of 16 and not (tile16x16 and rht). `what` names the
// tensor in the message.
void check_nvfp4_shape(int64_t M, int64_t K, const Nvfp4Options& o, std::string_view what);

// float32[2] on x's device: [0] = max|x|, [1] = the columnwise copy's amax (max|RHT(x^T)| with
// rht, else [0]). NaN-propagating like compute_amax.
Tensor nvfp4_global_amax(const Tensor& x, bool rht, std::string_view what = "nvfp4 input");

// Quantizes x with the (already reduced) global amaxes float32[2] on x's device. Result: mode
// kNvfp4, format e2m1; rowwise data e2m1 [M, K] (bytes [M, K/2]) + E4M3 scale codes [M, K/16];
// columnwise data e2m1 [K, M] (the transpose, bytes [K, M/2]) + codes [K, M/16]; with tiles each
// tile's code is on each of its 16 rows. amax / columnwise_amax hold the global amaxes.
QuantizedTensor quantize_nvfp4(const Tensor& x, const Nvfp4Options& o, Usage usage,
                               const Tensor& global_amax, std::string_view what = "nvfp4 input");
// One rank, no reduction group: global amax, then quantize.
QuantizedTensor quantize_nvfp4(const Tensor& x, const Nvfp4Options& o, Usage usage,
                               std::string_view what = "nvfp4 input");

// Decodes one copy to float32 in that copy's STORED layout (rowwise [M, K], columnwise [K, M],
// in the transformed domain when the columnwise copy has the RHT), on q's device.
Tensor dequantize_nvfp4(const QuantizedTensor& q, bool rowwise);

// The columnwise RHT domain of x: float32 [K, M], y = RHT of each 16-group of x^T (for tests and
// the emulated wgrad GEMM's reference). CPU only.
Tensor nvfp4_rht_transpose(const Tensor& x);

// ---- 16x16-tiled tensors (weights) in the NVFP4 all-gather (docs/design.md section 28)
// With 16x16 tiles, round to nearest and one global amax for both copies (a weight: no RHT, no
// stochastic rounding, rowwise and columnwise global amax equal), a column group's amax is its
// tile's amax and its encode scale the tile's, so the columnwise copy is the element-wise
// transpose of the rowwise copy, and every row of a tile carries the tile's code. The rowwise
// data plus one code per tile therefore determine the whole tensor: what the all-gather sends.

// The tile codes of a 16x16-tiled tensor's rowwise copy: E4M3 [M/16, K/16], row t being row 16t
// of the rowwise codes. On the tensor's device (a strided copy: a device tensor stays there).
Tensor nvfp4_tile_scales(const QuantizedTensor& q);

// The 16x16-tiled tensor with both copies, rebuilt from its rowwise data (e2m1 [M, K]), its tile
// codes (E4M3 [M/16, K/16]) and its global amax (float32 [1], both copies'): byte-equal to
// quantize_nvfp4(x, {.tile16x16 = true}, both copies) of the x they came from, on the inputs'
// device (one device: the CUDA kernel writes the same bytes as the host loops). M and K multiples
// of 16 and matching shapes, else an input error naming them.
QuantizedTensor nvfp4_tiled_from_rowwise(const Tensor& rowwise_data, const Tensor& tile_scales,
                                         const Tensor& global_amax);

}  // namespace meshproof::kernels
