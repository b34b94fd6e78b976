// Injected faults (docs/design.md section 7): each reproduces a real bug class of sharded FP8
// training and must be caught by a check. Plain data handed to the engine; the harness maps the
// scenario's fault catalog entries (harness/faults/scenario_faults.cc) onto it. A fault is active
// from step `from_step` on (counted in optimizer steps; 0 = from the start).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace meshproof::engine {

struct FaultInjection {
  // Per-tensor amax of sharded weights not MAX-reduced over the weight-sharding group, so
  // gather(quantize(shard)) != quantize(gather(shard)). Caught by allgather_parity, reference.
  bool amax_not_reduced = false;
  // FSDP x TP weights laid out left-to-right (Shard(0) over dp_shard then tp) instead of
  // StridedShard(0, sf=tp): checkpoint chunks land in the wrong global rows on another mesh.
  // Caught by resume_cross_mesh.
  bool tp_fsdp_left_to_right = false;
  // FP8 scale / amax history omitted from checkpoints (resumed delayed scaling restarts at 1).
  bool fp8_state_dropped_from_checkpoint = false;
  // scale_inv (and scale) round-tripped through bf16 when saved.
  bool scale_inv_saved_bf16 = false;
  // Backward uses a columnwise (transposed) FP8 weight copy from before the last optimizer step.
  bool stale_columnwise_copy = false;
  int64_t stale_columnwise_layer = -1;  // -1: every layer
  // Data cursor not restored on resume (the resumed run replays batches from step 0).
  bool data_cursor_not_restored = false;
  // Optimizer state not restored on resume: "all", "exp_avg", "exp_avg_sq" or "step".
  bool optimizer_state_not_restored = false;
  std::string optimizer_state_part = "all";
  // HSDP gradients not all-reduced over dp_replicate (replicas drift apart).
  bool hsdp_replicas_not_reduced = false;
  // The zero padding that evens out uneven shards for collectives leaks into the math (padded
  // rows are treated as real rows of the weight).
  bool uneven_shard_padding_leak = false;
  // RoPE under sequence parallelism rotates q and k by each tp rank's local positions (every
  // sequence shard restarting at 0) instead of the global ones.
  bool rope_positions_local_under_sp = false;
  // SwiGLU's gate and up weights (mlp.fc1_gate / mlp.fc1_up) saved with each rank's shard rows in
  // TP-swizzled order: the two row halves of the shard exchanged, as when a fused [gate; up]
  // per tp rank is split back the wrong way.
  bool swiglu_gate_up_swizzled_in_checkpoint = false;

  // ---- user-defined generic faults (docs/design.md section 23): each names what it corrupts
  // with a glob over checkpoint keys, tensor names or linear names (match_glob below); an empty
  // glob switches the fault off. The harness checks up front that every glob matches something
  // (fault_key_names, fault_linear_names).
  // drop_checkpoint_key: checkpoint keys matching the glob are left out of every save (a load
  // keeps the live values for them).
  std::string drop_checkpoint_key;
  // checkpoint_key_dtype: fp32 checkpoint tensors matching the glob are rounded through
  // `checkpoint_dtype` ("bf16" or "fp16", round to nearest even) when saved.
  std::string checkpoint_key_dtype;
  std::string checkpoint_dtype = "bf16";
  // freeze_state: fp32 state tensors matching the glob keep the values a checkpoint load gave
  // them: every later optimizer step's update of them is undone (a run that never loads is
  // unaffected).
  std::string freeze_state;
  // perturb: at the start of step `perturb_step` (0-based) every element of the fp32 state
  // tensors matching the glob moves by `perturb_ulp` ULPs (towards +inf; negative: -inf) or, with
  // perturb_ulp == 0, is multiplied by (1 + perturb_rel).
  std::string perturb_tensor;
  int64_t perturb_step = 0;
  int64_t perturb_ulp = 0;
  double perturb_rel = 0;
  // amax_group: the amax of linears matching the glob, role `amax_group_role` ("input",
  // "weight", "grad_output"), is MAX-reduced over `amax_group_dims` ("none" or "dp_shard+tp"
  // style) instead of the table's group.
  std::string amax_group_linear;
  std::string amax_group_role = "weight";
  std::string amax_group_dims = "none";

  // ---- built-in catalog faults added with issue #20 (docs/design.md section 23)
  // FP8 primary weights: the FP8 all-gather after an optimizer update does not reach the
  // forward: every GEMM computes (forward and backward) with the gathered FP8 weight of the
  // previous step, from before the update (Megatron-LM PR #5707).
  bool stale_fp8_weight_after_update = false;

