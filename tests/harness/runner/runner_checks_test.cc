// Checks and golden store of the runner (harness/checks.h, harness/golden.h): golden exact and
// tolerance modes, allowed failing steps, the missing-golden message, ULP distances, bitwise run
// comparison, atomic golden writes and the mean relative shift.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <sstream>

#include "harness/checks.h"
#include "harness/golden.h"
#include "harness/run_verb.h"
#include "harness/runner.h"
#include "harness/scenario_faults.h"
#include "harness/train_run.h"
#include "kernels/error.h"
#include "kernels/tensor.h"
#include "reports/report_writers.h"
#include "sample_record.h"

namespace meshproof::harness {
namespace {

namespace fs = std::filesystem;
using reports::Verdict;

std::vector<reports::StepMetrics> steps_of(const std::vector<double>& loss,
                                           const std::vector<double>& grad_norm) {
  std::vector<reports::StepMetrics> out;
  for (size_t i = 0; i < loss.size(); ++i) {
    reports::StepMetrics m;
    m.step = static_cast<int64_t>(i) + 1;
    m.loss = loss[i];
    m.grad_norm = grad_norm[i];
    out.push_back(m);
  }
  return out;
}

GoldenData golden_of(const std::vector<double>& loss, const std::vector<double>& grad_norm) {
  GoldenData g;
  g.metrics["loss"] = loss;
  g.metrics["grad_norm"] = grad_norm;
  return g;
}

TEST(UlpDistance, AdjacentAndSignedZero) {
  EXPECT_EQ(ulp_distance(1.0f, std::nextafter(1.0f, 2.0f)), 1);
  EXPECT_EQ(ulp_distance(0.0f, -0.0f), 0);
  // Across zero: smallest positive and smallest negative subnormal are 2 ULP apart.
  EXPECT_EQ(ulp_distance(std::numeric_limits<float>::denorm_min(),
                         -std::numeric_limits<float>::denorm_min()),
            2);
  EXPECT_EQ(ulp_distance(1.0, std::nextafter(std::nextafter(1.0, 2.0), 2.0)), 2);
  EXPECT_EQ(ulp_distance(std::nanf(""), 1.0f), std::numeric_limits<int64_t>::max());
}

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

TEST(CompareBitwise, MetricsAndFinalParams) {
  const auto a = steps_of({5.0, 4.0}, {1.0, 0.5});
  auto b = a;
  engine::TensorMap pa, pb;
  pa.insert("w", kernels::Tensor::from_vector<float>(kernels::Shape({2}), {1.0f, 2.0f}));
  pb.insert("w", kernels::Tensor::from_vector<float>(kernels::Shape({2}), {1.0f, 2.0f}));
  auto r = compare_bitwise("determinism", "determinism", {&a, &pa}, {&b, &pb}, "rerun", true);
  EXPECT_EQ(r.verdict, Verdict::kPass) << r.message;

  // Equal metrics, one parameter element one ULP apart: still a failure naming the tensor.
  engine::TensorMap pc;
  pc.insert("w", kernels::Tensor::from_vector<float>(kernels::Shape({2}),
                                                     {1.0f, std::nextafter(2.0f, 3.0f)}));
  r = compare_bitwise("determinism", "determinism", {&a, &pc}, {&b, &pb}, "rerun", true);
  ASSERT_EQ(r.verdict, Verdict::kFail);
  EXPECT_EQ(r.evidence->tensor, "w");
  EXPECT_EQ(r.evidence->ulp_distance, 1);

  b[1].grad_norm = std::nextafter(0.5, 1.0);
  r = compare_bitwise("determinism", "determinism", {&a, nullptr}, {&b, nullptr}, "rerun", false);
  ASSERT_EQ(r.verdict, Verdict::kFail);
  EXPECT_EQ(r.evidence->first_diverging_step, 2);
  EXPECT_EQ(r.evidence->metric, "grad_norm");
}

// A traced step: gradient and weight digests with the values first_diverging_traced compares.
std::vector<engine::TensorDigest> traced_step(const std::vector<float>& grad,
                                              const std::vector<float>& weight) {
  std::vector<engine::TensorDigest> out;
  for (const auto& [name, v] : {std::pair{"grad/w", grad}, std::pair{"param/w", weight}}) {
    engine::TensorDigest d;
    d.name = name;
    d.shape = kernels::Shape({static_cast<int64_t>(v.size())});
    d.values = v;
    out.push_back(d);
  }
  return out;
}

TEST(FirstDivergingTraced, EqualRunsHaveNone) {
  const Trace t = {traced_step({1, 2, 3}, {4, 5, 6}), traced_step({0.5f, -1, 0}, {4, 5, 6})};
  EXPECT_FALSE(first_diverging_traced(t, t).has_value());
  EXPECT_FALSE(first_diverging_traced(t, t, 1e-5).has_value());
  // +0 and -0 differ in their bits: a bitwise divergence of 0 ULP, no error.
  Trace z = t;
  z[1][0].values[2] = -0.0f;
  const auto d = first_diverging_traced(z, t);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->diff.ulp, 0);
}

TEST(FirstDivergingTraced, PerturbedTensorAtStepTwo) {
  const Trace expected = {traced_step({1, 2, 3}, {4, 5, 6}), traced_step({1, 2, 3}, {4, 5, 6}),
                          traced_step({1, 2, 3}, {4, 5, 6})};
  Trace actual = expected;
  // Step 2's weight: element 1 three ULP up (5 -> 5 + 3 * 2^-21), element 2 -> 6.5; step 3's
  // gradient differs too, but step 2 comes first.
  float up = 5.0f;
  for (int i = 0; i < 3; ++i) up = std::nextafter(up, 6.0f);
  actual[1][1].values = {4, up, 6.5f};
  actual[2][0].values = {1, 2, 4};
  const auto d = first_diverging_traced(actual, expected);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->step, 2);
  EXPECT_EQ(d->diff.tensor, "param/w");
  EXPECT_DOUBLE_EQ(d->diff.max_abs_err, 0.5);
  EXPECT_DOUBLE_EQ(d->diff.max_rel_err, 0.5 / 6.0);
  // 6 -> 6.5 in [4, 8) where one ULP is 2^-21: 0.5 / 2^-21 = 2^20 ULP (more than element 1's 3).
  EXPECT_EQ(d->diff.ulp, int64_t{1} << 20);
  const double rel_l2 = std::sqrt((std::pow(up - 5.0, 2) + 0.25) / (16 + 25 + 36));
  EXPECT_DOUBLE_EQ(d->rel_l2, rel_l2);
  EXPECT_TRUE(d->beyond_rtol);

