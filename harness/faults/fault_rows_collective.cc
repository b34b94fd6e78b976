// The fault table's collective faults (docs/design.md sections 28 and 29): NVFP4's unreduced global
// amax in the FP4 all-gather, a tp amax all-reduce the plan does not have, an FP8 all-gather moved
// in bf16, and the generic skip_collective and collective_dtype, whose parameters name a
// collective the sharding plan issues. Rows 27-31 of fault_table(), in its order
// (harness/faults/scenario_faults_internal.h).
#include "engine/faults/faults.h"
#include "harness/faults/scenario_faults.h"
#include "harness/faults/scenario_faults_internal.h"
#include "mesh/core/device_mesh.h"

namespace meshproof::harness::faults_internal {

std::vector<FaultDescriptor> collective_fault_rows() {
  return {
      {
          .name = "nvfp4_global_amax_not_reduced",
          .bug_class =
              "NVFP4 FP4 all-gather: each rank quantizes its weight shard with its own shard's "
              "global amax (the second-level scale) instead of the amax MAX-reduced over the "
              "weight's ranks, so the gathered shards carry different global scales and the "
              "gathered weight differs from quantizing the gathered weight",
          .needs = {kNvfp4Recipe, kFp8AllGather, kTwoShards},
          .caught_by = {"allgather_parity"},
          .params = {},
          .inject = [](const FaultSpec&,
                       engine::FaultInjection& f) { f.nvfp4_global_amax_not_reduced = true; },
      },
      {
          .name = "tp_weight_amax_all_reduced",
          .bug_class =
              "tensor parallelism all-reduces each quantized weight's amax over the tp group "
              "itself, a MAX-reduction the plan does not have (its weight amax group already "
              "spans the tp ranks); the scales do not change, the communication does (torchao "
              "PR #590)",
          .needs = {kTwoTpRanks, kRecipeReducesWeightAmax},
          .caught_by = {"collectives"},
          .params = {},
          .inject = [](const FaultSpec&,
                       engine::FaultInjection& f) { f.tp_weight_amax_all_reduced = true; },
      },
      {
          .name = "fp8_all_gather_in_bf16",
          .bug_class =
              "the FP8 parameter all-gather moves the bf16 shards and quantizes after the "
              "gather: twice the bytes (or more) on the wire for the same FP8 weight (torchao "
              "PR #590, FP8 all-gather falling back to bf16)",
          .needs = {kFp8Gather, kTwoShards},
          .caught_by = {"collectives"},
          .params = {},
          .inject = [](const FaultSpec&,
                       engine::FaultInjection& f) { f.fp8_all_gather_in_bf16 = true; },
      },
      {
          .name = "skip_collective",
          .bug_class =
              "generic: the engine's collectives of one kind over one mesh group that serve the "
              "parameters matching a glob are not issued (each rank keeps its own part), e.g. a "
              "gradient reduce-scatter or an amax all-reduce a code path forgets",
          .needs = {},
          .caught_by = {"collectives", "reference"},
          .params = {{.name = "kind",
                      .type = FaultParam::Type::kChoice,
                      .choices = {"all_gather", "reduce_scatter", "all_reduce"},
                      .doc = "the collective's kind"},
                     {.name = "group",
                      .type = FaultParam::Type::kString,
                      .doc = "the mesh group it spans, e.g. \"dp_shard\", \"dp_replicate\", "
                             "\"tp\", \"dp_shard+tp\"",
                      .required = true,
                      .check = mesh_group},
                     {.name = "tensor",
                      .type = FaultParam::Type::kString,
                      .doc = "glob over parameter names, e.g. \"layers.0.*\"",
                      .required = true,
                      .check = param_name}},
          .inject =
              [](const FaultSpec& spec, engine::FaultInjection& f) {
                f.skip_collective_kind = string_param(spec, "kind");
                f.skip_collective_group = mesh::DimSet::parse(string_param(spec, "group")).str();
                f.skip_collective_tensor = string_param(spec, "tensor");
              },
          .generic = true,
          .check = skip_names_a_collective,
      },
      {
          .name = "collective_dtype",
          .bug_class =
              "generic: the engine's all-gathers that serve the parameters matching a glob move "
              "their values through a narrower dtype (an FP8 all-gather: the bf16 shards, "
              "quantized after the gather), e.g. a gather that casts to the module's dtype",
          .needs = {},
          .caught_by = {"collectives"},
          .params = {{.name = "kind",
                      .type = FaultParam::Type::kChoice,
                      .choices = {"all_gather"},
                      .doc = "the collective's kind (reductions accumulate in fp32: only "
                             "all-gathers move another dtype)"},
                     {.name = "tensor",
                      .type = FaultParam::Type::kString,
                      .doc = "glob over parameter names, e.g. \"layers.*.mlp.fc1.weight\"",
                      .required = true,
                      .check = param_name},
                     {.name = "dtype",
                      .type = FaultParam::Type::kChoice,
                      .choices = {"bf16", "fp16"},
                      .doc = "the dtype the values travel in"}},
          .inject =
              [](const FaultSpec& spec, engine::FaultInjection& f) {
                f.collective_dtype_kind = string_param(spec, "kind");
                f.collective_dtype_tensor = string_param(spec, "tensor");
                f.collective_dtype_dtype = string_param(spec, "dtype");
              },
          .generic = true,
          .check = dtype_names_a_collective,
      },
  };
}

}  // namespace meshproof::harness::faults_internal
