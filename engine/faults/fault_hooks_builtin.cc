// The built-in faults' hooks of the first catalog and of issue #20's first round (docs/design.md
// sections 7 and 19): the vocabulary weights' gather padding, the unreduced amax, the
// left-to-right state layout, the unreduced HSDP replicas, the stale columnwise copy and stale FP8
// weight, the checkpoint save and restore faults, the local RoPE positions, the NVFP4 options and
// the last-micro-batch-only accumulation. Two runs of make_fault_hooks
// (engine/faults/fault_hooks_internal.h), apart from the generic faults that register between
// them and from the parallel machinery's faults after them.
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/checkpoint/state_keys.h"
#include "engine/config/config.h"
#include "engine/faults/fault_hooks.h"
#include "engine/faults/fault_hooks_internal.h"
#include "engine/faults/faults.h"
#include "engine/model/params.h"
#include "engine/model/recipe.h"
#include "kernels/core/error.h"
#include "kernels/core/formats.h"
#include "kernels/core/tensor.h"
#include "kernels/quantize/nvfp4.h"
#include "kernels/quantize/quantized_tensor.h"
#include "mesh/core/device_mesh.h"
#include "mesh/core/layout.h"
#include "mesh/core/padded_gather.h"

namespace meshproof::engine {

using kernels::Tensor;
using mesh::DimSet;
using mesh::Layout;
using mesh::MeshDim;
using mesh::Placement;

namespace {

// stale_columnwise_copy: from faults.from_step on, backward (dgrad) uses the columnwise copy of
// the weight quantized before the previous optimizer step instead of this step's. The weight is
// gathered once or twice per step (reshard_after_forward): the copy of the previous step is the
// one recorded at the first gather of that step. Copies are recorded from step 0 on, whatever
// from_step, so that the first active step has a previous copy.
class StaleColumnwise {
 public:
  StaleColumnwise(FaultInjection f) : f_(std::move(f)) {}
  void operator()(const ParamSpec& p, int64_t step, kernels::QuantizedTensor& w) {
    const int64_t layer = f_.stale_columnwise_layer;
    const bool this_layer = layer < 0 || p.unit == layer;
    Copies& c = copies_[p.linear];
    if (c.step != step) {
      if (c.step >= 0) {
        c.previous = c.current;
        c.has_previous = true;
      }
      c.current = {w.columnwise_data, w.columnwise_scale_inv};
      c.step = step;
    }
    if (this_layer && f_.active(step) && c.has_previous) {
      w.columnwise_data = c.previous.first;
      w.columnwise_scale_inv = c.previous.second;
    }
  }

 private:
  struct Copies {
    int64_t step = -1;                  // step of `current`
    std::pair<Tensor, Tensor> current;  // data, scale_inv
    std::pair<Tensor, Tensor> previous;
    bool has_previous = false;
  };
  FaultInjection f_;
  std::map<std::string, Copies> copies_;  // by linear
};

// stale_fp8_weight_after_update: from faults.from_step on, every gather of an FP8 weight hands
// the GEMMs the whole gathered copy (rowwise and columnwise data and scales) of the previous
// step's first gather, the weight as it was before the last optimizer update. Copies are
// recorded from step 0 on, as StaleColumnwise's; a fresh session (a resumed run) has none, so
// its first step computes with the current weight.
class StaleFp8Weight {
 public:
  StaleFp8Weight(FaultInjection f) : f_(std::move(f)) {}
  void operator()(const ParamSpec& p, int64_t step, kernels::QuantizedTensor& w) {
    Copies& c = copies_[p.linear];
    if (c.step != step) {
      if (c.step >= 0) {
        c.previous = c.current;
        c.has_previous = true;
      }
      c.current = w;
      c.step = step;
    }
    if (f_.active(step) && c.has_previous) w = c.previous;
  }

