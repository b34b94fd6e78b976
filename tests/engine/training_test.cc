#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>

#include "engine/optimizer.h"
#include "engine/trainer.h"

namespace meshproof::engine {
namespace {

Config small() {
  Config c;
  c.model.vocab = 16;
  c.model.hidden = 16;
  c.model.heads = 2;
  c.model.layers = 1;
  c.model.ffn = 32;
  c.model.max_positions = 8;
  c.training.batch = 8;
  c.training.seq_len = 8;
  c.training.lr = 1e-2;
  c.data.decay = 0.3;
  c.seed = 3;
  // The data stream these tests' measured bounds were taken on (keyed by Config::seed before
  // data.seed existed).
  c.data.seed = 3;
  return c;
}

TEST(Training, TwoRunsAreBitwiseEqual) {
  Config c = small();
  c.model.dropout = 0.1;
  c.training.micro_batches = 2;
  c.training.weight_decay = 0.1;
  Trainer a(c), b(c);
  for (int s = 0; s < 4; ++s) {
    const StepMetrics ma = a.step(), mb = b.step();
    EXPECT_EQ(ma.loss, mb.loss);
    EXPECT_EQ(ma.grad_norm, mb.grad_norm);
  }
  for (const std::string& n : a.params().names())
    EXPECT_EQ(a.params().at(n).to_vector<float>(), b.params().at(n).to_vector<float>()) << n;
}

TEST(Training, LossDecreasesTowardTheEntropyFloor) {
  Config c = small();
  c.training.steps = 60;
  Trainer t(c);
  const double floor = t.data().entropy_rate();
  const double first = t.step().loss;
  double last = 0;
  for (int s = 1; s < 60; ++s) last = t.step().loss;
  // Start near ln(16) = 2.77 (random init); the floor is ~1.23 nats for decay 0.3. After 60 steps
  // at lr 1e-2 the measured loss is ~1.6: require clear progress and nothing below the floor
  // beyond batch noise (64 positions: sd of the mean ~0.1).
  EXPECT_NEAR(first, std::log(16.0), 0.1);
  EXPECT_LT(last, first - 0.5 * (first - floor));
  EXPECT_GT(last, floor - 0.3);
}

TEST(Optimizer, Schedules) {
  TrainingConfig t;
  t.lr = 1.0;
  t.min_lr = 0.1;
  t.steps = 10;
  EXPECT_EQ(learning_rate(t, 7), 1.0);
  t.schedule = LrSchedule::kWarmupCosine;
  t.warmup_steps = 2;
  EXPECT_DOUBLE_EQ(learning_rate(t, 0), 0.5);
  EXPECT_DOUBLE_EQ(learning_rate(t, 1), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(t, 2), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(t, 6), 0.1 + 0.9 * 0.5);
  EXPECT_NEAR(learning_rate(t, 10), 0.1, 1e-15);
  EXPECT_EQ(clip_coefficient(0.5, 1.0), 1.0);
  EXPECT_DOUBLE_EQ(clip_coefficient(4.0, 1.0), 1.0 / (4.0 + 1e-6));
  EXPECT_EQ(clip_coefficient(4.0, 0.0), 1.0);
}

}  // namespace
}  // namespace meshproof::engine

namespace meshproof::engine {
namespace {

// bf16 recipe against fp32 on the same model and data: bf16 compute weights and activations
// (8-bit mantissa, relative rounding 2^-9 = 2e-3 per value) with fp32 accumulation and fp32
// master weights. Measured on this configuration: worst per-step loss rel difference 1.1e-3 over
// 20 steps, step-0 gradients norm-wise rel <= 6.5e-3 per tensor. Bounds: 5e-3 on losses and 3e-2
// on gradients (about 4.5x the measurement, under the 1e-2 loss bound DESIGN.md section 8 gives
// bf16 across meshes).
TEST(Training, Bf16TracksFp32) {
  Config c = small();
  c.training.steps = 20;
  c.training.weight_decay = 0.01;
  Trainer f32(c);
  c.recipe.kind = RecipeKind::kBf16;
  Trainer b16(c);
  double worst_loss = 0, worst_grad = 0;
  for (int s = 0; s < 20; ++s) {
    TensorMap g32, g16;
    using Observer = std::function<void(int64_t, const TensorMap&)>;
    auto keep = [s](TensorMap& dst) -> Observer {
      if (s != 0) return nullptr;
      return [&dst](int64_t, const TensorMap& g) {
        for (const std::string& n : g.names()) dst.insert(n, g.at(n).clone());
      };
    };
    const StepMetrics a = f32.step(keep(g32));
    const StepMetrics b = b16.step(keep(g16));
    worst_loss = std::max(worst_loss, std::abs(a.loss - b.loss) / a.loss);
    if (s == 0) {
      for (const std::string& n : g32.names()) {
        const auto x = g32.at(n).to_vector<float>(), y = g16.at(n).to_vector<float>();
        double d = 0, r = 0;
        for (size_t k = 0; k < x.size(); ++k) {
          d += std::pow(double(x[k]) - y[k], 2);
          r += double(x[k]) * x[k];
        }
        worst_grad = std::max(worst_grad, std::sqrt(d / r));
      }
    }
  }
  RecordProperty("worst_loss_rel", std::to_string(worst_loss));
  RecordProperty("worst_grad0_rel", std::to_string(worst_grad));
  std::printf("bf16 vs fp32: worst loss rel %.3e, worst step-0 grad rel %.3e\n", worst_loss,
              worst_grad);
  EXPECT_LT(worst_loss, 5e-3);
  EXPECT_LT(worst_grad, 3e-2);
  EXPECT_GT(worst_loss, 0.0);  // bf16 really ran in bf16
}

TEST(Training, Bf16LossDecreasesTowardTheEntropyFloor) {
  Config c = small();
  c.recipe.kind = RecipeKind::kBf16;
  Trainer t(c);
  const double floor = t.data().entropy_rate();
  const double first = t.step().loss;
  double last = 0;
  for (int s = 1; s < 60; ++s) last = t.step().loss;
  // Same bounds as the fp32 test above.
  EXPECT_LT(last, first - 0.5 * (first - floor));
  EXPECT_GT(last, floor - 0.3);
}

}  // namespace
}  // namespace meshproof::engine
