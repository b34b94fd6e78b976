// The hooks of the catalog's faults in the parallel machinery (docs/design.md sections 19, 27, 29
// and 33): FP8 all-gathered scale_invs through bf16, the floor-offset vocabulary rows of a
// resharded load, MXFP8 block scales gathered with their swizzle padding, the MoE router in bf16,
// the weights' NVFP4 global amax unreduced and the weight amax reduced over tp again, the
// collective faults (skipped, moved through another dtype, the FP8 all-gather in bf16, the experts'
// reductions skipped), the experts' gradient factor and split padding, and the pipeline stages'
// skipped sync, overwritten accumulators and unsynced tied embedding. The last run of
// make_fault_hooks (engine/faults/fault_hooks_internal.h), where a new fault registers.
#include <string_view>
#include <utility>

#include "engine/checkpoint/state_keys.h"
#include "engine/faults/fault_hooks.h"
#include "engine/faults/fault_hooks_internal.h"
#include "engine/faults/faults.h"
#include "engine/model/params.h"
#include "engine/model/recipe.h"
#include "engine/parallel/scale_padding.h"
#include "kernels/core/formats.h"
#include "kernels/core/tensor.h"
#include "kernels/quantize/quantized_tensor.h"
#include "mesh/core/communicator.h"
#include "mesh/core/device_mesh.h"
#include "mesh/core/layout.h"

namespace meshproof::engine {

using kernels::Tensor;
using mesh::DimSet;
using mesh::Layout;
using mesh::MeshDim;
using mesh::Placement;

namespace {

// scale_inv_gathered_bf16: a float32 scale_inv buffer rounded through bf16 (RNE), as a copy.
Tensor scale_inv_through_bf16(const Tensor& s) {
  if (!s.defined() || s.dtype() != kernels::DType::kFloat32) return s;
  Tensor t = s.to(kernels::Device::cpu()).clone();
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel().value; ++i)
    p[i] = kernels::fmt8::bf16_to_float(kernels::fmt8::float_to_bf16(p[i]));
  return t.on(s.device());
}

// vocab_uneven_resume_rows: the checkpoint keys of the vocabulary-row parameters (their masters
// and AdamW moments).
bool vocab_row_key(std::string_view key) {
  for (const char* p : {"embed.tok", "lm_head.weight"})
    if (key == keys::model(p) || key == keys::exp_avg(p) || key == keys::exp_avg_sq(p)) return true;
  return false;
}

// The box the buggy loader reads for `rank`: where exactly one mesh dim shards the rows with a
// plain Shard(0) (FSDP's dp_shard chunks of the vocabulary) over n ranks and n does not divide
// the V rows, the rank's first row is k * floor(V / n) (k: its coordinate on that dim) instead
// of torch.chunk's k * ceil(V / n); the extent stays the rank's own. Rows of the next chunk are
// read twice and the last (n - 1) * (ceil - floor) rows of V never.
mesh::Box floor_offset_box(const Layout& layout, int rank, mesh::Box box) {
  int dims = 0;
  MeshDim row_dim = MeshDim::kDpShard;
  for (MeshDim d : mesh::kAllMeshDims) {
    const Placement& pl = layout.placement(d);
    if (pl.is_shard() && pl.dim == 0 && layout.mesh().size(d) > 1) {
      ++dims;
      row_dim = d;
    }
  }
  if (dims != 1 || layout.placement(row_dim).kind != Placement::Kind::kShard || box.empty())
    return box;
  const int64_t rows = layout.global_shape()[0], n = layout.mesh().size(row_dim);
  if (rows % n == 0) return box;
  box.offset[0] = kernels::Elements(layout.mesh().coord(rank, row_dim) * (rows / n));
  return box;
}

}  // namespace

