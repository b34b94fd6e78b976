#include "engine/parallel/collective_budget.h"

#include <algorithm>

#include "engine/model/params.h"
#include "engine/moe/moe.h"
#include "engine/parallel/amax_groups.h"
#include "engine/parallel/mesh_groups.h"
#include "engine/parallel/shard_plan.h"
#include "engine/pipeline/pipeline.h"
#include "kernels/core/dtype.h"

namespace meshproof::engine {

using kernels::DType;
using mesh::Box;
using mesh::CollectiveCall;
using mesh::CollectiveKind;
using mesh::DimSet;
using mesh::Layout;
using mesh::MeshDim;
using mesh::ReduceOp;

namespace {

int64_t dtype_bytes(DType t) { return kernels::dtype_bits(t) / 8; }

// nccl-tests size of the padded all-gather (mesh/core/padded_gather.h) of `dtype` tensors whose
// members hold `numel` elements each: every member sends max(1, largest) elements.
int64_t padded_bytes(const std::vector<int64_t>& numel, DType dtype) {
  int64_t chunk = 1;
  for (int64_t n : numel) chunk = std::max(chunk, n);
  return static_cast<int64_t>(numel.size()) * chunk * dtype_bytes(dtype);
}

}  // namespace

std::vector<CollectiveCall> expected_collectives(const RunOptions& options, int rank,
                                                 int64_t step) {
  const Config& config = options.config;
  const mesh::DeviceMesh mesh = options.mesh.device_mesh();
  const RecipeKind rk = config.recipe.kind;
  const TrainingConfig& t = config.training;
  // The session's decision (engine/session/session.cc): FP8 primary weights are gathered as FP8,
  // and the FP8 all-gather exists for the per-tensor recipes, mxfp8 and nvfp4 (FP4, section 28).
  const bool fp8_recipe_gathers = rk == RecipeKind::kCurrent || rk == RecipeKind::kDelayed ||
                                  rk == RecipeKind::kMxfp8 || rk == RecipeKind::kNvfp4;
  const bool fp8_gather =
      (options.fsdp.fp8_all_gather || options.fsdp.fp8_params) && fp8_recipe_gathers;
  const std::vector<int> shard_members = mesh.group_ranks(rank, groups::kDpShard);
  const int shard = static_cast<int>(shard_members.size());
  const int replicate = mesh.group_size(groups::kDpReplicate);
  const bool sp = options.mesh.sequence_parallel && mesh.size(MeshDim::kTp) > 1;
  const int64_t syncs = options.fsdp.sync_each_micro_batch ? t.micro_batches : 1;
  const int64_t prepass = moe::needs_routing_prepass(config) ? t.micro_batches : 0;

  // With pipeline stages the rank issues collectives only for its own stage's parameters
  // (ShardPlan holds no others); activations and their gradients travel by send/recv, which
  // carries no parameter.
  const StageLayers stage = stage_layers(config.model.layers, mesh.size(MeshDim::kPp),
                                         mesh.stage(rank), config.model.pp_layers);

  std::vector<CollectiveCall> out;
  const auto add = [&](CollectiveKind kind, ReduceOp op, DimSet group, DType dtype, int64_t bytes,
                       const std::string& tensor, int64_t times) {
    for (int64_t i = 0; i < times; ++i)
      out.push_back({.step = step,
                     .kind = kind,
                     .op = op,
                     .group = group.str(),
                     .dtype = dtype,
                     .bytes = bytes,
                     .tensor = tensor});
  };
  for (const ParamSpec& spec : param_specs(config.model)) {
    if (!stage_holds(spec, stage)) continue;
    const Layout layout(mesh, spec.shape, placements(spec, mesh));
    const Box compute = compute_box(layout, rank);
    const Box& mine = layout.box(rank);
    std::vector<int64_t> member_numel, member_rows;
    for (int r : shard_members) {
      member_numel.push_back(layout.box(r).numel().value);
      member_rows.push_back(layout.box(r).extent[0].value);
    }
    // Weight gathers: the root unit is gathered once per micro-batch (it stays gathered from
    // the forward through the backward); a layer once, or twice with reshard_after_forward (the
    // backward gathers it again).
    // The MoE routing pre-pass (aux loss with micro-batches, docs/design.md "Tensor-parallel
    // experts") runs every micro-batch's forward once more first: the root and, with
    // reshard_after_forward, each layer gathered once more per micro-batch (without it the
    // pre-pass's gather of a layer is held through the first real forward).
    const int64_t gathers =
        t.micro_batches * (spec.unit == kRootUnit || !options.fsdp.reshard_after_forward ? 1 : 2) +
        (spec.unit == kRootUnit || options.fsdp.reshard_after_forward ? prepass : 0);
    const auto gather = [&](DType dtype, int64_t bytes) {
      add(CollectiveKind::kAllGather, ReduceOp::kSum, groups::kDpShard, dtype, bytes, spec.name,
          gathers);
    };
    if (shard > 1) {
      if (!(fp8_gather && spec.quantized())) {
        gather(DType::kFloat32, padded_bytes(member_numel, DType::kFloat32));
      } else if (rk == RecipeKind::kNvfp4) {
        // FP4 (section 28): the packed E2M1 rowwise bytes [r, cols / 2] and one E4M3 code per
        // 16x16 tile [r / 16, cols / 16]; the columnwise copy is rebuilt after the gather.
        const int64_t cols = compute.extent[1].value;
        std::vector<int64_t> packed, codes;
        for (int64_t r : member_rows) {
          packed.push_back(r * cols / 2);
          codes.push_back((r / 16) * (cols / 16));
        }
        gather(DType::kE4M3, padded_bytes(codes, DType::kE4M3));
        gather(DType::kUInt8, padded_bytes(packed, DType::kUInt8));
      } else if (rk != RecipeKind::kMxfp8) {
        // Per-tensor FP8: the e4m3 rows; the scale_inv is replicated (one scale per weight).
        gather(DType::kE4M3, padded_bytes(member_numel, DType::kE4M3));
      } else {
        // The columns this rank's tp shard computes with (row-parallel weights: K / tp).
        const int64_t cols = compute.extent[1].value;
        bool aligned = cols % 32 == 0;
        for (int64_t r : member_rows) aligned = aligned && r % 32 == 0;
        if (!aligned) {
          // The mxfp8 fallback: the bf16 shards, quantized after the gather.
          gather(DType::kBFloat16, padded_bytes(member_numel, DType::kBFloat16));
        } else {
          std::vector<int64_t> row_scales, col_scales;
          for (int64_t r : member_rows) {
            row_scales.push_back(r * (cols / 32));
            col_scales.push_back((r / 32) * cols);
          }
          // rowwise data, rowwise e8m0 scales, columnwise data, columnwise e8m0 scales
          gather(DType::kE4M3, padded_bytes(member_numel, DType::kE4M3));
          gather(DType::kE8M0, padded_bytes(row_scales, DType::kE8M0));
          gather(DType::kE4M3, padded_bytes(member_numel, DType::kE4M3));
          gather(DType::kE8M0, padded_bytes(col_scales, DType::kE8M0));
        }
      }
    }
    // Weight amax reductions over the weight's amax group (engine/parallel/amax_groups.h).
    if (spec.quantized()) {
      const DimSet g =
          amax_group({spec.linear_kind, Fp8Role::kWeight}, options.mesh, options.amax_groups);
      if (mesh.group_size(g) > 1) {
        const auto amax = [&](int64_t floats, int64_t times) {
          add(CollectiveKind::kAllReduce, ReduceOp::kMax, g, DType::kFloat32, floats * 4, spec.name,
              times);
        };
        const int64_t recompute = t.recompute ? 2 : 1;
        switch (rk) {
          case RecipeKind::kCurrent:
            // Gathered as FP8: the shard's amax once per step, before its quantization;
            // otherwise the recipe reduces at every quantization of the weight (the forward, and
            // the recomputed forward).
            amax(1, fp8_gather ? 1 : t.micro_batches * recompute + prepass);
            break;
          case RecipeKind::kDelayed:
            // The amax history's current slot, after each forward (the pre-pass's included).
            amax(1, t.micro_batches + prepass);
            break;
          case RecipeKind::kNvfp4:
            // The rowwise and columnwise global amaxes together: once per step before the shard's
            // quantization when gathered as FP4, else at every quantization of the weight.
            amax(2, fp8_gather ? 1 : t.micro_batches * recompute + prepass);
            break;
          default:
            break;  // mxfp8, block: no per-tensor amax
        }
      }
    }
    // Gradient reductions: the sequence-parallel partial sums of tp-replicated parameters over
    // tp, the reduce-scatter (avg) over dp_shard, the all-reduce (avg) over dp_replicate of a
    // non-empty shard.
    if (sp && !layout.placement(MeshDim::kTp).is_shard())
      add(CollectiveKind::kAllReduce, ReduceOp::kSum, groups::kTp, DType::kFloat32,
          compute.numel().value * 4, spec.name, syncs);
    if (shard > 1)
      add(CollectiveKind::kReduceScatter, ReduceOp::kAvg, groups::kDpShard, DType::kFloat32,
          padded_bytes(member_numel, DType::kFloat32), spec.name, syncs);
    if (replicate > 1 && mine.numel().value > 0)
      add(CollectiveKind::kAllReduce, ReduceOp::kAvg, groups::kDpReplicate, DType::kFloat32,
          mine.numel().value * 4, spec.name, syncs);
  }
  return out;
}

}  // namespace meshproof::engine
