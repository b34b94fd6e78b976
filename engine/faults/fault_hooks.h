// The named points at which injected faults act (docs/design.md sections 7 and 20). The hot
// paths (the FSDP unit executor, the FP8 weight store, the checkpoint save and load) ask one of
// these points and never test a fault flag: a point folds over the hooks registered on it, in
// registration order, starting from the correct behaviour. make_fault_hooks registers the hooks
// of the faults an engine::FaultInjection enables (each gated by FaultInjection::active); a new
// fault registers a hook on an existing point (or, for a new kind of bug, adds one point here and
// one call at its site), so the hot paths stay untouched.
//
//   point                  asked by                      faults today
//   weight_gather_padding  dp_shard weight all-gather    uneven_shard_padding_leak
//   amax_group             every amax MAX-reduction      amax_not_reduced,
//                                                        nvfp4_global_amax_not_reduced
//   state_layout           checkpoint state entries      tp_fsdp_left_to_right
//   gradient_replicas      HSDP gradient all-reduce      hsdp_replicas_not_reduced
//   backward_weight        each FP8 weight gather        stale_columnwise_copy
//   checkpoint_save        each saved key (+ its bytes)  fp8_state_dropped_from_checkpoint,
//                                                        scale_inv_saved_bf16,
//                                                        swiglu_gate_up_swizzled_in_checkpoint
//   checkpoint_restore     each loaded key and scalar    data_cursor_not_restored,
//                                                        optimizer_state_not_restored,
//                                                        amax_history_restored_from_init
//   state                  the rank's state after a      freeze_state, perturb
//                          load, at a step's start and
//                          after its optimizer update
//   rope_positions         each micro-batch's RoPE       rope_positions_local_under_sp
//   nvfp4_options          each NVFP4 quantization       nvfp4_rht_on_one_operand,
//                                                        nvfp4_block_scale_pow2
//   restored_scalar        each restored scalar's value  optimizer_step_advanced_before_load
//   gradient_accumulation  each micro-batch's gradients  grad_accum_last_micro_batch_only
//   gathered_weight        each FP8 all-gathered weight  scale_inv_gathered_bf16
//                          as the gather returns it
//   load_box               each loaded key's target box  vocab_uneven_resume_rows
//   block_scale_padding    each MXFP8 FP8 all-gather's   block_scale_padding_reshard
//                          block scales
//   router_precision       each MoE router GEMM          router_not_fp32
//   collective             each collective the engine    skip_collective, collective_dtype,
//                          issues for a parameter        fp8_all_gather_in_bf16
//   extra_amax_group       each weight amax reduction    tp_weight_amax_all_reduced
//   expert_grad_factor     each MoE micro-batch's        expert_grad_scaled_by_ep
//                          expert weight gradients
//   expert_split_padding   each MoE layer's expert       expert_split_padding_too_small
//                          wgrad input operands
//   pp_last_backward       each pipeline stage's last        pp_last_backward_sync_skipped
//                          backward of a step
//   pp_accumulation        each pipeline stage's backward    pp_microbatch_grads_overwritten
//   pp_tied_sync           each step's exchange of a tied    pp_tied_embedding_grad_not_synced
//                          embedding's gradient parts
// (moe_final_backward_skips_experts acts on the collective point.)
// The generic (user-defined) faults register on these points too: drop_checkpoint_key and
// checkpoint_key_dtype on checkpoint_save, amax_group on amax_group.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/checkpoint/sharded_state.h"
#include "engine/config/config.h"
#include "engine/faults/faults.h"
#include "engine/model/params.h"
#include "engine/model/recipe.h"
#include "engine/parallel/scale_padding.h"
#include "kernels/core/tensor.h"
#include "kernels/quantize/nvfp4.h"
#include "kernels/quantize/quantized_tensor.h"
#include "mesh/core/communicator.h"
#include "mesh/core/device_mesh.h"
#include "mesh/core/layout.h"
#include "mesh/core/padded_gather.h"

