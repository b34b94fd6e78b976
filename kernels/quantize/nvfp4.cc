// NVFP4 quantizers: CPU reference and the dispatch to the CUDA kernels (nvfp4.cu). Both run the
// block workers of kernels/quantize/nvfp4_rules.h (docs/design.md section 25).
#include "kernels/quantize/nvfp4.h"

#include <vector>

#include "kernels/core/error.h"
#include "kernels/core/runtime.h"
#include "kernels/ops/op_util.h"
#include "kernels/quantize/nvfp4_cuda.h"
#include "kernels/quantize/nvfp4_rules.h"

namespace meshproof::kernels {
namespace {

namespace nv = rules::nvfp4;

#if MESHPROOF_HAVE_CUDA
#define MP_NVFP4_CUDA(call) cuda::call
#else
#define MP_NVFP4_CUDA(call) detail::no_cuda_backend("nvfp4")
#endif

}  // namespace

void check_nvfp4_shape(int64_t M, int64_t K, const Nvfp4Options& o, std::string_view what) {
  MP_CHECK_INPUT(M % nv::kBlock == 0 && K % nv::kBlock == 0,
                 "{} has shape [{}, {}]: nvfp4 needs rows and columns that are multiples of 16",
                 what, M, K);
  MP_CHECK_INPUT(!(o.tile16x16 && o.rht),
                 "{}: nvfp4 16x16 tiles (weights) and the random Hadamard transform (non-weights) "
                 "exclude each other",
                 what);
}

Tensor nvfp4_global_amax(const Tensor& x, bool rht, std::string_view what) {
  const bool bf16 = detail::check_quantizer_input(x, what);
  const int64_t M = x.shape().leading();
  const int64_t K = x.shape().last();
  check_nvfp4_shape(M, K, Nvfp4Options{}, what);
  Tensor out = Tensor::empty({2}, DType::kFloat32, x.device());
  if (x.device().is_cuda()) {
    MP_NVFP4_CUDA(launch_nvfp4_global_amax(x.raw_data(), bf16, M, K, rht, out.data<float>(),
                                           detail::cuda_stream()));
    return out;
  }
  const uint32_t row = rules::block_amax_bits(x.raw_data(), bf16, 0, 1, M * K);
  uint32_t col = row;
  if (rht) {
    col = 0;
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t g = 0; g < M / nv::kBlock; ++g) {
        const uint32_t b = nv::rht_group_amax_bits(x.raw_data(), bf16, K, k, g);
        col = b > col ? b : col;
      }
    }
  }
  out.data<float>()[0] = fmt8::bits_float(row);
  out.data<float>()[1] = fmt8::bits_float(col);
  return out;
}

