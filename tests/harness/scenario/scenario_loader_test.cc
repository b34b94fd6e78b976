// Scenario schema and strict loader: exact error messages for every error class, --set
// overrides, matrix expansion (names, counts, order), defaults, the canonical hash, the fault
// catalog, the starter library and the `validate` verb.
#include "harness/scenario/scenario_loader.h"

#include <fmt/format.h>
#include <gtest/gtest.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "engine/config/run_rules.h"
#include "harness/checks/check_table.h"
#include "harness/checks/golden.h"
#include "harness/faults/scenario_faults.h"
#include "harness/run/train_run.h"
#include "harness/scenario/scenario.h"
#include "harness/verbs/cli.h"
#include "harness/verbs/exit_codes.h"
#include "harness/verbs/validate_verb.h"
#include "kernels/core/error.h"
#include "mesh/local/local_comm.h"
#include "tests/harness/cli_run.h"
#include "tests/scoped_env.h"
#include "tests/source_dir.h"

namespace meshproof::harness {
namespace {

namespace fs = std::filesystem;

using test_support::source_dir;

std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::ostringstream s;
  s << in.rdbuf();
  return s.str();
}

// The kInput message of loading `yaml`, or "" when it loads.
std::string load_error(const std::string& yaml, const std::vector<std::string>& sets = {},
                       const std::string& source = "x.yaml") {
  try {
    std::vector<Override> overrides;
    for (const std::string& s : sets) overrides.push_back(parse_override(s));
    load_scenario_text(yaml, source, overrides);
  } catch (const kernels::Error& e) {
    EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput) << e.what();
    return e.message();
  }
  return "";
}

Scenario load_one(const std::string& yaml, const std::vector<std::string>& sets = {}) {
  std::vector<Override> overrides;
  for (const std::string& s : sets) overrides.push_back(parse_override(s));
  std::vector<Scenario> all = load_scenario_text(yaml, "x.yaml", overrides);
  EXPECT_EQ(all.size(), 1u);
  return all.at(0);
}

std::vector<std::string> names_of(const std::vector<Scenario>& v) {
  std::vector<std::string> names;
  for (const Scenario& s : v) names.push_back(s.name);
  return names;
}

// ---- error classes, data-driven: tests/harness/scenario/bad/*.yaml carry their expected message.

// The bad-scenario files live next to this test; a GPU bundle that did not copy them skips.
fs::path bad_dir() { return source_dir() / "tests/harness/scenario/bad"; }
#define SKIP_WITHOUT_BAD_DIR()                                                               \
  if (!fs::is_directory(bad_dir())) {                                                        \
    GTEST_SKIP() << bad_dir() << " is not present (set MESHPROOF_SOURCE_DIR to a checkout)"; \
  }

TEST(ScenarioErrors, EveryBadFileGivesItsExactMessage) {
  SKIP_WITHOUT_BAD_DIR();
  const fs::path dir = bad_dir();
  int count = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != ".yaml") continue;
    const std::string text = read_text(entry.path());
    const std::string name = "bad/" + entry.path().filename().string();
    std::string expected;
    std::istringstream lines(text);
    for (std::string line; std::getline(lines, line);) {
      if (line.rfind("# expect: ", 0) == 0) expected = line.substr(10);
    }
    ASSERT_FALSE(expected.empty()) << name << " has no '# expect:' header";
    for (size_t pos; (pos = expected.find("${FILE}")) != std::string::npos;) {
      expected.replace(pos, 7, name);
    }
    EXPECT_EQ(load_error(text, {}, name), expected) << name;
    ++count;
  }
  // One file per error class listed in docs/scenarios.md; a lost file would shrink coverage.
  EXPECT_GE(count, 25);
}

TEST(ScenarioErrors, UnknownKeyWithoutCloseMatchListsAllowedKeys) {
  EXPECT_EQ(load_error("data:\n  flavour: markov\n"),
            "x.yaml:2:3: data.flavour: unknown key (allowed: kind, order, seed)");
}

TEST(ScenarioErrors, MessagesAreLocatedOneBased) {
  // Line 1 column 1 is the first character of the file.
  EXPECT_EQ(load_error("bogus: 1\n"),
            "x.yaml:1:1: bogus: unknown key (allowed: name, description, "
            "model, mesh, recipe, fsdp, train, data, backend, launcher, "
            "requires_gpu, checkpoint, checks, faults, expect, matrix)");
}

TEST(ScenarioErrors, DocumentMustBeAMapping) {
  EXPECT_EQ(load_error("- a\n- b\n"),
            "x.yaml:1:1: scenario: expected a mapping of keys, got a sequence");
  EXPECT_EQ(load_error(""), "x.yaml:1:1: scenario: expected a mapping of keys, got nothing (null)");
}

// A key written with a value that no run of the scenario would act on is refused at the key
// (docs/scenarios.md, "Keys that only apply with others"): accepted, the scenario would claim a
// configuration it does not run. Each case has a twin where the key does apply, which loads.
TEST(ScenarioErrors, KeysThatNoRunActsOnAreRefused) {
  EXPECT_EQ(load_error("model: {rope_theta: 5000}\n"),
            "x.yaml:1:21: model.rope_theta: only applies with model.position: rope (learned "
            "positions have no rotary frequency)");
  EXPECT_EQ(load_one("model: {position: rope, rope_theta: 5000}\n").model.rope_theta, 5000.0);
  // The preset's own theta is not written by the user: overriding the position alone loads.
  EXPECT_EQ(load_one("model: {preset: llama3_debug, position: learned}\n").model.position,
            engine::PositionKind::kLearned);

  EXPECT_EQ(load_error("train: {pp_schedule: 1f1b}\n"),
            "x.yaml:1:22: train.pp_schedule: only applies with mesh.pp > 1: every run of this "
            "scenario (and of its checks) has one pipeline stage");
  EXPECT_EQ(load_one("train: {pp_schedule: gpipe}\n").train.pp_schedule,
            engine::PpSchedule::kGpipe);  // the default written out
  // A check's run with stages is enough.
  EXPECT_EQ(
      load_one("train: {pp_schedule: 1f1b}\nchecks: {resume: {mesh: {pp: 2}}}\n").train.pp_schedule,
      engine::PpSchedule::kOneFOneB);

  EXPECT_EQ(load_error("fsdp: {sync_each_micro_batch: true}\n"),
            "x.yaml:1:31: fsdp.sync_each_micro_batch: only applies with train.micro_batches > 1 "
            "(with one micro-batch the gradients are reduced once per step either way)");
  EXPECT_TRUE(load_one("fsdp: {sync_each_micro_batch: true}\ntrain: {micro_batches: 2}\n")
                  .fsdp.sync_each_micro_batch);
  // The reference run inherits it and has micro-batches.
  EXPECT_TRUE(load_one("recipe: fp32\nfsdp: {sync_each_micro_batch: true}\n"
                       "checks: {reference: {train: {micro_batches: 2}}}\n")
                  .fsdp.sync_each_micro_batch);
  EXPECT_EQ(
      load_error("recipe: fp32\nchecks: {reference: {fsdp: {sync_each_micro_batch: true}}}\n"),
      "x.yaml:2:52: checks.reference.fsdp.sync_each_micro_batch: only applies with "
      "micro_batches > 1, and the reference run has 1 (set "
      "checks.reference.train.micro_batches or train.micro_batches): the comparison would "
      "prove nothing");
  EXPECT_TRUE(load_one("recipe: fp32\ntrain: {micro_batches: 2}\n"
                       "checks: {reference: {fsdp: {sync_each_micro_batch: true}}}\n")
                  .checks.reference.fsdp->sync_each_micro_batch);

  EXPECT_EQ(load_error("checkpoint: {keep_last: 5}\n"),
            "x.yaml:1:25: checkpoint.keep_last: only applies with checkpoint.every > 0 (it prunes "
            "the run's periodic checkpoints; a check's own checkpoint is never pruned)");
  EXPECT_EQ(load_one("checkpoint: {keep_last: 2}\n").checkpoint.keep_last, 2);
  EXPECT_EQ(load_one("checkpoint: {every: 2, keep_last: 5}\n").checkpoint.keep_last, 5);
  // The reference run's periodic checkpoints inherit it.
  EXPECT_EQ(load_one("checkpoint: {keep_last: 5}\nchecks: {reference: {checkpoint: {every: 2}}}\n")
                .checks.reference.checkpoint->keep_last,
            5);
  // A reference whose only difference is a keep_last it never uses would pass vacuously.
  EXPECT_EQ(load_error("checks: {reference: {checkpoint: {keep_last: 5}}}\n"),
            "x.yaml:1:46: checks.reference.checkpoint.keep_last: only applies with "
            "checks.reference.checkpoint.every > 0 (it prunes periodic checkpoints, and with every "
            "0 the reference run writes none)");
  EXPECT_EQ(load_one("checks: {reference: {checkpoint: {every: 2, keep_last: 5}}}\n")
                .checks.reference.checkpoint->keep_last,
            5);
}

