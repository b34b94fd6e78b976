#include "engine/parallel/fp8_all_gather.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/core/error.h"
#include "kernels/core/formats.h"
#include "kernels/quantize/nvfp4.h"
#include "kernels/quantize/nvfp4_rules.h"
#include "kernels/quantize/quantize.h"
#include "mesh/core/padded_gather.h"

namespace meshproof::engine {

using kernels::DType;
using kernels::Tensor;
using mesh::Box;

namespace {

struct RowPiece {
  int64_t offset = 0;  // first row (in `unit`s) inside the target
  int64_t rows = 0;
};

// Rows [offset, offset + rows) x all `cols` columns of an [R, C] tensor, as a box.
Box row_box(int64_t offset, int64_t rows, int64_t cols) {
  using kernels::Elements;
  return Box{{Elements(offset), Elements(0)}, {Elements(rows), Elements(cols)}};
}

// Gathers each member's rows [R_s, C] (any byte-sized dtype) into [R, C] with the padded
// all-gather (mesh/core/padded_gather.h): each member's real rows land at its offset.
Tensor gather_rows(mesh::Communicator& comm, const Tensor& local,
                   const std::vector<RowPiece>& pieces, int64_t total_rows, int64_t cols) {
  std::vector<Box> boxes;
  for (const RowPiece& p : pieces) boxes.push_back(row_box(p.offset, p.rows, cols));
  return mesh::gather_padded(comm, boxes, local, row_box(0, total_rows, cols));
}

// The block_scale_padding_reshard fault's gather of block scales: each member's [rows, cols]
// scales padded with zero rows to a multiple of `multiple`, the padded blocks gathered back to
// back, and the first `total_rows` rows of the result kept: from the first member whose rows are
// not a multiple of `multiple`, every later member's scales land `padding` rows too low and the
// rows between get the zero padding (e8m0 code 0, 2^-127).
Tensor gather_rows_keeping_scale_padding(mesh::Communicator& comm, const Tensor& local,
                                         const std::vector<RowPiece>& pieces, int64_t total_rows,
                                         int64_t cols, int64_t multiple) {
  const auto round_up = [multiple](int64_t n) { return (n + multiple - 1) / multiple * multiple; };
  std::vector<RowPiece> padded;
  int64_t rows = 0;
  for (const RowPiece& p : pieces) {
    padded.push_back({rows, round_up(p.rows)});
    rows += round_up(p.rows);
  }
  Tensor mine = Tensor::zeros(kernels::Shape{round_up(local.shape()[0]), cols}, local.dtype(),
                              local.device());
  if (local.shape()[0] > 0) mine.slice_rows(0, local.shape()[0]).copy_from(local);
  const Tensor all = gather_rows(comm, mine, padded, rows, cols);
  return all.slice_rows(0, total_rows).clone();
}

// Each member's row range inside `target` (the members' boxes must be full-column row ranges);
// `aligned32` tells whether every member's row count is a multiple of 32.
std::vector<RowPiece> row_pieces(mesh::Communicator& gather, const mesh::Layout& layout,
                                 const Box& target, bool& aligned32) {
  MP_CHECK_INPUT(target.rank() == 2, "fp8_all_gather: 2-D weights only, got target {}",
                 target.str());
  std::vector<RowPiece> pieces;
  aligned32 = true;
  for (int r : gather.ranks()) {
    const Box& b = layout.box(r);
    MP_CHECK_INPUT(b.extent[1] == target.extent[1] && b.offset[1] == target.offset[1],
                   "fp8_all_gather: box {} of rank {} does not span the columns of {}", b.str(), r,
                   target.str());
    MP_CHECK_INPUT(b.extent[0].value > 0,
                   "fp8_all_gather: rank {} holds no rows of {} (weight of {} rows over {} ranks)",
                   r, target.str(), target.extent[0].value, gather.size());
    pieces.push_back({b.offset[0].value - target.offset[0].value, b.extent[0].value});
    aligned32 = aligned32 && b.extent[0].value % 32 == 0;
  }
  return pieces;
}

// Compares two buffers byte by byte; a size difference counts every byte of the larger one.
void compare_bytes(const Tensor& got_any, const Tensor& want_any, AllGatherParity& p) {
  const int64_t ng = got_any.defined() ? got_any.nbytes().value : 0;
  const int64_t nw = want_any.defined() ? want_any.nbytes().value : 0;
  if (ng != nw) {
    p.bytes += std::max(ng, nw);
    p.mismatched_bytes += std::max(ng, nw);
    return;
  }
  const Tensor got = ng > 0 ? got_any.on(kernels::Device::cpu()) : got_any;
  const Tensor want = nw > 0 ? want_any.on(kernels::Device::cpu()) : want_any;
  const auto* a = static_cast<const unsigned char*>(ng > 0 ? got.raw_data() : nullptr);
  const auto* b = static_cast<const unsigned char*>(nw > 0 ? want.raw_data() : nullptr);
  p.bytes += ng;
  for (int64_t i = 0; i < ng; ++i) p.mismatched_bytes += a[i] != b[i] ? 1 : 0;
}

bool same_size(const Tensor& a, const Tensor& b) {
  return a.defined() && b.defined() && a.nbytes().value == b.nbytes().value;
}

// max |dequant(got) - dequant(want)| over the elements of one copy (both in the logical layout).
// A NaN on one side only counts as infinite; NaN on both sides as equal.
double max_abs_error(const kernels::QuantizedTensor& got, const kernels::QuantizedTensor& want,
                     kernels::QuantizedCopy which) {
  const bool row = which == kernels::QuantizedCopy::kRowwise;
  const Tensor& gd = row ? got.rowwise_data : got.columnwise_data;
  const Tensor& gs = row ? got.rowwise_scale_inv : got.columnwise_scale_inv;
  const Tensor& wd = row ? want.rowwise_data : want.columnwise_data;
  const Tensor& ws = row ? want.rowwise_scale_inv : want.columnwise_scale_inv;
  if (!same_size(gd, wd) || !same_size(gs, ws)) return std::numeric_limits<double>::infinity();
  const std::vector<float> a = kernels::dequantize(got, which).to_vector<float>();
  const std::vector<float> b = kernels::dequantize(want, which).to_vector<float>();
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    if (std::isnan(a[i]) || std::isnan(b[i])) {
      if (std::isnan(a[i]) != std::isnan(b[i])) return std::numeric_limits<double>::infinity();
      continue;
    }
    m = std::max(m, std::fabs(static_cast<double>(a[i]) - static_cast<double>(b[i])));
  }
  return m;
}

// The first element of a scale_inv buffer as a number (float32 per-tensor, e8m0 per block).
double first_scale_inv(const Tensor& any) {
  if (!any.defined() || any.numel().value == 0) return std::nan("");
  const Tensor s = any.on(kernels::Device::cpu());
  if (s.dtype() == DType::kFloat32) return s.data<float>()[0];
  if (s.dtype() == DType::kE8M0)
    return kernels::fmt8::e8m0_to_float(static_cast<const uint8_t*>(s.raw_data())[0]);
  return std::nan("");
}

bool per_tensor(RecipeKind kind) {
  return kind == RecipeKind::kCurrent || kind == RecipeKind::kDelayed;
}

// NVFP4 all-gather: 16x16 tiles must lie inside the shards, so every member holds a non-empty
// multiple of 16 rows and the columns are a multiple of 16. No fallback: a tile across two shards
// takes its E4M3 code from both shards' values, which neither rank has.
void check_nvfp4_pieces(const std::vector<RowPiece>& pieces, const Box& target) {
  bool ok = target.extent[1].value % 16 == 0;
  std::string rows;
  for (const RowPiece& p : pieces) {
    ok = ok && p.rows % 16 == 0;
    rows += fmt::format("{}{}", rows.empty() ? "" : ", ", p.rows);
  }
  MP_CHECK_INPUT(ok,
                 "nvfp4 all-gather of the weight box {} over {} dp_shard ranks: shards of {} rows "
                 "x {} columns; every shard needs a non-empty multiple of 16 rows and columns "
                 "(16x16 tiles may not cross shards)",
                 target.str(), pieces.size(), rows, target.extent[1].value);
}

// The weight's NVFP4 options must be the tiled, round-to-nearest ones for the columnwise copy to
// be rebuilt from the gathered rowwise copy (kernels/quantize/nvfp4.h).
void check_nvfp4_weight_options(const kernels::Nvfp4Options& o) {
  MP_CHECK_INPUT(o.tile16x16 && !o.rht && !o.rounding.stochastic,
                 "nvfp4 all-gather: weights are quantized in 16x16 tiles with round to nearest "
                 "(got tiles={} rht={} stochastic={})",
                 o.tile16x16, o.rht, o.rounding.stochastic);
}

// The packed bytes of an e2m1 [R, C] tensor as uint8 [R, C/2], and back: the padded gather cuts
// boxes by element, which a 4-bit element cannot be. Copied on the tensor's own device.
Tensor packed_bytes(const Tensor& e2m1) {
  Tensor b = Tensor::empty({e2m1.shape()[0], e2m1.shape()[1] / 2}, DType::kUInt8, e2m1.device());
  kernels::copy_bytes(b.raw_data(), b.device(), e2m1.raw_data(), e2m1.device(), b.nbytes());
  return b;
}
Tensor e2m1_of_bytes(const Tensor& bytes) {
  Tensor t = Tensor::empty({bytes.shape()[0], bytes.shape()[1] * 2}, DType::kE2M1, bytes.device());
  kernels::copy_bytes(t.raw_data(), t.device(), bytes.raw_data(), bytes.device(), t.nbytes());
  return t;
}

// NVFP4's second-level (global decode) scale of a global amax float32 [1].
double nvfp4_decode_scale(const Tensor& amax) {
  if (!amax.defined() || amax.numel().value != 1) return std::nan("");
  namespace nv = kernels::rules::nvfp4;
  return nv::global_decode_scale(nv::global_encode_scale(amax.to_vector<float>()[0]));
}

}  // namespace