QuantizedTensor quantize_nvfp4(const Tensor& x, const Nvfp4Options& o, Usage usage,
                               const Tensor& global_amax, std::string_view what) {
  const bool bf16 = detail::check_quantizer_input(x, what);
  const int64_t M = x.shape().leading();
  const int64_t K = x.shape().last();
  check_nvfp4_shape(M, K, o, what);
  MP_CHECK_INPUT(usage.rowwise || usage.columnwise, "{}: no nvfp4 copy requested", what);
  MP_CHECK_INPUT(global_amax.defined() && global_amax.dtype() == DType::kFloat32 &&
                     global_amax.numel().value == 2 && global_amax.device() == x.device(),
                 "{}: the nvfp4 global amax must be float32[2] on {}, got {}", what,
                 x.device().str(), global_amax.defined() ? global_amax.describe() : "undefined");
  const Device dev = x.device();
  QuantizedTensor q;
  q.mode = ScalingMode::kNvfp4;
  q.format = DType::kE2M1;
  q.logical_shape = Shape{M, K};
  q.columnwise_rht = o.rht;
  uint8_t* row = nullptr;
  uint8_t* row_s = nullptr;
  uint8_t* col = nullptr;
  uint8_t* col_s = nullptr;
  if (usage.rowwise) {
    q.rowwise_data = Tensor::empty({M, K}, DType::kE2M1, dev);
    q.rowwise_scale_inv = Tensor::empty({M, K / nv::kBlock}, DType::kE4M3, dev);
    row = static_cast<uint8_t*>(q.rowwise_data.raw_data());
    row_s = static_cast<uint8_t*>(q.rowwise_scale_inv.raw_data());
  }
  if (usage.columnwise) {
    q.columnwise_data = Tensor::empty({K, M}, DType::kE2M1, dev);
    q.columnwise_scale_inv = Tensor::empty({K, M / nv::kBlock}, DType::kE4M3, dev);
    col = static_cast<uint8_t*>(q.columnwise_data.raw_data());
    col_s = static_cast<uint8_t*>(q.columnwise_scale_inv.raw_data());
  }
  // The two global amaxes, each as its own float32[1] (what the checkpoint and the GEMM read),
  // copied where they live: device-to-device on a GPU, so a quantization there makes no host
  // round trip (docs/design.md, "Host-device traffic per step").
  q.amax = Tensor::empty({1}, DType::kFloat32, dev);
  q.columnwise_amax = Tensor::empty({1}, DType::kFloat32, dev);
  const auto* amax_bytes = static_cast<const char*>(global_amax.raw_data());
  copy_bytes(q.amax.raw_data(), dev, amax_bytes, dev, Bytes(sizeof(float)));
  copy_bytes(q.columnwise_amax.raw_data(), dev, amax_bytes + sizeof(float), dev,
             Bytes(sizeof(float)));

  nv::SrKey sr;
  sr.on = o.rounding.stochastic;
  sr.seed = o.rounding.seed;
  sr.stream = nv::sr_stream(o.rounding.step, o.rounding.tensor_id);
  sr.row0 = o.rounding.row0;
  sr.col0 = o.rounding.col0;
  sr.ld = o.rounding.ld > 0 ? o.rounding.ld : K;
  if (dev.is_cuda()) {
    MP_NVFP4_CUDA(launch_quantize_nvfp4(x.raw_data(), bf16, M, K, o.tile16x16, o.rht,
                                        o.pow2_block_scales, sr.on, sr.seed, sr.stream, sr.row0,
                                        sr.col0, sr.ld, global_amax.data<float>(), row, row_s, col,
                                        col_s, detail::cuda_stream()));
    return q;
  }
  nv::Job j;
  j.x = x.raw_data();
  j.bf16 = bf16;
  j.M = M;
  j.K = K;
  j.tile = o.tile16x16;
  j.rht = o.rht;
  j.pow2 = o.pow2_block_scales;
  j.sr = sr;
  j.s_enc_row = nv::global_encode_scale(global_amax.data<float>()[0]);
  j.s_enc_col = nv::global_encode_scale(global_amax.data<float>()[1]);
  // Each tile's amax once, not once per block of each copy (32 reads of every tile).
  std::vector<uint32_t> tiles;
  if (j.tile) {
    tiles.resize(static_cast<size_t>((M / nv::kBlock) * (K / nv::kBlock)));
    for (int64_t tm = 0; tm < M / nv::kBlock; ++tm)
      for (int64_t tk = 0; tk < K / nv::kBlock; ++tk)
        tiles[static_cast<size_t>(tm * (K / nv::kBlock) + tk)] =
            nv::compute_tile_amax_bits(j, tm * nv::kBlock, tk * nv::kBlock);
    j.tile_amax = tiles.data();
  }
  if (row) {
    for (int64_t m = 0; m < M; ++m) {
      for (int64_t b = 0; b < K / nv::kBlock; ++b) nv::row_block(j, m, b, row, row_s);
    }
  }
  if (col) {
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t g = 0; g < M / nv::kBlock; ++g) nv::col_group(j, k, g, col, col_s);
    }
  }
  return q;
}