TEST(ScenarioErrors, ConsistencyRules) {
  // MXFP8 under sequence parallelism: the GEMM inputs are quantized as sequence shards, so the
  // tokens per rank divided by tp must be whole 32-blocks too (engine::check_run counts the data
  // rank's tokens: 32 here, which it accepts).
  EXPECT_EQ(
      load_error(
          "recipe: mxfp8\nmesh: {tp: 2, sequence_parallel: true}\ntrain: {global_batch: 1}\n"),
      "x.yaml:3:23: train.global_batch: tokens per rank and micro-batch (global_batch / (dp x "
      "micro_batches) x seq_len / tp) = 16: recipe mxfp8 needs multiples of 32 (1x32 / 32x1 "
      "blocks)");
  // sequence parallelism splits the sequence over tp
  EXPECT_EQ(load_error("model: {seq_len: 31}\nmesh: {tp: 2, sequence_parallel: true}\n"),
            "x.yaml:2:34: mesh.sequence_parallel: model.seq_len = 31 is not divisible by tp = 2");
  // a warmup longer than the run; warmup_cosine keeps the peak step and one cosine step
  // (CosineAnnealingLR's T_max = steps - 1 - warmup_steps >= 1)
  EXPECT_EQ(load_error("train: {steps: 4, schedule: warmup_cosine, warmup_steps: 5}\n"),
            "x.yaml:1:58: train.warmup_steps: must be in [0, 2], got 5");
  EXPECT_EQ(load_error("train: {steps: 4, schedule: warmup_cosine, warmup_steps: 3}\n"),
            "x.yaml:1:58: train.warmup_steps: must be in [0, 2], got 3");
  EXPECT_EQ(load_error("train: {steps: 1, schedule: warmup_cosine}\n"),
            "x.yaml:1:29: train.schedule: warmup_cosine needs train.steps >= 2 (a peak step and a "
            "step at min_lr), got 1");
  EXPECT_EQ(load_error("train: {warmup_steps: 2}\n"),
            "x.yaml:1:23: train.warmup_steps: only applies to schedule warmup_cosine");
  EXPECT_EQ(load_error("backend: cpu\nrequires_gpu: true\n"),
            "x.yaml:2:15: requires_gpu: true contradicts backend: cpu");
  EXPECT_EQ(load_error("checks: {golden: {rtol: 0.1}}\n"),
            "x.yaml:1:25: checks.golden.rtol: only applies to mode tolerance (exact is bitwise)");
  EXPECT_EQ(load_error("recipe: mxfp8\nchecks: {golden: {mode: tolerance}}\n"),
            "x.yaml:2:18: checks.golden.rtol: required: FP8 recipes have no default tolerance "
            "(docs/design.md section 8); give a measured bound");
  EXPECT_EQ(load_error("checks: {resume: {rtol: 0.1}}\n"),
            "x.yaml:1:25: checks.resume.rtol: only applies with a mesh override (a same-mesh "
            "resume is bitwise)");
  EXPECT_EQ(load_error("checks: {reference: {}}\n"),
            "x.yaml:1:21: checks.reference: needs a mesh, recipe, fsdp, train and/or checkpoint "
            "override to compare against");
  // The fsdp and train overrides (issue #20): a key of their own sections only, a value that
  // differs from the scenario's, micro_batches present.
  EXPECT_EQ(load_error("checks: {reference: {fsdp: {reshard_after_forward: true}}}\n"),
            "x.yaml:1:21: checks.reference: the reference mesh, recipe, fsdp, train.micro_batches "
            "and checkpoint equal the scenario's own");
  EXPECT_EQ(load_error("checks: {reference: {fsdp: {reshard: false}}}\n"),
            "x.yaml:1:29: checks.reference.fsdp.reshard: unknown key (allowed: "
            "reshard_after_forward, fp8_all_gather, fp8_params, sync_each_micro_batch)\n"
            "x.yaml:1:21: checks.reference: the reference mesh, recipe, fsdp, train.micro_batches "
            "and checkpoint equal the scenario's own");
  // The checkpoint override (issue #20): every and keep_last only, within their ranges, and
  // different from the scenario's own.
  const Scenario ck = load_one("checks: {reference: {checkpoint: {every: 1}}}\n");
  ASSERT_TRUE(ck.checks.reference.checkpoint.has_value());
  EXPECT_EQ(ck.checks.reference.checkpoint->every, 1);
  EXPECT_EQ(ck.checks.reference.checkpoint->keep_last, 2);
  EXPECT_EQ(load_error("checks: {reference: {checkpoint: {every: 0}}}\n"),
            "x.yaml:1:21: checks.reference: the reference mesh, recipe, fsdp, train.micro_batches "
            "and checkpoint equal the scenario's own");
  EXPECT_NE(load_error("checks: {reference: {checkpoint: {dir: x}}}\n")
                .find("checks.reference.checkpoint.dir: unknown key (allowed: every, keep_last)"),
            std::string::npos);
  EXPECT_NE(load_error("train: {steps: 4}\nchecks: {reference: {checkpoint: {every: 9}}}\n")
                .find("checks.reference.checkpoint.every: must be in [0, 4], got 9"),
            std::string::npos);
  EXPECT_EQ(load_error("checks: {reference: {train: {steps: 2}}}\n"),
            "x.yaml:1:30: checks.reference.train.steps: unknown key (allowed: micro_batches)\n"
            "x.yaml:1:29: checks.reference.train: needs micro_batches (the one train key it "
            "overrides)\n"
            "x.yaml:1:21: checks.reference: the reference mesh, recipe, fsdp, train.micro_batches "
            "and checkpoint equal the scenario's own");
  EXPECT_EQ(load_error("train: {global_batch: 8}\n"
                       "checks: {reference: {train: {micro_batches: 3}}}\n"),
            "x.yaml:2:29: checks.reference.train: train.micro_batches: train.micro_batches = 3 "
            "must be >= 1 and divide train.global_batch = 8 (in the reference run)");
  EXPECT_EQ(load_error("checks: {allgather_parity: true}\n"),
            "x.yaml:1:28: checks.allgather_parity: needs fsdp.fp8_all_gather: true");
  // The engine's rule (engine::check_config), in the scenario's key names.
  EXPECT_EQ(load_error("model: {vocab: 5000}\ndata: {order: 2}\n"),
            "x.yaml:2:15: data.order: data.order = 2 with model.vocab = 5000: the transition "
            "table (vocab^(order+1) = 5000^3 entries) exceeds 2^24");
  // the resume target mesh must fit the model too
  EXPECT_EQ(load_error("checks: {resume: {mesh: {tp: 3}}}\n"),
            "x.yaml:1:30: checks.resume.mesh.tp: model.heads = 4 is not divisible by tp = 3");
  EXPECT_EQ(load_error("train: {steps: 1}\nchecks: {resume: true}\n"),
            "x.yaml:2:18: checks.resume: needs train.steps >= 2 to stop and resume, got 1");
}

TEST(ScenarioErrors, FaultWithExpectPassIsRejected) {
  EXPECT_EQ(load_error("checks: {resume: true}\nfaults: [data_cursor_not_restored]\n"),
            "x.yaml:2:9: faults: a scenario with injected faults must say expect: caught");
}

// ---- overrides