  // Loading into an FP8-parameter model restores the delayed-scaling amax histories from their
  // init values instead of the checkpoint's (TE PR #567). Caught by state.
  bool amax_history_restored_from_init = false;
  // The optimizer step counter advanced by a synthetic step before the load, which keeps the
  // advance: the resumed optim/step is one past the saved one (Megatron-LM #5974). Caught by
  // state.
  bool optimizer_step_advanced_before_load = false;
  // Gradient accumulation over micro-batches keeps only the last micro-batch's gradient (each
  // micro-batch's backward overwrites the accumulator; Megatron-LM PR #7186). Caught by
  // reference with a train.micro_batches override.
  bool grad_accum_last_micro_batch_only = false;

  int64_t from_step = 0;

  // NVFP4 (docs/design.md section 25): the random Hadamard transform applied to only one wgrad
  // operand (the output gradient's columnwise copy, not the input's), so dW = dY^T T^T X no longer
  // equals dY^T X. Caught by golden, reference.
  bool nvfp4_rht_on_one_operand = false;
  // NVFP4 block scales rounded up to a power of two instead of E4M3 (MXFP4-style scales where
  // NVFP4 requires E4M3). Caught by golden.
  bool nvfp4_block_scale_pow2 = false;
  // NVFP4 FP4 all-gather (docs/design.md section 28): each rank quantizes its weight shard with
  // its own shard's global amax (the second-level scale) instead of the amax MAX-reduced over the
  // weight's amax group, so the gathered shards carry different global scales and the gathered
  // weight is not quantize(gather(shard)). Caught by allgather_parity.
  bool nvfp4_global_amax_not_reduced = false;

  // ---- built-in catalog faults (issue #20, catalog entries; docs/design.md section 23)
  // Current/delayed scaling FP8 all-gather: the gathered weight's scale_inv travels through bf16
  // (8 mantissa bits), so the GEMMs decode the FP8 bytes with a rounded scale. Caught by
  // allgather_parity.
  bool scale_inv_gathered_bf16 = false;
  // A checkpoint load computes each rank's box of the vocabulary-row tensors (embed.tok,
  // lm_head.weight and their AdamW moments) at rank x floor(V/n) instead of torch.chunk's rank x
  // ceil(V/n) when n does not divide V: rows are duplicated and the last ones lost (torchtitan
  // #1136). Caught by state.
  bool vocab_uneven_resume_rows = false;
  // MXFP8 FP8 all-gather: each shard's block scales keep TransformerEngine's swizzle padding
  // (rowwise rows to a multiple of 128, columnwise to 4) and the padded blocks are gathered back
  // to back, so the gathered scales shift by shard whenever a shard's rows are not a multiple of
  // 128: right on DP2 of a 256-row weight, wrong on DP4 (TE's xfails). Caught by
  // allgather_parity.
  bool block_scale_padding_reshard = false;
  // The MoE router GEMM (docs/design.md section 27) runs in bf16 (operands and output rounded to
  // bf16) instead of fp32, so near-tied experts flip and the combine weights move. Caught by
  // golden.
  bool router_not_fp32 = false;

  // ---- collective faults (docs/design.md section 29), caught by the collectives check
  // Tensor parallelism MAX-reduces every quantized weight's amax over the tp group itself, a
  // second all-reduce after the plan's weight amax reduction (which already covers the tp
  // ranks), where the plan says none (torchao PR #590). The values do not change.
  bool tp_weight_amax_all_reduced = false;
  // The FP8 parameter all-gather gathers the bf16 shards and quantizes the gathered weight
  // (bf16 bytes on the wire instead of FP8 bytes and scales; torchao PR #590).
  bool fp8_all_gather_in_bf16 = false;
  // skip_collective: the engine's collectives of kind `skip_collective_kind` ("all_gather",
  // "reduce_scatter", "all_reduce") over `skip_collective_group` ("dp_shard", "dp_shard+tp", ...)
  // serving a parameter matching the glob are not issued: each rank keeps its own part (a
  // skipped gather leaves the other members' rows zero, a skipped reduction its own unreduced
  // values).
  std::string skip_collective_tensor;
  std::string skip_collective_kind = "all_gather";
  std::string skip_collective_group = "dp_shard";
  // collective_dtype: the engine's all-gathers serving a parameter matching the glob move its
  // values through `collective_dtype_dtype` ("bf16", "fp16") instead of their own dtype (an FP8
  // all-gather: the high-precision shard, quantized after the gather).
  std::string collective_dtype_tensor;
  std::string collective_dtype_kind = "all_gather";
  std::string collective_dtype_dtype = "bf16";

