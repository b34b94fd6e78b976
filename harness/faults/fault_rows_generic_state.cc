// The fault table's generic state faults (docs/design.md section 23): rows whose parameters name
// what they corrupt, so one row expresses many bug classes: checkpoint keys dropped or saved
// through a narrower dtype, fp32 state tensors frozen after a load or perturbed at a step, and a
// linear's amax reduced over other mesh dims. Rows 10-14 of fault_table(), in its order
// (harness/faults/scenario_faults_internal.h).
#include "engine/faults/faults.h"
#include "harness/faults/scenario_faults.h"
#include "harness/faults/scenario_faults_internal.h"

namespace meshproof::harness::faults_internal {

std::vector<FaultDescriptor> generic_state_fault_rows() {
  return {
      {
          .name = "drop_checkpoint_key",
          .bug_class =
              "generic: the checkpoint keys matching a glob are not saved (a resumed run keeps "
              "its fresh values for them), e.g. a state dict that forgets a buffer or an "
              "optimizer moment",
          .needs = {},
          // state: the key is missing from the checkpoint under test (issue #46).
          .caught_by = {"resume", "resume_cross_mesh", "state"},
          .params = {{.name = "key",
                      .type = FaultParam::Type::kString,
                      .doc = "glob over checkpoint keys, e.g. \"optim/*/exp_avg_sq\"",
                      .required = true,
                      .check = any_key}},
          .inject =
              [](const FaultSpec& spec, engine::FaultInjection& f) {
                f.drop_checkpoint_key = string_param(spec, "key");
              },
          .generic = true,
      },
      {
          .name = "checkpoint_key_dtype",
          .bug_class =
              "generic: the fp32 checkpoint tensors matching a glob are saved through a narrower "
              "dtype (bf16 or fp16), e.g. a distributed checkpoint that casts to the template's "
              "dtype",
          .needs = {},
          // state: the restored values are not the live ones, bitwise (issue #46).
          .caught_by = {"resume", "state"},
          .params = {{.name = "key",
                      .type = FaultParam::Type::kString,
                      .doc = "glob over fp32 checkpoint tensors, e.g. \"fp8/*/scale\"",
                      .required = true,
                      .check = fp32_key},
                     {.name = "dtype",
                      .type = FaultParam::Type::kChoice,
                      .choices = {"bf16", "fp16"},
                      .doc = "the dtype the values are rounded through (nearest even)"}},
          .inject =
              [](const FaultSpec& spec, engine::FaultInjection& f) {
                f.checkpoint_key_dtype = string_param(spec, "key");
                f.checkpoint_dtype = string_param(spec, "dtype");
              },
          .generic = true,
      },
      {
          .name = "freeze_state",
          .bug_class =
              "generic: the fp32 state tensors matching a glob stop changing once a checkpoint "
              "is loaded (updates after the load are lost), e.g. a loaded buffer that is no "
              "longer the one the optimizer or the recipe writes",
          .needs = {},
          .caught_by = {"resume"},
          .params = {{.name = "key",
                      .type = FaultParam::Type::kString,
                      .doc = "glob over fp32 state tensors (checkpoint keys), e.g. "
                             "\"fp8/*/amax_history\"",
                      .required = true,
                      .check = fp32_key}},
          .inject = [](const FaultSpec& spec,
                       engine::FaultInjection& f) { f.freeze_state = string_param(spec, "key"); },
          .generic = true,
      },
      {
          .name = "perturb",
          .bug_class =
              "generic: the fp32 state tensors matching a glob move by some ULPs or a relative "
              "amount at one step, e.g. a non-deterministic or lossy path that touches them; "
              "says how small a change a check resolves",
          .needs = {},
          .caught_by = {"reference"},
          .params = {{.name = "tensor",
                      .type = FaultParam::Type::kString,
                      .doc = "glob over fp32 state tensors (checkpoint keys; model/<param> is the "
                             "master weight), e.g. \"model/layers.0.*\"",
                      .required = true,
                      .check = fp32_key},
                     {.name = "step",
                      .type = FaultParam::Type::kInt,
                      .default_int = 1,
                      .min = 1,
                      .max = FaultParam::Max::kLastStep,
                      .doc = "the step (1-based) at whose start the tensors move"},
                     {.name = "ulp",
                      .type = FaultParam::Type::kInt,
                      .default_int = 0,
                      .min = -1000000,
                      .doc = "ULPs every element moves (sign: direction); or give rel"},
                     {.name = "rel",
                      .type = FaultParam::Type::kDouble,
                      .doc = "relative change of every element (x * (1 + rel)); or give ulp",
                      .default_double = 0,
                      .min_double = -1,
                      .max_double = 1}},
          .inject =
              [](const FaultSpec& spec, engine::FaultInjection& f) {
                f.perturb_tensor = string_param(spec, "tensor");
                f.perturb_step = spec.int_params.at("step") - 1;
                f.perturb_ulp = spec.int_params.at("ulp");
                f.perturb_rel = spec.double_params.at("rel");
              },
          .generic = true,
          .check = one_perturbation,
      },
      {
          .name = "amax_group",
          .bug_class =
              "generic: the amax of the linears matching a glob, one role, is MAX-reduced over "
              "other mesh dims than the ranks that hold its tensor, e.g. a TP weight amax that "
              "skips the TP group or a reduction that forgets dp_shard",
          .needs = {kPerTensorRecipe},
          .caught_by = {"allgather_parity", "reference"},
          .params = {{.name = "linear",
                      .type = FaultParam::Type::kString,
                      .doc = "glob over quantized linears, e.g. \"layers.*.attn.qkv\"",
                      .required = true,
                      .check = linear_name},
                     {.name = "role",
                      .type = FaultParam::Type::kChoice,
                      .choices = {"weight", "input", "grad_output"},
                      .doc = "which amax of the linear"},
                     {.name = "dims",
                      .type = FaultParam::Type::kString,
                      .doc = "the mesh dims it is reduced over instead: \"none\" or e.g. "
                             "\"dp_shard\", \"dp_shard+tp\"",
                      .required = true,
                      .check = dim_list}},
          .inject =
              [](const FaultSpec& spec, engine::FaultInjection& f) {
                f.amax_group_linear = string_param(spec, "linear");
                f.amax_group_role = string_param(spec, "role");
                f.amax_group_dims = string_param(spec, "dims");
              },
          .generic = true,
      },
  };
}

}  // namespace meshproof::harness::faults_internal
