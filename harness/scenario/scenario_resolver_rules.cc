// The resolver's scenario-level rules, applied after every key is read (docs/design.md sections 7,
// 11 and 18): the shapes a (mesh, recipe) pair imposes on the model and batch, the keys written
// with a value no run of the scenario acts on, and engine::check_run (engine/config/run_rules.h) on
// the scenario's run and on the runs its checks make, each issue reported at the scenario key that
// wrote the setting (the engine's key names mapped to the scenario's). Members of the Resolver
// (harness/scenario/scenario_resolver_internal.h).
#include <fmt/format.h>

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <utility>

#include "engine/config/run_rules.h"
#include "engine/model/params.h"
#include "harness/run/train_run.h"
#include "harness/scenario/scenario.h"
#include "harness/scenario/scenario_resolver_internal.h"

namespace meshproof::harness::resolver_internal {
namespace {

// engine::ConfigIssue key paths and message words in the scenario's names (the engine's Config
// calls the global batch training.batch, the sequence length training.seq_len and also
// model.max_positions, the data order data.markov_order).
const std::pair<std::string_view, std::string_view> kEngineNames[] = {
    {"training.batch", "train.global_batch"}, {"training.seq_len", "model.seq_len"},
    {"model.max_positions", "model.seq_len"}, {"data.markov_order", "data.order"},
    {"recipe.kind", "recipe.name"},           {"training.", "train."}};

std::string scenario_key(const std::string& key) {
  for (const auto& [engine_name, name] : kEngineNames) {
    if (key.rfind(engine_name, 0) == 0) return std::string(name) + key.substr(engine_name.size());
  }
  return key;
}

std::string scenario_text(std::string text) {
  for (const auto& [engine_name, name] : kEngineNames) {
    for (size_t pos = 0; (pos = text.find(engine_name, pos)) != std::string::npos;) {
      text.replace(pos, engine_name.size(), name);
      pos += name.size();
    }
  }
  return text;
}

}  // namespace

// The shape rules a (mesh, recipe) pair imposes on the model and batch.
void Resolver::check_fits(const engine::MeshSpec& m, const std::string& mesh_path,
                          const engine::RecipeConfig& r, const engine::ModelConfig& model,
                          const engine::TrainingConfig& train) {
  // Scenario policy beyond the engine's rules (engine::check_run): whole ffn columns per TP
  // rank, and FP8 GEMM dims that cuBLASLt accepts on every backend.
  const std::string tp_path = mesh_path + ".tp";
  if (model.ffn % m.tp != 0) {
    bad(tp_path, fmt::format("model.ffn = {} is not divisible by tp = {}", model.ffn, m.tp));
  }
  if (!engine::is_fp8(r.kind)) return;
  // GEMM operand dims: K of qkv/fc1 is H; K of proj is H/tp and of fc2 F/tp (row parallel);
  // M is the tokens of one micro-batch on one rank (a sequence shard before the SP gather).
  const int64_t rows = train.batch / (int64_t{m.dp_replicate} * m.dp_shard * train.micro_batches);
  const int64_t tokens = rows * train.seq_len / (m.sequence_parallel ? m.tp : 1);
  const std::string tokens_what = fmt::format(
      "tokens per rank and micro-batch (global_batch / (dp x micro_batches) x seq_len{}{})",
      m.sequence_parallel ? " / tp" : "",
      mesh_path == "mesh" ? "" : fmt::format(" on {}", mesh_path));
  if (r.kind == RecipeKind::kMxfp8) {
    // MXFP8 blocks are 32 elements along K (rowwise) and M (columnwise), docs/design.md
    // section 4. engine::check_run holds these rules (hidden, hidden / tp, ffn / tp and a data
    // rank's tokens); only a sequence shard's tokens are the loader's.
    if (m.sequence_parallel && tokens % 32 != 0) {
      bad("train.global_batch",
          fmt::format("{} = {}: recipe mxfp8 needs multiples of 32 (1x32 / 32x1 blocks)",
                      tokens_what, tokens));
    }
    return;
  }
  // Per-tensor and block FP8 GEMMs (cuBLASLt, and TE's assertion) need dims % 16 == 0.
  const std::string why =
      fmt::format("recipe {} needs multiples of 16 (FP8 GEMM dims)", to_string(r.kind));
  auto need = [&](int64_t value, const std::string& path, const std::string& what) {
    if (value % 16 != 0) bad(path, fmt::format("{} = {}: {}", what, value, why));
  };
  // The K of every linear layer of a block (engine/model/params.h block_linears): its in
  // features, divided by tp for a row-parallel layer ("hidden / tp (proj K)"), each distinct K
  // once.
  std::set<std::string> asked;
  for (const engine::LinearLayer& l : engine::block_linears(model.activation)) {
    const std::string dim(engine::model_dim_name(l.in_dim));
    const int64_t size = l.in_dim == engine::ModelDim::kHidden ? model.hidden : model.ffn;
    const bool split = l.kind == engine::LinearKind::kRowParallel && m.tp > 1;
    const std::string_view layer = l.name.substr(l.name.rfind('.') + 1);
    const std::string what = split ? fmt::format("{} / tp ({} K)", dim, layer) : dim;
    if (asked.insert(what).second)
      need(split ? size / m.tp : size, split ? tp_path : "model." + dim, what);
  }
  need(tokens, "train.global_batch", tokens_what);
}

// Keys written with a value that no run of the scenario (its own, or the runs its checks make)
// would act on: accepted, they would be parsed and ignored, and the scenario would claim a
// configuration it does not run (docs/scenarios.md, "Keys that only apply with others").
// Recipe options are the documented exception (one recipe mapping shared by a matrix over
// recipes). Defaults written out are never an error.
void Resolver::no_effect_rules(const Scenario& sc, const Section& ms, const Section& fs,
                               const Section& ts, const Section& cks) {
  if (ms.has("rope_theta") && sc.model.position != engine::PositionKind::kRope) {
    fail(ms.where("rope_theta"), ms.child("rope_theta"),
         "only applies with model.position: rope (learned positions have no rotary frequency)");
  }
  const ChecksConfig& c = sc.checks;
  if (ts.has("pp_schedule") && sc.train.pp_schedule != engine::PpSchedule::kGpipe) {
    bool staged = sc.mesh.pp > 1;
    for (const std::optional<engine::MeshSpec>* m :
         {&c.resume.mesh, &c.state.mesh, &c.reference.mesh}) {
      staged = staged || (m->has_value() && (*m)->pp > 1);
    }
    if (!staged) {
      fail(ts.where("pp_schedule"), ts.child("pp_schedule"),
           "only applies with mesh.pp > 1: every run of this scenario (and of its checks) has "
           "one pipeline stage");
    }
  }
  // The reference run inherits fsdp.sync_each_micro_batch unless its fsdp mapping sets it.
  const int64_t ref_micro = c.reference.micro_batches.value_or(sc.train.micro_batches);
  const bool ref_sync =
      c.reference.fsdp ? c.reference.fsdp->sync_each_micro_batch : sc.fsdp.sync_each_micro_batch;
  if (fs.has("sync_each_micro_batch") && sc.fsdp.sync_each_micro_batch &&
      sc.train.micro_batches == 1 && !(c.reference.enabled && ref_sync && ref_micro > 1)) {
    fail(fs.where("sync_each_micro_batch"), fs.child("sync_each_micro_batch"),
         "only applies with train.micro_batches > 1 (with one micro-batch the gradients are "
         "reduced once per step either way)");
  }
  if (c.reference.enabled && ref_sync_written_ && ref_sync && ref_micro == 1) {
    bad("checks.reference.fsdp.sync_each_micro_batch",
        "only applies with micro_batches > 1, and the reference run has 1 (set "
        "checks.reference.train.micro_batches or train.micro_batches): the comparison would "
        "prove nothing");
  }
  // A reference run with periodic checkpoints of its own inherits keep_last unless it sets it.
  const bool ref_prunes = c.reference.enabled && c.reference.checkpoint &&
                          c.reference.checkpoint->every > 0 && !ref_keep_last_written_;
  if (cks.has("keep_last") && sc.checkpoint.keep_last != Scenario().checkpoint.keep_last &&
      sc.checkpoint.every == 0 && !ref_prunes) {
    fail(cks.where("keep_last"), cks.child("keep_last"),
         "only applies with checkpoint.every > 0 (it prunes the run's periodic checkpoints; a "
         "check's own checkpoint is never pruned)");
  }
  if (ref_keep_last_written_ && c.reference.checkpoint && c.reference.checkpoint->every == 0) {
    bad("checks.reference.checkpoint.keep_last",
        "only applies with checks.reference.checkpoint.every > 0 (it prunes periodic "
        "checkpoints, and with every 0 the reference run writes none)");
  }
}

// engine::check_run (engine/config/run_rules.h), the one set of model x mesh x recipe x FSDP
// rules the training session applies, on the scenario's run and on the runs its checks make (the
// resume half on checks.resume.mesh, the reference run). Each issue is reported at the
// scenario key that wrote the setting; a key the loader's own reading already reported is
// not reported twice.
void Resolver::engine_rules(const Scenario& sc) {
  std::set<std::pair<std::string, std::string>> main_issues;
  auto emit = [&](const std::string& path, const std::string& what) {
    report(at(path), path, what);
  };
  for (const engine::ConfigIssue& i : engine::check_run(engine_run_options(sc))) {
    main_issues.insert({i.key_path, i.message});
    emit(scenario_key(i.key_path), scenario_text(i.message));
  }
  check_fits(sc.mesh, "mesh", sc.recipe, sc.model, sc.train);
  const ChecksConfig& c = sc.checks;
  if (c.resume.enabled && c.resume.mesh) {
    const Scenario r = on_mesh(sc, *c.resume.mesh);
    for (const engine::ConfigIssue& i : engine::check_run(engine_run_options(r))) {
      if (main_issues.count({i.key_path, i.message}) > 0) continue;
      if (i.key_path.rfind("mesh", 0) == 0) {
        emit("checks.resume." + i.key_path, scenario_text(i.message));
      } else {
        emit(scenario_key(i.key_path), scenario_text(i.message) + " (on checks.resume.mesh)");
      }
    }
    check_fits(*c.resume.mesh, "checks.resume.mesh", sc.recipe, sc.model, sc.train);
  }
  if (c.state.enabled && c.state.mesh) {
    const Scenario r = on_mesh(sc, *c.state.mesh);
    for (const engine::ConfigIssue& i : engine::check_run(engine_run_options(r))) {
      if (main_issues.count({i.key_path, i.message}) > 0) continue;
      if (i.key_path.rfind("mesh", 0) == 0) {
        emit("checks.state." + i.key_path, scenario_text(i.message));
      } else {
        emit(scenario_key(i.key_path), scenario_text(i.message) + " (on checks.state.mesh)");
      }
    }
    check_fits(*c.state.mesh, "checks.state.mesh", sc.recipe, sc.model, sc.train);
  }
  if (c.reference.enabled) {
    Scenario r = c.reference.mesh ? on_mesh(sc, *c.reference.mesh) : sc;
    if (c.reference.recipe) r.recipe = *c.reference.recipe;
    if (c.reference.fsdp) r.fsdp = *c.reference.fsdp;
    if (c.reference.micro_batches) r.train.micro_batches = *c.reference.micro_batches;
    const std::string owner = c.reference.recipe ? "checks.reference.recipe"
                              : c.reference.mesh ? "checks.reference.mesh"
                              : c.reference.fsdp ? "checks.reference.fsdp"
                                                 : "checks.reference.train";
    for (const engine::ConfigIssue& i : engine::check_run(engine_run_options(r))) {
      if (main_issues.count({i.key_path, i.message}) > 0) continue;
      if (c.reference.mesh && i.key_path.rfind("mesh", 0) == 0) {
        emit("checks.reference." + i.key_path, scenario_text(i.message));
      } else if (c.reference.recipe && i.key_path.rfind("recipe", 0) == 0) {
        emit("checks.reference." + scenario_key(i.key_path), scenario_text(i.message));
      } else {
        // A setting of the scenario that the reference's mesh or recipe cannot run with
        // (e.g. fsdp.fp8_params with a reference recipe fp32): the reference key is the cause.
        emit(owner, fmt::format("{}: {} (in the reference run)", scenario_key(i.key_path),
                                scenario_text(i.message)));
      }
    }
    check_fits(r.mesh, c.reference.mesh ? "checks.reference.mesh" : "mesh", r.recipe, sc.model,
               r.train);
  }
}

}  // namespace meshproof::harness::resolver_internal