  // Tolerance mode: step 2's weight (rel L2 0.057) is within rtol 0.1; step 3's gradient
  // (||(0,0,1)|| / ||(1,2,3)|| = 0.267) is not.
  const auto t = first_diverging_traced(actual, expected, 0.1);
  ASSERT_TRUE(t.has_value());
  EXPECT_EQ(t->step, 3);
  EXPECT_EQ(t->diff.tensor, "grad/w");
  EXPECT_DOUBLE_EQ(t->diff.max_abs_err, 1.0);
  EXPECT_DOUBLE_EQ(t->diff.max_rel_err, 1.0 / 3.0);
  EXPECT_TRUE(t->beyond_rtol);
  // Nothing beyond rtol 0.5: the largest relative L2 difference, flagged as within rtol.
  const auto w = first_diverging_traced(actual, expected, 0.5);
  ASSERT_TRUE(w.has_value());
  EXPECT_EQ(w->step, 3);
  EXPECT_FALSE(w->beyond_rtol);

  // Another shape is a divergence that cannot be measured element by element.
  Trace shaped = expected;
  shaped[0][0].shape = kernels::Shape({3, 1});
  const auto s = first_diverging_traced(shaped, expected);
  ASSERT_TRUE(s.has_value());
  EXPECT_EQ(s->step, 1);
  EXPECT_EQ(s->diff.tensor, "grad/w (shape [3, 1] vs [3])");
}

// #17.11: a noisy first-in-canonical-order gradient (the embedding's) must not be named when
// its difference is the one a fault-free control shows as well; judged against its own noise
// floor, in step order (gradients backward: the head's first), the head's gradient, bitwise in
// the control, is the first tensor beyond its floor. The loss-rtol rule named the embedding.
TEST(FirstDivergingTraced, NoiseFloorsAndStepOrder) {
  auto step_of = [](const std::vector<float>& g_embed, const std::vector<float>& g_head) {
    std::vector<engine::TensorDigest> out;
    for (const auto& [name, v] :
         {std::pair{"grad/embed.tok", g_embed}, std::pair{"grad/lm_head.weight", g_head},
          std::pair{"param/embed.tok", std::vector<float>{1, 1}},
          std::pair{"param/lm_head.weight", std::vector<float>{2, 2}}}) {
      engine::TensorDigest d;
      d.name = name;
      d.shape = kernels::Shape({2});
      d.values = v;
      out.push_back(d);
    }
    return out;
  };
  const Trace expected = {step_of({1, 1}, {1, 1})};
  // Control (fault-free, same comparison): the embedding gradient moves by rel L2 0.05, the
  // head's not at all.
  const Trace control = {step_of({1.05f, 1.05f}, {1, 1})};
  // The faulty run: the same embedding noise, and the head's gradient off by rel L2 1e-3.
  const Trace actual = {step_of({1.05f, 1.05f}, {1.001f, 1.001f})};
  // The old rule (rtol 1e-2, canonical order) names the embedding's noise.
  const auto old_rule = first_diverging_traced(actual, expected, 1e-2);
  ASSERT_TRUE(old_rule.has_value());
  EXPECT_EQ(old_rule->diff.tensor, "grad/embed.tok");
  const NoiseFloors floors = noise_floors(control, expected);
  ASSERT_EQ(floors.size(), 1u);
  EXPECT_NEAR(floors[0].at("grad/embed.tok"), 0.05, 1e-6);
  EXPECT_EQ(floors[0].at("grad/lm_head.weight"), 0.0);
  const auto d = first_diverging_traced(actual, expected, 1e-2, &floors);
  ASSERT_TRUE(d.has_value());
  EXPECT_EQ(d->diff.tensor, "grad/lm_head.weight");
  EXPECT_TRUE(d->beyond_rtol);
  ASSERT_TRUE(d->floor.has_value());
  EXPECT_EQ(*d->floor, 0.0);
  // Only the embedding's noise: nothing beyond its floor; the furthest above it is reported.
  const auto quiet = first_diverging_traced(control, expected, 1e-2, &floors);
  ASSERT_TRUE(quiet.has_value());
  EXPECT_FALSE(quiet->beyond_rtol);
  EXPECT_EQ(quiet->diff.tensor, "grad/embed.tok");
  // Through compare_tolerance: the message says which rule judged the tensor.
  const auto a = steps_of({5.0}, {1.0});
  const auto e = steps_of({5.5}, {1.0});
  const auto r =
      compare_tolerance("reference", "reference", {&a, nullptr, &actual}, {&e, nullptr, &expected},
                        {{Metric::kLoss, 1e-2}}, "run", true, &floors);
  EXPECT_EQ(r.evidence->tensor, "grad/lm_head.weight at step 1");
  EXPECT_NE(r.message.find("first tensor beyond its noise floor (step order; 4x the fault-free "
                           "control's relative L2 difference): grad/lm_head.weight at step 1"),
            std::string::npos)
      << r.message;
}