namespace meshproof::engine {

class FaultHooks {
 public:
  // --- hook types (what a fault registers) ---
  using GatherPaddingHook =
      std::function<mesh::Padding(const ParamSpec&, int64_t step, mesh::Padding)>;
  using AmaxGroupHook =
      std::function<mesh::DimSet(std::string_view linear, Fp8Role, int64_t step, mesh::DimSet)>;
  using StateLayoutHook = std::function<mesh::Layout(const ParamSpec&, const mesh::Layout& layout,
                                                     int rank, mesh::Layout described)>;
  using GradientReplicasHook = std::function<bool(int64_t step, bool reduce)>;
  // Called at every FP8 gather of a quantized weight with its gathered copy (may replace parts).
  using BackwardWeightHook =
      std::function<void(const ParamSpec&, int64_t step, kernels::QuantizedTensor& gathered)>;
  // Whether `key` is saved at `step`, and the host bytes to save (return `host` or a changed
  // copy; never change `host` in place: it may share the live tensor's storage).
  struct SaveHook {
    std::function<bool(std::string_view key, int64_t step)> keeps;
    std::function<kernels::Tensor(std::string_view key, int64_t step, kernels::Tensor host)> bytes;
  };
  using RestoreHook = std::function<bool(std::string_view key, int64_t step)>;
  // The rank's state at a point of the run (its entries share storage with the live tensors).
  enum class StatePoint {
    kLoaded,       // a checkpoint was just loaded into it (step: the loaded step count)
    kStepBegin,    // step `step` (0-based) starts, before its forward reads anything
    kAfterUpdate,  // step `step`'s optimizer update is done, before FP8 weights re-quantize
  };
  using StateHook = std::function<void(StatePoint, int64_t step, ShardedState& state)>;
  // Whether RoPE uses the global positions under sequence parallelism (true: correct).
  using RopePositionsHook = std::function<bool(int64_t step, bool global)>;
  // The options an NVFP4 quantization of (linear, role) uses at `step`, given the recipe's.
  using Nvfp4OptionsHook = std::function<kernels::Nvfp4Options(
      std::string_view linear, Fp8Role, int64_t step, kernels::Nvfp4Options)>;
  // The value a load of a checkpoint of `step` restores for scalar `key`, given `value`.
  using ScalarRestoreHook =
      std::function<int64_t(std::string_view key, int64_t step, int64_t value)>;
  using GradientAccumulationHook = std::function<bool(int64_t step, bool accumulate)>;
  // Called with each FP8 all-gathered weight as the gather returns it, before anything reads
  // it (allgather_parity, the GEMMs); may replace buffers (never edit one in place: the
  // scale_inv is shared with the local shard).
  using GatheredWeightHook =
      std::function<void(const ParamSpec&, int64_t step, kernels::QuantizedTensor& gathered)>;
  // The global box a load of a checkpoint of `step` reads into `rank`'s local tensor of `key`
  // (same shape as `box`, the layout's), given `box`.
  // How the MXFP8 all-gather of `p` at `step` lays out each member's block scales (ScalePadding;
  // the default, no padding, is correct).
  using BlockScalePaddingHook =
      std::function<ScalePadding(const ParamSpec&, int64_t step, ScalePadding)>;
  using LoadBoxHook = std::function<mesh::Box(std::string_view key, const mesh::Layout&, int rank,
                                              int64_t step, mesh::Box box)>;
  // Whether the MoE router GEMM runs in fp32 at `step` (true: correct; docs/design.md section 27).
  using RouterPrecisionHook = std::function<bool(int64_t step, bool fp32)>;
  // A collective the engine issues for a parameter (docs/design.md section 29): its kind, the
  // mesh group, the parameter's name and the step. What runs: the collective (run) and, for an
  // all-gather, the dtype its values travel in (nullopt: their own).
  struct CollectiveSite {
    mesh::CollectiveKind kind = mesh::CollectiveKind::kAllGather;
    mesh::DimSet group;
    std::string_view tensor;
    int64_t step = 0;
    bool fp8 = false;  // an FP8 all-gather (the FP8 bytes and scales of a quantized weight)
  };
  struct CollectiveAction {
    bool run = true;
    std::optional<kernels::DType> dtype;
  };
  using CollectiveHook = std::function<CollectiveAction(const CollectiveSite&, CollectiveAction)>;
  // A second group the weight amax of `linear` is MAX-reduced over after the plan's group
  // (empty: none).
  using ExtraAmaxGroupHook =
      std::function<mesh::DimSet(std::string_view linear, int64_t step, mesh::DimSet extra)>;
  // The factor the owner's expert weight gradients are multiplied by under expert parallelism
  // with `ep` ranks (1: correct; docs/design.md "Expert parallelism").
  using ExpertGradFactorHook = std::function<double(int64_t step, int ep, double factor)>;
  // The row padding of the grouped columnwise quantization of the experts' wgrad inputs; 0: no
  // grouped quantization (each expert's operands quantized per expert, correct).
  using ExpertSplitPaddingHook = std::function<int64_t(int64_t step, int64_t padding)>;
  // Whether pipeline stage `stage`'s last backward of `step` runs the deferred gradient
  // reduction (true: correct; docs/design.md section 33).
  using PpLastBackwardHook = std::function<bool(int stage, int64_t step, bool reduce)>;
  // Whether pipeline stage `stage` of `stages` adds each micro-batch's gradients to the
  // accumulated ones at `step` (true: correct).
  using PpAccumulationHook =
      std::function<bool(int stage, int stages, int64_t step, bool accumulate)>;
  // Whether the first and the last pipeline stage exchange a tied embedding's gradient parts at
  // `step` before reducing it (true: correct; docs/design.md section 33).
  using PpTiedSyncHook = std::function<bool(int64_t step, bool exchange)>;