QuantizedTensor quantize_nvfp4(const Tensor& x, const Nvfp4Options& o, Usage usage,
                               std::string_view what) {
  return quantize_nvfp4(x, o, usage, nvfp4_global_amax(x, o.rht && usage.columnwise, what), what);
}

Tensor dequantize_nvfp4(const QuantizedTensor& q, bool rowwise) {
  MP_CHECK_INPUT(q.mode == ScalingMode::kNvfp4, "dequantize_nvfp4: a {} tensor is not nvfp4",
                 scaling_mode_name(q.mode));
  const Tensor& data = rowwise ? q.rowwise_data : q.columnwise_data;
  const Tensor& scale = rowwise ? q.rowwise_scale_inv : q.columnwise_scale_inv;
  const Tensor& amax = rowwise ? q.amax : q.columnwise_amax;
  MP_CHECK_INPUT(data.defined() && scale.defined() && amax.defined(),
                 "dequantize: the {} copy of an nvfp4 tensor {} is absent",
                 rowwise ? "rowwise" : "columnwise", q.logical_shape.str());
  const int64_t R = data.shape()[0];
  const int64_t C = data.shape()[1];
  Tensor out = Tensor::empty({R, C}, DType::kFloat32, data.device());
  const auto* d = static_cast<const uint8_t*>(data.raw_data());
  const auto* s = static_cast<const uint8_t*>(scale.raw_data());
  if (data.device().is_cuda()) {
    MP_NVFP4_CUDA(launch_dequantize_nvfp4(d, s, amax.data<float>(), R, C, out.data<float>(),
                                          detail::cuda_stream()));
    return out;
  }
  const float gds = nv::global_decode_scale(nv::global_encode_scale(amax.data<float>()[0]));
  float* o = out.data<float>();
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) {
      const uint8_t byte = d[(r * C + c) / 2];
      const uint8_t code = static_cast<uint8_t>((c & 1) ? byte >> 4 : byte & 0xFu);
      o[r * C + c] = nv::decode(code, s[r * (C / nv::kBlock) + c / nv::kBlock], gds);
    }
  }
  return out;
}

Tensor nvfp4_rht_transpose(const Tensor& x) {
  const bool bf16 = detail::check_quantizer_input(x, "nvfp4_rht_transpose");
  MP_CHECK_INPUT(x.device().is_cpu(), "nvfp4_rht_transpose: {} must be on the CPU", x.describe());
  const int64_t M = x.shape().leading();
  const int64_t K = x.shape().last();
  check_nvfp4_shape(M, K, Nvfp4Options{}, "nvfp4_rht_transpose input");
  Tensor out = Tensor::empty({K, M}, DType::kFloat32, Device::cpu());
  float* o = out.data<float>();
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t g = 0; g < M / nv::kBlock; ++g) {
      nv::rht16(x.raw_data(), bf16, g * nv::kBlock * K + k, K, o + k * M + g * nv::kBlock);
    }
  }
  return out;
}

Tensor nvfp4_tile_scales(const QuantizedTensor& q) {
  MP_CHECK_INPUT(q.mode == ScalingMode::kNvfp4 && q.rowwise_scale_inv.defined(),
                 "nvfp4_tile_scales: needs an nvfp4 tensor with its rowwise copy, got a {} tensor "
                 "{}",
                 scaling_mode_name(q.mode), q.logical_shape.str());
  const int64_t M = q.rows();
  const int64_t K = q.cols();
  check_nvfp4_shape(M, K, Nvfp4Options{}, "nvfp4_tile_scales input");
  const int64_t kb = K / nv::kBlock;
  const Device dev = q.rowwise_scale_inv.device();
  Tensor out = Tensor::empty({M / nv::kBlock, kb}, DType::kE4M3, dev);
  // Row t of the output is row 16t of the rowwise codes: one strided copy (on the device when the
  // codes are there).
  copy_bytes_2d(out.raw_data(), dev, kb, q.rowwise_scale_inv.raw_data(), dev, nv::kBlock * kb, kb,
                M / nv::kBlock);
  return out;
}