Fp8Shard quantize_shard(mesh::Communicator& gather, mesh::Communicator& amax_group,
                        const mesh::Layout& layout, const Tensor& local, const Box& target,
                        RecipeKind kind, const Tensor* delayed_scale, bool reduce_amax,
                        CurrentScaleOptions current, const kernels::Nvfp4Options& nvfp4) {
  MP_CHECK_INPUT(local.shape().rank() == 2, "fp8_all_gather: 2-D weights only, got {}",
                 local.describe());
  bool aligned32 = true;
  const std::vector<RowPiece> pieces = row_pieces(gather, layout, target, aligned32);
  const int64_t total = target.extent[0].value, cols = target.extent[1].value;
  Fp8Shard out;
  if (per_tensor(kind)) {
    Tensor scale, amax = kernels::compute_amax(local);
    if (kind == RecipeKind::kCurrent) {
      if (reduce_amax && amax_group.size() > 1) amax_group.all_reduce(amax, mesh::ReduceOp::kMax);
      scale = kernels::compute_current_scale(amax, DType::kE4M3, current.eps, current.pow2);
    } else {
      MP_CHECK_INPUT(delayed_scale != nullptr, "fp8_all_gather: delayed recipe without a scale");
      scale = *delayed_scale;
    }
    const kernels::ScalingMode mode = kind == RecipeKind::kCurrent
                                          ? kernels::ScalingMode::kCurrentTensor
                                          : kernels::ScalingMode::kDelayedTensor;
    out.q = kernels::quantize_per_tensor(local, scale, DType::kE4M3,
                                         {.rowwise = true, .columnwise = false}, mode, amax);
    return out;
  }
  if (kind == RecipeKind::kNvfp4) {
    // The shard's global amax (both copies: a weight has no RHT) MAX-reduced over the weight's
    // amax group before any tile is quantized: every rank's second-level scale is the whole
    // weight's. Rowwise only: the columnwise copy is rebuilt after the gather.
    check_nvfp4_pieces(pieces, target);
    check_nvfp4_weight_options(nvfp4);
    Tensor amax = kernels::nvfp4_global_amax(local, false, "nvfp4 all-gather shard");
    if (reduce_amax && amax_group.size() > 1) amax_group.all_reduce(amax, mesh::ReduceOp::kMax);
    out.q = kernels::quantize_nvfp4(local, nvfp4, {.rowwise = true, .columnwise = false}, amax,
                                    "nvfp4 all-gather shard");
    return out;
  }
  MP_CHECK_INPUT(kind == RecipeKind::kMxfp8,
                 "fp8_all_gather: recipe {} has no FP8 all-gather (current, delayed, mxfp8, nvfp4)",
                 recipe_name(kind));
  if (!aligned32 || cols % 32 != 0) {
    out.high_precision = local;
    out.high_precision_fallback = true;
    out.note = fmt::format(
        "mxfp8 all-gather of a {}x{} weight over {} ranks fell back to a high-precision "
        "gather: shard rows are not all multiples of 32 (columnwise 32x1 blocks would cross "
        "shards)",
        total, cols, gather.size());
    return out;
  }
  out.q = kernels::quantize_mxfp8(local, DType::kE4M3, {.rowwise = true, .columnwise = true});
  return out;
}

