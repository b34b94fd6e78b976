// FP8 all-gather of FSDP weight shards (docs/design.md section 5): quantize the local shard, then
// gather the FP8 bytes and scales instead of the high-precision weight.
//
// Per-tensor recipes (current, delayed): the shard's amax is MAX-reduced over the weight-sharding
// group first (current scaling) or the replicated delayed scale is used, so every rank quantizes
// with the scale of the whole weight and gather(quantize(shard)) is bitwise equal to
// quantize(gather(shard)). The columnwise (transposed) copy is the transpose of the gathered
// rowwise bytes (same scale).
// MXFP8: rowwise 1x32 blocks lie inside a shard's rows; columnwise 32x1 blocks only when every
// shard's row count is a multiple of 32 (and the kernel quantizes only such shards). Otherwise
// the shards are gathered in high precision and quantized afterwards (reported in `note`).
// NVFP4 (docs/design.md section 28): the shard's global amax (float32[2]) is MAX-reduced over the
// weight's amax group, so every rank's second-level scale is the whole weight's; the shard is
// quantized rowwise in 16x16 tiles and the packed E2M1 bytes plus one E4M3 code per tile are
// gathered; the columnwise copy is rebuilt from them (kernels::nvfp4_tiled_from_rowwise). Every
// member's row count must be a non-empty multiple of 16 (tiles inside a shard), else an input
// error: no fallback, a tile across two shards needs both shards' values for its code.
#pragma once

#include <string>

#include "engine/config/config.h"
#include "engine/parallel/scale_padding.h"
#include "engine/session/session.h"
#include "kernels/core/tensor.h"
#include "kernels/quantize/nvfp4.h"
#include "kernels/quantize/quantized_tensor.h"
#include "mesh/core/communicator.h"
#include "mesh/core/layout.h"