TEST(ScenarioOverrides, ErrorsNameTheOverride) {
  EXPECT_EQ(load_error("name: q\n", {"mesh.tp=two"}),
            "--set mesh.tp=two: mesh.tp: expected an integer, got 'two'");
  EXPECT_EQ(load_error("name: q\n", {"mesh.tpp=2"}),
            "--set mesh.tpp=2: mesh.tpp: unknown key; did you mean 'tp'?");
  EXPECT_EQ(load_error("name: q\n", {"name.x=1"}),
            "--set name.x=1: name: is 'q', not a mapping: cannot set 'x' inside it");
  EXPECT_EQ(load_error("name: q\n", {"mesh.tp=[1"}),
            "--set mesh.tp=[1: mesh.tp: cannot parse the value as YAML: end of sequence flow not "
            "found");
  EXPECT_EQ(load_error("name: q\n", {"mesh.tp="}),
            "--set mesh.tp=: mesh.tp: expected a value after '='");
  // a consistency error caused by an override points at the override
  EXPECT_EQ(load_error("name: q\n", {"mesh.tp=3"}),
            "--set mesh.tp=3: mesh.tp: model.heads = 4 is not divisible by tp = 3");
}

TEST(ScenarioOverrides, MalformedOverrideText) {
  EXPECT_EQ(load_error("name: q\n", {"mesh.tp"}), "--set mesh.tp: expected KEY.PATH=VALUE");
  EXPECT_EQ(load_error("name: q\n", {"mesh..tp=2"}),
            "--set mesh..tp=2: mesh..tp: malformed key path (expected names joined by '.')");
  EXPECT_EQ(load_error("name: q\n", {"=2"}),
            "--set =2: (empty): malformed key path (expected names joined by '.')");
}

TEST(ScenarioOverrides, ValuesAreAppliedAsYaml) {
  const Scenario s = load_one("name: q\nmesh: {dp_shard: 2}\ntrain: {steps: 8}\n",
                              {"train.steps=12", "mesh={tp: 2}", "recipe=current",
                               "recipe.margin=3", "train.lr=2e-3", "fsdp.fp8_all_gather=true"});
  EXPECT_EQ(s.train.steps, 12);
  EXPECT_EQ(s.mesh.dp_shard, 2);  // a mapping merges into the existing one
  EXPECT_EQ(s.mesh.tp, 2);
  EXPECT_EQ(s.recipe.kind, RecipeKind::kCurrent);  // the recipe shorthand works in --set too
  EXPECT_EQ(s.recipe.margin, 3);
  EXPECT_DOUBLE_EQ(s.train.lr, 2e-3);
  EXPECT_TRUE(s.fsdp.fp8_all_gather);
}

TEST(ScenarioFsdp, SyncEachMicroBatchIsReadAndHashedOnlyWhenSet) {
  const std::string yaml = "name: q\nmesh: {dp_shard: 2}\ntrain: {micro_batches: 2}\n";
  const Scenario deferred = load_one(yaml);
  EXPECT_FALSE(deferred.fsdp.sync_each_micro_batch);
  // Left out of the canonical text at its default: hashes of existing scenarios are unchanged.
  EXPECT_FALSE(to_canonical_json(deferred)["fsdp"].contains("sync_each_micro_batch"));
  const Scenario each = load_one(yaml, {"fsdp.sync_each_micro_batch=true"});
  EXPECT_TRUE(each.fsdp.sync_each_micro_batch);
  EXPECT_TRUE(to_canonical_json(each)["fsdp"].at("sync_each_micro_batch").get<bool>());
  EXPECT_NE(scenario_hash(deferred), scenario_hash(each));
}

// model.pp_layers (docs/design.md section 33): a list read into the engine's split, hashed only
// when set; its rules (one entry per stage, each >= 1, summing to model.layers) are the engine's,
// reported at the list's line and column; a check on a mesh with another pp takes the even split.
TEST(ScenarioPipeline, PpLayersIsReadHashedOnlyWhenSetAndJudgedAtItsKey) {
  const std::string yaml = "name: q\nmodel: {layers: 4}\nmesh: {pp: 2}\n";
  const Scenario even = load_one(yaml);
  EXPECT_TRUE(even.model.pp_layers.empty());
  EXPECT_FALSE(to_canonical_json(even)["model"].contains("pp_layers"));
  const Scenario split = load_one(yaml, {"model.pp_layers=[3, 1]"});
  EXPECT_EQ(split.model.pp_layers, (std::vector<int64_t>{3, 1}));
  EXPECT_EQ(to_canonical_json(split)["model"].at("pp_layers"), nlohmann::json::array({3, 1}));
  EXPECT_NE(scenario_hash(even), scenario_hash(split));
  // The split is not the model: a checkpoint's model record is the same with and without it.
  EXPECT_EQ(model_record(even), model_record(split));
  // Another pp (a check's mesh) drops the split; the same pp keeps it.
  engine::MeshSpec one;
  EXPECT_TRUE(on_mesh(split, one).model.pp_layers.empty());
  EXPECT_EQ(on_mesh(split, split.mesh).model.pp_layers, split.model.pp_layers);

  const std::string file = "name: q\nmodel:\n  layers: 4\n  pp_layers: [3, 2]\nmesh: {pp: 2}\n";
  EXPECT_EQ(load_error(file), "x.yaml:4:14: model.pp_layers: [3, 2] sums to 5, model.layers = 4");
  EXPECT_EQ(load_error("name: q\nmodel:\n  layers: 4\n  pp_layers: [4]\nmesh: {pp: 2}\n"),
            "x.yaml:4:14: model.pp_layers: [4] has 1 entries; mesh.pp = 2 needs one per stage");
  EXPECT_EQ(load_error("name: q\nmodel:\n  layers: 4\n  pp_layers: [4, 0]\nmesh: {pp: 2}\n"),
            "x.yaml:4:14: model.pp_layers: [4, 0]: every stage needs at least one layer");
  EXPECT_EQ(load_error("name: q\nmodel:\n  layers: 4\n  pp_layers: [3, x]\nmesh: {pp: 2}\n"),
            "x.yaml:4:18: model.pp_layers[1]: expected an integer, got 'x'");
  EXPECT_NE(load_error("name: q\nmodel:\n  layers: 4\n  pp_layers: 4\nmesh: {pp: 2}\n")
                .find("x.yaml:4:14: model.pp_layers: expected a non-empty list of integers"),
            std::string::npos);
  // A reference on pp 1 runs with the even split: accepted.
  EXPECT_EQ(load_error("name: q\nmodel:\n  layers: 4\n  pp_layers: [1, 3]\nmesh: {pp: 2}\n"
                       "checks:\n  reference:\n    mesh: {pp: 1}\n    rtol: 0\n"),
            "");
}

TEST(ScenarioOverrides, SetWinsOverMatrixAndCanEditTheMatrix) {
  const std::string yaml = "name: m\nmatrix:\n  recipe: [bf16, mxfp8]\n";
  const std::vector<Scenario> pinned =
      load_scenario_text(yaml, "m.yaml", {parse_override("recipe=fp32")});
  ASSERT_EQ(pinned.size(), 2u);
  for (const Scenario& s : pinned) EXPECT_EQ(s.recipe.kind, RecipeKind::kFp32);
  const std::vector<Scenario> edited = load_scenario_text(
      yaml, "m.yaml", {parse_override("matrix.recipe=[delayed, current, block]")});
  EXPECT_EQ(names_of(edited), (std::vector<std::string>{"m[recipe=delayed]", "m[recipe=current]",
                                                        "m[recipe=block]"}));
}

// ---- matrix

