#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <utility>
#include <vector>

#include "engine/model/trainer.h"
#include "engine/optim/optimizer.h"
#include "kernels/core/error.h"

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

// PyTorch's SequentialLR([LinearLR(start_factor=1/(W+1), total_iters=W),
// CosineAnnealingLR(T_max=N-1-W, eta_min=min_lr)], milestones=[W]), written out from the
// schedulers' closed forms (docs/scenarios.md): the peak is used at step W only and min_lr at the
// last step N-1.
double sequential_lr(double lr, double min_lr, int64_t w, int64_t n, int64_t s) {
  if (s < w) {
    const double start = 1.0 / static_cast<double>(w + 1);  // LinearLR start_factor
    return lr * (start + (1.0 - start) * static_cast<double>(s) / static_cast<double>(w));
  }
  const double t_max = static_cast<double>(n - 1 - w);
  return min_lr + (lr - min_lr) * (1.0 + std::cos(M_PI * static_cast<double>(s - w) / t_max)) / 2;
}

TEST(Optimizer, Schedules) {
  TrainingConfig t;
  t.lr = 1.0;
  t.min_lr = 0.1;
  t.steps = 10;
  EXPECT_EQ(learning_rate(t, 7), 1.0);
  t.schedule = LrSchedule::kWarmupCosine;
  t.warmup_steps = 2;
  // Warmup (s+1)/(W+1): 1/3, 2/3; the peak once at s = W = 2, then strictly down to min_lr at
  // s = 9 (T_max = 7).
  EXPECT_DOUBLE_EQ(learning_rate(t, 0), 1.0 / 3.0);
  EXPECT_DOUBLE_EQ(learning_rate(t, 1), 2.0 / 3.0);
  EXPECT_EQ(learning_rate(t, 2), 1.0);
  EXPECT_LT(learning_rate(t, 3), 1.0);
  EXPECT_DOUBLE_EQ(learning_rate(t, 3), 0.1 + 0.9 * (1 + std::cos(M_PI / 7)) / 2);
  EXPECT_NEAR(learning_rate(t, 9), 0.1, 1e-16);  // min_lr at the last step (cos(pi) = -1 exactly)
  EXPECT_EQ(clip_coefficient(0.5, 1.0), 1.0);
  EXPECT_DOUBLE_EQ(clip_coefficient(4.0, 1.0), 1.0 / (4.0 + 1e-6));
  EXPECT_EQ(clip_coefficient(4.0, 0.0), 1.0);
}

// Every step of several (W, N) pairs against the SequentialLR formula. Tolerance 4 ulp-scale
// (1e-15 relative): the engine evaluates the same closed forms in a different order.
TEST(Optimizer, WarmupCosineMatchesSequentialLinearCosine) {
  for (const auto& [w, n] : std::vector<std::pair<int64_t, int64_t>>{
           {0, 2}, {0, 10}, {1, 3}, {2, 8}, {5, 20}, {3, 5}, {8, 10}}) {
    TrainingConfig t;
    t.schedule = LrSchedule::kWarmupCosine;
    t.lr = 3e-3;
    t.min_lr = 1e-4;
    t.steps = n;
    t.warmup_steps = w;
    int peaks = 0;
    for (int64_t s = 0; s < n; ++s) {
      const double want = sequential_lr(t.lr, t.min_lr, w, n, s);
      EXPECT_NEAR(learning_rate(t, s), want, 1e-15 * want) << "W " << w << " N " << n << " s " << s;
      peaks += learning_rate(t, s) == t.lr;
      if (s > 0 && s <= w) {
        EXPECT_GT(learning_rate(t, s), learning_rate(t, s - 1));
      }
      if (s > w) {
        EXPECT_LT(learning_rate(t, s), learning_rate(t, s - 1));
      }
    }
    EXPECT_EQ(peaks, 1) << "W " << w << " N " << n;  // the peak lr is used exactly once
    EXPECT_NEAR(learning_rate(t, n - 1), t.min_lr, 1e-18) << "W " << w << " N " << n;
  }
}

// The cosine phase needs T_max = steps - 1 - warmup_steps >= 1.
TEST(Optimizer, WarmupCosineNeedsACosineStep) {
  Config c = small();
  c.training.schedule = LrSchedule::kWarmupCosine;
  c.training.steps = 4;
  c.training.warmup_steps = 2;
  EXPECT_NO_THROW(validate(c));
  for (int64_t w : {3, 4}) {
    c.training.warmup_steps = w;
    try {
      validate(c);
      ADD_FAILURE() << "warmup_steps " << w << " accepted";
    } catch (const kernels::Error& e) {
      EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
      EXPECT_NE(e.message().find("must be <= training.steps - 2 = 2"), std::string::npos)
          << e.message();
    }
  }
  c.training.steps = 1;
  c.training.warmup_steps = 0;
  EXPECT_THROW(validate(c), kernels::Error);
}

// A training run reports the schedule's lr per step.
TEST(Optimizer, TrainerUsesTheSchedule) {
  Config c = small();
  c.training.schedule = LrSchedule::kWarmupCosine;
  c.training.steps = 6;
  c.training.warmup_steps = 2;
  c.training.min_lr = 1e-4;
  Trainer tr(c);
  for (int64_t s = 0; s < 6; ++s) EXPECT_EQ(tr.step().lr, learning_rate(c.training, s)) << s;
  EXPECT_NEAR(learning_rate(c.training, 5), 1e-4, 1e-18);
}

}  // namespace
}  // namespace meshproof::engine

namespace meshproof::engine {
namespace {

// bf16 recipe against fp32 on the same model and data: bf16 compute weights and activations
// (8-bit mantissa, relative rounding 2^-9 = 2e-3 per value) with fp32 accumulation and fp32
// master weights. Measured on this configuration: worst per-step loss rel difference 1.1e-3 over
// 20 steps, step-0 gradients norm-wise rel <= 6.5e-3 per tensor. Bounds: 5e-3 on losses and 3e-2
// on gradients (about 4.5x the measurement, under the 1e-2 loss bound docs/design.md section 8
// gives bf16 across meshes).
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