Fp8GatherResult gather_shard(mesh::Communicator& gather, const mesh::Layout& layout,
                             const Fp8Shard& shard, const Box& target, RecipeKind kind,
                             ScalePadding scale_padding) {
  bool aligned32 = true;
  const std::vector<RowPiece> pieces = row_pieces(gather, layout, target, aligned32);
  const int64_t total = target.extent[0].value, cols = target.extent[1].value;
  Fp8GatherResult out;
  kernels::QuantizedTensor& g = out.weight;
  if (shard.high_precision_fallback) {
    // High-precision gather, then quantize the whole weight.
    const Tensor full = gather_rows(gather, shard.high_precision, pieces, total, cols);
    g = kernels::quantize_mxfp8(full, DType::kE4M3, {.rowwise = true, .columnwise = true});
    out.high_precision_fallback = true;
    out.note = shard.note;
    return out;
  }
  const kernels::QuantizedTensor& q = shard.q;
  if (kind == RecipeKind::kNvfp4) {
    // On the wire: the packed E2M1 bytes [r, K/2] and one E4M3 code per 16x16 tile
    // [r/16, K/16]; the global amax is the reduced one every member holds.
    check_nvfp4_pieces(pieces, target);
    std::vector<RowPiece> tiles;
    for (const RowPiece& p : pieces) tiles.push_back({p.offset / 16, p.rows / 16});
    const Tensor data = gather_rows(gather, packed_bytes(q.rowwise_data), pieces, total, cols / 2);
    const Tensor codes =
        gather_rows(gather, kernels::nvfp4_tile_scales(q), tiles, total / 16, cols / 16);
    g = kernels::nvfp4_tiled_from_rowwise(e2m1_of_bytes(data), codes, q.amax);
    return out;
  }
  g.format = DType::kE4M3;
  g.logical_shape = target.shape();
  g.mode = q.mode;
  g.rowwise_data = gather_rows(gather, q.rowwise_data, pieces, total, cols);
  if (per_tensor(kind)) {
    // Every member quantized with the same (reduced or replicated) scale: the scale_inv is
    // replicated and the columnwise copy is the transpose of the gathered rowwise bytes.
    g.rowwise_scale_inv = q.rowwise_scale_inv;
    g.columnwise_data = kernels::transpose_2d(g.rowwise_data);
    g.columnwise_scale_inv = q.rowwise_scale_inv;
    g.amax = q.amax;
    g.scale = q.scale;
    return out;
  }
  std::vector<RowPiece> blocks;
  for (const RowPiece& p : pieces) blocks.push_back({p.offset / 32, p.rows / 32});
  g.rowwise_scale_inv =
      scale_padding.rowwise_rows > 0
          ? gather_rows_keeping_scale_padding(gather, q.rowwise_scale_inv, pieces, total, cols / 32,
                                              scale_padding.rowwise_rows)
          : gather_rows(gather, q.rowwise_scale_inv, pieces, total, cols / 32);
  g.columnwise_data = gather_rows(gather, q.columnwise_data, pieces, total, cols);
  g.columnwise_scale_inv =
      scale_padding.columnwise_rows > 0
          ? gather_rows_keeping_scale_padding(gather, q.columnwise_scale_inv, blocks, total / 32,
                                              cols, scale_padding.columnwise_rows)
          : gather_rows(gather, q.columnwise_scale_inv, blocks, total / 32, cols);
  return out;
}