TEST(ScenarioMatrix, CartesianProductInFileOrderLastKeyFastest) {
  const std::vector<Scenario> v = load_scenario_text(
      "name: grid\nmatrix:\n  mesh: [{dp_shard: 4}, {dp_shard: 2, tp: 2}]\n  recipe: [bf16, "
      "mxfp8]\n  fsdp: [{reshard_after_forward: false}]\n",
      "grid.yaml");
  EXPECT_EQ(names_of(v),
            (std::vector<std::string>{
                "grid[mesh=dp_shard4,recipe=bf16,fsdp=no_reshard_after_forward]",
                "grid[mesh=dp_shard4,recipe=mxfp8,fsdp=no_reshard_after_forward]",
                "grid[mesh=dp_shard2_tp2,recipe=bf16,fsdp=no_reshard_after_forward]",
                "grid[mesh=dp_shard2_tp2,recipe=mxfp8,fsdp=no_reshard_after_forward]"}));
  EXPECT_EQ(v[2].mesh.dp_shard, 2);
  EXPECT_EQ(v[2].mesh.tp, 2);
  EXPECT_EQ(v[1].recipe.kind, RecipeKind::kMxfp8);
  EXPECT_EQ(v[1].recipe.fp8_format, Fp8Format::kE4M3);  // the mxfp8 default
  EXPECT_FALSE(v[3].fsdp.reshard_after_forward);
  EXPECT_EQ(v[3].base_name, "grid");
  ASSERT_EQ(v[3].matrix_labels.size(), 3u);
  EXPECT_EQ(v[3].matrix_labels[0], (std::pair<std::string, std::string>{"mesh", "dp_shard2_tp2"}));
  // every entry hashes differently
  std::set<uint64_t> hashes;
  for (const Scenario& s : v) hashes.insert(scenario_hash(s));
  EXPECT_EQ(hashes.size(), v.size());
}

TEST(ScenarioMatrix, DottedKeysAndMergeIntoBase) {
  const std::vector<Scenario> v = load_scenario_text(
      "name: acc\nmesh: {dp_shard: 2, tp: 2}\ntrain: {global_batch: 16}\nmatrix:\n"
      "  train.micro_batches: [1, 2, 4]\n  mesh: [{dp_shard: 1}, {}]\n",
      "acc.yaml");
  ASSERT_EQ(v.size(), 6u);
  EXPECT_EQ(v[0].name, "acc[train.micro_batches=1,mesh=dp_shard1]");
  EXPECT_EQ(v[1].name, "acc[train.micro_batches=1,mesh=]");
  EXPECT_EQ(v[0].mesh.tp, 2);  // merged: tp comes from the base mesh
  EXPECT_EQ(v[0].mesh.dp_shard, 1);
  EXPECT_EQ(v[5].train.micro_batches, 4);
  EXPECT_EQ(v[5].train.batch, 16);
}

TEST(ScenarioMatrix, Errors) {
  EXPECT_EQ(load_error("matrix:\n  recipe: []\n"),
            "x.yaml:2:11: matrix.recipe: expected a non-empty list of values, got a sequence");
  EXPECT_EQ(load_error("matrix:\n  recipe: [bf16, bf16]\n"),
            "x.yaml:2:18: matrix.recipe[1]: duplicate matrix entry 'bf16'");
  EXPECT_EQ(load_error("matrix: [1]\n"), "x.yaml:1:9: matrix: expected a mapping, got a sequence");
  EXPECT_EQ(load_error("matrix:\n  name: [a, b]\n"),
            "x.yaml:2:3: matrix.name: unknown key (allowed: model, mesh, recipe, fsdp, train, "
            "data, backend, launcher, requires_gpu, checkpoint, checks, faults, expect)");
}

TEST(ScenarioMatrix, NoMatrixKeepsThePlainName) {
  const Scenario s = load_one("name: plain\n");
  EXPECT_EQ(s.name, "plain");
  EXPECT_TRUE(s.matrix_labels.empty());
}

// ---- defaults

TEST(ScenarioDefaults, EmptyDocumentGetsTheDocumentedDefaults) {
  const std::vector<Scenario> v = load_scenario_text("{}\n", "dir/my_run.yaml");
  ASSERT_EQ(v.size(), 1u);
  const Scenario& s = v[0];
  EXPECT_EQ(s.name, "my_run");  // the file stem
  EXPECT_EQ(s.model.vocab, 256);
  EXPECT_EQ(s.model.hidden, 64);
  EXPECT_EQ(s.model.ffn, 256);  // 4 x hidden
  EXPECT_EQ(s.mesh.world_size(), 1);
  EXPECT_EQ(s.recipe.kind, RecipeKind::kBf16);
  EXPECT_EQ(s.recipe.amax_history_len, 1024);
  EXPECT_TRUE(s.fsdp.reshard_after_forward);
  EXPECT_EQ(s.train.steps, 8);
  EXPECT_DOUBLE_EQ(s.train.beta2, 0.999);
  EXPECT_EQ(s.backend, Backend::kAuto);
  EXPECT_EQ(s.launcher, Launcher::kLocal);
  EXPECT_EQ(s.expect, Expect::kPass);
  EXPECT_TRUE(enabled_checks(s).empty());
  EXPECT_TRUE(s.faults.empty());
}

TEST(ScenarioDefaults, RecipeDependentDefaultsAndCheckDefaults) {
  // The loader always sets the recipe-dependent options (engine::RecipeConfig holds optionals).
  EXPECT_EQ(load_one("recipe: block\n").recipe.power_2_scale, std::optional<bool>(true));
  // TE Float8BlockScaling's default format is E4M3 (as the engine's block recipe always ran).
  EXPECT_EQ(load_one("recipe: block\n").recipe.fp8_format, Fp8Format::kE4M3);
  EXPECT_EQ(load_one("recipe: current\n").recipe.power_2_scale, std::optional<bool>(false));
  EXPECT_EQ(load_one("recipe: delayed\n").recipe.fp8_format, Fp8Format::kHybrid);
  const Scenario r = load_one("train: {steps: 10}\nchecks: {resume: true, golden: true}\n");
  EXPECT_EQ(r.checks.resume.at_step, 5);  // steps / 2
  EXPECT_FALSE(r.checks.resume.mesh.has_value());
  EXPECT_EQ(r.checks.golden.mode, GoldenMode::kExact);
  EXPECT_EQ(r.checks.golden.metrics, (std::vector<Metric>{Metric::kLoss, Metric::kGradNorm}));
  // docs/design.md section 8 bounds as defaults: bf16 1e-2 per step, fp32 1e-5
  const Scenario x = load_one("recipe: bf16\nchecks: {resume: {mesh: {tp: 2}}}\n");
  EXPECT_DOUBLE_EQ(x.checks.resume.rtol, 1e-2);
  const Scenario ref = load_one("recipe: fp32\nchecks: {reference: {mesh: {dp_shard: 2}}}\n");
  EXPECT_DOUBLE_EQ(ref.checks.reference.rtol.at(Metric::kLoss), 1e-5);
  const Scenario per_metric = load_one(
      "recipe: mxfp8\nchecks: {reference: {recipe: fp32, rtol: {loss: 0.05, grad_norm: 0.1}}}\n");
  EXPECT_DOUBLE_EQ(per_metric.checks.reference.rtol.at(Metric::kGradNorm), 0.1);
  EXPECT_EQ(per_metric.checks.reference.recipe->kind, RecipeKind::kFp32);
}

TEST(ScenarioDefaults, FaultParamsResolvedFromTheCatalog) {
  const Scenario s = load_one(
      "recipe: delayed\nchecks: {golden: true, resume: true}\nfaults:\n"
      "  - {name: stale_columnwise_copy, layer: 1}\n  - optimizer_state_not_restored\n"
      "expect: caught\n");
  ASSERT_EQ(s.faults.size(), 2u);
  EXPECT_EQ(s.faults[0].int_params.at("layer"), 1);
  EXPECT_EQ(s.faults[0].int_params.at("from_step"), 1);
  EXPECT_EQ(s.faults[1].string_params.at("state"), "all");
  EXPECT_EQ(load_error("recipe: delayed\nchecks: {golden: true}\nfaults:\n"
                       "  - {name: stale_columnwise_copy, layer: 2}\nexpect: caught\n"),
            "x.yaml:4:42: faults[0].layer: must be in [0, 1], got 2");
}

