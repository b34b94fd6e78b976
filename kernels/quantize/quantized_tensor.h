// A quantized tensor: the recipe travels with the data (TransformerEngine's design). It carries a
// rowwise copy and/or a columnwise copy, each with its own scale_inv, plus the amax that produced
// the scale and the scaling mode. Decoding: x ~= data * scale_inv (per element's block/tensor).
#pragma once

#include <cstdint>
#include <string_view>

#include "kernels/core/tensor.h"

namespace meshproof::kernels {

enum class ScalingMode : uint8_t {
  kDelayedTensor,  // per-tensor scale from the amax history (DelayedScaling)
  kCurrentTensor,  // per-tensor scale from this tensor's amax (Float8CurrentScaling)
  kMxfp8,          // 1x32 (rowwise) / 32x1 (columnwise) blocks, E8M0 scales (MXFP8BlockScaling)
  kBlock1x128,     // 1x128 blocks, fp32 power-of-2 scales (Float8BlockScaling activations/grads)
  kBlock128x128,   // 128x128 blocks, fp32 power-of-2 scales (Float8BlockScaling weights)
  kNvfp4,          // 1x16 blocks or 16x16 tiles of E2M1, E4M3 scales + fp32 global scale (NVFP4)
};

std::string_view scaling_mode_name(ScalingMode m);

// Which copies to produce: rowwise for fprop operands, columnwise for dgrad/wgrad operands.
struct Usage {
  bool rowwise = true;
  bool columnwise = false;
};

struct QuantizedTensor {
  ScalingMode mode = ScalingMode::kCurrentTensor;
  DType format = DType::kE4M3;  // element format of the data copies (e4m3, e5m2; e2m1 nvfp4)
  Shape logical_shape;          // [M, K]: leading dims flattened into M

  // Rowwise copy, blocks along K (the last dim).
  //   data:      format  [M, K]
  //   scale_inv: per-tensor float32 [1]; mxfp8 e8m0 [M, K/32] (compact);
  //              block1x128 float32 [M, ceil(K/128)]; block128x128 float32 [ceil(M/128),
  //              ceil(K/128)]
  Tensor rowwise_data;
  Tensor rowwise_scale_inv;

  // Columnwise copy, blocks along M (what a GEMM needs when it consumes the operand transposed).
  //   per-tensor and block modes: the TRANSPOSE, format [K, M] (Hopper FP8 GEMMs take only TN),
  //     scale_inv: per-tensor float32 [1]; block1x128 float32 [K, ceil(M/128)] (1x128 blocks of
  //     the transpose); block128x128 float32 [ceil(K/128), ceil(M/128)]
  //   mxfp8: NOT transposed, format [M, K] with 32x1 blocks, scale_inv e8m0 [M/32, K] (compact)
  //   nvfp4: the transpose, e2m1 [K, M] (bytes [K, M/2]), E4M3 codes [K, M/16]; rowwise e2m1
  //     [M, K] with codes [M, K/16] (16x16 tiles: each tile's code on each of its 16 rows)
  Tensor columnwise_data;
  Tensor columnwise_scale_inv;

  Tensor amax;   // float32 [1]: the (reduced) amax the per-tensor scale came from; undefined for
                 // block modes
  Tensor scale;  // float32 [1]: per-tensor scale used (1/scale_inv); undefined for block modes

  // nvfp4: `amax` is the rowwise copy's global amax and this the columnwise copy's (after the RHT
  // when columnwise_rht), float32 [1]; the global scales derive from them
  // (kernels/quantize/nvfp4.h).
  Tensor columnwise_amax;
  bool columnwise_rht = false;  // nvfp4: the columnwise copy holds the RHT of x^T's 16-groups

  bool has_rowwise() const { return rowwise_data.defined(); }
  bool has_columnwise() const { return columnwise_data.defined(); }
  int64_t rows() const { return logical_shape.leading(); }  // M
  int64_t cols() const { return logical_shape.last(); }     // K
};

}  // namespace meshproof::kernels
