// The fault table's built-in rows of the bug catalog's later waves (docs/design.md sections 22-28):
// FP8 / NVFP4 / MXFP8 numerics (a stale FP8 weight, NVFP4's Hadamard transform and block scales, a
// bf16 scale_inv in the all-gather, MXFP8 scale padding, a bf16 MoE router), the Llama-style
// model under tensor parallelism (RoPE positions, SwiGLU row order in checkpoints), checkpoint
// loads (amax histories, the optimizer step, uneven vocabulary rows) and gradient accumulation.
// Rows 15-26 of fault_table(), in its order (harness/faults/scenario_faults_internal.h).
#include "engine/faults/faults.h"
#include "harness/faults/scenario_faults.h"
#include "harness/faults/scenario_faults_internal.h"

namespace meshproof::harness::faults_internal {

std::vector<FaultDescriptor> numerics_checkpoint_fault_rows() {
  return {
      {
          .name = "stale_fp8_weight_after_update",
          .bug_class =
              "FP8 primary weights: the FP8 parameter all-gather after an optimizer update does "
              "not reach the forward, so every GEMM computes with the gathered FP8 weight of the "
              "step before (Megatron-LM PR #5707, stale FP8 weights after the param all-gather "
              "overlap)",
          .needs = {kFp8Params},
          // Not reference: like stale_columnwise_copy the one-step-old weight moves the loss by
          // less than the FP8 noise between meshes. The bitwise resume catches it: the resumed
          // session has no older copy, so its first step computes with the current weight
          // where the straight run used the stale one.
          .caught_by = {"resume"},
          .params = {},
          .inject = [](const FaultSpec&,
                       engine::FaultInjection& f) { f.stale_fp8_weight_after_update = true; },
      },
      {
          .name = "rope_positions_local_under_sp",
          .bug_class =
              "under sequence parallelism each tp rank rotates q and k by its sequence shard's "
              "local positions (every shard restarting at 0) instead of the global ones, so "
              "attention sees the wrong relative distances across shards",
          .needs = {kRopeUnderSp},
          .caught_by = {"golden", "reference"},
          .params = {},
          .inject = [](const FaultSpec&,
                       engine::FaultInjection& f) { f.rope_positions_local_under_sp = true; },
      },
      {
          .name = "swiglu_gate_up_swizzled_in_checkpoint",
          .bug_class =
              "SwiGLU's gate and up projections are saved in TP-swizzled row order (each tp "
              "rank's shard with its two halves exchanged, as when a fused [gate; up] per rank "
              "is split back the wrong way; Megatron-LM PR 5714), so a resumed run computes "
              "with permuted MLP rows",
          .needs = {kSwiGluUnderTp},
          .caught_by = {"resume", "state"},
          .params = {},
          .inject =
              [](const FaultSpec&, engine::FaultInjection& f) {
                f.swiglu_gate_up_swizzled_in_checkpoint = true;
              },
      },
      {
          .name = "nvfp4_rht_on_one_operand",
          .bug_class =
              "NVFP4's random Hadamard transform is applied to the output gradient's columnwise "
              "copy but not to the input's, so the wgrad GEMM multiplies operands in different "
              "bases: dY^T T^T X instead of dY^T X",
          .needs = {kNvfp4Recipe},
          .caught_by = {"golden", "reference"},
          .params = {},
          .inject = [](const FaultSpec&,
                       engine::FaultInjection& f) { f.nvfp4_rht_on_one_operand = true; },
      },
      {
          .name = "nvfp4_block_scale_pow2",
          .bug_class =
              "NVFP4 block scales rounded up to a power of two (MXFP4-style E8M0 scales) where "
              "the recipe requires E4M3 scales: every block loses up to a factor 2 of E2M1 range",
          .needs = {kNvfp4Recipe},
          .caught_by = {"golden"},
          .params = {},
          .inject = [](const FaultSpec&,
                       engine::FaultInjection& f) { f.nvfp4_block_scale_pow2 = true; },
      },
      {
          .name = "amax_history_restored_from_init",
          .bug_class = "loading a checkpoint into a model with FP8 primary weights restores the "
                       "delayed-scaling amax histories from their init values instead of the "
                       "checkpoint's, so the resumed scales forget the history (TE PR #567)",
          .needs = {kDelayedRecipe, kFp8Params},
          .caught_by = {"state"},
          .params = {},
          .inject = [](const FaultSpec&,
                       engine::FaultInjection& f) { f.amax_history_restored_from_init = true; },
      },
      {
          .name = "optimizer_step_advanced_before_load",
          .bug_class =
              "a synthetic optimizer step before the load advances the step counter and the "
              "load keeps the advance, so AdamW's bias correction and the LR schedule run one "
              "step ahead after a resume (Megatron-LM #5974)",
          .needs = {},
          .caught_by = {"state"},
          .params = {},
          .inject = [](const FaultSpec&,
                       engine::FaultInjection& f) { f.optimizer_step_advanced_before_load = true; },
      },
      {
          .name = "grad_accum_last_micro_batch_only",
          .bug_class =
              "gradient accumulation over micro-batches keeps only the last micro-batch's "
              "gradient: each micro-batch's backward overwrites the accumulator instead of "
              "adding to it (Megatron-LM PR #7186)",
          .needs = {kTwoMicroBatches},
          .caught_by = {"reference"},
          .params = {},
          .inject = [](const FaultSpec&,
                       engine::FaultInjection& f) { f.grad_accum_last_micro_batch_only = true; },
      },
      {
          .name = "scale_inv_gathered_bf16",
          .bug_class =
              "current scaling with the FP8 all-gather: the gathered weight's scale_inv travels "
              "through bf16 (the all-gather metadata in the parameter dtype), so every GEMM "
              "decodes correctly scaled FP8 bytes with a scale_inv rounded to 8 mantissa bits "
              "(TE test comment; the saved-through-bf16 variant is scale_inv_saved_bf16)",
          .needs = {kCurrentRecipeNotPow2, kFp8AllGather, kTwoShards},
          .caught_by = {"allgather_parity"},
          .params = {},
          .inject = [](const FaultSpec&,
                       engine::FaultInjection& f) { f.scale_inv_gathered_bf16 = true; },
      },
      {
          .name = "vocab_uneven_resume_rows",
          .bug_class =
              "resume with a vocabulary the world size does not divide: the loader computes "
              "each rank's rows of embed.tok / lm_head.weight (and their AdamW moments) at rank "
              "x floor(V/n) instead of torch.chunk's rank x ceil(V/n), so rows are duplicated "
              "and the last ones lost (torchtitan #1136)",
          .needs = {kUnevenVocabOnLoad},
          .caught_by = {"state"},
          .params = {},
          .inject = [](const FaultSpec&,
                       engine::FaultInjection& f) { f.vocab_uneven_resume_rows = true; },
      },
      {
          .name = "block_scale_padding_reshard",
          .bug_class =
              "MXFP8 FP8 all-gather: each shard's block scales keep their swizzle padding (rowwise "
              "rows to a multiple of 128, columnwise to 4, as TransformerEngine stores scale_inv) "
              "and the padded blocks are gathered back to back, so the gathered scales shift by "
              "shard wherever a shard's rows are not a multiple of 128: a 256-row weight is right "
              "on DP2 and wrong on DP4 (TE PR #1455, scale-inv padding not removed in the MXFP8 "
              "all-gather; TE xfails)",
          .needs = {kMxfp8Recipe, kFp8AllGather, kTwoShards},
          .caught_by = {"allgather_parity"},
          .params = {},
          .inject = [](const FaultSpec&,
                       engine::FaultInjection& f) { f.block_scale_padding_reshard = true; },
      },
      {
          .name = "router_not_fp32",
          .bug_class =
              "the MoE router GEMM runs in bf16 (operands and logits rounded to bf16) instead of "
              "fp32, so near-tied experts flip and the combine weights move (docs/design.md "
              "section 27)",
          .needs = {kMoe},
          // Not reference: the 1-rank reference run carries the same fault.
          .caught_by = {"golden"},
          .params = {},
          .inject = [](const FaultSpec&, engine::FaultInjection& f) { f.router_not_fp32 = true; },
      },
  };
}

}  // namespace meshproof::harness::faults_internal