// The FP8 state in a trace (engine::TrainingSession::digests, as the engine lists it): the
// forward's state ("fp8/<key>") first, then the gradients in backward order, the weights, and the
// state after the step ("updated/fp8/<key>"). Each is judged against its own noise floor.
TEST(FirstDivergingTraced, Fp8StateInStepOrderWithNoiseFloors) {
  using Entry = std::pair<const char*, std::vector<float>>;
  auto step_of = [](float input_scale, float weight_scale_inv, float g_head, float updated) {
    std::vector<engine::TensorDigest> out;
    for (const Entry& e :
         {Entry{"fp8/layers.0.attn.qkv/input/scale", {input_scale}},
          Entry{"fp8/params/layers.0.attn.qkv.weight/scale_inv", {weight_scale_inv}},
          Entry{"grad/layers.0.attn.qkv.weight", {1, 1}}, Entry{"grad/lm_head.weight", {g_head, 1}},
          Entry{"param/layers.0.attn.qkv.weight", {2, 2}}, Entry{"param/lm_head.weight", {3, 3}},
          Entry{"updated/fp8/layers.0.attn.qkv/input/scale", {updated}}}) {
      engine::TensorDigest d;
      d.name = e.first;
      d.shape = kernels::Shape({static_cast<int64_t>(e.second.size())});
      d.values = e.second;
      out.push_back(d);
    }
    return out;
  };
  const Trace expected = {step_of(100, 0.01f, 1, 90)};
  // Bitwise: a forward FP8 scale that differs comes before the (later in the list, earlier in
  // the backward) head gradient and the updated state.
  const auto first = first_diverging_traced({step_of(1, 0.01f, 2, 80)}, expected);
  ASSERT_TRUE(first.has_value());
  EXPECT_EQ(first->diff.tensor, "fp8/layers.0.attn.qkv/input/scale");
  // Only the FP8 weight's scale_inv and the head gradient differ: the scale_inv (forward state).
  const auto inv = first_diverging_traced({step_of(100, 0.0101f, 2, 90)}, expected);
  ASSERT_TRUE(inv.has_value());
  EXPECT_EQ(inv->diff.tensor, "fp8/params/layers.0.attn.qkv.weight/scale_inv");
  // Only the updated state: named after the weights.
  const auto upd = first_diverging_traced({step_of(100, 0.01f, 1, 91)}, expected);
  ASSERT_TRUE(upd.has_value());
  EXPECT_EQ(upd->diff.tensor, "updated/fp8/layers.0.attn.qkv/input/scale");
  // Noise floors: the control moves the input scale by rel 1e-2 (its floor); the faulty run
  // moves it by the same amount and the scale_inv (floor 0) by rel 1e-3: the scale is within
  // 4x its floor, the scale_inv is named.
  const Trace control = {step_of(101, 0.01f, 1, 90)};
  const NoiseFloors floors = noise_floors(control, expected);
  EXPECT_NEAR(floors[0].at("fp8/layers.0.attn.qkv/input/scale"), 0.01, 1e-6);
  EXPECT_EQ(floors[0].at("fp8/params/layers.0.attn.qkv.weight/scale_inv"), 0.0);
  const auto judged =
      first_diverging_traced({step_of(101, 0.01001f, 1, 90)}, expected, 1e-2, &floors);
  ASSERT_TRUE(judged.has_value());
  EXPECT_TRUE(judged->beyond_rtol);
  EXPECT_EQ(judged->diff.tensor, "fp8/params/layers.0.attn.qkv.weight/scale_inv");
  // The control itself: nothing beyond its floor.
  const auto quiet = first_diverging_traced(control, expected, 1e-2, &floors);
  ASSERT_TRUE(quiet.has_value());
  EXPECT_FALSE(quiet->beyond_rtol);
}