// Generic faults: their globs must name something of the scenario's run, before it runs (exit 2
// naming the parameter's file:line); their own parameter rules likewise.
TEST(ScenarioDefaults, GenericFaultParametersAreCheckedUpFront) {
  const Scenario s = load_one(
      "checks: {resume: true}\nfaults:\n"
      "  - {name: drop_checkpoint_key, key: \"optim/*/exp_avg_sq\"}\nexpect: caught\n");
  ASSERT_EQ(s.faults.size(), 1u);
  EXPECT_EQ(s.faults[0].string_params.at("key"), "optim/*/exp_avg_sq");
  EXPECT_EQ(load_error("checks: {resume: true}\nfaults:\n"
                       "  - {name: drop_checkpoint_key, key: \"optim/*/exp_avg_cube\"}\n"
                       "expect: caught\n"),
            "x.yaml:3:38: faults[0].key: drop_checkpoint_key key: 'optim/*/exp_avg_cube' matches "
            "no checkpoint key of this scenario (e.g. model/embed.tok, "
            "optim/embed.tok/exp_avg, optim/embed.tok/exp_avg_sq, model/embed.pos, ...)");
  // A required glob left out.
  EXPECT_EQ(
      load_error("checks: {resume: true}\nfaults:\n  - drop_checkpoint_key\nexpect: caught\n"),
      "x.yaml:3:5: faults[0]: drop_checkpoint_key needs key: glob over checkpoint keys, e.g. "
      "\"optim/*/exp_avg_sq\"");
  // fp8/ keys exist only with an FP8 recipe that keeps state (delayed).
  EXPECT_NE(load_error("checks: {resume: true}\nfaults:\n"
                       "  - {name: freeze_state, key: \"fp8/*/amax_history\"}\nexpect: caught\n")
                .find("faults[0].key: freeze_state key: 'fp8/*/amax_history' matches no fp32 "
                      "state tensor"),
            std::string::npos);
  // Scalars are checkpoint keys but not fp32 tensors: perturb cannot move them.
  EXPECT_NE(load_error("checks: {reference: {mesh: {dp_shard: 1}}}\nmesh: {dp_shard: 2}\n"
                       "faults:\n  - {name: perturb, tensor: optim/step, rel: 0.1}\n"
                       "expect: caught\n")
                .find("matches no fp32 state tensor"),
            std::string::npos);
  EXPECT_NE(load_error("checks: {reference: {mesh: {dp_shard: 1}}}\nmesh: {dp_shard: 2}\n"
                       "faults:\n  - {name: perturb, tensor: \"model/*\", rel: 0.1, ulp: 2}\n"
                       "expect: caught\n")
                .find("faults[0]: perturb: give exactly one of ulp"),
            std::string::npos);
  EXPECT_NE(load_error("recipe: current\nmesh: {dp_shard: 2}\nfsdp: {fp8_all_gather: true}\n"
                       "checks: {allgather_parity: true}\nfaults:\n"
                       "  - {name: amax_group, linear: \"layers.*.mlp.fc9\", dims: none}\n"
                       "expect: caught\n")
                .find("faults[0].linear: amax_group linear: 'layers.*.mlp.fc9' matches no "
                      "quantized linear"),
            std::string::npos);
  EXPECT_NE(load_error("recipe: current\nmesh: {dp_shard: 2}\nfsdp: {fp8_all_gather: true}\n"
                       "checks: {allgather_parity: true}\nfaults:\n"
                       "  - {name: amax_group, linear: \"*\", dims: dp_shard+pp}\n"
                       "expect: caught\n")
                .find("faults[0].dims: amax_group dims: 'pp' is no mesh dim"),
            std::string::npos);
}

// The collective faults (docs/design.md section 29): a bad kind, group or glob, and a
// (kind, group, tensor) that names no collective the scenario's plan issues, are input errors at
// the parameter (or the fault's entry) before anything runs.
TEST(ScenarioDefaults, CollectiveFaultParametersAreCheckedUpFront) {
  const std::string head = "mesh: {dp_shard: 4}\nchecks: {collectives: true}\nfaults:\n  - ";
  const Scenario s = load_one(
      head +
      "{name: skip_collective, kind: reduce_scatter, group: dp_shard, tensor: \"layers.0.*\"}"
      "\nexpect: caught\n");
  EXPECT_EQ(s.faults.at(0).string_params.at("group"), "dp_shard");
  EXPECT_EQ(
      load_error(head + "{name: skip_collective, kind: broadcast, group: dp_shard, tensor: \"*\"}\n"
                        "expect: caught\n"),
      "x.yaml:4:35: faults[0].kind: expected one of all_gather|reduce_scatter|all_reduce, "
      "got 'broadcast'");
  EXPECT_EQ(load_error(head + "{name: skip_collective, kind: all_gather, group: dp_shard, tensor: "
                              "\"layers.9.*\"}\nexpect: caught\n"),
            "x.yaml:4:72: faults[0].tensor: skip_collective tensor: 'layers.9.*' matches no "
            "parameter of this scenario (e.g. embed.tok, embed.pos, layers.0.ln1.weight, "
            "layers.0.ln1.bias, ...)");
  EXPECT_NE(
      load_error(head + "{name: skip_collective, kind: all_gather, group: dp_shart, tensor: \"*\"}"
                        "\nexpect: caught\n")
          .find("faults[0].group: skip_collective group: 'dp_shart' is no mesh dim"),
      std::string::npos);
  // A real glob, but no tp collective exists on a mesh without tp.
  EXPECT_EQ(
      load_error(head + "{name: skip_collective, kind: all_reduce, group: tp, tensor: \"*\"}\n"
                        "expect: caught\n"),
      "x.yaml:4:5: faults[0]: skip_collective: this scenario issues no all_reduce over tp "
      "for a parameter (mesh dp_replicate=1,dp_shard=4,tp=1)");
  // Reductions accumulate in fp32: collective_dtype names all-gathers only.
  EXPECT_NE(load_error(head + "{name: collective_dtype, kind: reduce_scatter, tensor: \"*\"}\n"
                              "expect: caught\n")
                .find("faults[0].kind: expected one of all_gather, got 'reduce_scatter'"),
            std::string::npos);
  // One rank: nothing is gathered.
  EXPECT_NE(load_error("checks: {collectives: true}\nfaults:\n"
                       "  - {name: collective_dtype, tensor: \"layers.*\"}\nexpect: caught\n")
                .find("faults[0]: collective_dtype: this scenario issues no all_gather for a "
                      "parameter"),
            std::string::npos);
}

// ---- canonical form and hash

TEST(ScenarioHash, StableUnderKeyOrderAndSpelledOutDefaults) {
  const Scenario a = load_one(
      "name: h\nmesh: {dp_shard: 2, tp: 2}\nrecipe: mxfp8\ntrain: {steps: 8, lr: 0.001}\n");
  const Scenario b = load_one(
      "train:\n  lr: 1.0e-3\n  steps: 8\n  micro_batches: 1\nrecipe:\n  fp8_format: e4m3\n"
      "  name: mxfp8\nmesh:\n  tp: 2\n  dp_shard: 2\n  dp_replicate: 1\nname: h\n"
      "description: commentary is not part of the hash\n");
  EXPECT_EQ(canonical_text(a), canonical_text(b));
  EXPECT_EQ(scenario_hash(a), scenario_hash(b));
  EXPECT_EQ(scenario_hash_hex(a).size(), 16u);
}

TEST(ScenarioHash, ChangesWhenAValueChanges) {
  const std::string base = "name: h\nmesh: {dp_shard: 2}\n";
  const uint64_t h = scenario_hash(load_one(base));
  EXPECT_NE(h, scenario_hash(load_one(base, {"train.seed=1235"})));
  EXPECT_NE(h, scenario_hash(load_one(base, {"mesh.dp_shard=1"})));
  EXPECT_NE(h, scenario_hash(load_one(base, {"train.lr=0.0010000001"})));
  EXPECT_NE(h, scenario_hash(load_one(base, {"name=h2"})));
  EXPECT_NE(h, scenario_hash(load_one(base, {"checks.determinism=true"})));
}

TEST(ScenarioHash, CanonicalTextIsSortedJson) {
  const std::string text = canonical_text(load_one("name: c\n"));
  // Sorted top-level keys: backend < checkpoint < checks < data < expect < ...
  const size_t backend = text.find("\"backend\"");
  const size_t checkpoint = text.find("\"checkpoint\"");
  const size_t train = text.find("\"train\"");
  ASSERT_NE(backend, std::string::npos);
  EXPECT_LT(backend, checkpoint);
  EXPECT_LT(checkpoint, train);
  EXPECT_EQ(text.find("description"), std::string::npos);
  EXPECT_EQ(text.find('\n'), std::string::npos);  // one line
}