  // --- registration ---
  void on_weight_gather_padding(GatherPaddingHook h) { padding_.push_back(std::move(h)); }
  void on_amax_group(AmaxGroupHook h) { amax_.push_back(std::move(h)); }
  void on_state_layout(StateLayoutHook h) { state_layout_.push_back(std::move(h)); }
  void on_gradient_replicas(GradientReplicasHook h) { replicas_.push_back(std::move(h)); }
  // `needs_quantized_weights`: the hook needs every GEMM weight gathered through the FP8 path.
  void on_backward_weight(BackwardWeightHook h, bool needs_quantized_weights) {
    backward_.push_back(std::move(h));
    needs_quantized_ = needs_quantized_ || needs_quantized_weights;
  }
  void on_checkpoint_save(SaveHook h) { save_.push_back(std::move(h)); }
  void on_checkpoint_restore(RestoreHook h) { restore_.push_back(std::move(h)); }
  void on_state(StateHook h) { state_.push_back(std::move(h)); }
  void on_rope_positions(RopePositionsHook h) { rope_.push_back(std::move(h)); }
  void on_nvfp4_options(Nvfp4OptionsHook h) { nvfp4_.push_back(std::move(h)); }
  void on_restored_scalar(ScalarRestoreHook h) { restored_scalar_.push_back(std::move(h)); }
  void on_gradient_accumulation(GradientAccumulationHook h) {
    accumulation_.push_back(std::move(h));
  }
  void on_gathered_weight(GatheredWeightHook h) { gathered_.push_back(std::move(h)); }
  void on_load_box(LoadBoxHook h) { load_box_.push_back(std::move(h)); }
  void on_block_scale_padding(BlockScalePaddingHook h) {
    block_scale_padding_.push_back(std::move(h));
  }
  void on_router_precision(RouterPrecisionHook h) { router_.push_back(std::move(h)); }
  void on_collective(CollectiveHook h) { collective_.push_back(std::move(h)); }
  void on_extra_amax_group(ExtraAmaxGroupHook h) { extra_amax_.push_back(std::move(h)); }
  void on_expert_grad_factor(ExpertGradFactorHook h) { expert_grad_.push_back(std::move(h)); }
  void on_expert_split_padding(ExpertSplitPaddingHook h) {
    expert_split_padding_.push_back(std::move(h));
  }
  void on_pp_last_backward(PpLastBackwardHook h) { pp_last_backward_.push_back(std::move(h)); }
  void on_pp_accumulation(PpAccumulationHook h) { pp_accumulation_.push_back(std::move(h)); }
  void on_pp_tied_sync(PpTiedSyncHook h) { pp_tied_sync_.push_back(std::move(h)); }