TEST(CompareBitwise, TraceNamesTensorStepAndItsErrors) {
  const auto a = steps_of({5.0, 4.0, 3.0}, {1.0, 0.5, 0.25});
  auto b = a;
  b[2].loss = std::nextafter(3.0, 4.0);  // the metrics leave at step 3
  const Trace te = {traced_step({1, 2}, {3, 4}), traced_step({1, 2}, {3, 4}),
                    traced_step({1, 2}, {3, 4})};
  Trace ta = te;
  ta[1][1].values = {3, 4.5f};  // the weights already at step 2
  const auto r = compare_bitwise("resume", "resume", {&a, nullptr, &ta}, {&b, nullptr, &te},
                                 "resumed run", true);
  ASSERT_EQ(r.verdict, Verdict::kFail);
  EXPECT_EQ(r.evidence->first_diverging_step, 3);
  EXPECT_EQ(r.evidence->metric, "loss");
  EXPECT_EQ(r.evidence->tensor, "param/w at step 2");
  EXPECT_DOUBLE_EQ(*r.evidence->max_abs_err, 0.5);
  EXPECT_DOUBLE_EQ(*r.evidence->max_rel_err, 0.125);
  EXPECT_EQ(*r.evidence->ulp_distance, int64_t{1} << 20);  // 0.5 / 2^-21 in [4, 8)
  EXPECT_NE(r.message.find("first diverging tensor param/w at step 2: max abs 0.5, max rel "
                           "0.125, 1048576 ULP"),
            std::string::npos)
      << r.message;
  // Without --trace: the metric only.
  const auto plain = compare_bitwise("resume", "resume", {&a, nullptr, &ta}, {&b, nullptr, &te},
                                     "resumed run", false);
  EXPECT_EQ(plain.evidence->tensor, "");
  EXPECT_EQ(plain.message.find("tensor"), std::string::npos) << plain.message;
}

TEST(CompareTolerance, TraceNamesFirstTensorBeyondRtol) {
  const auto a = steps_of({5.0, 4.0}, {1.0, 0.5});
  const auto e = steps_of({5.0, 4.1}, {1.0, 0.5});
  const Trace te = {traced_step({1, 2}, {3, 4}), traced_step({1, 2}, {3, 4})};
  Trace ta = te;
  ta[0][0].values = {1, std::nextafter(2.0f, 3.0f)};  // last-bit noise at step 1: within rtol
  ta[1][0].values = {1.5f, 2};                        // rel L2 0.5 / sqrt(5) = 0.22 at step 2
  const auto r = compare_tolerance("reference", "reference", {&a, nullptr, &ta}, {&e, nullptr, &te},
                                   {{Metric::kLoss, 1e-3}}, "run", true);
  ASSERT_EQ(r.verdict, Verdict::kFail);
  EXPECT_EQ(r.evidence->first_diverging_step, 2);
  EXPECT_EQ(r.evidence->tensor, "grad/w at step 2");
  EXPECT_DOUBLE_EQ(*r.evidence->max_abs_err, 0.5);
  EXPECT_DOUBLE_EQ(*r.evidence->max_rel_err, 0.5);
  EXPECT_EQ(*r.evidence->ulp_distance, int64_t{1} << 22);  // 0.5 / 2^-23 in [1, 2)
  EXPECT_NE(r.message.find("first tensor beyond rtol 0.001 (relative L2 difference): grad/w at "
                           "step 2"),
            std::string::npos)
      << r.message;
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

TEST(CompareTolerance, PerMetricRtol) {
  const auto a = steps_of({5.0, 4.0}, {1.0, 0.5});
  const auto e = steps_of({5.0, 4.001}, {1.0, 0.9});
  // grad_norm is not compared; loss differs by 2.5e-4 relative at step 2.
  auto r = compare_tolerance("reference", "reference", {&a}, {&e}, {{Metric::kLoss, 1e-3}}, "run",
                             false);
  EXPECT_EQ(r.verdict, Verdict::kPass) << r.message;
  r = compare_tolerance("reference", "reference", {&a}, {&e}, {{Metric::kLoss, 1e-4}}, "run",
                        false);
  ASSERT_EQ(r.verdict, Verdict::kFail);
  EXPECT_EQ(r.evidence->first_diverging_step, 2);
}

TEST(GoldenStore, AtomicRoundTripProvenanceAndShift) {
  const fs::path dir = fs::path(::testing::TempDir()) / "runner_golden_store";
  fs::remove_all(dir);
  const fs::path path = golden_path(dir, "fsdp[recipe=bf16]", "cpu");
  EXPECT_EQ(path, dir / "fsdp@recipe=bf16" / "cpu.h5");
  EXPECT_FALSE(read_golden(path).has_value());

  GoldenData g = golden_of({5.0, 4.0}, {1.0, 0.5});
  g.provenance = {{"scenario", "fsdp[recipe=bf16]"}, {"backend", "cpu"}, {"cuda_runtime", ""}};
  write_golden(path, g);
  for (const auto& e : fs::directory_iterator(path.parent_path()))
    EXPECT_EQ(e.path().filename(), "cpu.h5") << "temporary left behind: " << e.path();
  const auto back = read_golden(path);
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->metrics.at("loss"), g.metrics.at("loss"));
  EXPECT_EQ(back->metrics.at("grad_norm"), g.metrics.at("grad_norm"));
  EXPECT_EQ(back->provenance.at("scenario"), "fsdp[recipe=bf16]");
  EXPECT_EQ(back->provenance.at("cuda_runtime"), "");

  // +10% at step 1, -10% at step 2: mean 0; +10% both: +0.1.
  // 1e-15: 3.6 and 4.4 are not exact in binary, so the shifts are 0.1 only to a few ULP.
  EXPECT_NEAR(*mean_relative_shift({5.0, 4.0}, {5.5, 3.6}), 0.0, 1e-15);
  EXPECT_NEAR(*mean_relative_shift({5.0, 4.0}, {5.5, 4.4}), 0.1, 1e-15);
  EXPECT_FALSE(mean_relative_shift({0.0}, {1.0}).has_value());
}