namespace fault_detail {

void add_parallel_faults(const FaultInjection& f, FaultHooks& h) {
  // ---- catalog entries (issue #20)
  // scale_inv_gathered_bf16: the per-tensor scale_inv of every FP8 all-gathered weight arrives
  // rounded through bf16; the FP8 bytes are the correctly scaled ones.
  if (f.scale_inv_gathered_bf16)
    h.on_gathered_weight([f](const ParamSpec&, int64_t step, kernels::QuantizedTensor& w) {
      const bool per_tensor = w.mode == kernels::ScalingMode::kCurrentTensor ||
                              w.mode == kernels::ScalingMode::kDelayedTensor;
      if (!f.active(step) || !per_tensor) return;
      w.rowwise_scale_inv = scale_inv_through_bf16(w.rowwise_scale_inv);
      w.columnwise_scale_inv = scale_inv_through_bf16(w.columnwise_scale_inv);
    });
  // vocab_uneven_resume_rows: the loader reads the vocabulary-row tensors at floor-sized chunk
  // offsets.
  if (f.vocab_uneven_resume_rows)
    h.on_load_box([f](std::string_view key, const Layout& layout, int rank, int64_t step,
                      mesh::Box box) {
      return f.active(step) && vocab_row_key(key) ? floor_offset_box(layout, rank, std::move(box))
                                                  : box;
    });
  // block_scale_padding_reshard: every member's MXFP8 block scales keep TransformerEngine's
  // swizzle padding (rowwise rows to 128, columnwise rows to 4) through the all-gather.
  if (f.block_scale_padding_reshard)
    h.on_block_scale_padding([f](const ParamSpec&, int64_t step, ScalePadding padding) {
      return f.active(step) ? ScalePadding{.rowwise_rows = 128, .columnwise_rows = 4} : padding;
    });
  // router_not_fp32: the MoE router GEMM runs on bf16 operands with a bf16 output.
  if (f.router_not_fp32)
    h.on_router_precision([f](int64_t step, bool fp32) { return fp32 && !f.active(step); });
  // nvfp4_global_amax_not_reduced: the weights' amax group is empty while active, so under the
  // FP4 all-gather (the only NVFP4 weight quantization that reduces over a group: the gathered
  // weights reach the recipe prequantized) each rank takes its shard's global amax for the
  // second-level scale. Activations and gradients keep their groups.
  if (f.nvfp4_global_amax_not_reduced)
    h.on_amax_group([f](std::string_view, Fp8Role role, int64_t step, DimSet g) {
      return f.active(step) && role == Fp8Role::kWeight ? DimSet{} : g;
    });
  // tp_weight_amax_all_reduced: every weight amax is MAX-reduced over tp once more.
  if (f.tp_weight_amax_all_reduced)
    h.on_extra_amax_group([f](std::string_view, int64_t step, DimSet extra) {
      return f.active(step) ? DimSet{MeshDim::kTp} : extra;
    });
  // fp8_all_gather_in_bf16: the FP8 all-gather of every quantized weight moves bf16 values (the
  // engine then quantizes the gathered weight).
  if (f.fp8_all_gather_in_bf16)
    h.on_collective([f](const FaultHooks::CollectiveSite& site, FaultHooks::CollectiveAction a) {
      if (f.active(site.step) && site.fp8) a.dtype = kernels::DType::kBFloat16;
      return a;
    });
  // skip_collective: matching collectives are not issued.
  if (!f.skip_collective_tensor.empty()) {
    const mesh::CollectiveKind kind = parse_fault_collective_kind(f.skip_collective_kind);
    const DimSet group = DimSet::parse(f.skip_collective_group);
    h.on_collective(
        [f, kind, group](const FaultHooks::CollectiveSite& site, FaultHooks::CollectiveAction a) {
          if (f.active(site.step) && site.kind == kind && site.group == group &&
              match_glob(f.skip_collective_tensor, site.tensor))
            a.run = false;
          return a;
        });
  }
  // collective_dtype: matching all-gathers move their values through the dtype.
  if (!f.collective_dtype_tensor.empty()) {
    const mesh::CollectiveKind kind = parse_fault_collective_kind(f.collective_dtype_kind);
    const kernels::DType dtype = parse_fault_wire_dtype(f.collective_dtype_dtype);
    h.on_collective(
        [f, kind, dtype](const FaultHooks::CollectiveSite& site, FaultHooks::CollectiveAction a) {
          if (f.active(site.step) && site.kind == kind &&
              match_glob(f.collective_dtype_tensor, site.tensor))
            a.dtype = dtype;
          return a;
        });
  }
  // expert_grad_scaled_by_ep: the owner's expert weight gradients x ep (no effect at ep = 1).
  if (f.expert_grad_scaled_by_ep)
    h.on_expert_grad_factor(
        [f](int64_t step, int ep, double factor) { return f.active(step) ? factor * ep : factor; });
  // moe_final_backward_skips_experts: the gradient reductions of the expert parameters are not
  // issued (with deferred sync they run once, after the last micro-batch's backward).
  if (f.moe_final_backward_skips_experts)
    h.on_collective([f](const FaultHooks::CollectiveSite& site, FaultHooks::CollectiveAction a) {
      const bool reduction = (site.kind == mesh::CollectiveKind::kReduceScatter &&
                              site.group == DimSet{MeshDim::kDpShard}) ||
                             (site.kind == mesh::CollectiveKind::kAllReduce &&
                              site.group == DimSet{MeshDim::kDpReplicate});
      if (f.active(site.step) && reduction &&
          site.tensor.find(".moe.experts.") != std::string_view::npos)
        a.run = false;
      return a;
    });
  // expert_split_padding_too_small: the experts' wgrad inputs come from one grouped columnwise
  // quantization with every expert's rows padded to 16 (GptModel::moe_forward).
  if (f.expert_split_padding_too_small)
    h.on_expert_split_padding([f](int64_t step, int64_t padding) {
      return f.active(step) ? f.expert_split_padding_rows : padding;
    });
  // pp_last_backward_sync_skipped: the first stage's last backward does not reduce.
  if (f.pp_last_backward_sync_skipped)
    h.on_pp_last_backward([f](int stage, int64_t step, bool reduce) {
      return reduce && !(f.active(step) && stage == 0);
    });
  // pp_microbatch_grads_overwritten: the last stage overwrites its gradient accumulators.
  if (f.pp_microbatch_grads_overwritten)
    h.on_pp_accumulation([f](int stage, int stages, int64_t step, bool accumulate) {
      return accumulate && !(f.active(step) && stage == stages - 1);
    });
  // pp_tied_embedding_grad_not_synced: the end stages do not exchange the tied gradient parts.
  if (f.pp_tied_embedding_grad_not_synced)
    h.on_pp_tied_sync([f](int64_t step, bool exchange) { return exchange && !f.active(step); });
}

}  // namespace fault_detail

}  // namespace meshproof::engine
