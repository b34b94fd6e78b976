// The check table (harness/checks/check_table.h): the rows in run and report order, which checks a
// scenario enables (every combination of the five switches), the names fault rows claim them by,
// what a check asks of the main run, and when a check is skipped rather than run.
#include "harness/checks/check_table.h"

#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <tuple>
#include <vector>

#include "harness/run/runner.h"

namespace meshproof::harness {
namespace {

TEST(CheckTable, RowsInRunOrderEachComplete) {
  std::vector<std::string> names;
  for (const CheckDescriptor& c : check_table()) {
    names.emplace_back(c.name);
    EXPECT_EQ(&check(c.id), &c) << c.name;  // row `id` is the row of that id
    EXPECT_NE(c.enabled, nullptr) << c.name;
    EXPECT_NE(c.claim, nullptr) << c.name;
    EXPECT_NE(c.run, nullptr) << c.name;
    EXPECT_FALSE(c.doc.empty()) << c.name;
    EXPECT_EQ(find_check(c.name), &c);
  }
  EXPECT_EQ(names, (std::vector<std::string>{"golden", "resume", "reference", "allgather_parity",
                                             "determinism", "state", "collectives"}));
  EXPECT_EQ(find_check("nope"), nullptr);
  // The checks that judge the main run itself count its training in their duration.
  EXPECT_TRUE(find_check("golden")->judges_main_run);
  EXPECT_TRUE(find_check("allgather_parity")->judges_main_run);
  EXPECT_FALSE(find_check("resume")->judges_main_run);
  EXPECT_FALSE(find_check("reference")->judges_main_run);
  EXPECT_FALSE(find_check("determinism")->judges_main_run);
  EXPECT_FALSE(find_check("state")->judges_main_run);
  EXPECT_TRUE(find_check("collectives")->judges_main_run);
}

// The collectives check asks the main run to record its collectives, and only when enabled.
TEST(CheckTable, CollectivesRecordsTheMainRun) {
  Scenario s;
  EXPECT_EQ(enabled_checks(s), std::vector<std::string>{});
  s.checks.collectives = true;
  EXPECT_EQ(enabled_checks(s), std::vector<std::string>{"collectives"});
  EXPECT_EQ(enabled_claims(s), std::vector<std::string>{"collectives"});
  TrainRequest req;
  ASSERT_NE(find_check("collectives")->prepare_main, nullptr);
  find_check("collectives")->prepare_main(s, {}, req);
  EXPECT_TRUE(req.record_collectives);
}

// golden, resume, reference, allgather_parity, determinism switched on or off.
using Switches = std::tuple<bool, bool, bool, bool, bool>;

class CheckTableEnabled : public ::testing::TestWithParam<Switches> {};

TEST_P(CheckTableEnabled, ExactlyTheSwitchedOnChecksInTableOrder) {
  const auto [golden, resume, reference, parity, determinism] = GetParam();
  Scenario s;
  s.checks.golden.enabled = golden;
  s.checks.resume.enabled = resume;
  s.checks.reference.enabled = reference;
  s.checks.allgather_parity = parity;
  s.checks.determinism = determinism;
  std::vector<std::string> expected;
  if (golden) expected.emplace_back("golden");
  if (resume) expected.emplace_back("resume");
  if (reference) expected.emplace_back("reference");
  if (parity) expected.emplace_back("allgather_parity");
  if (determinism) expected.emplace_back("determinism");
  EXPECT_EQ(enabled_checks(s), expected);
  // Without a resume mesh every check is claimed by its own name.
  EXPECT_EQ(enabled_claims(s), expected);
}

// "golden_resume", ..., "none": the switched-on checks.
std::string switches_name(const ::testing::TestParamInfo<Switches>& info) {
  const auto [g, res, ref, p, d] = info.param;
  const std::vector<std::pair<bool, const char*>> named = {{g, "golden"},
                                                           {res, "resume"},
                                                           {ref, "reference"},
                                                           {p, "allgather_parity"},
                                                           {d, "determinism"}};
  std::string name;
  for (const auto& [on, what] : named) {
    if (!on) continue;
    if (!name.empty()) name += '_';
    name += what;
  }
  return name.empty() ? std::string("none") : name;
}

INSTANTIATE_TEST_SUITE_P(CheckTable, CheckTableEnabled,
                         ::testing::Combine(::testing::Bool(), ::testing::Bool(), ::testing::Bool(),
                                            ::testing::Bool(), ::testing::Bool()),
                         switches_name);

// Fault rows claim the resume check with a mesh override as resume_cross_mesh.
TEST(CheckTable, ResumeWithAMeshOverrideIsClaimedAsCrossMesh) {
  Scenario s;
  s.checks.resume.enabled = true;
  s.checks.golden.enabled = true;
  EXPECT_EQ(enabled_claims(s), (std::vector<std::string>{"golden", "resume"}));
  s.checks.resume.mesh = engine::MeshSpec{};
  EXPECT_EQ(enabled_claims(s), (std::vector<std::string>{"golden", "resume_cross_mesh"}));
  EXPECT_EQ(enabled_checks(s), (std::vector<std::string>{"golden", "resume"}));
  EXPECT_EQ(check_of_claim("resume_cross_mesh"), find_check("resume"));
  EXPECT_EQ(check_of_claim("golden"), find_check("golden"));
  EXPECT_EQ(check_of_claim("nope"), nullptr);
  // Named by the scenario keys that enable them (issue #46: "resume or resume (with a mesh
  // override)" read as one check named twice).
  EXPECT_EQ(describe_claim("resume_cross_mesh"), "checks.resume.mesh");
  EXPECT_EQ(describe_claim("resume"), "checks.resume");
  EXPECT_EQ(describe_claim("reference"), "checks.reference");
}

// allgather_parity asks the main run to compare its FP8 all-gathers; no other check asks that.
TEST(CheckTable, OnlyAllgatherParityPreparesTheMainRun) {
  Scenario s;
  for (const CheckDescriptor& c : check_table()) {
    TrainRequest req;
    if (c.prepare_main) c.prepare_main(s, {}, req);
    EXPECT_EQ(req.allgather_parity, c.name == "allgather_parity") << c.name;
  }
}

// The resume check asks the main run to save after start + at_step into the checkpoint root
// (its first half), and nothing when it is skipped (no step would be left to resume).
TEST(CheckTable, ResumeAsksTheMainRunToSaveItsFirstHalf) {
  Scenario s;
  s.train.steps = 6;
  s.checks.resume.enabled = true;
  s.checks.resume.at_step = 2;
  const CheckDescriptor& resume = *find_check("resume");
  ASSERT_NE(resume.prepare_main, nullptr);
  TrainRequest req;
  resume.prepare_main(s, {.start = 3, .checkpoint_root = "/tmp/root"}, req);
  EXPECT_EQ(req.resume_save_at, 5);
  EXPECT_EQ(req.resume_root, "/tmp/root");
  TrainRequest skipped;
  resume.prepare_main(s, {.start = 4, .checkpoint_root = "/tmp/root"}, skipped);  // 4 + 2 = 6
  EXPECT_EQ(skipped.resume_save_at, 0);
  for (const CheckDescriptor& c : check_table()) {
    if (c.name == "resume" || !c.prepare_main) continue;
    TrainRequest other;
    c.prepare_main(s, {.start = 0, .checkpoint_root = "/tmp/root"}, other);
    EXPECT_EQ(other.resume_save_at, 0) << c.name;
  }
}

// A CheckContext of a run that starts from step `start` (no training happens in these tests:
// only the rows' skip rules are asked).
struct Fixture {
  Scenario s;
  RunnerOptions opts;
  reports::EnvironmentRecord env;
  TrainOutcome main;
  reports::ScenarioRecord rec;
  CheckContext context(int64_t start) {
    return CheckContext{.scenario = s,
                        .run = s,
                        .opts = opts,
                        .env = env,
                        .backend = "cpu",
                        .hash = "0",
                        .start = start,
                        .main = main,
                        .faults = {},
                        .record = rec,
                        .phase = {},
                        .done = {},
                        .fault_free_control = {}};
  }
};

// The resume check saves at_step steps after the start: from a checkpoint at step 4 of 6, saving
// 2 steps later leaves no step to resume.
TEST(CheckTable, ResumeIsSkippedWhenNoStepIsLeftAfterTheSave) {
  Fixture f;
  f.s.train.steps = 6;
  f.s.checks.resume.enabled = true;
  f.s.checks.resume.at_step = 2;
  const CheckDescriptor& resume = *find_check("resume");
  ASSERT_NE(resume.skip, nullptr);
  EXPECT_EQ(resume.skip(f.context(0)), std::nullopt);
  EXPECT_EQ(resume.skip(f.context(3)), std::nullopt);
  EXPECT_EQ(resume.skip(f.context(4)),
            "the run starts from step 4: saving 2 steps later leaves no step to resume");
}

// A reference with another recipe cannot start from the run's checkpoint (other FP8 state).
TEST(CheckTable, ReferenceWithAnotherRecipeIsSkippedFromACheckpoint) {
  Fixture f;
  f.s.recipe = default_recipe(RecipeKind::kDelayed);
  f.s.checks.reference.enabled = true;
  f.opts.from_checkpoint = "ck/step_0000002";
  const CheckDescriptor& reference = *find_check("reference");
  ASSERT_NE(reference.skip, nullptr);
  EXPECT_EQ(reference.skip(f.context(2)), std::nullopt);  // no recipe override
  f.s.checks.reference.recipe = default_recipe(RecipeKind::kDelayed);
  EXPECT_EQ(reference.skip(f.context(2)), std::nullopt);  // the same recipe
  f.s.checks.reference.recipe = default_recipe(RecipeKind::kBf16);
  EXPECT_EQ(reference.skip(f.context(0)), std::nullopt);  // from scratch
  EXPECT_EQ(reference.skip(f.context(2)),
            "a reference with recipe bf16 cannot start from the delayed checkpoint "
            "ck/step_0000002");
}

// A reference with another fsdp.fp8_params cannot start from the run's checkpoint either (the
// FP8 primary weights are keys of their own); other fsdp overrides can.
TEST(CheckTable, ReferenceWithAnotherFp8ParamsIsSkippedFromACheckpoint) {
  Fixture f;
  f.s.recipe = default_recipe(RecipeKind::kDelayed);
  f.s.checks.reference.enabled = true;
  f.opts.from_checkpoint = "ck/step_0000002";
  f.s.checks.reference.fsdp = engine::FsdpOptions{.reshard_after_forward = false};
  const CheckDescriptor& reference = *find_check("reference");
  EXPECT_EQ(reference.skip(f.context(2)), std::nullopt);
  f.s.checks.reference.fsdp->fp8_params = true;
  EXPECT_EQ(reference.skip(f.context(0)), std::nullopt);
  EXPECT_EQ(reference.skip(f.context(2)),
            "a reference with fsdp.fp8_params true cannot start from the checkpoint "
            "ck/step_0000002 (saved with fp8_params false)");
}

// The state check is enabled by its switch and claimed by its own name, with or without a mesh.
TEST(CheckTable, StateIsClaimedByItsName) {
  Scenario s;
  EXPECT_EQ(enabled_checks(s), std::vector<std::string>{});
  s.checks.state.enabled = true;
  EXPECT_EQ(enabled_checks(s), (std::vector<std::string>{"state"}));
  s.checks.state.mesh = engine::MeshSpec{};
  EXPECT_EQ(enabled_claims(s), (std::vector<std::string>{"state"}));
  EXPECT_EQ(check_of_claim("state"), find_check("state"));
}

// The state check saves at_step steps after the start, at most at the last step.
TEST(CheckTable, StateIsSkippedWhenTheSaveIsPastTheLastStep) {
  Fixture f;
  f.s.train.steps = 6;
  f.s.checks.state.enabled = true;
  f.s.checks.state.at_step = 2;
  const CheckDescriptor& state = *find_check("state");
  ASSERT_NE(state.skip, nullptr);
  EXPECT_EQ(state.skip(f.context(0)), std::nullopt);
  EXPECT_EQ(state.skip(f.context(4)), std::nullopt);  // saves after the last step
  EXPECT_EQ(state.skip(f.context(5)),
            "the run starts from step 5: saving 2 steps later is past the last step");
}

// A scenario without the state check or the reference's later overrides keeps the canonical form
// (and hash) it had before they existed; enabling them changes it.
TEST(CheckTable, StateAndReferenceOverridesAppearInTheCanonicalFormOnlyWhenEnabled) {
  Scenario s;
  s.name = "x";
  const std::string before = canonical_text(s);
  EXPECT_EQ(before.find("\"state\""), std::string::npos);
  Scenario t = s;
  t.checks.state.enabled = true;
  t.checks.state.at_step = 2;
  EXPECT_NE(canonical_text(t), before);
  Scenario r = s;
  r.checks.reference.enabled = true;
  r.checks.reference.mesh = engine::MeshSpec{.dp_replicate = 1, .dp_shard = 2, .tp = 1};
  const std::string with_mesh = canonical_text(r);
  EXPECT_EQ(with_mesh.find("\"fsdp\":{\"fp8"), with_mesh.rfind("\"fsdp\":{\"fp8"));  // once
  r.checks.reference.micro_batches = 4;
  EXPECT_NE(canonical_text(r), with_mesh);
  r.checks.reference.micro_batches.reset();
  r.checks.reference.fsdp = engine::FsdpOptions{};
  EXPECT_NE(canonical_text(r), with_mesh);
}

}  // namespace
}  // namespace meshproof::harness
