// The golden check (harness/checks/checks.h check_golden): exact and tolerance modes, allowed
// failing steps, per-metric evidence in fp32 ULP, the missing and stale golden messages.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <limits>

#include "harness/checks/checks.h"
#include "harness/checks/golden.h"
#include "runner_test_builders.h"

namespace meshproof::harness {
namespace {

namespace fs = std::filesystem;
using reports::Verdict;
using namespace test;

TEST(GoldenCheck, ExactPassesOnlyOnIdenticalBits) {
  const auto steps = steps_of({5.0, 4.5, 4.0}, {1.0, 0.9, 0.8});
  GoldenCheck cfg;
  cfg.enabled = true;
  auto r = check_golden(steps, golden_of({5.0, 4.5, 4.0}, {1.0, 0.9, 0.8}), cfg, "g.h5", "cmd");
  EXPECT_EQ(r.verdict, Verdict::kPass) << r.message;

  // One ULP off at step 2 is a failure in exact mode, and the evidence names that step.
  const double off = std::nextafter(4.5, 5.0);
  r = check_golden(steps, golden_of({5.0, off, 4.0}, {1.0, 0.9, 0.8}), cfg, "g.h5", "cmd");
  ASSERT_EQ(r.verdict, Verdict::kFail);
  ASSERT_TRUE(r.evidence.has_value());
  EXPECT_EQ(r.evidence->first_diverging_step, 2);
  EXPECT_EQ(r.evidence->metric, "loss");
  EXPECT_EQ(r.evidence->ulp_distance, 1);
  EXPECT_EQ(r.evidence->failing_steps, 1);
}

TEST(GoldenCheck, ToleranceBandAndAllowedFailingSteps) {
  const auto steps = steps_of({5.0, 4.5, 4.0, 3.5}, {1, 1, 1, 1});
  GoldenCheck cfg;
  cfg.enabled = true;
  cfg.mode = GoldenMode::kTolerance;
  cfg.metrics = {Metric::kLoss};
  cfg.rtol = 1e-3;
  cfg.atol = 0;
  // 5.004 is 8e-4 relative from 5.0: inside. 4.51 is 2.2e-3 from 4.5: outside.
  const auto golden = golden_of({5.004, 4.51, 4.0, 3.51}, {2, 2, 2, 2});
  auto r = check_golden(steps, golden, cfg, "g.h5", "cmd");
  ASSERT_EQ(r.verdict, Verdict::kFail) << r.message;
  EXPECT_EQ(r.evidence->first_diverging_step, 2);
  EXPECT_EQ(r.evidence->failing_steps, 2);  // steps 2 and 4; grad_norm is not compared

  cfg.allowed_failing_steps = 2;
  r = check_golden(steps, golden, cfg, "g.h5", "cmd");
  EXPECT_EQ(r.verdict, Verdict::kPass) << r.message;
  cfg.allowed_failing_steps = 1;
  EXPECT_EQ(check_golden(steps, golden, cfg, "g.h5", "cmd").verdict, Verdict::kFail);

  // NaN never falls inside a band.
  cfg.allowed_failing_steps = 0;
  const auto nan_steps = steps_of({5.0, std::nan(""), 4.0, 3.5}, {1, 1, 1, 1});
  r = check_golden(nan_steps, golden_of({5.0, 4.5, 4.0, 3.5}, {1, 1, 1, 1}), cfg, "g", "c");
  EXPECT_EQ(r.verdict, Verdict::kFail);
  EXPECT_EQ(r.evidence->first_diverging_step, 2);
}

// #17.10: each metric carries its own errors. Loss fails first (step 1, slightly), grad_norm
// later and by far more: the evidence is loss's (not grad_norm's errors labelled loss), the
// message lists both, and ULP distances are fp32's (the metrics are fp32 quantities), not the
// float64 distance (4632078833224253-sized numbers for a 2x error).
TEST(GoldenCheck, EvidencePerMetricWithFp32Ulp) {
  GoldenCheck cfg;
  cfg.enabled = true;
  const float loss1 = 5.0f, loss1_off = std::nextafter(std::nextafter(5.0f, 6.0f), 6.0f);
  const auto steps = steps_of({loss1_off, 4.5, 4.0}, {1.0, 0.9, 2.0});
  const auto golden = golden_of({loss1, 4.5, 4.0}, {1.0, 0.9, 1.0});
  const auto r = check_golden(steps, golden, cfg, "g.h5", "cmd");
  ASSERT_EQ(r.verdict, Verdict::kFail);
  ASSERT_TRUE(r.evidence.has_value());
  EXPECT_EQ(r.evidence->first_diverging_step, 1);
  EXPECT_EQ(r.evidence->metric, "loss");
  EXPECT_EQ(r.evidence->ulp_distance, 2);  // two fp32 steps above 5.0f
  EXPECT_DOUBLE_EQ(*r.evidence->max_abs_err, static_cast<double>(loss1_off) - loss1);
  EXPECT_LT(*r.evidence->max_rel_err, 1e-6);  // loss's own, not grad_norm's 1.0
  EXPECT_EQ(r.evidence->failing_steps, 2);    // steps 1 (loss) and 3 (grad_norm)
  // grad_norm 2.0 vs 1.0 is 2^23 fp32 ULP apart (one binade).
  EXPECT_NE(
      r.message.find("; loss: 1 failing steps from step 1, max abs 9.54e-07, max rel 1.91e-07, "
                     "2 fp32 ULP; grad_norm: 1 failing steps from step 3, max abs 1, max rel "
                     "1, 8388608 fp32 ULP"),
      std::string::npos)
      << r.message;
  // A difference below one fp32 ULP (the double sums' last bits) is 1 ULP, never 0.
  const auto r2 = check_golden(steps_of({std::nextafter(4.5, 5.0)}, {1.0}), golden_of({4.5}, {1.0}),
                               cfg, "g.h5", "cmd");
  ASSERT_TRUE(r2.evidence.has_value());
  EXPECT_EQ(r2.evidence->ulp_distance, 1);
}

TEST(GoldenCheck, MissingGoldenFailsWithTheUpdateCommand) {
  GoldenCheck cfg;
  cfg.enabled = true;
  const auto r = check_golden(steps_of({1}, {1}), std::nullopt, cfg, "golden/x/cpu.h5",
                              "meshproof golden update x.yaml --platform cpu");
  EXPECT_EQ(r.verdict, Verdict::kFail);
  EXPECT_NE(r.message.find("golden/x/cpu.h5"), std::string::npos) << r.message;
  EXPECT_NE(r.message.find("meshproof golden update x.yaml --platform cpu"), std::string::npos);
}

TEST(GoldenCheck, StepCountMismatchFails) {
  GoldenCheck cfg;
  cfg.enabled = true;
  const auto r = check_golden(steps_of({1, 2}, {1, 1}), golden_of({1}, {1}), cfg, "g", "c");
  EXPECT_EQ(r.verdict, Verdict::kFail);
}

TEST(GoldenCheck, TraceSaysGoldensHaveNoTensors) {
  GoldenCheck cfg;
  cfg.enabled = true;
  const auto r = check_golden(steps_of({5.0, 4.0}, {1, 1}), golden_of({5.0, 4.5}, {1, 1}), cfg,
                              "g.h5", "cmd", nullptr, true);
  ASSERT_EQ(r.verdict, Verdict::kFail);
  EXPECT_NE(r.message.find("no per-tensor evidence: goldens store per-step metrics only"),
            std::string::npos)
      << r.message;
}

TEST(GoldenCheck, StaleScenarioHashIsNamedOnFailure) {
  GoldenCheck cfg;
  cfg.enabled = true;
  GoldenData g = golden_of({5.0, 4.5}, {1, 1});
  g.provenance["scenario_hash"] = "00000000000000aa";
  // A failure against a golden recorded for another configuration says so, with the update.
  auto r = check_golden(steps_of({5.0, 4.0}, {1, 1}), g, cfg, "g.h5", "meshproof golden update x",
                        nullptr, false, "00000000000000bb");
  ASSERT_EQ(r.verdict, Verdict::kFail);
  EXPECT_NE(r.message.find("; golden recorded for scenario hash 00000000000000aa, this run has "
                           "00000000000000bb; update with: meshproof golden update x"),
            std::string::npos)
      << r.message;
  // The same hash: the failure is about the numbers only.
  r = check_golden(steps_of({5.0, 4.0}, {1, 1}), g, cfg, "g.h5", "cmd", nullptr, false,
                   "00000000000000aa");
  ASSERT_EQ(r.verdict, Verdict::kFail);
  EXPECT_EQ(r.message.find("scenario hash"), std::string::npos) << r.message;
  // A pass says nothing about the hash (the metrics still match).
  r = check_golden(steps_of({5.0, 4.5}, {1, 1}), g, cfg, "g.h5", "cmd", nullptr, false,
                   "00000000000000bb");
  EXPECT_EQ(r.verdict, Verdict::kPass);
  EXPECT_EQ(r.message.find("scenario hash"), std::string::npos) << r.message;
  // A golden without a recorded hash (older writer): named as such.
  g.provenance.clear();
  r = check_golden(steps_of({5.0, 4.0}, {1, 1}), g, cfg, "g.h5", "cmd", nullptr, false,
                   "00000000000000bb");
  EXPECT_NE(r.message.find("golden recorded for scenario hash (none), this run has "
                           "00000000000000bb"),
            std::string::npos)
      << r.message;
}

}  // namespace
}  // namespace meshproof::harness