QuantizedTensor nvfp4_tiled_from_rowwise(const Tensor& rowwise_data, const Tensor& tile_scales,
                                         const Tensor& global_amax) {
  MP_CHECK_INPUT(rowwise_data.defined() && rowwise_data.dtype() == DType::kE2M1 &&
                     rowwise_data.shape().rank() == 2,
                 "nvfp4_tiled_from_rowwise: the rowwise data must be e2m1 [M, K], got {}",
                 rowwise_data.defined() ? rowwise_data.describe() : "undefined");
  const Device dev = rowwise_data.device();
  const int64_t M = rowwise_data.shape()[0];
  const int64_t K = rowwise_data.shape()[1];
  Nvfp4Options tiled;
  tiled.tile16x16 = true;
  check_nvfp4_shape(M, K, tiled, "nvfp4_tiled_from_rowwise data");
  const int64_t mb = M / nv::kBlock;
  const int64_t kb = K / nv::kBlock;
  MP_CHECK_INPUT(tile_scales.defined() && tile_scales.dtype() == DType::kE4M3 &&
                     tile_scales.shape() == Shape({mb, kb}) && tile_scales.device() == dev,
                 "nvfp4_tiled_from_rowwise: the tile codes of data [{}, {}] must be e4m3 [{}, {}] "
                 "on {}, got {}",
                 M, K, mb, kb, dev.str(),
                 tile_scales.defined() ? tile_scales.describe() : "undefined");
  MP_CHECK_INPUT(global_amax.defined() && global_amax.dtype() == DType::kFloat32 &&
                     global_amax.numel().value == 1 && global_amax.device() == dev,
                 "nvfp4_tiled_from_rowwise: the global amax must be float32 [1] on {}, got {}",
                 dev.str(), global_amax.defined() ? global_amax.describe() : "undefined");
  QuantizedTensor q;
  q.mode = ScalingMode::kNvfp4;
  q.format = DType::kE2M1;
  q.logical_shape = Shape{M, K};
  q.rowwise_data = rowwise_data;
  q.rowwise_scale_inv = Tensor::empty({M, kb}, DType::kE4M3, dev);
  q.columnwise_data = Tensor::empty({K, M}, DType::kE2M1, dev);
  q.columnwise_scale_inv = Tensor::empty({K, mb}, DType::kE4M3, dev);
  q.amax = global_amax.clone();
  q.columnwise_amax = global_amax.clone();
  const auto* tiles = static_cast<const uint8_t*>(tile_scales.raw_data());
  auto* row_s = static_cast<uint8_t*>(q.rowwise_scale_inv.raw_data());
  auto* col_s = static_cast<uint8_t*>(q.columnwise_scale_inv.raw_data());
  const auto* rd = static_cast<const uint8_t*>(rowwise_data.raw_data());
  auto* cd = static_cast<uint8_t*>(q.columnwise_data.raw_data());
  if (dev.is_cuda()) {
    MP_NVFP4_CUDA(
        launch_nvfp4_tiled_from_rowwise(rd, tiles, M, K, row_s, cd, col_s, detail::cuda_stream()));
    return q;
  }
  for (int64_t m = 0; m < M; ++m) {
    for (int64_t b = 0; b < kb; ++b) row_s[m * kb + b] = tiles[(m / nv::kBlock) * kb + b];
  }
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t g = 0; g < mb; ++g) col_s[k * mb + g] = tiles[g * kb + k / nv::kBlock];
  }
  // Nibble transpose: element (m, k) of the rowwise copy is element (k, m) of the columnwise one.
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t m = 0; m < M; m += 2) {
      const auto code = [&](int64_t r) {
        const uint8_t byte = rd[(r * K + k) / 2];
        return static_cast<uint8_t>((k & 1) ? byte >> 4 : byte & 0xFu);
      };
      cd[(k * M + m) / 2] = static_cast<uint8_t>(code(m) | (code(m + 1) << 4));
    }
  }
  return q;
}

}  // namespace meshproof::kernels