// ---- fault catalog

TEST(FaultCatalog, CoversTheDesignBugClasses) {
  // docs/design.md section 7 lists these bug classes; each must have a catalog entry.
  for (const char* name :
       {"amax_not_reduced", "tp_fsdp_left_to_right", "fp8_state_dropped_from_checkpoint",
        "scale_inv_saved_bf16", "stale_columnwise_copy", "data_cursor_not_restored",
        "optimizer_state_not_restored", "hsdp_replicas_not_reduced", "uneven_shard_padding_leak"}) {
    const FaultDescriptor* f = find_fault(name);
    ASSERT_NE(f, nullptr) << name;
    EXPECT_FALSE(f->bug_class.empty()) << name;
    EXPECT_FALSE(f->caught_by.empty()) << name;
  }
  EXPECT_EQ(find_fault("nope"), nullptr);
}

// ---- the starter library

TEST(ScenarioLibrary, EveryFileValidatesAndEveryFaultHasACaughtScenario) {
  const fs::path dir = source_dir() / "scenarios";
  size_t files = 0, scenarios = 0;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    if (entry.path().extension() != ".yaml") continue;
    ++files;
    std::vector<Scenario> v;
    ASSERT_NO_THROW(v = load_scenario_file(entry.path().string())) << entry.path();
    scenarios += v.size();
  }
  EXPECT_GT(files, 10u);
  EXPECT_GT(scenarios, files);  // matrices expand
  for (const FaultDescriptor& f : fault_table()) {
    const fs::path p = dir / "faults" / (std::string(f.name) + ".yaml");
    ASSERT_TRUE(fs::exists(p)) << p;
    const std::vector<Scenario> v = load_scenario_file(p.string());
    for (const Scenario& s : v) {
      EXPECT_EQ(s.expect, Expect::kCaught) << s.name;
      ASSERT_EQ(s.faults.size(), 1u) << s.name;
      EXPECT_EQ(s.faults[0].name, f.name);
    }
  }
  const std::vector<Scenario> q = load_scenario_file((dir / "quickstart.yaml").string());
  ASSERT_EQ(q.size(), 1u);
  EXPECT_EQ(q[0].mesh, (engine::MeshSpec{2, 2, 2, false}));
  EXPECT_EQ(q[0].recipe.kind, RecipeKind::kMxfp8);
  EXPECT_TRUE(q[0].checks.golden.enabled);
  EXPECT_TRUE(q[0].checks.resume.enabled);
}

// ---- the verb

using harness::testing::CliResult;
constexpr auto& run = harness::testing::run_meshproof;

TEST(ValidateVerb, PrintsOneLinePerExpandedScenario) {
  const std::string fsdp = (source_dir() / "scenarios/fsdp.yaml").string();
  const CliResult r = run({"validate", fsdp});
  EXPECT_EQ(r.code, kExitOk) << r.err;
  for (const char* name : {"fsdp[recipe=bf16]", "fsdp[recipe=delayed]", "fsdp[recipe=current]",
                           "fsdp[recipe=mxfp8]"}) {
    EXPECT_NE(r.out.find(std::string(name) + "  mesh dp_replicate=1 dp_shard=4 tp=1 (4 ranks)"),
              std::string::npos)
        << r.out;
  }
  EXPECT_NE(r.out.find("4 scenario(s) from 1 file(s) valid"), std::string::npos) << r.out;
}

