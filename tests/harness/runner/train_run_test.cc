// The scenario -> engine mapping (harness/run/train_run.h to_engine_config).
#include "harness/run/train_run.h"

#include <gtest/gtest.h>

#include <filesystem>

#include "engine/config/config.h"
#include "harness/checks/checks.h"
#include "runner_test_builders.h"

namespace meshproof::harness {
namespace {

namespace fs = std::filesystem;
using reports::Verdict;
using namespace test;

TEST(ScenarioToEngine, DataSeedAndTrainSeedAreSeparateKeys) {
  Scenario s;
  s.data.seed = 99;
  s.seed = 5;
  const engine::Config c = to_engine_config(s);
  EXPECT_EQ(c.data.seed, 99u);
  EXPECT_EQ(c.seed, 5u);
}

// The recipe options reach the engine (issue #17.2): fp8_format, power_2_scale and eps, which
// was refused for every non-zero value before.
TEST(ScenarioToEngine, RecipeOptionsAreMapped) {
  Scenario s;
  s.recipe = default_recipe(engine::RecipeKind::kCurrent);
  s.recipe.fp8_format = Fp8Format::kE4M3;
  s.recipe.power_2_scale = true;
  s.recipe.eps = 1e-3;
  const engine::Config c = to_engine_config(s);
  EXPECT_EQ(engine::fp8_format_of(c.recipe), engine::Fp8Format::kE4M3);
  EXPECT_TRUE(engine::power_2_scale_of(c.recipe));
  EXPECT_EQ(c.recipe.eps, 1e-3);
  s.recipe = default_recipe(engine::RecipeKind::kBlock);
  s.recipe.power_2_scale = false;
  const engine::Config b = to_engine_config(s);
  EXPECT_FALSE(engine::power_2_scale_of(b.recipe));
  EXPECT_EQ(engine::fp8_format_of(b.recipe), engine::Fp8Format::kE4M3);  // block's default
}

// A small 2-rank scenario for the state round trip (a tiny model: the test trains 2 steps).
Scenario tiny_state_scenario() {
  Scenario s;
  s.name = "state_roundtrip_test";
  s.model.vocab = 64;
  s.model.hidden = 32;
  s.model.heads = 2;
  s.model.kv_heads = 2;  // Scenario() set it from the default heads (4)
  s.model.layers = 1;
  s.model.ffn = 64;
  s.train.seq_len = 16;
  s.model.max_positions = 16;
  s.train.steps = 3;
  s.train.batch = 4;
  s.mesh.dp_shard = 2;
  s.backend = Backend::kCpu;
  return s;
}

// The state check's round trip (save, load into a fresh engine, save again) of a correct engine
// is bitwise; with the AdamW first moment not restored the comparison names that key and its
// first element (global index, both values).
TEST(StateRoundtrip, CleanIsBitwiseAndAnUnrestoredMomentIsNamed) {
  const fs::path root = fs::temp_directory_path() / "meshproof_state_roundtrip_test";
  fs::remove_all(root);
  const Scenario s = tiny_state_scenario();
  StateRequest req;
  req.at_step = 2;
  req.checkpoint_root = root;
  req.mesh = engine::MeshSpec{.dp_replicate = 1, .dp_shard = 1, .tp = 1};
  StateOutcome clean = state_roundtrip(s, req);
  EXPECT_EQ(clean.steps.size(), 2u);
  EXPECT_EQ(clean.before, clean.saved);  // no save-side fault: one checkpoint under test
  reports::CheckResult r =
      compare_checkpoint_state(clean.after, clean.saved, clean.before, clean.params, "x");
  EXPECT_EQ(r.verdict, Verdict::kPass) << r.message;
  EXPECT_NE(r.message.find("scalars data/cursor,lr/step,optim/step,rng/offset"), std::string::npos)
      << r.message;

  req.faults.optimizer_state_not_restored = true;
  req.faults.optimizer_state_part = "exp_avg";
  StateOutcome bad = state_roundtrip(s, req);
  EXPECT_NE(bad.folder, clean.folder);  // a fresh folder: state_check_step2.2
  r = compare_checkpoint_state(bad.after, bad.saved, bad.before, bad.params, "x");
  ASSERT_EQ(r.verdict, Verdict::kFail);
  ASSERT_TRUE(r.evidence.has_value());
  EXPECT_TRUE(r.evidence->tensor.starts_with("optim/") && r.evidence->tensor.ends_with("/exp_avg"))
      << r.message;
  EXPECT_NE(r.message.find("element [0"), std::string::npos) << r.message;
  EXPECT_NE(r.message.find("after the load"), std::string::npos) << r.message;
  EXPECT_EQ(r.evidence->actual, 0.0);  // the fresh engine's zero moment

  // A generic save-side fault: the checkpoint under test drops every second moment. It was left
  // out of a hand list of save-side faults, so the check saved faithfully and passed.
  req.faults = {};
  req.faults.drop_checkpoint_key = "optim/*/exp_avg_sq";
  StateOutcome dropped = state_roundtrip(s, req);
  EXPECT_NE(dropped.before, dropped.saved);
  r = compare_checkpoint_state(dropped.after, dropped.saved, dropped.before, dropped.params, "x");
  ASSERT_EQ(r.verdict, Verdict::kFail) << r.message;
  ASSERT_TRUE(r.evidence.has_value());
  EXPECT_TRUE(r.evidence->tensor.ends_with("/exp_avg_sq")) << r.message;
  // Issue #46: named as missing from the checkpoint under test, not as a value difference.
  EXPECT_NE(r.message.find("not in the checkpoint " + dropped.saved.string()), std::string::npos)
      << r.message;

  // A save that rounds the masters through bf16: the first rounded element is named with its ULP
  // distance (the live fp32 value against the one the load restored).
  req.faults = {};
  req.faults.checkpoint_key_dtype = "model/*";
  req.faults.checkpoint_dtype = "bf16";
  StateOutcome rounded = state_roundtrip(s, req);
  r = compare_checkpoint_state(rounded.after, rounded.saved, rounded.before, rounded.params, "x");
  ASSERT_EQ(r.verdict, Verdict::kFail) << r.message;
  ASSERT_TRUE(r.evidence.has_value() && r.evidence->ulp_distance.has_value()) << r.message;
  EXPECT_TRUE(r.evidence->tensor.starts_with("model/")) << r.message;
  // bf16 keeps 8 of float32's 24 significand bits: a rounded element moves by 1 to 2^15 ULP.
  EXPECT_GE(*r.evidence->ulp_distance, 1) << r.message;
  EXPECT_LE(*r.evidence->ulp_distance, 1 << 15) << r.message;
  EXPECT_NE(r.message.find(" ULP apart"), std::string::npos) << r.message;
  fs::remove_all(root);
}

// The resume check's first half taken from the main run (issue 26: checks share what they can):
// the main run saves after at_step into the check's folder, and resuming from that save gives the
// same rows, trace and final parameters, bit for bit, as a check that trains the first half
// itself; with a save-side fault the main run's save carries it (the resumed run then departs
// from the straight one in both ways alike), so reusing the save proves no less.
TEST(ResumeFromTheMainRun, SameRowsTraceAndParamsAsTrainingTheFirstHalf) {
  const fs::path root = fs::temp_directory_path() / "meshproof_resume_first_half_test";
  fs::remove_all(root);
  Scenario s = tiny_state_scenario();
  s.name = "resume_first_half_test";
  for (const bool fault : {false, true}) {
    SCOPED_TRACE(fault ? "save drops the second moments" : "no fault");
    engine::FaultInjection faults;
    if (fault) faults.drop_checkpoint_key = "optim/*/exp_avg_sq";
    TrainRequest mreq;
    mreq.faults = faults;
    mreq.trace = true;
    mreq.resume_save_at = 2;
    mreq.resume_root = root;
    const TrainOutcome main = train_scenario(s, mreq);
    ASSERT_FALSE(main.resume_saved.empty());
    EXPECT_TRUE(fs::is_directory(main.resume_saved)) << main.resume_saved;
    EXPECT_TRUE(
        main.resume_saved.parent_path().filename().string().starts_with("resume_check_step2"))
        << main.resume_saved;

    ResumeRequest req;
    req.at_step = 2;
    req.faults = faults;
    req.trace = true;
    req.checkpoint_root = root;
    const TrainOutcome trained = resume_scenario(s, req);
    req.first_half = &main;
    const TrainOutcome reused = resume_scenario(s, req);
    ASSERT_EQ(reused.checkpoints.size(), 1u);
    EXPECT_EQ(reused.checkpoints[0], main.resume_saved.parent_path());
    EXPECT_NE(trained.checkpoints[0], reused.checkpoints[0]);  // the check's own folder
    ASSERT_EQ(reused.steps.size(), 3u);
    EXPECT_EQ(reused.steps[0].time.total_s, 0.0);  // rows, not the main run's timings

    const RunView a{&reused.steps, &reused.final_params, &reused.trace};
    const RunView b{&trained.steps, &trained.final_params, &trained.trace};
    const RunView m{&main.steps, &main.final_params, &main.trace};
    reports::CheckResult r = compare_bitwise("resume", "resume", a, b, "reused first half", true);
    EXPECT_EQ(r.verdict, Verdict::kPass) << r.message;
    r = compare_bitwise("resume", "resume", a, m, "resumed from the main run's save", true);
    EXPECT_EQ(r.verdict, fault ? Verdict::kFail : Verdict::kPass) << r.message;
  }
  fs::remove_all(root);
}

// The per-stage pipeline report (docs/design.md section 38) from given per-rank times: ranks
// grouped by their stage, each stage's times the mean over its ranks and the steps after the
// warm-up, the measured bubble p2p wait / step of those means, the predicted one the schedule's
// in unit time, one peak per rank; nothing for one stage.
TEST(PipelineStages, StagesAggregateTheirRanks) {
  engine::RunOptions o;
  o.config.training.micro_batches = 4;
  o.config.training.pp_schedule = engine::PpSchedule::kGpipe;
  o.mesh.pp = 2;
  o.mesh.dp_shard = 2;
  engine::RunResult res;
  // Three steps per rank; the first (the warm-up: default_warmup_steps(3) = 1) is far off.
  const auto t = [](double f, double wait, double step) {
    return engine::PipelineStepTime{f, 2 * f, wait, 0.1 * f, 0.2 * f, step};
  };
  for (int rank = 0; rank < 4; ++rank) {
    engine::RankReport r;
    r.rank = rank;
    r.memory.peak = 1000 + rank;
    r.pipeline.stage = rank / 2;
    r.pipeline.first_layer = 3 * (rank / 2);
    r.pipeline.layers = 3;
    const double w = rank < 2 ? 4 : 1;  // stage 0 waits longer than stage 1
    r.pipeline.steps = {t(50, 50, 500), t(1 + rank, w, 20), t(3 + rank, w + 2, 20)};
    res.ranks.push_back(r);
  }
  const std::vector<reports::PipelineStageRecord> st = pipeline_stages(res, o);
  ASSERT_EQ(st.size(), 2u);
  for (int s = 0; s < 2; ++s) {
    const reports::PipelineStageRecord& p = st[static_cast<size_t>(s)];
    EXPECT_EQ(p.stage, s);
    EXPECT_EQ(p.ranks, (std::vector<int>{2 * s, 2 * s + 1}));
    EXPECT_EQ(p.first_layer, 3 * s);
    EXPECT_EQ(p.layers, 3);
    EXPECT_EQ(p.warmup_steps, 1);
    EXPECT_EQ(p.steady_steps, 2);
    EXPECT_EQ(p.peak_bytes, (std::vector<int64_t>{1000 + 2 * s, 1001 + 2 * s}));
    // Forward: ranks 2s and 2s+1, steps 1 and 2: (1 + 3 + 2 + 4) / 4 + 2s = 2.5 + 2s.
    EXPECT_DOUBLE_EQ(p.mean.forward_s, 2.5 + 2 * s);
    EXPECT_DOUBLE_EQ(p.mean.backward_s, 2 * (2.5 + 2 * s));
    EXPECT_DOUBLE_EQ(p.mean.step_s, 20);
    // Waits (w + w + 2) / 2 = w + 1: 5 on stage 0, 2 on stage 1; bubble 5/20, 2/20.
    EXPECT_DOUBLE_EQ(p.mean.p2p_wait_s, s == 0 ? 5 : 2);
    EXPECT_DOUBLE_EQ(p.bubble_fraction, s == 0 ? 0.25 : 0.1);
    // GPipe, 2 stages, 4 micro-batches, forward 1 and backward 2: makespan 15, busy 12.
    EXPECT_DOUBLE_EQ(p.predicted_bubble_fraction, 0.2);
  }
  o.mesh.pp = 1;
  EXPECT_TRUE(pipeline_stages(res, o).empty());
}

}  // namespace
}  // namespace meshproof::harness