Fp8GatherResult fp8_all_gather(mesh::Communicator& gather, mesh::Communicator& amax_group,
                               const mesh::Layout& layout, const Tensor& local, const Box& target,
                               RecipeKind kind, const Tensor* delayed_scale, bool reduce_amax,
                               CurrentScaleOptions current, const kernels::Nvfp4Options& nvfp4) {
  const Fp8Shard shard = quantize_shard(gather, amax_group, layout, local, target, kind,
                                        delayed_scale, reduce_amax, current, nvfp4);
  return gather_shard(gather, layout, shard, target, kind);
}

AllGatherParity fp8_all_gather_parity(mesh::Communicator& gather, mesh::Communicator& amax_group,
                                      const mesh::Layout& layout, const Tensor& local,
                                      const Box& target, RecipeKind kind,
                                      const Tensor* delayed_scale,
                                      const kernels::QuantizedTensor& gathered,
                                      CurrentScaleOptions current,
                                      const kernels::Nvfp4Options& nvfp4) {
  MP_CHECK_INPUT(local.shape().rank() == 2, "fp8_all_gather_parity: 2-D weights only, got {}",
                 local.describe());
  bool aligned32 = true;
  const std::vector<RowPiece> pieces = row_pieces(gather, layout, target, aligned32);
  const int64_t total = target.extent[0].value, cols = target.extent[1].value;
  // The high-precision gathered weight, exactly as a high-precision all-gather produces it.
  const Tensor full = gather_rows(gather, local, pieces, total, cols);
  const kernels::Usage both{.rowwise = true, .columnwise = true};
  kernels::QuantizedTensor ref;
  switch (kind) {
    case RecipeKind::kCurrent: {
      Tensor amax = kernels::compute_amax(full);
      if (amax_group.size() > 1) amax_group.all_reduce(amax, mesh::ReduceOp::kMax);
      ref = kernels::quantize_per_tensor(
          full, kernels::compute_current_scale(amax, DType::kE4M3, current.eps, current.pow2),
          DType::kE4M3, both, kernels::ScalingMode::kCurrentTensor, amax);
      break;
    }
    case RecipeKind::kDelayed:
      MP_CHECK_INPUT(delayed_scale != nullptr,
                     "fp8_all_gather_parity: delayed recipe without a scale");
      ref = kernels::quantize_per_tensor(full, *delayed_scale, DType::kE4M3, both,
                                         kernels::ScalingMode::kDelayedTensor);
      break;
    case RecipeKind::kMxfp8:
      ref = kernels::quantize_mxfp8(full, DType::kE4M3, both);
      break;
    case RecipeKind::kNvfp4: {
      // The single-rank recipe: the whole weight's global amax (tp peers' pieces added by the
      // group, as for current scaling), then tiles with both copies.
      check_nvfp4_weight_options(nvfp4);
      Tensor amax = kernels::nvfp4_global_amax(full, false, "allgather_parity reference");
      if (amax_group.size() > 1) amax_group.all_reduce(amax, mesh::ReduceOp::kMax);
      ref = kernels::quantize_nvfp4(full, nvfp4, both, amax, "allgather_parity reference");
      break;
    }
    default:
      MP_FAIL_INPUT(
          "fp8_all_gather_parity: recipe {} has no FP8 all-gather (current, delayed, mxfp8, "
          "nvfp4)",
          recipe_name(kind));
  }
  AllGatherParity p;
  compare_bytes(gathered.rowwise_data, ref.rowwise_data, p);
  compare_bytes(gathered.rowwise_scale_inv, ref.rowwise_scale_inv, p);
  compare_bytes(gathered.columnwise_data, ref.columnwise_data, p);
  compare_bytes(gathered.columnwise_scale_inv, ref.columnwise_scale_inv, p);
  p.max_abs_error = std::max(max_abs_error(gathered, ref, kernels::QuantizedCopy::kRowwise),
                             max_abs_error(gathered, ref, kernels::QuantizedCopy::kColumnwise));
  p.scale_inv = first_scale_inv(gathered.rowwise_scale_inv);
  p.reference_scale_inv = first_scale_inv(ref.rowwise_scale_inv);
  if (kind == RecipeKind::kNvfp4) {
    // The second level: both global amaxes, and the global decode scales as the scale_inv.
    compare_bytes(gathered.amax, ref.amax, p);
    compare_bytes(gathered.columnwise_amax, ref.columnwise_amax, p);
    p.scale_inv = nvfp4_decode_scale(gathered.amax);
    p.reference_scale_inv = nvfp4_decode_scale(ref.amax);
  }
  return p;
}

}  // namespace meshproof::engine