TEST(GoldenPlatform, CpuAndGpuFamilies) {
  reports::EnvironmentRecord env;
  EXPECT_EQ(golden_platform("cpu", env), "cpu");
  env.gpus.push_back({0, "NVIDIA H100 80GB HBM3", "9.0", 0, 132});
  EXPECT_EQ(golden_platform("cuda:0", env), "h100");
  env.gpus[0].name = "NVIDIA H200";
  EXPECT_EQ(golden_platform("cuda:0", env), "h200");
}

// Issue #18.12: concurrent `golden update`s of one golden shared the name <golden>.partial; one
// renamed the other's half-written file or found it gone, and 1 in 8 left no golden. Now each
// writer stages its own mkstemp'd file: after every trial of two processes writing at once, the
// golden is one of the two complete goldens and no temporary is left.
TEST(GoldenStore, ConcurrentWritersEachLeaveACompleteGolden) {
  const fs::path dir = fs::path(::testing::TempDir()) / "runner_golden_concurrent";
  fs::remove_all(dir);
  const fs::path path = golden_path(dir, "tp[recipe=bf16]", "cpu");
  std::vector<GoldenData> versions;
  for (int w = 0; w < 2; ++w) {
    std::vector<double> loss(64), gn(64);
    for (int i = 0; i < 64; ++i) {
      loss[static_cast<size_t>(i)] = 5.0 - 0.01 * i + w;
      gn[static_cast<size_t>(i)] = 1.0 + w;
    }
    versions.push_back(golden_of(loss, gn));
    versions.back().provenance = {{"writer", std::to_string(w)}};
  }
  constexpr int kTrials = 12;
  for (int trial = 0; trial < kTrials; ++trial) {
    std::vector<pid_t> kids;
    for (int w = 0; w < 2; ++w) {
      const pid_t pid = fork();
      ASSERT_GE(pid, 0);
      if (pid == 0) {
        int code = 0;
        try {
          for (int k = 0; k < 4; ++k) write_golden(path, versions[static_cast<size_t>(w)]);
        } catch (...) {
          code = 1;
        }
        _exit(code);
      }
      kids.push_back(pid);
    }
    for (pid_t pid : kids) {
      int status = 0;
      waitpid(pid, &status, 0);
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "trial " << trial;
    }
    const auto back = read_golden(path);
    ASSERT_TRUE(back.has_value()) << "trial " << trial << ": no golden left";
    const std::string writer = back->provenance.at("writer");
    EXPECT_EQ(back->metrics.at("loss"), versions.at(std::stoul(writer)).metrics.at("loss"))
        << "trial " << trial;
    for (const auto& e : fs::directory_iterator(path.parent_path()))
      EXPECT_EQ(e.path().filename(), "cpu.h5") << "left behind: " << e.path();
  }
}

