// The run comparisons (harness/checks/checks.h): ULP distances, the bitwise comparison
// (determinism, same-mesh resume), the tolerance comparison (reference, cross-mesh resume) and the
// first diverging traced tensor, judged against rtol or against a fault-free control's noise
// floors.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <limits>

#include "harness/checks/checks.h"
#include "kernels/core/tensor.h"
#include "runner_test_builders.h"

namespace meshproof::harness {
namespace {

namespace fs = std::filesystem;
using reports::Verdict;
using namespace test;

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

}  // namespace
}  // namespace meshproof::harness
