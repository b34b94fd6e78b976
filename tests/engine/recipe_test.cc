// FP8 recipes (DESIGN.md section 4) applied to the qkv/proj/fc1/fc2 GEMMs: tracking the fp32
// reference, training toward the entropy floor, determinism, recompute with delayed scaling, and
// the amax hook.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <map>
#include <string>

#include "engine/trainer.h"

namespace meshproof::engine {
namespace {

Config fp8_config(RecipeKind kind) {
  Config c;
  c.model.vocab = 32;
  c.model.hidden = 32;  // multiples of 32 for MXFP8 blocks
  c.model.heads = 4;
  c.model.layers = 1;
  c.model.ffn = 64;
  c.model.max_positions = 16;
  c.training.batch = 4;
  c.training.seq_len = 16;  // M = 64 rows
  c.training.lr = 1e-2;
  c.data.decay = 0.3;
  c.seed = 21;
  // The data stream these tests' measured bounds were taken on (keyed by Config::seed before
  // data.seed existed).
  c.data.seed = 21;
  c.recipe.kind = kind;
  c.recipe.amax_history_len = 16;
  return c;
}

class Fp8RecipeTest : public ::testing::TestWithParam<RecipeKind> {};

// Per-step loss against fp32 over 20 steps and progress toward the floor over 40 steps.
// Measured worst per-step loss rel difference to fp32 (20 steps, this configuration): current
// 1.2e-2, delayed 1.3e-2, mxfp8 6.3e-3, block 6.3e-3 (FP8 rounding of 3-bit-mantissa operands,
// up to 6% per element, averaged over K; trajectories drift as AdamW amplifies the differences;
// mxfp8 and block agree because E4M3 rounding is invariant under their power-of-2 scales).
// Bound 4e-2 (about 3x the worst measurement); an FP8 recipe that breaks scaling (wrong scale
// inverse, transposed copy mixed up) moves the loss by far more.
TEST_P(Fp8RecipeTest, TracksFp32AndLearns) {
  Config c = fp8_config(GetParam());
  Trainer ref(fp8_config(RecipeKind::kFp32)), t(c);
  const double floor = t.data().entropy_rate();
  double worst = 0, first = 0, last = 0;
  for (int s = 0; s < 40; ++s) {
    const double lq = t.step().loss;
    const double lr = ref.step().loss;
    if (s < 20) worst = std::max(worst, std::abs(lq - lr) / lr);
    if (s == 0) first = lq;
    last = lq;
  }
  std::printf("%s: worst loss rel vs fp32 over 20 steps %.3e; loss %.4f -> %.4f (floor %.4f)\n",
              std::string(recipe_name(GetParam())).c_str(), worst, first, last, floor);
  EXPECT_LT(worst, 4e-2);
  EXPECT_GT(worst, 0.0);  // the recipe really quantized
  // Same progress criterion as the fp32/bf16 training tests.
  EXPECT_LT(last, first - 0.5 * (first - floor));
  EXPECT_GT(last, floor - 0.3);
}

TEST_P(Fp8RecipeTest, TwoRunsAreBitwiseEqual) {
  Config c = fp8_config(GetParam());
  Trainer a(c), b(c);
  for (int s = 0; s < 3; ++s) EXPECT_EQ(a.step().loss, b.step().loss);
  for (const std::string& n : a.params().names())
    EXPECT_EQ(a.params().at(n).to_vector<float>(), b.params().at(n).to_vector<float>()) << n;
}

// Recompute re-quantizes the forward tensors with the scales the forward used (delayed scaling
// has already advanced its window by then), so it is bitwise equal to storing activations.
TEST_P(Fp8RecipeTest, RecomputeIsBitwiseEqual) {
  Config c = fp8_config(GetParam());
  c.model.dropout = 0.1;
  Trainer a(c);
  c.training.recompute = true;
  Trainer b(c);
  for (int s = 0; s < 3; ++s) {
    const StepMetrics ma = a.step(), mb = b.step();
    EXPECT_EQ(ma.loss, mb.loss);
    EXPECT_EQ(ma.grad_norm, mb.grad_norm);
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, Fp8RecipeTest,
                         ::testing::Values(RecipeKind::kCurrent, RecipeKind::kDelayed,
                                           RecipeKind::kMxfp8, RecipeKind::kBlock),
                         [](const auto& info) { return std::string(recipe_name(info.param)); });

TEST(DelayedScaling, ScalesStartAtOneAndFollowTheAmaxHistory) {
  Config c = fp8_config(RecipeKind::kDelayed);
  int64_t reductions = 0;
  CommHooks hooks;
  hooks.reduce_amax = [&reductions](const std::string&, Fp8Role, float*, int64_t n) {
    reductions += n;
  };
  Trainer t(c, hooks);
  t.step();
  auto& states = t.recipe().delayed_states();
  // qkv, proj, fc1, fc2 x (input, weight, grad_output) for one layer.
  ASSERT_EQ(states.size(), 12u);
  // One reduction per state after its pass.
  EXPECT_EQ(reductions, 12);
  for (auto& [key, st] : states) {
    // After step 0 the scale is fp8_max / amax of that step (margin 0), no longer 1.
    const float scale = st.scale.to_vector<float>()[0];
    const float amax = st.amax_history.to_vector<float>().back();  // newest entry
    const bool grad = key.find("grad_output") != std::string::npos;
    const float fp8_max = grad ? 57344.0f : 448.0f;
    EXPECT_GT(amax, 0.0f) << key;
    EXPECT_EQ(scale, fp8_max / amax) << key;
  }
}

TEST(CurrentScaling, AmaxGoesThroughTheHook) {
  Config c = fp8_config(RecipeKind::kCurrent);
  int64_t calls = 0;
  std::map<std::string, int> per_tensor;  // "<linear>/<role>" -> calls
  CommHooks hooks;
  hooks.reduce_amax = [&](const std::string& linear, Fp8Role role, float* amax, int64_t n) {
    EXPECT_EQ(n, 1);
    EXPECT_GE(*amax, 0.0f);
    ++per_tensor[linear + "/" + std::string(fp8_role_name(role))];
    ++calls;
  };
  Trainer t(c, hooks);
  t.step();
  // Forward: X and W of 4 linears; backward: dY of 4 linears; each named once.
  EXPECT_EQ(calls, 12);
  EXPECT_EQ(per_tensor.size(), 12u);
  for (const char* l : {"attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"})
    for (const char* r : {"input", "weight", "grad_output"})
      EXPECT_EQ(per_tensor[fmt::format("layers.0.{}/{}", l, r)], 1) << l << "/" << r;
}

TEST(Mxfp8, RejectsDimsThatAreNotMultiplesOf32) {
  Config c = fp8_config(RecipeKind::kMxfp8);
  c.model.hidden = 48;
  c.model.heads = 4;
  try {
    validate(c);
    FAIL();
  } catch (const kernels::Error& e) {
    EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
    EXPECT_NE(e.message().find("model.hidden % 32"), std::string::npos) << e.message();
  }
  c = fp8_config(RecipeKind::kMxfp8);
  c.training.seq_len = 12;
  EXPECT_THROW(validate(c), kernels::Error);
}

}  // namespace
}  // namespace meshproof::engine