 private:
  struct Copies {
    int64_t step = -1;  // step of `current`
    kernels::QuantizedTensor current;
    kernels::QuantizedTensor previous;
    bool has_previous = false;
  };
  FaultInjection f_;
  std::map<std::string, Copies> copies_;  // by linear
};

// Whether optimizer_state_not_restored skips `key` (tensor or scalar).
bool optimizer_part_skips(const std::string& part, std::string_view key) {
  if (!keys::is_optim(key)) return false;
  if (part == "all") return true;
  if (part == keys::kExpAvg) return key.ends_with(std::string("/").append(keys::kExpAvg));
  if (part == keys::kExpAvgSq) return key.ends_with(std::string("/").append(keys::kExpAvgSq));
  if (part == "step") return key == keys::kOptimStep;
  MP_FAIL_INPUT(
      "fault optimizer_state_not_restored: unknown part '{}' (all, exp_avg, exp_avg_sq, "
      "step)",
      part);
}

}  // namespace

namespace fault_detail {

void add_first_builtin_faults(const FaultInjection& f, FaultHooks& h) {
  // uneven_shard_padding_leak: the vocabulary-sized weights (embed.tok, lm_head.weight) keep the
  // zero rows that pad uneven dp_shard chunks, so the logits gain zero classes.
  if (f.uneven_shard_padding_leak)
    h.on_weight_gather_padding([f](const ParamSpec& p, int64_t step, mesh::Padding v) {
      return p.vocab_rows && f.active(step) ? mesh::Padding::kKeep : v;
    });
  // amax_not_reduced: while active every tensor's group is empty (no reduction): each rank
  // scales by its own piece.
  if (f.amax_not_reduced)
    h.on_amax_group([f](std::string_view, Fp8Role, int64_t step, DimSet g) {
      return f.active(step) ? DimSet{} : g;
    });
  // tp_fsdp_left_to_right: the shards are the strided ones but the state describes them as
  // Shard(0) over dp_shard then tp (left to right), so a checkpoint puts their rows at the wrong
  // global offsets (visible when it is loaded on another mesh). Where the left-to-right box has
  // another shape than the real one the real layout is kept (the save would fail otherwise).
  if (f.tp_fsdp_left_to_right)
    h.on_state_layout([](const ParamSpec& p, const Layout& layout, int rank, Layout described) {
      if (layout.placement(MeshDim::kDpShard).kind != Placement::Kind::kStridedShard)
        return described;
      std::vector<Placement> pl = layout.placements();
      pl[static_cast<size_t>(MeshDim::kDpShard)] = Placement::shard(0);
      Layout l2r(layout.mesh(), p.shape, pl);
      return l2r.box(rank).shape() == layout.box(rank).shape() ? l2r : described;
    });
  // hsdp_replicas_not_reduced: gradients not all-reduced over dp_replicate (replicas drift).
  if (f.hsdp_replicas_not_reduced)
    h.on_gradient_replicas([f](int64_t step, bool reduce) { return reduce && !f.active(step); });
  // stale_columnwise_copy needs the executor to hold the quantized weights, so it also takes the
  // FP8 all-gather path (bitwise equal to the high-precision gather, see tests).
  if (f.stale_columnwise_copy) {
    auto stale = std::make_shared<StaleColumnwise>(f);
    h.on_backward_weight([stale](const ParamSpec& p, int64_t step,
                                 kernels::QuantizedTensor& w) { (*stale)(p, step, w); },
                         true);
  }
  // fp8_state_dropped_from_checkpoint: FP8 scales / amax histories (every fp8/ key) left out of
  // the checkpoint; a load of such a checkpoint keeps the live values for them.
  if (f.fp8_state_dropped_from_checkpoint)
    h.on_checkpoint_save(
        {.keeps = [f](std::string_view key,
                      int64_t step) { return !(f.active(step) && keys::is_fp8(key)); },
         .bytes = nullptr});
  // scale_inv_saved_bf16: fp32 scales and scale_invs rounded through bf16 (RNE) when saved.
  if (f.scale_inv_saved_bf16)
    h.on_checkpoint_save(
        {.keeps = nullptr, .bytes = [f](std::string_view key, int64_t step, Tensor host) {
           if (!f.active(step) || host.dtype() != kernels::DType::kFloat32 ||
               !(key.ends_with("/scale") || key.ends_with("/scale_inv")))
             return host;
           Tensor t = host.clone();
           float* p = t.data<float>();
           for (int64_t i = 0; i < t.numel().value; ++i)
             p[i] = kernels::fmt8::bf16_to_float(kernels::fmt8::float_to_bf16(p[i]));
           return t;
         }});
  // data_cursor_not_restored: the resumed run replays batches from step 0.
  if (f.data_cursor_not_restored)
    h.on_checkpoint_restore([f](std::string_view key, int64_t step) {
      return !(f.active(step) && key == keys::kDataCursor);
    });
  // optimizer_state_not_restored: the optimizer state part (all, exp_avg, exp_avg_sq, step).
  if (f.optimizer_state_not_restored)
    h.on_checkpoint_restore([f](std::string_view key, int64_t step) {
      return !(f.active(step) && optimizer_part_skips(f.optimizer_state_part, key));
    });
}

void add_issue20_builtin_faults(const FaultInjection& f, FaultHooks& h) {
  // ---- built-in catalog faults added with issue #20
  if (f.stale_fp8_weight_after_update) {
    auto stale = std::make_shared<StaleFp8Weight>(f);
    h.on_backward_weight([stale](const ParamSpec& p, int64_t step,
                                 kernels::QuantizedTensor& w) { (*stale)(p, step, w); },
                         true);
  }
  // rope_positions_local_under_sp: every sequence shard's tokens rotated as if it started at
  // position 0.
  if (f.rope_positions_local_under_sp)
    h.on_rope_positions([f](int64_t step, bool global) { return global && !f.active(step); });
  // swiglu_gate_up_swizzled_in_checkpoint: the saved shard of every model/...mlp.fc1_gate.weight
  // and .fc1_up.weight holds its rows' second half first (the shard's two halves exchanged).
  if (f.swiglu_gate_up_swizzled_in_checkpoint)
    h.on_checkpoint_save(
        {.keeps = nullptr, .bytes = [f](std::string_view key, int64_t step, Tensor host) {
           if (!f.active(step) || !key.starts_with(keys::kModel) ||
               !(key.ends_with("mlp.fc1_gate.weight") || key.ends_with("mlp.fc1_up.weight")) ||
               host.shape().rank() < 1 || host.shape()[0] < 2)
             return host;
           const int64_t rows = host.shape()[0], half = rows / 2;
           Tensor t = host.clone();
           t.slice_rows(0, rows - half).copy_from(host.slice_rows(half, rows));
           t.slice_rows(rows - half, rows).copy_from(host.slice_rows(0, half));
           return t;
         }});
  if (f.nvfp4_rht_on_one_operand) {
    // The input's columnwise copy loses its RHT; the output gradient's keeps it.
    h.on_nvfp4_options([f](std::string_view, Fp8Role role, int64_t step, kernels::Nvfp4Options o) {
      if (f.active(step) && role == Fp8Role::kInput) o.rht = false;
      return o;
    });
  }
  if (f.nvfp4_block_scale_pow2) {
    h.on_nvfp4_options([f](std::string_view, Fp8Role, int64_t step, kernels::Nvfp4Options o) {
      if (f.active(step)) o.pow2_block_scales = true;
      return o;
    });
  }
  // amax_history_restored_from_init: the delayed-scaling amax histories keep the fresh engine's
  // init values (zeros) on load; the scales are restored.
  if (f.amax_history_restored_from_init)
    h.on_checkpoint_restore([f](std::string_view key, int64_t step) {
      return !(f.active(step) && keys::is_fp8(key) && key.ends_with("/amax_history"));
    });
  // optimizer_step_advanced_before_load: a synthetic step before the load advanced the step
  // counter, and the load keeps the advance.
  if (f.optimizer_step_advanced_before_load)
    h.on_restored_scalar([f](std::string_view key, int64_t step, int64_t value) {
      return f.active(step) && key == keys::kOptimStep ? value + 1 : value;
    });
  // grad_accum_last_micro_batch_only: each micro-batch's gradients replace the accumulated ones.
  if (f.grad_accum_last_micro_batch_only)
    h.on_gradient_accumulation(
        [f](int64_t step, bool accumulate) { return accumulate && !f.active(step); });
}

}  // namespace fault_detail

}  // namespace meshproof::engine
