// The fault table's first rows (harness/faults/scenario_faults.h): the built-in faults of
// docs/design.md section 7's catalog, each reproducing one real bug class of sharded FP8 training:
// the FP8 all-gather's unreduced amax, the TP x FSDP checkpoint layout, state a checkpoint or a
// resume drops (FP8 scales, the scale_inv's precision, the data cursor, the optimizer state), a
// stale columnwise FP8 copy, unreduced HSDP replicas and leaking uneven-shard padding. Rows 1-9
// of fault_table(), in its order (harness/faults/scenario_faults_internal.h).
#include "engine/faults/faults.h"
#include "harness/faults/scenario_faults.h"
#include "harness/faults/scenario_faults_internal.h"

namespace meshproof::harness::faults_internal {

std::vector<FaultDescriptor> core_fault_rows() {
  return {
      {
          .name = "amax_not_reduced",
          .bug_class =
              "FP8 all-gather quantizes each weight shard with its own amax instead of the amax "
              "MAX-reduced over the weight-sharding group, so gather(quantize(shard)) differs "
              "from quantize(gather(shard))",
          .needs = {kPerTensorRecipe, kFp8AllGather, kTwoShards},
          .caught_by = {"allgather_parity", "reference"},
          .params = {},
          .inject = [](const FaultSpec&, engine::FaultInjection& f) { f.amax_not_reduced = true; },
      },
      {
          .name = "tp_fsdp_left_to_right",
          .bug_class =
              "TP x FSDP: FSDP shards of a TP-sharded dim laid out left-to-right (Shard(0)) "
              "instead of StridedShard(0, sf=tp), so checkpoint chunks carry the wrong global "
              "offsets and a load on another mesh scrambles rows",
          .needs = {kTwoShards, kTwoTpRanks},
          .caught_by = {"resume_cross_mesh", "state"},
          .params = {},
          .inject = [](const FaultSpec&,
                       engine::FaultInjection& f) { f.tp_fsdp_left_to_right = true; },
      },
      {
          .name = "fp8_state_dropped_from_checkpoint",
          .bug_class =
              "delayed-scaling FP8 scales and amax histories are not saved, so a resumed run "
              "restarts its scales from 1 and diverges from the straight run",
          .needs = {kDelayedRecipe},
          // Not resume_cross_mesh: the library's cross-mesh FP8 resume (resume_cross_mesh_fp8.yaml,
          // rtol 1e-2) misses it (rel 9.4e-3): the scales re-converge within the amax history
          // while the other mesh's reduction order already moves the loss by the same order. Only
          // the bitwise same-mesh resume catches it (runner.fault_claim.* tests every claim here).
          .caught_by = {"resume", "state"},
          .params = {},
          .inject = [](const FaultSpec&,
                       engine::FaultInjection& f) { f.fp8_state_dropped_from_checkpoint = true; },
      },
      {
          .name = "scale_inv_saved_bf16",
          .bug_class =
              "the scale_inv of FP8 primary weights is saved through bf16 (8 mantissa bits), so "
              "the loaded FP8 weights decode to different values",
          .needs = {kPerTensorRecipe, kFp8Params},
          .caught_by = {"resume", "resume_cross_mesh", "state"},
          .params = {},
          .inject = [](const FaultSpec&,
                       engine::FaultInjection& f) { f.scale_inv_saved_bf16 = true; },
      },
      {
          .name = "stale_columnwise_copy",
          .bug_class =
              "backward uses a columnwise (transposed) FP8 weight copy left from before the last "
              "optimizer step instead of re-quantizing it with the current weight",
          .needs = {kFp8Recipe},
          // Not reference: on the library's model (6 steps, delayed) the fault moves loss and
          // grad_norm by 2.2e-4 relative to a fault-free run on another mesh, while two fault-free
          // meshes already differ by 1.0e-4 (FSDP 2 x TP 2 vs FSDP 4): no tolerance separates
          // them. The bitwise golden of the fault-free run catches it (runner.fault_claim.* tests
          // every claim here).
          .caught_by = {"golden"},
          .params = {{"layer",
                      FaultParam::Type::kInt,
                      0,
                      0,
                      FaultParam::Max::kLastLayer,
                      {},
                      "the transformer layer whose copy goes stale"}},
          .inject =
              [](const FaultSpec& spec, engine::FaultInjection& f) {
                f.stale_columnwise_copy = true;
                const auto layer = spec.int_params.find("layer");
                if (layer != spec.int_params.end()) f.stale_columnwise_layer = layer->second;
              },
      },
      {
          .name = "data_cursor_not_restored",
          .bug_class =
              "the data loader's cursor is not saved/restored, so a resumed run replays the "
              "batches of the first steps",
          .needs = {},
          .caught_by = {"resume", "resume_cross_mesh", "state"},
          .params = {},
          .inject = [](const FaultSpec&,
                       engine::FaultInjection& f) { f.data_cursor_not_restored = true; },
      },
      {
          .name = "optimizer_state_not_restored",
          .bug_class =
              "AdamW state (moments or step count) is not restored on resume, so bias correction "
              "and update sizes differ from the straight run",
          .needs = {},
          .caught_by = {"resume", "resume_cross_mesh", "state"},
          .params = {{"state",
                      FaultParam::Type::kChoice,
                      0,
                      0,
                      FaultParam::Max::kNone,
                      {"all", "exp_avg", "exp_avg_sq", "step"},
                      "which optimizer state is dropped"}},
          .inject =
              [](const FaultSpec& spec, engine::FaultInjection& f) {
                f.optimizer_state_not_restored = true;
                const auto part = spec.string_params.find("state");
                if (part != spec.string_params.end()) f.optimizer_state_part = part->second;
              },
      },
      {
          .name = "hsdp_replicas_not_reduced",
          .bug_class =
              "HSDP gradients are reduce-scattered over dp_shard but never all-reduced over "
              "dp_replicate, so replicas drift apart and the loss differs from a single-replica "
              "run",
          .needs = {kTwoReplicas},
          .caught_by = {"golden", "reference"},
          .params = {},
          .inject = [](const FaultSpec&,
                       engine::FaultInjection& f) { f.hsdp_replicas_not_reduced = true; },
      },
      {
          .name = "uneven_shard_padding_leak",
          .bug_class =
              "the zero padding that evens out uneven torch.chunk shards for the all-gather is "
              "not cut off: the gathered embedding / lm_head keep the padded vocabulary rows, so "
              "the logits gain zero classes and the softmax denominator changes (a padded-vocab "
              "leak)",
          .needs = {kTwoShards, kUnevenVocabShards},
          .caught_by = {"golden", "reference"},
          .params = {},
          .inject = [](const FaultSpec&,
                       engine::FaultInjection& f) { f.uneven_shard_padding_leak = true; },
      },
  };
}

}  // namespace meshproof::harness::faults_internal