// An HDF5 failure names the golden and HDF5's reason, never the source text of the code that
// failed (MP_HDF5 quotes its expression: it was a whole lambda).
TEST(GoldenStore, ErrorsNameTheFileNotTheSourceCode) {
  const fs::path dir = fs::path(::testing::TempDir()) / "runner_golden_errors";
  fs::remove_all(dir);
  fs::create_directories(dir / "x");
  const fs::path bad = dir / "x" / "cpu.h5";
  { std::ofstream(bad) << "not hdf5"; }
  try {
    (void)read_golden(bad);
    FAIL() << "read a malformed golden";
  } catch (const kernels::Error& e) {
    EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
    EXPECT_NE(std::string(e.what()).find("reading golden " + bad.string()), std::string::npos)
        << e.what();
    EXPECT_EQ(std::string(e.what()).find("H5File"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find("[&]"), std::string::npos) << e.what();
  }
  // The golden's name is taken by a folder: the rename fails.
  const fs::path taken = dir / "y" / "cpu.h5";
  fs::create_directories(taken / "sub");
  try {
    write_golden(taken, golden_of({1.0}, {1.0}));
    FAIL() << "wrote over a folder";
  } catch (const kernels::Error& e) {
    EXPECT_NE(std::string(e.what()).find("writing golden " + taken.string()), std::string::npos)
        << e.what();
    EXPECT_EQ(std::string(e.what()).find("[&]"), std::string::npos) << e.what();
  }
  EXPECT_EQ(std::distance(fs::directory_iterator(taken.parent_path()), fs::directory_iterator()),
            1);  // no temporary left beside it
}

// Issue #17.13: a platform is a file name, never a path.
TEST(GoldenPlatform, PlatformIsAFileName) {
  EXPECT_TRUE(valid_platform_name("h100"));
  EXPECT_TRUE(valid_platform_name("my_lab-gpu2"));
  for (const char* bad : {"", "x/../../y", "H100", "..", "a b", "cpu.h5"}) {
    EXPECT_FALSE(valid_platform_name(bad)) << bad;
    EXPECT_THROW((void)golden_path("golden", "s", bad), kernels::Error) << bad;
  }
}

// The printed fix-up command keeps every flag that decides which golden the run read.
TEST(GoldenPlatform, UpdateCommandKeepsGoldenDirAndFlags) {
  Scenario s;
  s.source = "scenarios/tp.yaml";
  s.name = "tp[recipe=bf16]";
  RunnerOptions opts;
  opts.sets = {"train.lr=2e-3", "description=it's"};
  opts.backend = Backend::kCpu;
  opts.launcher = Launcher::kMpi;
  opts.golden_dir = "/tmp/my goldens";
  EXPECT_EQ(golden_update_command(s, opts, "cpu"),
            "meshproof golden update scenarios/tp.yaml --filter 'tp[recipe=bf16]' "
            "--set=train.lr=2e-3 '--set=description=it'\\''s' --backend=cpu --launcher=mpi "
            "'--golden-dir=/tmp/my goldens' --platform=cpu");
}

// Issue #17.3: an explicit cuda backend without a usable GPU is an input error with the probe's
// reason; requires_gpu scenarios are skipped (with that reason) under auto and cpu.
TEST(ResolveBackend, ExplicitCudaWithoutGpuIsAnErrorRequiresGpuSkips) {
  reports::EnvironmentRecord env;
  env.cuda_usable = false;
  env.cuda_unusable_reason = "no CUDA driver is installed";
  Scenario s;
  s.source = "x.yaml";
  s.name = "x";
  RunnerOptions opts;
  std::string skip;
  EXPECT_EQ(resolve_backend(s, opts, env, &skip), "cpu");
  opts.backend = Backend::kCuda;
  try {
    (void)resolve_backend(s, opts, env, &skip);
    FAIL() << "--backend cuda accepted without a GPU";
  } catch (const kernels::Error& e) {
    EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
    EXPECT_NE(e.message().find("x.yaml: scenario x: backend cuda (--backend cuda) but no usable "
                               "GPU: no CUDA driver is installed"),
              std::string::npos)
        << e.message();
  }
  opts.backend.reset();
  s.backend = Backend::kCuda;
  EXPECT_THROW((void)resolve_backend(s, opts, env, &skip), kernels::Error);
  s.requires_gpu = true;
  for (Backend b : {Backend::kAuto, Backend::kCpu}) {
    opts.backend = b;
    skip.clear();
    EXPECT_FALSE(resolve_backend(s, opts, env, &skip).has_value());
    EXPECT_EQ(skip, "requires_gpu but no usable GPU: no CUDA driver is installed");
  }
  env.cuda_usable = true;
  opts.backend = Backend::kCuda;
  EXPECT_EQ(resolve_backend(s, opts, env, &skip), "cuda:0");
}

// ---- allgather_parity

engine::AllGatherParity parity_record(int64_t step, const std::string& tensor, int64_t mismatched) {
  engine::AllGatherParity p;
  p.step = step;
  p.tensor = tensor;
  p.bytes = 2 * 98336;
  p.mismatched_bytes = mismatched;
  p.max_abs_error = mismatched > 0 ? 0.0175 : 0.0;
  p.scale_inv = mismatched > 0 ? 0.000168936589 : 0.000183105469;
  p.reference_scale_inv = 0.000183105469;
  return p;
}

TEST(AllGatherParityCheck, PassesOnlyWithRecordsAndNoMismatch) {
  auto r = check_allgather_parity({});
  EXPECT_EQ(r.verdict, Verdict::kFail);  // nothing compared is not a pass
  EXPECT_NE(r.message.find("no FP8 all-gathered weight was compared"), std::string::npos)
      << r.message;

  r = check_allgather_parity({parity_record(0, "layers.0.attn.qkv.weight", 0),
                              parity_record(0, "layers.0.mlp.fc1.weight", 0),
                              parity_record(1, "layers.0.attn.qkv.weight", 0)});
  EXPECT_EQ(r.verdict, Verdict::kPass) << r.message;
  EXPECT_EQ(r.kind, "allgather_parity");
  EXPECT_NE(r.message.find("3 FP8 all-gathered weights over 2 steps"), std::string::npos)
      << r.message;
  EXPECT_NE(r.message.find("590016 bytes compared"), std::string::npos) << r.message;
}

TEST(AllGatherParityCheck, FailureNamesFirstStepTensorBytesScalesAndError) {
  const auto r = check_allgather_parity({parity_record(0, "layers.0.attn.qkv.weight", 0),
                                         parity_record(1, "layers.1.mlp.fc2.weight", 71022),
                                         parity_record(2, "layers.0.attn.qkv.weight", 5)});
  ASSERT_EQ(r.verdict, Verdict::kFail);
  // Engine steps are 0-based; reports count from 1.
  EXPECT_NE(r.message.find("step 2, layers.1.mlp.fc2.weight: 71022 of 196672 bytes differ"),
            std::string::npos)
      << r.message;
  EXPECT_NE(r.message.find("scale_inv 0.000168936589 vs reference 0.000183105469"),
            std::string::npos)
      << r.message;
  EXPECT_NE(r.message.find("max abs error 0.0175"), std::string::npos) << r.message;
  EXPECT_NE(r.message.find("2 of 3 gathered weights mismatch"), std::string::npos) << r.message;
  ASSERT_TRUE(r.evidence.has_value());
  EXPECT_EQ(r.evidence->first_diverging_step, 2);
  EXPECT_EQ(r.evidence->tensor, "layers.1.mlp.fc2.weight");
  EXPECT_EQ(r.evidence->metric, "scale_inv");
  EXPECT_EQ(r.evidence->actual, 0.000168936589);
  EXPECT_EQ(r.evidence->expected, 0.000183105469);
  EXPECT_EQ(r.evidence->max_abs_err, 0.0175);
  EXPECT_EQ(r.evidence->failing_steps, 2);
}

// ---- scenario -> engine mapping

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

// ---- fault catalog: which faults this build runs

TEST(FaultCatalogRunnable, EngineFaultsRunAndMissingFeaturesAreNamed) {
  std::string why;
  for (const FaultInfo& f : fault_catalog()) EXPECT_TRUE(fault_runnable(f.name, &why)) << why;
  EXPECT_FALSE(fault_runnable("no_such_fault", &why));
  EXPECT_NE(why.find("no engine side"), std::string::npos) << why;

  std::ostringstream out;
  print_fault_catalog(out);
  const std::string text = out.str();
  const size_t at = text.find("uneven_shard_padding_leak\n");
  ASSERT_NE(at, std::string::npos) << text;
  const size_t next = text.find("runnable:", at);
  ASSERT_NE(next, std::string::npos);
  EXPECT_EQ(text.compare(next, 14, "runnable:  yes"), 0) << text.substr(at);
}

// The intended checks of a fault scenario: the catalog's caught_by restricted to enabled checks,
// with resume_cross_mesh meaning the resume check with a mesh override.
TEST(IntendedChecks, CatalogRestrictedToEnabledChecks) {
  Scenario s;
  s.expect = Expect::kCaught;
  s.faults = {FaultSpec{"amax_not_reduced", {}, {}}};  // caught by allgather_parity, reference
  s.checks.allgather_parity = true;
  s.checks.golden.enabled = true;
  EXPECT_EQ(intended_checks(s), std::vector<std::string>{"allgather_parity"});
  s.checks.reference.enabled = true;
  EXPECT_EQ(intended_checks(s), (std::vector<std::string>{"allgather_parity", "reference"}));

  Scenario t;
  t.expect = Expect::kCaught;
  t.faults = {FaultSpec{"tp_fsdp_left_to_right", {}, {}}};  // caught by resume_cross_mesh only
  t.checks.resume.enabled = true;
  EXPECT_TRUE(intended_checks(t).empty());  // a same-mesh resume does not count
  t.checks.resume.mesh = engine::MeshSpec{};
  EXPECT_EQ(intended_checks(t), std::vector<std::string>{"resume"});
  t.expect = Expect::kPass;
  EXPECT_TRUE(intended_checks(t).empty());
}

// The exit code of `meshproof run` follows expectation_met, which must agree with the verdict
// the four reports show: a fault caught only by a check outside caught_by is a miss.
TEST(ExpectationMet, AgreesWithTheReportVerdict) {
  std::string why;
  const reports::RunRecord ok = reports::testing::sample_record();
  EXPECT_TRUE(expectation_met(ok.scenarios[0], &why));
  EXPECT_TRUE(expectation_met(ok.scenarios[2], &why)) << why;  // caught by allgather_parity
  EXPECT_FALSE(expectation_met(ok.scenarios[1], &why));        // golden failed
  EXPECT_EQ(why.rfind("check golden failed: ", 0), 0u) << why;

  const reports::RunRecord wrong = reports::testing::wrong_check_record();
  const reports::ScenarioRecord& s = wrong.scenarios[2];
  EXPECT_FALSE(expectation_met(s, &why));
  EXPECT_EQ(why,
            "fault not caught: none of the intended checks (allgather_parity, reference) failed; "
            "determinism failed instead");
  EXPECT_EQ(reports::scenario_verdict(s), Verdict::kFail);
  const nlohmann::json j = nlohmann::json::parse(reports::render_json(wrong));
  EXPECT_EQ(j["scenarios"][2]["verdict"], "fail");
  EXPECT_NE(reports::render_junit(wrong).find("<failure message=\"" + why), std::string::npos);
  EXPECT_NE(reports::render_markdown(wrong).find("| 1 pass, 1 fail | fail |"), std::string::npos);
}

// MFU of a `meshproof run` scenario on a (fake) H100: the GPU name comes from the probed
// environment, eight virtual ranks on cuda:0 are one device, and MXFP8 on Hopper (cc 9.0) is
// emulated with bf16 GEMMs, so the bf16 peak applies.
TEST(PerformanceInputs, H100PeakAndMfu) {
  reports::EnvironmentRecord env;
  env.gpus.push_back(reports::GpuRecord{0, "NVIDIA H100 80GB HBM3", "9.0", 85899345920, 132});
  Scenario s;  // default model: L=2, H=64, F=256, V=256, S=32, GELU
  s.mesh.dp_replicate = 2;
  s.mesh.dp_shard = 2;
  s.mesh.tp = 2;
  s.recipe = default_recipe(RecipeKind::kMxfp8);
  std::string note;
  reports::PerformanceInputs in = performance_inputs(s, "cuda:0", env, &note);
  EXPECT_EQ(in.gpu_name, "NVIDIA H100 80GB HBM3");
  EXPECT_EQ(in.num_devices, 1);
  EXPECT_EQ(in.gemm_dtype, "bf16");
  EXPECT_EQ(note, "");

  // Five steps of 0.5 s, 8 sequences of 32 tokens each.
  std::vector<reports::StepMetrics> steps(5);
  for (size_t i = 0; i < steps.size(); ++i) {
    steps[i].step = static_cast<int64_t>(i) + 1;
    steps[i].tokens = 256;
    steps[i].time.total_s = 0.5;
  }
  const reports::PerformanceFigures p = reports::compute_performance(steps, in);
  // P_matmul = 2*(3*64*64 + 64*64 + 2*64*256) + 256*64 = 114688; flops = 6*256*114688 +
  // 12*2*32*64*256 = 188743680 per step; / 0.5 s / 1 device = 3.7748736e-4 TFLOP/s.
  EXPECT_EQ(p.model_flops_per_step, 188743680.0);
  EXPECT_EQ(p.num_devices, 1);
  ASSERT_TRUE(p.peak_tflops.has_value());
  EXPECT_EQ(*p.peak_tflops, 989.0);
  EXPECT_EQ(p.peak_source, "table:H100 bf16");
  ASSERT_TRUE(p.mfu.has_value());
  // One division apart from the hand value: 3.7748736e-4 / 989.
  EXPECT_DOUBLE_EQ(*p.mfu, 188743680.0 / 0.5 / 1e12 / 989.0);

  // Per-tensor FP8 runs fp8 GEMMs on Hopper; MXFP8 does on Blackwell (cc 10.0).
  s.recipe = default_recipe(RecipeKind::kDelayed);
  EXPECT_EQ(performance_inputs(s, "cuda:0", env, &note).gemm_dtype, "fp8");
  env.gpus[0] = reports::GpuRecord{0, "NVIDIA B200", "10.0", 0, 148};
  s.recipe = default_recipe(RecipeKind::kMxfp8);
  in = performance_inputs(s, "cuda:0", env, &note);
  EXPECT_EQ(in.gemm_dtype, "fp8");
  EXPECT_EQ(reports::compute_performance(steps, in).peak_tflops, 4500.0);

  // The mpi launcher puts one process on each GPU of the host (two here, for eight ranks).
  env.gpus.push_back(reports::GpuRecord{1, "NVIDIA B200", "10.0", 0, 148});
  s.launcher = Launcher::kMpi;
  EXPECT_EQ(performance_inputs(s, "cuda:0", env, &note).num_devices, 2);

  // A GPU outside the table and the CPU: no MFU, and a note saying why.
  env.gpus = {reports::GpuRecord{0, "NVIDIA GeForce RTX 4090", "8.9", 0, 128}};
  s.launcher = Launcher::kLocal;
  in = performance_inputs(s, "cuda:0", env, &note);
  EXPECT_FALSE(reports::compute_performance(steps, in).mfu.has_value());
  EXPECT_NE(note.find("no dense bf16 peak for NVIDIA GeForce RTX 4090"), std::string::npos);
  // With a calibration (meshproof run measures a bf16 GEMM on such a GPU) the MFU is against it.
  int calibrated = -1;
  in = performance_inputs(s, "cuda:0", env, &note, [&](int device) {
    calibrated = device;
    return std::optional<double>(150.0);
  });
  EXPECT_EQ(calibrated, 0);
  const reports::PerformanceFigures cal = reports::compute_performance(steps, in);
  ASSERT_TRUE(cal.mfu.has_value());
  EXPECT_EQ(cal.peak_source, "calibration");
  EXPECT_DOUBLE_EQ(*cal.mfu, 188743680.0 / 0.5 / 1e12 / 150.0);
  EXPECT_NE(note.find("MFU against a measured bf16 GEMM (150.0 TFLOP/s"), std::string::npos);
  in = performance_inputs(s, "cpu", env, &note);
  EXPECT_EQ(in.num_devices, 1);
  EXPECT_EQ(in.gpu_name, "");
  EXPECT_FALSE(reports::compute_performance(steps, in).mfu.has_value());
  EXPECT_EQ(note, "MFU n/a: the CPU backend has no dense tensor-core peak");

  // The golden's `device` provenance names the GPU.
  EXPECT_EQ(device_description("cuda:0", env), "NVIDIA GeForce RTX 4090 (cuda:0)");
  EXPECT_EQ(device_description("cuda:1", env), "cuda:1");
  EXPECT_EQ(device_description("cpu", env), "cpu");
}

// Live progress covers the checks' own training runs too: the resume check's two halves and the
// determinism rerun each print their steps, labelled, after the main run.
TEST(RunScenarioProgress, ReRunsOfChecksShowTheirSteps) {
  Scenario s;  // the default model (L=2, H=64), 4 steps of 8 sequences on dp_shard=2
  s.name = "progress_probe";
  s.mesh.dp_shard = 2;
  s.train.steps = 4;
  s.train.batch = 8;
  s.checks.resume.enabled = true;
  s.checks.resume.at_step = 2;
  s.checks.determinism = true;
  RunnerOptions opts;
  opts.backend = Backend::kCpu;
  opts.progress = true;
  opts.out_dir = fs::temp_directory_path() / ("meshproof_progress_" + std::to_string(::getpid()));
  std::ostringstream log;
  const reports::ScenarioRecord r = run_scenario(s, opts, reports::EnvironmentRecord{}, log);
  fs::remove_all(opts.out_dir);
  ASSERT_EQ(r.error, "");
  EXPECT_EQ(reports::scenario_verdict(r), Verdict::kPass);
  const std::string text = log.str();
  const size_t main_run = text.find("progress_probe  step 4/4  loss ");
  const size_t resume = text.find("progress_probe [resume]  step 4/4  loss ");
  const size_t again = text.find("progress_probe [determinism]  step 4/4  loss ");
  ASSERT_NE(main_run, std::string::npos) << text;
  ASSERT_NE(resume, std::string::npos) << text;
  ASSERT_NE(again, std::string::npos) << text;
  EXPECT_LT(main_run, resume);
  EXPECT_LT(resume, again);
  EXPECT_NE(text.find("progress_probe [resume]  step 1/4"), std::string::npos);
  // Each run ends by clearing its line, so the next output starts on a clean line.
  EXPECT_EQ(text.substr(text.size() - 4), "\r\033[K");
}

}  // namespace
}  // namespace meshproof::harness