TEST(ValidateVerb, BadInputExits2AndReportsEveryBrokenFile) {
  SKIP_WITHOUT_BAD_DIR();
  const std::string bad = bad_dir().string();
  const CliResult r = run({"validate", bad});
  EXPECT_EQ(r.code, kExitBadInput);
  EXPECT_NE(r.err.find("mesh.tp: expected an integer, got 'two'"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("yaml: end of sequence flow not found"), std::string::npos) << r.err;
  const CliResult s = run({"validate", (source_dir() / "scenarios/quickstart.yaml").string(),
                           "--set", "checks.resume.at_step=8"});
  EXPECT_EQ(s.code, kExitBadInput);
  EXPECT_EQ(s.err.substr(0, s.err.find('\n')),
            "--set checks.resume.at_step=8: checks.resume.at_step: must be in [1, 7] (a step "
            "before the last of train.steps = 8), got 8");
  EXPECT_EQ(run({"validate", "/nonexistent/x.yaml"}).code, kExitBadInput);
  EXPECT_EQ(run({"validate"}).code, kExitBadInput);  // SCENARIO is required
}

// ---- #18.3: bounded reading. Each of these crashed (stack overflow in std::regex or in the
// recursive copy of a cyclic alias) or grew to gigabytes before the fix.

TEST(ScenarioLimits, LongScalarsAreErrorsNotStackOverflows) {
  const std::string big(40000, 'a');
  EXPECT_EQ(load_error("name: " + big + "\n"),
            "x.yaml:1:7: name: a value of 40000 bytes; values are at most 4096 bytes");
  const std::string digits(40000, '7');
  EXPECT_EQ(load_error("model:\n  vocab: " + digits + "\n"),
            "x.yaml:2:10: model.vocab: a value of 40000 bytes; values are at most 4096 bytes");
  // Under the scalar bound, the scanners take long numbers and names in linear time.
  EXPECT_EQ(load_error("model:\n  vocab: " + std::string(4000, '7') + "\n"),
            "x.yaml:2:10: model.vocab: expected an integer, got '" + std::string(4000, '7') + "'");
  EXPECT_EQ(load_error("train:\n  lr: 0." + std::string(4000, '1') + "\n"), "");
  const std::string msg = load_error("name: a\n", {"name=" + big});
  EXPECT_EQ(msg, "--set name=" + std::string(75, 'a') +
                     "... (40005 bytes): name: a value of 40000 bytes; values are at most 4096 "
                     "bytes");
  try {
    parse_override(big + ".=1");  // a long path with an empty last name
    FAIL() << "expected a malformed key path";
  } catch (const kernels::Error& e) {
    EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
    EXPECT_NE(e.message().find("malformed key path"), std::string::npos);
  }
}

TEST(ScenarioLimits, SelfReferentialAliasIsAnError) {
  const std::string msg = load_error("d: &a [*a]\n");
  EXPECT_EQ(msg.rfind("x.yaml:1:", 0), 0u) << msg;
  EXPECT_NE(msg.find("nested more than 64 levels deep (a self-referential YAML alias?)"),
            std::string::npos)
      << msg;
}

TEST(ScenarioLimits, AliasBombStopsAtTheNodeBound) {
  // 435 bytes: 9 aliases per level over 8 levels expand to 9^8 = 43 million values (5 GB as a
  // tree). The copy stops at kMaxNodes.
  std::string yaml = "a: &a [x, x, x, x, x, x, x, x, x]\n";
  char prev = 'a';
  for (char c = 'b'; c <= 'i'; ++c) {
    yaml += fmt::format("{}: &{} [", c, c);
    for (int i = 0; i < 9; ++i) yaml += fmt::format("{}*{}", i ? ", " : "", prev);
    yaml += "]\n";
    prev = c;
  }
  const auto t0 = std::chrono::steady_clock::now();
  const std::string msg = load_error(yaml);
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_NE(msg.find("the document expands to more than 100000 values"), std::string::npos) << msg;
  EXPECT_LT(s, 30.0);  // bounded work (about 0.1 s here); generous for a loaded 2-core machine
}

TEST(ScenarioLimits, MatrixExpansionIsBounded) {
  // 5 axes of 10 values: 100000 scenarios, each a copy of the document, refused before any.
  std::string yaml = "matrix:\n";
  for (const char* key :
       {"train.seed", "data.seed", "train.steps", "model.layers", "checkpoint.every"}) {
    yaml += fmt::format("  {}: [1, 2, 3, 4, 5, 6, 7, 8, 9, 10]\n", key);
  }
  EXPECT_EQ(load_error(yaml), "x.yaml:1:1: matrix: expands to 100000 scenarios, more than 10000");
}

// ---- #18.5 / #18.4: names that name folders.

TEST(ScenarioNames, DotNamesAndLongNamesAreRejected) {
  EXPECT_EQ(load_error("name: ..\n"),
            "x.yaml:1:7: name: '..' names a folder's self or parent; golden and checkpoint "
            "folders are named after the scenario");
  EXPECT_EQ(load_error("name: .\n"),
            "x.yaml:1:7: name: '.' names a folder's self or parent; golden and checkpoint "
            "folders are named after the scenario");
  EXPECT_EQ(load_error("name: " + std::string(256, 'n') + "\n"),
            "x.yaml:1:7: name: is 256 bytes long, more than 255 (it names golden and "
            "checkpoint folders)");
  EXPECT_EQ(load_error("name: " + std::string(255, 'n') + "\n"), "");
  EXPECT_EQ(load_error("name: a\n", {"name=.."}),
            "--set name=..: name: '..' names a folder's self or parent; golden and checkpoint "
            "folders are named after the scenario");
  EXPECT_EQ(load_error("name: ...\n"), "");  // a plain file name
  // Matrix labels are free text: the derived folder name must stay a usable name.
  const std::string label(300, 'l');
  const std::string msg = load_error("name: m\nmatrix:\n  checkpoint.dir: [\"" + label + "\"]\n");
  EXPECT_NE(msg.find("x.yaml:1:7: name: the expanded name gives a folder name of 317 bytes, "
                     "more than 255"),
            std::string::npos)
      << msg;
}

TEST(ScenarioNames, DerivedPathsStayInsideTheirRoot) {
  EXPECT_EQ(path_inside("golden", "a/cpu.h5"), fs::path("golden/a/cpu.h5"));
  for (const char* bad : {"../cpu.h5", "a/../../x", "/etc/x", "./x", "a//"}) {
    EXPECT_THROW(path_inside("golden", bad), kernels::Error) << bad;
  }
  EXPECT_THROW(path_inside("out", std::string(256, 'x')), kernels::Error);
  EXPECT_THROW(golden_path("golden", "..", "cpu"), kernels::Error);
  EXPECT_THROW(golden_path("golden", "ok", "../../cpu"), kernels::Error);  // --platform
  EXPECT_EQ(golden_path("golden", "fsdp[recipe=bf16]", "cpu"),
            fs::path("golden/fsdp@recipe=bf16/cpu.h5"));
}

TEST(ScenarioRules, DataOrderZeroIsRejected) {
  // The engine's data source needs order >= 1; validate used to accept 0 and run refuse it.
  EXPECT_EQ(load_error("data:\n  order: 0\n"), "x.yaml:2:10: data.order: must be in [1, 4], got 0");
}

// ---- #17.4: one set of rules. Every rule of engine::check_run that a scenario can break, each
// with a minimal scenario: the engine refuses the run (the session constructor's
// require_valid_run) and the loader reports the same rule at FILE:LINE:COL of the key.

struct RuleCase {
  const char* yaml;
  const char* where_key;   // "x.yaml:L:C: key" the loader must report
  const char* engine_key;  // the engine's key path
  const char* words;       // part of the engine's message
};

Scenario base_scenario() {
  Scenario s = load_one("name: base\n");
  s.backend = Backend::kCpu;
  return s;
}

// The scenario as the loader resolves it, but without the loader's rules: the settings are
// applied to a valid scenario directly, so the engine judges them alone.
engine::RunOptions options_of(const std::string& yaml) {
  // Parse the few keys the cases use into a Scenario by hand.
  Scenario s = base_scenario();
  const YAML::Node n = YAML::Load(yaml);
  if (n["model"]) {
    if (n["model"]["dropout"]) s.model.dropout = n["model"]["dropout"].as<double>();
    if (n["model"]["heads"]) s.model.heads = n["model"]["heads"].as<int64_t>();
    if (n["model"]["hidden"]) s.model.hidden = n["model"]["hidden"].as<int64_t>();
    if (n["model"]["seq_len"]) {
      s.train.seq_len = n["model"]["seq_len"].as<int64_t>();
      s.model.max_positions = s.train.seq_len;
    }
    if (n["model"]["vocab"]) s.model.vocab = n["model"]["vocab"].as<int64_t>();
    if (n["model"]["ffn"]) s.model.ffn = n["model"]["ffn"].as<int64_t>();
    if (n["model"]["layers"]) s.model.layers = n["model"]["layers"].as<int64_t>();
  }
  if (n["mesh"]) {
    if (n["mesh"]["tp"]) s.mesh.tp = n["mesh"]["tp"].as<int>();
    if (n["mesh"]["dp_shard"]) s.mesh.dp_shard = n["mesh"]["dp_shard"].as<int>();
    if (n["mesh"]["dp_replicate"]) s.mesh.dp_replicate = n["mesh"]["dp_replicate"].as<int>();
    if (n["mesh"]["sequence_parallel"])
      s.mesh.sequence_parallel = n["mesh"]["sequence_parallel"].as<bool>();
  }
  if (n["recipe"])
    s.recipe = default_recipe(engine::parse_recipe(n["recipe"].as<std::string>(), "recipe"));
  if (n["fsdp"]) {
    if (n["fsdp"]["fp8_all_gather"]) s.fsdp.fp8_all_gather = n["fsdp"]["fp8_all_gather"].as<bool>();
    if (n["fsdp"]["fp8_params"]) s.fsdp.fp8_params = n["fsdp"]["fp8_params"].as<bool>();
  }
  if (n["train"] && n["train"]["global_batch"])
    s.train.batch = n["train"]["global_batch"].as<int64_t>();
  if (n["data"] && n["data"]["order"]) s.data.markov_order = n["data"]["order"].as<int64_t>();
  return engine_run_options(s);
}

const RuleCase kRuleCases[] = {
    {"model:\n  dropout: 0.1\nmesh:\n  tp: 2\n  sequence_parallel: true\n",
     "x.yaml:5:22: mesh.sequence_parallel", "mesh.sequence_parallel", "needs model.dropout = 0"},
    {"mesh:\n  sequence_parallel: true\n", "x.yaml:2:22: mesh.sequence_parallel",
     "mesh.sequence_parallel", "needs tensor parallelism"},
    {"model:\n  seq_len: 33\nmesh:\n  tp: 2\n  sequence_parallel: true\n",
     "x.yaml:5:22: mesh.sequence_parallel", "mesh.sequence_parallel",
     "seq_len = 33 is not divisible by tp = 2"},
    {"model:\n  hidden: 96\n  heads: 6\n  ffn: 384\nmesh:\n  tp: 4\n", "x.yaml:6:7: mesh.tp",
     "mesh.tp", "model.heads = 6 is not divisible by tp = 4"},
    {"model:\n  hidden: 64\n  heads: 3\n", "x.yaml:3:10: model.heads", "model.heads",
     "does not divide model.hidden = 64"},
    {"mesh:\n  dp_shard: 4\ntrain:\n  global_batch: 6\n", "x.yaml:4:17: train.global_batch",
     "training.batch", "6 is not divisible by dp_replicate x dp_shard x micro_batches"},
    {"recipe: bf16\nfsdp:\n  fp8_params: true\n", "x.yaml:3:15: fsdp.fp8_params", "fsdp.fp8_params",
     "needs recipe current, delayed or mxfp8, got bf16"},
    {"recipe: block\nfsdp:\n  fp8_params: true\n", "x.yaml:3:15: fsdp.fp8_params",
     "fsdp.fp8_params", "block-scaled weights are not kept"},
    {"model:\n  hidden: 64\nmesh:\n  dp_shard: 4\nrecipe: mxfp8\nfsdp:\n  fp8_params: true\n",
     "x.yaml:4:13: mesh.dp_shard", "mesh.dp_shard", "not a multiple of 32 x dp_shard = 128"},
    {"model:\n  seq_len: 20\nrecipe: mxfp8\ntrain:\n  global_batch: 4\n",
     "x.yaml:5:17: train.global_batch", "training.batch", "tokens, not a multiple of 32"},
    {"model:\n  heads: 4\nmesh:\n  tp: 4\nrecipe: mxfp8\n", "x.yaml:4:7: mesh.tp", "mesh.tp",
     "hidden / tp (proj K) = 16 is not a multiple of 32"},
    {"model:\n  vocab: 8192\n", "x.yaml:1:1: data.order", "data.markov_order",
     "the transition table"},
    {"model:\n  hidden: 1048576\n  ffn: 1048576\n  layers: 1024\n", "x.yaml:2:3: model", "model",
     "of host memory"},
};

TEST(ScenarioRules, EveryEngineRuleIsALoaderErrorAtItsKey) {
  for (const RuleCase& c : kRuleCases) {
    SCOPED_TRACE(c.yaml);
    // The engine refuses the run: the rule is in check_run, and the session constructor and
    // run_training throw it before any work.
    const engine::RunOptions o = options_of(c.yaml);
    bool found = false;
    for (const engine::ConfigIssue& i : engine::check_run(o)) {
      found = found || (i.key_path == c.engine_key && i.message.find(c.words) != std::string::npos);
    }
    EXPECT_TRUE(found) << "check_run has no " << c.engine_key << " issue with '" << c.words << "'";
    try {
      engine::require_valid_run(o);
      ADD_FAILURE() << "require_valid_run accepted it";
    } catch (const kernels::Error& e) {
      EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
    }
    // The loader reports it at the key's line and column.
    const std::string msg = load_error(c.yaml);
    EXPECT_NE(msg.find(std::string(c.where_key) + ": "), std::string::npos) << msg;
  }
}

TEST(ScenarioRules, ChecksRunsFollowTheSameRules) {
  // The runs a scenario's checks make are judged too, each at the checks.* key that asks for
  // them (before: validate passed, run failed after training with exit 3).
  EXPECT_EQ(load_error("model:\n  dropout: 0.1\ntrain:\n  steps: 4\nchecks:\n  resume:\n    mesh: "
                       "{tp: 2, sequence_parallel: true}\n"),
            "x.yaml:7:38: checks.resume.mesh.sequence_parallel: needs model.dropout = 0 (got "
            "0.1): dropout masks are keyed by contiguous token ranges, which a sequence shard is "
            "not");
  EXPECT_EQ(load_error("recipe: current\nfsdp:\n  fp8_params: true\nchecks:\n  reference:\n    "
                       "recipe: fp32\n    rtol: 0.1\n"),
            "x.yaml:6:13: checks.reference.recipe: fsdp.fp8_params: needs recipe current, "
            "delayed or mxfp8, got fp32 (in the reference run)");
}

TEST(ScenarioRules, ResourceRulesUseTheMachineLimits) {
  engine::RunOptions o = options_of("mesh:\n  dp_shard: 8\n");
  o.config.training.batch = 8;
  engine::HostLimits tight{.memory_bytes = 1 << 20, .max_threads = 4};
  // A thread per rank (MESHPROOF_VIRTUAL_RANKS=threads): 8 threads for 8 ranks.
  test_env::ScopedEnv env(mesh::kVirtualRanksEnv, "threads");
  const std::vector<engine::ConfigIssue> issues = engine::check_run(o, tight);
  // As fibers, one worker thread per CPU (at most 8): what the local world would start.
  env.set("fibers");
  const std::vector<engine::ConfigIssue> fiber_issues = engine::check_run(o, tight);
  const int workers = mesh::local_fiber_workers(8, mesh::LocalWorldOptions{});
  ASSERT_GE(workers, 1);
  ASSERT_EQ(fiber_issues.size(), workers > 4 ? 2u : 1u);
  if (workers > 4) {
    EXPECT_EQ(fiber_issues[0].message,
              fmt::format("launcher local runs 8 ranks on {} threads (fibers on one worker per "
                          "CPU), but this process may start at most 4 threads here",
                          workers));
  }
  ASSERT_EQ(issues.size(), 2u);
  EXPECT_EQ(issues[0].key_path, "mesh");
  EXPECT_EQ(issues[0].message,
            "launcher local runs 8 ranks on 8 threads (one per rank), but this process may start "
            "at most 4 threads here");
  EXPECT_EQ(issues[1].key_path, "model");
  EXPECT_NE(issues[1].message.find("this machine has 0.00 GiB"), std::string::npos)
      << issues[1].message;
  // The estimate is a lower bound: 16 bytes per parameter over dp_shard x tp, the data table,
  // the logits; launcher mpi holds one rank per process.
  const engine::MemoryEstimate e = engine::estimate_memory(o);
  EXPECT_EQ(e.ranks_in_process, 8);
  o.launcher = "mpi";
  EXPECT_EQ(engine::estimate_memory(o).ranks_in_process, 1);
  EXPECT_TRUE(engine::check_run(o, {.memory_bytes = 0, .max_threads = 4}).empty());
}

// ---- #17.7 / #17.8: every problem of a file; --filter reads only the selected entries.

TEST(ScenarioErrors, EveryProblemOfAFileIsReported) {
  const std::string msg = load_error(
      "mesh:\n  tp: two\n  dp_shards: 2\ntrain:\n  lr: -1\n  steps: 0\ndata:\n  order: 9\n");
  EXPECT_EQ(msg,
            "x.yaml:3:3: mesh.dp_shards: unknown key; did you mean 'dp_shard'?\n"
            "x.yaml:2:7: mesh.tp: expected an integer, got 'two'\n"
            "x.yaml:6:10: train.steps: must be in [1, 1000000], got 0\n"
            "x.yaml:5:7: train.lr: must be in (0, 10], got -1\n"
            "x.yaml:8:10: data.order: must be in [1, 4], got 9");
  // At most kMaxIssues, then a last line says the report stopped.
  std::string many = "model:\n";
  for (int i = 0; i < 30; ++i) many += fmt::format("  bogus{}: 1\n", i);
  const std::string capped = load_error(many);
  EXPECT_EQ(std::count(capped.begin(), capped.end(), '\n'), 20) << capped;
  EXPECT_NE(capped.find("x.yaml: stopped after 20 problems"), std::string::npos) << capped;
}

TEST(ScenarioErrors, MatrixEntryErrorsNameTheEntryAndFilterSkipsOthers) {
  const std::string yaml =
      "name: m\nmodel:\n  hidden: 64\nmatrix:\n  recipe: [bf16, delayed]\n  fsdp: "
      "[{fp8_params: false}, {fp8_params: true}]\n";
  EXPECT_EQ(load_error(yaml),
            "x.yaml:6:44: fsdp.fp8_params: needs recipe current, delayed or mxfp8, got bf16 (in "
            "matrix entry m[recipe=bf16,fsdp=fp8_params])");
  // --filter reads only the selected entries: an error elsewhere does not stop them.
  const std::vector<Scenario> one =
      load_scenario_text(yaml, "x.yaml", {}, "m[recipe=delayed,fsdp=fp8_params]");
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(one[0].name, "m[recipe=delayed,fsdp=fp8_params]");
  EXPECT_TRUE(load_scenario_text(yaml, "x.yaml", {}, "nothing").empty());
  // A problem every entry shares is the file's: no entry named.
  EXPECT_EQ(load_error("name: m\nmodel:\n  heads: 3\nmatrix:\n  recipe: [bf16, fp32]\n"),
            "x.yaml:3:10: model.heads: model.heads = 3 does not divide model.hidden = 64");
  // The validate verb takes --filter too.
  const fs::path dir = fs::temp_directory_path() / "meshproof_filter_test";
  fs::create_directories(dir);
  { std::ofstream(dir / "m.yaml") << yaml; }
  EXPECT_EQ(run({"validate", (dir / "m.yaml").string()}).code, kExitBadInput);
  const CliResult ok =
      run({"validate", (dir / "m.yaml").string(), "--filter", "m[recipe=delayed,fsdp=fp8_params]"});
  EXPECT_EQ(ok.code, kExitOk) << ok.err;
  EXPECT_EQ(run({"validate", (dir / "m.yaml").string(), "--filter", "zzz"}).code, kExitBadInput);
  fs::remove_all(dir);
}

TEST(EditDistance, Basics) {
  EXPECT_EQ(edit_distance("dp_shards", "dp_shard"), 1u);
  EXPECT_EQ(edit_distance("trian", "train"), 2u);
  EXPECT_EQ(edit_distance("", "abc"), 3u);
  EXPECT_EQ(edit_distance("kitten", "sitting"), 3u);
}

}  // namespace
}  // namespace meshproof::harness
