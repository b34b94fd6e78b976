#include <gtest/gtest.h>

#include <cmath>

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