  // ---- expert parallelism (docs/design.md "Expert parallelism")
  // The owner's expert weight gradients are multiplied by ep: the expert-data-parallel reduction
  // divides by its own size (dp / ep) where the gradients hold the tokens of all dp ranks
  // (Megatron-LM PR #5956). Caught by reference (grad_norm, and the clipped updates after).
  bool expert_grad_scaled_by_ep = false;
  // With deferred gradient sync over micro-batches, the expert parameters' gradient reductions
  // (reduce-scatter over dp_shard, all-reduce over dp_replicate) are skipped after the last
  // micro-batch's backward, so each rank updates its expert shards with its own unreduced
  // gradients (NeMo MoEFSDPSyncMixin's final backward). Caught by reference and golden.
  bool moe_final_backward_skips_experts = false;
  // MXFP8 / block scaling: the experts' wgrad input operands come from ONE grouped columnwise
  // quantization of all experts' rows, each expert's rows padded to 16 instead of the recipe's
  // 32 / 128, so a 32x1 or 128x1 block spans two experts and an expert's values carry another's
  // amax (TransformerEngine #2966). Caught by golden.
  bool expert_split_padding_too_small = false;
  // The rows each expert is padded to in that grouped quantization: 16 is the bug; the recipe's
  // alignment (32 / 128) gives bitwise the per-expert run (the engine test's control; not a
  // scenario parameter).
  int64_t expert_split_padding_rows = 16;

  // ---- pipeline parallelism (docs/design.md section 33)
  // The first pipeline stage's last backward of a step does not trigger its deferred gradient
  // reduction (NeMo MoEFSDPSyncMixin's hand-run post-backward hooks skipped on the last backward):
  // the stage's accumulated gradients are dropped unreduced and its gradient shards stay zero.
  // Caught by reference (pp = 1) and golden.
  bool pp_last_backward_sync_skipped = false;
  // In the last pipeline stage, each micro-batch's backward overwrites the gradient accumulators
  // instead of adding to them (a stage-local gradient-accumulation bug): the stage's reduced
  // gradients hold only its last micro-batch. Caught by reference (pp = 1) and golden.
  bool pp_microbatch_grads_overwritten = false;
  // Tied embeddings under pipeline stages: the first and the last stage do not exchange their
  // parts of embed.tok's gradient (the embedding backward's, the LM head's) before reducing it,
  // so each end stage updates its copy with its own part only and the copies drift apart.
  // Caught by reference (pp = 1) and golden.
  bool pp_tied_embedding_grad_not_synced = false;
  bool active(int64_t step) const { return step >= from_step; }
  bool any() const {
    return amax_not_reduced || tp_fsdp_left_to_right || fp8_state_dropped_from_checkpoint ||
           scale_inv_saved_bf16 || stale_columnwise_copy || data_cursor_not_restored ||
           optimizer_state_not_restored || hsdp_replicas_not_reduced || uneven_shard_padding_leak ||
           !drop_checkpoint_key.empty() || !checkpoint_key_dtype.empty() || !freeze_state.empty() ||
           !perturb_tensor.empty() || !amax_group_linear.empty() || stale_fp8_weight_after_update ||
           rope_positions_local_under_sp || swiglu_gate_up_swizzled_in_checkpoint ||

           nvfp4_rht_on_one_operand || nvfp4_block_scale_pow2 ||

           amax_history_restored_from_init || optimizer_step_advanced_before_load ||
           grad_accum_last_micro_batch_only ||
           // catalog entries (issue #20)
           scale_inv_gathered_bf16 || vocab_uneven_resume_rows || block_scale_padding_reshard ||
           router_not_fp32 || nvfp4_global_amax_not_reduced || tp_weight_amax_all_reduced ||
           fp8_all_gather_in_bf16 || !skip_collective_tensor.empty() ||
           !collective_dtype_tensor.empty() || expert_grad_scaled_by_ep ||
           moe_final_backward_skips_experts || expert_split_padding_too_small ||
           pp_last_backward_sync_skipped || pp_microbatch_grads_overwritten ||
           pp_tied_embedding_grad_not_synced;
  }
};

// Glob matching for the generic faults, as `meshproof ckpt inspect --key` matches (fnmatch
// without flags): `*` matches any run of characters ('/' and '.' included), `?` any one
// character, `[...]` one of a set. "optim/*/exp_avg_sq" matches every second moment,
// "model/layers.0.*" every master weight of layer 0.
bool match_glob(std::string_view glob, std::string_view text);

}  // namespace meshproof::engine
