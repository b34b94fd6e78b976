// The requirements of the fault table's rows (harness/faults/scenario_faults.h,
// FaultRequirement): each names what a fault needs of its scenario (an FP8 recipe, a second
// replica, an uneven vocabulary split, ...) and tests it; a row lists them in `needs` and the
// loader rejects a scenario that lacks one ("faults[i]: NAME needs WHAT"). Constants, declared in
// harness/faults/scenario_faults_internal.h.
#include "engine/config/config.h"
#include "engine/config/mesh_spec.h"
#include "harness/faults/scenario_faults.h"
#include "harness/faults/scenario_faults_internal.h"
#include "harness/scenario/scenario.h"

namespace meshproof::harness::faults_internal {
namespace {

// The mesh a checkpoint of the scenario is loaded on: the state check's, else the resume
// check's, else the scenario's.
const engine::MeshSpec& load_mesh(const Scenario& s) {
  if (s.checks.state.enabled && s.checks.state.mesh) return *s.checks.state.mesh;
  if (s.checks.resume.enabled && s.checks.resume.mesh) return *s.checks.resume.mesh;
  return s.mesh;
}

}  // namespace

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
constexpr FaultRequirement kNvfp4Recipe{
    "recipe nvfp4", [](const Scenario& s) { return s.recipe.kind == RecipeKind::kNvfp4; }};

// ---- requirements of the catalog entries added with issue #20 (scale_inv_gathered_bf16,
// vocab_uneven_resume_rows)
constexpr FaultRequirement kCurrentRecipeNotPow2{
    "recipe current without power_2_scale (a power-of-2 scale_inv is exact in bf16)",
    [](const Scenario& s) {
      return s.recipe.kind == RecipeKind::kCurrent && !engine::power_2_scale_of(s.recipe);
    }};
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

}  // namespace meshproof::harness::faults_internal
