// The fault table's mixture-of-experts and pipeline faults (docs/design.md sections 27, 30 and 33):
// expert gradients scaled by ep, expert reductions skipped after the last micro-batch, expert
// splits padded too little for the recipe's blocks, and the pipeline stages' deferred gradient
// sync, micro-batch accumulation and tied-embedding exchange. Rows 32-37 of fault_table(), the
// last, in its order (harness/faults/scenario_faults_internal.h).
#include "engine/faults/faults.h"
#include "harness/faults/scenario_faults.h"
#include "harness/faults/scenario_faults_internal.h"

namespace meshproof::harness::faults_internal {

std::vector<FaultDescriptor> moe_pipeline_fault_rows() {
  return {
      {
          .name = "expert_grad_scaled_by_ep",
          .bug_class =
              "expert parallelism: the experts' weight gradients come out ep times too large "
              "(the expert-data-parallel reduction divides by dp / ep although each owner's "
              "gradients hold the tokens of all ep ranks; Megatron-LM PR #5956)",
          .needs = {kMoe, kTwoEpRanks},
          // Against ep = 1 on one rank: the gradient norm at step 1, then the clipped updates.
          .caught_by = {"reference"},
          .params = {},
          .inject = [](const FaultSpec&,
                       engine::FaultInjection& f) { f.expert_grad_scaled_by_ep = true; },
      },
      {
          .name = "moe_final_backward_skips_experts",
          .bug_class = "gradient accumulation with deferred sync: the expert parameters' gradient "
                       "reductions are skipped after the last micro-batch's backward, so each rank "
                       "updates its expert shards with its own unreduced gradients (NeMo "
                       "MoEFSDPSyncMixin's final backward)",
          .needs = {kMoe, kTwoMicroBatches, kTwoShards, kDeferredSync},
          .caught_by = {"reference", "golden"},
          .params = {},
          .inject = [](const FaultSpec&,
                       engine::FaultInjection& f) { f.moe_final_backward_skips_experts = true; },
      },
      {
          .name = "expert_split_padding_too_small",
          .bug_class =
              "grouped MXFP8 / block quantization of the MoE experts: each expert's rows padded "
              "to 16 where a 32x1 or 128x1 columnwise block needs 32 or 128, so one quantizer "
              "call over the concatenated experts puts two experts' rows in one block and an "
              "expert's wgrad operand carries another expert's amax (TransformerEngine #2966)",
          .needs = {kTwoExperts, kTokenBlockRecipe},
          // Not reference: the 1-rank reference run carries the same fault.
          .caught_by = {"golden"},
          .params = {},
          .inject = [](const FaultSpec&,
                       engine::FaultInjection& f) { f.expert_split_padding_too_small = true; },
      },
      {
          .name = "pp_last_backward_sync_skipped",
          .bug_class =
              "pipeline parallelism with FSDP: the first stage's last backward of the step "
              "does not run its deferred gradient reduction (NeMo MoEFSDPSyncMixin runs "
              "the post-backward hooks by hand on the last backward; under 1F1B it is not "
              "the pass after the last forward), so that stage's parameters get no "
              "gradient",
          .needs = {kTwoStages, kDeferredSync},
          .caught_by = {"reference", "golden"},
          .params = {},
          .inject = [](const FaultSpec&,
                       engine::FaultInjection& f) { f.pp_last_backward_sync_skipped = true; },
      },
      {
          .name = "pp_microbatch_grads_overwritten",
          .bug_class = "pipeline parallelism with gradient accumulation: in the last stage each "
                       "micro-batch's backward overwrites the gradient accumulators instead of "
                       "adding to them, so that stage's parameters are updated with their last "
                       "micro-batch's gradient only",
          .needs = {kTwoStages, kTwoMicroBatches, kDeferredSync},
          .caught_by = {"reference", "golden"},
          .params = {},
          .inject = [](const FaultSpec&,
                       engine::FaultInjection& f) { f.pp_microbatch_grads_overwritten = true; },
      },
      {
          .name = "pp_tied_embedding_grad_not_synced",
          .bug_class = "pipeline parallelism with tied embeddings: the first stage's embedding "
                       "gradient and the last stage's LM-head gradient of the shared weight are "
                       "not exchanged before the reduction, so each end stage updates its copy "
                       "with its own part only and the two copies drift apart",
          .needs = {kTwoStages, kTiedEmbeddings, kDeferredSync},
          .caught_by = {"reference", "golden"},
          .params = {},
          .inject = [](const FaultSpec&,
                       engine::FaultInjection& f) { f.pp_tied_embedding_grad_not_synced = true; },
      },
  };
}

}  // namespace meshproof::harness::faults_internal