  // --- the points ---
  // How the dp_shard all-gather of parameter `p`'s weight treats the padding (kCut: correct).
  mesh::Padding weight_gather_padding(const ParamSpec& p, int64_t step) const;
  // The group an amax of (linear, role) is MAX-reduced over, given the table's `group`.
  mesh::DimSet amax_group(std::string_view linear, Fp8Role role, int64_t step,
                          mesh::DimSet group) const;
  // The layout parameter `p`'s checkpoint entries describe, given its real `layout`.
  mesh::Layout state_layout(const ParamSpec& p, const mesh::Layout& layout, int rank) const;
  // Whether the gradients are all-reduced over dp_replicate at `step` (HSDP).
  bool gradient_replicas(int64_t step) const;
  // The gathered FP8 weight of `p` as the backward sees it.
  void backward_weight(const ParamSpec& p, int64_t step, kernels::QuantizedTensor& w) const;
  bool needs_quantized_weights() const { return needs_quantized_; }
  // Whether `key` goes into the checkpoint of `step`.
  bool checkpoint_keeps(std::string_view key, int64_t step) const;
  // The host bytes saved for `key` at `step`.
  kernels::Tensor checkpoint_bytes(std::string_view key, int64_t step, kernels::Tensor host) const;
  // Whether a load of a checkpoint of `step` restores `key` (tensor or scalar).
  bool restores(std::string_view key, int64_t step) const;
  // Lets the state hooks act on the rank's state at `point`.
  void state(StatePoint point, int64_t step, ShardedState& state) const;
  // Whether the model's RoPE uses global positions under sequence parallelism at `step`.
  bool rope_global_positions(int64_t step) const;
  // Whether the MoE router GEMM runs in fp32 at `step`.
  bool router_fp32(int64_t step) const;
  // The NVFP4 options of (linear, role) at `step`, given the recipe's `o`.
  kernels::Nvfp4Options nvfp4_options(std::string_view linear, Fp8Role role, int64_t step,
                                      kernels::Nvfp4Options o) const;
  bool has_nvfp4_hooks() const { return !nvfp4_.empty(); }
  // The value a load of a checkpoint of `step` restores for scalar `key` (saved: `value`).
  int64_t restored_scalar(std::string_view key, int64_t step, int64_t value) const;
  // Whether a micro-batch after the first adds its gradients to the accumulated ones at `step`
  // (false: it replaces them).
  bool accumulates_gradients(int64_t step) const;
  // The FP8 all-gathered weight of `p` as the gather hands it on.
  void gathered_weight(const ParamSpec& p, int64_t step, kernels::QuantizedTensor& w) const;
  // The global box a load of a checkpoint of `step` reads into `rank`'s tensor of `key`.
  mesh::Box load_box(std::string_view key, const mesh::Layout& layout, int rank,
                     int64_t step) const;
  // The layout of the block scales the MXFP8 all-gather of `p` gathers at `step`.
  ScalePadding block_scale_padding(const ParamSpec& p, int64_t step) const;
  // What runs of the collective at `site` (the default action: it runs, in its own dtype).
  CollectiveAction collective(const CollectiveSite& site) const;
  // The group a weight amax of `linear` is reduced over again after the plan's (empty: none).
  mesh::DimSet extra_amax_group(std::string_view linear, int64_t step) const;
  // The factor of the owner's expert weight gradients at `step` with `ep` expert-parallel ranks.
  double expert_grad_factor(int64_t step, int ep) const;
  // TpContext::expert_split_padding at `step`: 0 (correct) or the grouped quantization's padding.
  int64_t expert_split_padding(int64_t step) const;
  // Whether pipeline stage `stage`'s last backward of `step` runs its deferred gradient
  // reduction.
  bool pp_last_backward(int stage, int64_t step) const;
  // Whether pipeline stage `stage` of `stages` accumulates its micro-batches' gradients at
  // `step`.
  bool pp_accumulates(int stage, int stages, int64_t step) const;
  // Whether the end stages exchange a tied embedding's gradient parts at `step`.
  bool pp_tied_embedding_synced(int64_t step) const;

