// The fault table (docs/design.md section 19, "how to add a fault"): one FaultDescriptor row per
// built-in fault (name, bug class, requirements, intended checks, the engine hook it sets) and the
// generic collective faults. Over 600 lines on purpose: the table is long by nature (about 30
// rows with their documentation strings); the code around it is the few functions at the end
// that read a scenario's `faults:` list against it.
#include "harness/scenario/scenario_faults.h"

#include <fmt/format.h>

#include <algorithm>
#include <limits>

#include "engine/faults/fault_hooks.h"
#include "engine/parallel/collective_budget.h"
#include "harness/run/train_run.h"
#include "kernels/core/error.h"
#include "mesh/core/device_mesh.h"

namespace meshproof::harness {
namespace {

// ---- what a fault can need of its scenario (the loader's message is "NAME needs WHAT")

constexpr FaultRequirement kFp8Recipe{
    "an FP8 recipe (delayed, current, mxfp8, block, nvfp4)",
    [](const Scenario& s) { return engine::is_fp8(s.recipe.kind); }};
constexpr FaultRequirement kPerTensorRecipe{
    "a per-tensor recipe (delayed or current)", [](const Scenario& s) {
      return s.recipe.kind == RecipeKind::kDelayed || s.recipe.kind == RecipeKind::kCurrent;
    }};
constexpr FaultRequirement kDelayedRecipe{
    "recipe delayed", [](const Scenario& s) { return s.recipe.kind == RecipeKind::kDelayed; }};
constexpr FaultRequirement kFp8AllGather{"fsdp.fp8_all_gather: true",
                                         [](const Scenario& s) { return s.fsdp.fp8_all_gather; }};
constexpr FaultRequirement kFp8Params{"fsdp.fp8_params: true",
                                      [](const Scenario& s) { return s.fsdp.fp8_params; }};
constexpr FaultRequirement kTwoShards{"mesh.dp_shard >= 2",
                                      [](const Scenario& s) { return s.mesh.dp_shard >= 2; }};
constexpr FaultRequirement kTwoReplicas{"mesh.dp_replicate >= 2",
                                        [](const Scenario& s) { return s.mesh.dp_replicate >= 2; }};
constexpr FaultRequirement kTwoTpRanks{"mesh.tp >= 2",
                                       [](const Scenario& s) { return s.mesh.tp >= 2; }};
constexpr FaultRequirement kRopeUnderSp{
    "model.position: rope and mesh.sequence_parallel: true with mesh.tp >= 2",
    [](const Scenario& s) {
      return s.model.position == engine::PositionKind::kRope && s.mesh.sequence_parallel &&
             s.mesh.tp >= 2;
    }};
constexpr FaultRequirement kSwiGluUnderTp{
    "model.activation: swiglu and mesh.tp >= 2", [](const Scenario& s) {
      return s.model.activation == engine::Activation::kSwiGlu && s.mesh.tp >= 2;
    }};
constexpr FaultRequirement kTwoMicroBatches{
    "train.micro_batches >= 2", [](const Scenario& s) { return s.train.micro_batches >= 2; }};
constexpr FaultRequirement kMoe{"model.moe.experts >= 1",
                                [](const Scenario& s) { return s.model.moe.enabled(); }};
constexpr FaultRequirement kTwoEpRanks{"mesh.ep >= 2",
                                       [](const Scenario& s) { return s.mesh.ep >= 2; }};
constexpr FaultRequirement kDeferredSync{
    "fsdp.sync_each_micro_batch: false (gradients reduced once, after the last micro-batch)",
    [](const Scenario& s) { return !s.fsdp.sync_each_micro_batch; }};
constexpr FaultRequirement kTwoStages{"mesh.pp >= 2",
                                      [](const Scenario& s) { return s.mesh.pp >= 2; }};
constexpr FaultRequirement kUnevenVocabShards{
    "model.vocab not divisible by mesh.dp_shard (the padded vocabulary rows are what leaks)",
    [](const Scenario& s) { return s.model.vocab % s.mesh.dp_shard != 0; }};
constexpr FaultRequirement kTiedEmbeddings{
    "model.tied_embeddings: true", [](const Scenario& s) { return s.model.tied_embeddings; }};

// ---- the generic faults' parameter checks: a glob must name something of the scenario's run
// (its checkpoint keys and linears are known before running, engine/faults/fault_hooks.h).

// The first few names of `names`, for messages.
std::string some_of(const std::vector<std::string>& names) {
  std::vector<std::string> shown(names.begin(), names.begin() + std::min<size_t>(names.size(), 4));
  return fmt::format("{}{}", fmt::join(shown, ", "), names.size() > shown.size() ? ", ..." : "");
}

std::string glob_over(const std::string& glob, const std::vector<std::string>& names,
                      std::string_view what) {
  for (const std::string& n : names)
    if (engine::match_glob(glob, n)) return "";
  return fmt::format("'{}' matches no {} of this scenario (e.g. {})", glob, what, some_of(names));
}

std::vector<std::string> key_names(const Scenario& s, bool fp32_tensors_only) {
  std::vector<std::string> out;
  for (const engine::FaultKey& k : engine::fault_key_names(s.config(), s.fsdp.fp8_params))
    if (k.fp32_tensor || !fp32_tensors_only) out.push_back(k.key);
  return out;
}

std::string any_key(const Scenario& s, const std::string& glob) {
  return glob_over(glob, key_names(s, false), "checkpoint key");
}
std::string fp32_key(const Scenario& s, const std::string& glob) {
  return glob_over(glob, key_names(s, true), "fp32 state tensor (checkpoint key)");
}
std::string linear_name(const Scenario& s, const std::string& glob) {
  return glob_over(glob, engine::fault_linear_names(s.config()), "quantized linear");
}
// "none" or mesh dim names joined by '+' ("dp_shard+tp"), each at most once.
std::string dim_list(const Scenario&, const std::string& dims) {
  if (dims == "none") return "";
  unsigned seen = 0;
  size_t pos = 0;
  while (pos <= dims.size()) {
    const size_t plus = dims.find('+', pos);
    const std::string part = dims.substr(pos, plus == std::string::npos ? plus : plus - pos);
    int bit = -1;
    for (mesh::MeshDim d : mesh::kAllMeshDims)
      if (mesh::mesh_dim_name(d) == part) bit = static_cast<int>(d);
    if (bit < 0)
      return fmt::format(
          "'{}' is no mesh dim (dp_replicate, dp_shard, tp; 'none' for no "
          "reduction; join with '+')",
          part);
    if ((seen >> bit) & 1u) return fmt::format("'{}' is listed twice", part);
    seen |= 1u << bit;
    if (plus == std::string::npos) break;
    pos = plus + 1;
  }
  return "";
}

// perturb moves by ULPs or by a relative amount: exactly one of them, at a step the fault is
// active at.
std::string one_perturbation(const Scenario&, const FaultSpec& spec) {
  const bool ulp = spec.int_params.at("ulp") != 0;
  const bool rel = spec.double_params.at("rel") != 0;
  if (ulp == rel) return "give exactly one of ulp (a nonzero integer) and rel (a nonzero number)";
  if (spec.int_params.at("from_step") > spec.int_params.at("step"))
    return "from_step is after step: the perturbation would never happen";
  return "";
}

const std::string& string_param(const FaultSpec& spec, const char* name) {
  return spec.string_params.at(name);
}
constexpr FaultRequirement kNvfp4Recipe{
    "recipe nvfp4", [](const Scenario& s) { return s.recipe.kind == RecipeKind::kNvfp4; }};

// ---- requirements of the catalog entries added with issue #20 (scale_inv_gathered_bf16,
// vocab_uneven_resume_rows)
constexpr FaultRequirement kCurrentRecipeNotPow2{
    "recipe current without power_2_scale (a power-of-2 scale_inv is exact in bf16)",
    [](const Scenario& s) {
      return s.recipe.kind == RecipeKind::kCurrent && !engine::power_2_scale_of(s.recipe);
    }};
// The mesh a checkpoint of the scenario is loaded on: the state check's, else the resume
// check's, else the scenario's.
const engine::MeshSpec& load_mesh(const Scenario& s) {
  if (s.checks.state.enabled && s.checks.state.mesh) return *s.checks.state.mesh;
  if (s.checks.resume.enabled && s.checks.resume.mesh) return *s.checks.resume.mesh;
  return s.mesh;
}
constexpr FaultRequirement kUnevenVocabOnLoad{
    "model.vocab not divisible by the dp_shard of the mesh the checkpoint is loaded on "
    "(checks.state.mesh, else checks.resume.mesh, else mesh), without vocabulary parallelism",
    [](const Scenario& s) {
      const engine::MeshSpec& m = load_mesh(s);
      return s.model.vocab % m.dp_shard != 0 && !(s.model.vocab_parallel && m.tp > 1);
    }};

constexpr FaultRequirement kMxfp8Recipe{
    "recipe mxfp8", [](const Scenario& s) { return s.recipe.kind == RecipeKind::kMxfp8; }};
// ---- the collective faults (docs/design.md section 29)

// The recipe reduces weight amaxes itself (at its quantizations or after each forward): delayed,
// nvfp4, and current unless the weights are gathered as FP8 (then the FP8 all-gather's shard
// quantization reduces them, and the recipe reads the gathered weight).
constexpr FaultRequirement kRecipeReducesWeightAmax{
    "a recipe that reduces weight amaxes itself: delayed, nvfp4, or current without "
    "fsdp.fp8_all_gather and fsdp.fp8_params",
    [](const Scenario& s) {
      const RecipeKind k = s.recipe.kind;
      return k == RecipeKind::kDelayed || k == RecipeKind::kNvfp4 ||
             (k == RecipeKind::kCurrent && !s.fsdp.fp8_all_gather && !s.fsdp.fp8_params);
    }};
constexpr FaultRequirement kFp8Gather{
    "weights gathered as FP8: fsdp.fp8_all_gather or fsdp.fp8_params with recipe delayed, "
    "current or mxfp8",
    [](const Scenario& s) {
      const RecipeKind k = s.recipe.kind;
      return (s.fsdp.fp8_all_gather || s.fsdp.fp8_params) &&
             (k == RecipeKind::kDelayed || k == RecipeKind::kCurrent || k == RecipeKind::kMxfp8);
    }};
// expert_split_padding_too_small: the recipes whose columnwise blocks run along the tokens in
// blocks longer than 16 rows (32x1 MXFP8, 128x1 block scaling). The per-tensor recipes have no
// blocks (one scale per tensor) and NVFP4's 16x1 blocks fit a 16-row split: a 16-row padding
// spans no expert there.
constexpr FaultRequirement kTokenBlockRecipe{
    "recipe mxfp8 or block (columnwise blocks of 32 or 128 rows along the tokens)",
    [](const Scenario& s) {
      return s.recipe.kind == RecipeKind::kMxfp8 || s.recipe.kind == RecipeKind::kBlock;
    }};
constexpr FaultRequirement kTwoExperts{"model.moe.experts >= 2",
                                       [](const Scenario& s) { return s.model.moe.experts >= 2; }};

// The plan's collectives of one step of `s`, every rank's (what a collective fault can name).
std::vector<mesh::CollectiveCall> plan_collectives(const Scenario& s) {
  const engine::RunOptions o = engine_run_options(s);
  std::vector<mesh::CollectiveCall> out;
  for (int r = 0; r < o.mesh.device_mesh().world_size(); ++r)
    for (mesh::CollectiveCall& c : engine::expected_collectives(o, r, 0))
      out.push_back(std::move(c));
  return out;
}

std::string param_name(const Scenario& s, const std::string& glob) {
  return glob_over(glob, engine::fault_param_names(s.config()), "parameter");
}

// "dp_shard", "dp_shard+tp", ...: mesh dims, not "none".
std::string mesh_group(const Scenario& s, const std::string& dims) {
  if (dims == "none") return "'none' is no group: name the mesh dims the collective spans";
  return dim_list(s, dims);
}

// A collective fault's (kind, group, tensor) must name a collective the plan issues in this
// scenario, else it would change nothing.
std::string names_a_collective(const std::string& kind, const std::string& group,
                               const std::string& tensor, const Scenario& s) {
  const std::vector<mesh::CollectiveCall> plan = plan_collectives(s);
  std::vector<std::string> seen;
  for (const mesh::CollectiveCall& c : plan) {
    if (mesh::collective_name(c.kind) != kind || (!group.empty() && c.group != group)) continue;
    if (engine::match_glob(tensor, c.tensor)) return "";
    if (std::find(seen.begin(), seen.end(), c.tensor) == seen.end()) seen.push_back(c.tensor);
  }
  const std::string where = group.empty() ? "" : " over " + group;
  if (seen.empty())
    return fmt::format("this scenario issues no {}{} for a parameter (mesh {})", kind, where,
                       s.mesh.device_mesh().str());
  return fmt::format("'{}' matches no parameter this scenario's {}{} serves (e.g. {})", tensor,
                     kind, where, some_of(seen));
}

std::string skip_names_a_collective(const Scenario& s, const FaultSpec& spec) {
  // A bad group or a glob that names no parameter is reported at its parameter already.
  if (!mesh_group(s, string_param(spec, "group")).empty() ||
      !param_name(s, string_param(spec, "tensor")).empty())
    return "";
  const std::string group = mesh::DimSet::parse(string_param(spec, "group")).str();
  return names_a_collective(string_param(spec, "kind"), group, string_param(spec, "tensor"), s);
}

std::string dtype_names_a_collective(const Scenario& s, const FaultSpec& spec) {
  if (!param_name(s, string_param(spec, "tensor")).empty()) return "";  // reported at `tensor`
  return names_a_collective(string_param(spec, "kind"), "", string_param(spec, "tensor"), s);
}

const FaultParam kFromStep{"from_step",
                           FaultParam::Type::kInt,
                           1,
                           1,
                           FaultParam::Max::kLastStep,
                           {},
                           "first step (1-based) at which the fault is active"};

// ---- the table

const std::vector<FaultDescriptor>& rows() {
  static const std::vector<FaultDescriptor> table = {
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
  return table;
}

}  // namespace

int64_t FaultParam::max_for(const Scenario& s) const {
  switch (max) {
    case Max::kLastLayer:
      return s.model.layers - 1;
    case Max::kLastStep:
      return s.train.steps;
    case Max::kNone:
      break;
  }
  return std::numeric_limits<int64_t>::max();
}

std::string FaultParam::describe() const {
  if (type == Type::kChoice) {
    return fmt::format("one of {}; default {}", fmt::join(choices, ", "), choices.front());
  }
  if (type == Type::kString) return required ? "text, required" : "text";
  if (type == Type::kDouble)
    return fmt::format("number in [{}, {}], default {}", min_double, max_double, default_double);
  switch (max) {
    case Max::kLastLayer:
      return fmt::format("int in [{}, model.layers - 1], default {}", min, default_int);
    case Max::kLastStep:
      return fmt::format("int in [{}, train.steps], default {}", min, default_int);
    case Max::kNone:
      break;
  }
  return fmt::format("int >= {}, default {}", min, default_int);
}

std::span<const FaultDescriptor> fault_table() { return rows(); }

const FaultDescriptor* find_fault(std::string_view name) {
  for (const FaultDescriptor& f : fault_table()) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

const FaultParam& from_step_param() { return kFromStep; }

std::vector<const FaultParam*> all_params(const FaultDescriptor& f) {
  std::vector<const FaultParam*> out = {&kFromStep};
  for (const FaultParam& p : f.params) out.push_back(&p);
  return out;
}

engine::FaultInjection to_fault_injection(const std::vector<FaultSpec>& faults) {
  engine::FaultInjection f;
  int64_t from = -1;
  for (const FaultSpec& spec : faults) {
    const FaultDescriptor* row = find_fault(spec.name);
    MP_CHECK_INPUT(row != nullptr, "fault {}: not in the fault table (`meshproof faults` lists it)",
                   spec.name);
    const auto it = spec.int_params.find(std::string(kFromStep.name));
    const int64_t first = it == spec.int_params.end() ? kFromStep.default_int : it->second;
    from = from < 0 ? first : std::min(from, first);
    row->inject(spec, f);
  }
  f.from_step = from < 1 ? 0 : from - 1;
  return f;
}

}  // namespace meshproof::harness