namespace meshproof::engine {

struct Fp8GatherResult {
  kernels::QuantizedTensor weight;  // the gathered weight [rows of target, K], row+columnwise
  bool high_precision_fallback = false;
  std::string note;  // why the fallback was taken (empty otherwise)
};

// One rank's weight shard quantized for the FP8 all-gather: the first half of fp8_all_gather,
// kept separately so an executor can quantize once per step and gather per layer use (FSDP2
// re-gathers after reshard_after_forward), or keep the shard as an FP8 primary weight
// (fsdp.fp8_params) and gather it every step.
struct Fp8Shard {
  // Per-tensor recipes: rowwise e4m3 data [r, K], scale_inv float32 [1], amax/scale float32 [1].
  // mxfp8: rowwise data [r, K] + e8m0 scale_inv [r, K/32], columnwise data [r, K] + e8m0
  // scale_inv [r/32, K] (r a multiple of 32). nvfp4: rowwise e2m1 data [r, K] (bytes [r, K/2]) +
  // E4M3 codes [r, K/16] in 16x16 tiles, amax float32 [1] the reduced global amax (r a multiple
  // of 16), no columnwise copy. Empty when high_precision_fallback.
  kernels::QuantizedTensor q;
  kernels::Tensor high_precision;  // [r, K] the unquantized shard (mxfp8 fallback only)
  bool high_precision_fallback = false;
  std::string note;  // why the fallback was taken (empty otherwise)
};

// The current-scaling options of the recipe (recipe.eps, recipe.power_2_scale) that weight scales
// follow, so a gathered weight has the scale the single-rank recipe gives it.
struct CurrentScaleOptions {
  float eps = 0.0f;
  bool pow2 = false;
};

// The NVFP4 options of a weight as the recipe gives them without faults (16x16 tiles, round to
// nearest); the session passes Fp8Recipe::nvfp4_options, which the fault hooks may change.
inline kernels::Nvfp4Options nvfp4_weight_options() {
  kernels::Nvfp4Options o;
  o.tile16x16 = true;
  return o;
}

// `layout`: the weight's layout; the boxes of the members of `gather` must be disjoint row ranges
// (full columns) that tile `target` (e.g. Shard(0) over dp_shard, with target the TP-local box).
// `local`: this rank's fp32/bf16 shard. `amax_group`: the group the amax is MAX-reduced over
// (current scaling; the session passes the weight's entry of engine/parallel/amax_groups.h, which
// the amax_not_reduced fault empties); `reduce_amax` false skips the reduction whatever the group.
// `delayed_scale`: float32 [1], the replicated delayed-scaling scale (delayed recipe only).
// `nvfp4`: the weight's NVFP4 options (nvfp4 only; 16x16 tiles, no RHT, no stochastic rounding,
// else an input error). Recipes other than current, delayed, mxfp8 and nvfp4 are input errors.
Fp8Shard quantize_shard(mesh::Communicator& gather, mesh::Communicator& amax_group,
                        const mesh::Layout& layout, const kernels::Tensor& local,
                        const mesh::Box& target, RecipeKind kind,
                        const kernels::Tensor* delayed_scale = nullptr, bool reduce_amax = true,
                        CurrentScaleOptions current = {},
                        const kernels::Nvfp4Options& nvfp4 = nvfp4_weight_options());

// Gathers the members' quantized shards over `gather` into the weight of `target` (collective).
// `scale_padding` (mxfp8 only): see ScalePadding; the default is the correct gather.
Fp8GatherResult gather_shard(mesh::Communicator& gather, const mesh::Layout& layout,
                             const Fp8Shard& shard, const mesh::Box& target, RecipeKind kind,
                             ScalePadding scale_padding = {});

// quantize_shard then gather_shard.
Fp8GatherResult fp8_all_gather(mesh::Communicator& gather, mesh::Communicator& amax_group,
                               const mesh::Layout& layout, const kernels::Tensor& local,
                               const mesh::Box& target, RecipeKind kind,
                               const kernels::Tensor* delayed_scale = nullptr,
                               bool reduce_amax = true, CurrentScaleOptions current = {},
                               const kernels::Nvfp4Options& nvfp4 = nvfp4_weight_options());

// allgather_parity (docs/design.md section 7): the single-rank reference for one FP8 all-gathered
// weight. Takes the inputs fp8_all_gather was given plus what it returned (`gathered`), gathers the
// high-precision shards over `gather` (padding cut off), quantizes the whole gathered weight the
// way one rank would (current: amax of the full weight -> compute_current_scale; delayed: the
// replicated `delayed_scale`; mxfp8: quantize_mxfp8 of the full weight, rowwise and columnwise;
// nvfp4: nvfp4_global_amax of the full weight, MAX-reduced over `amax_group` like current's, then
// quantize_nvfp4 with `nvfp4`, both copies) and compares every byte of the rowwise/columnwise data
// and scale_inv buffers (nvfp4: and of both global amaxes, float32 [1] each; scale_inv and
// reference_scale_inv are then the global decode scales 1/S_enc, the second-level scale).
// `amax_group` (current scaling only): the group whose gathered boxes make up the whole weight.
// With tp = 1 every member holds the same gathered weight and the MAX over the group is the
// gathered weight's own amax; with TP-sharded weights it adds the tp peers' pieces so that the
// reference scale is that of the global weight (what the single-rank recipe uses). The reduction
// is of the gathered high-precision weight, independent of the shard amax reduction under test
// (nvfp4 likewise).
// Collective over `gather` (and `amax_group` for current scaling). Fills every field except step
// and tensor; a buffer whose size differs from the reference counts all its bytes as mismatched.
AllGatherParity fp8_all_gather_parity(mesh::Communicator& gather, mesh::Communicator& amax_group,
                                      const mesh::Layout& layout, const kernels::Tensor& local,
                                      const mesh::Box& target, RecipeKind kind,
                                      const kernels::Tensor* delayed_scale,
                                      const kernels::QuantizedTensor& gathered,
                                      CurrentScaleOptions current = {},
                                      const kernels::Nvfp4Options& nvfp4 = nvfp4_weight_options());

}  // namespace meshproof::engine