 private:
  std::vector<GatherPaddingHook> padding_;
  std::vector<AmaxGroupHook> amax_;
  std::vector<StateLayoutHook> state_layout_;
  std::vector<GradientReplicasHook> replicas_;
  std::vector<BackwardWeightHook> backward_;
  std::vector<SaveHook> save_;
  std::vector<RestoreHook> restore_;
  std::vector<StateHook> state_;
  std::vector<RopePositionsHook> rope_;
  std::vector<RouterPrecisionHook> router_;
  std::vector<Nvfp4OptionsHook> nvfp4_;
  std::vector<ScalarRestoreHook> restored_scalar_;
  std::vector<GradientAccumulationHook> accumulation_;
  std::vector<GatheredWeightHook> gathered_;
  std::vector<LoadBoxHook> load_box_;
  std::vector<BlockScalePaddingHook> block_scale_padding_;
  std::vector<CollectiveHook> collective_;
  std::vector<ExtraAmaxGroupHook> extra_amax_;
  std::vector<ExpertGradFactorHook> expert_grad_;
  std::vector<ExpertSplitPaddingHook> expert_split_padding_;
  std::vector<PpLastBackwardHook> pp_last_backward_;
  std::vector<PpAccumulationHook> pp_accumulation_;
  std::vector<PpTiedSyncHook> pp_tied_sync_;
  bool needs_quantized_ = false;
};

// The hooks of every fault `faults` enables. An unknown optimizer_state_part is an input error
// when the restore point is asked about an optim/ key (the harness validates it up front).
FaultHooks make_fault_hooks(const FaultInjection& faults);

// What the generic faults' globs can name, known before a run (the harness rejects a glob that
// matches none of them): every checkpoint key of a run of `config` with `fsdp` (tensors and
// scalars; engine/checkpoint/state_keys.h), with whether it is an fp32 tensor (the only ones
// checkpoint_key_dtype, freeze_state and perturb change).
struct FaultKey {
  std::string key;
  bool fp32_tensor = false;
};
std::vector<FaultKey> fault_key_names(const Config& config, bool fp8_params);
// The quantized linears of `config`'s model, as the recipe and amax groups name them
// ("layers.0.attn.qkv", ...).
std::vector<std::string> fault_linear_names(const Config& config);
// The parameters of `config`'s model, as the collective faults' tensor globs name them
// ("embed.tok", "layers.0.attn.qkv.weight", ...).
std::vector<std::string> fault_param_names(const Config& config);
// The collective kinds the collective faults name ("all_gather", "reduce_scatter",
// "all_reduce"; an input error otherwise) and the dtypes an all-gather can be moved through
// ("bf16", "fp16").
mesh::CollectiveKind parse_fault_collective_kind(std::string_view name);
kernels::DType parse_fault_wire_dtype(std::string_view name);

}  // namespace meshproof::engine
