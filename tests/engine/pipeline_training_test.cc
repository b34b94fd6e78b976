// The pipelined training step with the real model (docs/design.md section 33): pp stages, each
// running its layers' forward and backward per micro-batch under GPipe or 1F1B with FSDP inside
// the stage, must give the loss, the gradient norm and the final parameters of one stage on the
// same global problem bit for bit (the CPU backend is the bitwise reference): the backwards run
// in micro-batch order, each stage's deferred reduction follows the schedule's last backward,
// the norm adds the per-parameter sums in model order and the loss comes from the last stage.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "engine/collective_budget.h"
#include "engine/pipeline.h"
#include "engine/run_rules.h"
#include "engine/session.h"
#include "kernels/error.h"
#include "test_config.h"

namespace meshproof::engine {
namespace {

using testing::expect_same_run;
using testing::make_config;
using testing::run_options;
using testing::TestModel;

// 4 layers (so pp 2 and 4 both split them), 4 micro-batches of 2 rows (dp_shard 1) or 1 row per
// data rank (dp_shard 2), 3 steps: small enough for every recipe and schedule below.
Config pp_config(RecipeKind recipe) {
  TestModel tm;
  tm.layers = 4;
  tm.recipe = recipe;
  Config c = make_config(tm);
  c.training.micro_batches = 4;
  return c;
}

constexpr int64_t kSteps = 3;

TEST(PipelineTraining, StagesAreBitwiseOneStageForEveryScheduleAndFsdp) {
  for (RecipeKind recipe : {RecipeKind::kFp32, RecipeKind::kBf16, RecipeKind::kCurrent}) {
    for (int dp_shard : {1, 2}) {
      Config c = pp_config(recipe);
      MeshSpec one;
      one.dp_shard = dp_shard;
      const RunResult ref = run_training(run_options(c, one, kSteps));
      ASSERT_EQ(ref.metrics.size(), static_cast<size_t>(kSteps));
      for (int pp : {2, 4}) {
        for (PpSchedule sched : {PpSchedule::kGpipe, PpSchedule::kOneFOneB}) {
          c.training.pp_schedule = sched;
          MeshSpec m = one;
          m.pp = pp;
          const std::string ctx = fmt::format("recipe {} dp_shard {} pp {} {}", recipe_name(recipe),
                                              dp_shard, pp, pp_schedule_name(sched));
          const RunResult run = run_training(run_options(c, m, kSteps));
          ASSERT_EQ(run.final_params.size(), ref.final_params.size()) << ctx;
          expect_same_run(ref, run, ctx);
          // Every rank (every stage) is reported.
          EXPECT_EQ(run.ranks.size(), static_cast<size_t>(pp * dp_shard)) << ctx;
        }
      }
    }
  }
}

// An uneven split (5 layers over 2 stages: [3, 2]) with HSDP inside the stages, recompute and
// reduce-after-every-micro-batch: still one stage's bits.
TEST(PipelineTraining, UnevenSplitHsdpRecomputeAndSyncEachMicroBatch) {
  TestModel tm;
  tm.layers = 5;
  tm.recipe = RecipeKind::kBf16;
  Config c = make_config(tm);
  c.training.micro_batches = 2;
  c.training.recompute = true;
  c.training.pp_schedule = PpSchedule::kOneFOneB;
  MeshSpec one;
  one.dp_replicate = 2;
  one.dp_shard = 2;
  RunOptions ro = run_options(c, one, 2);
  ro.fsdp.sync_each_micro_batch = true;
  ro.fsdp.reshard_after_forward = false;
  ro.trace = true;
  const RunResult ref = run_training(ro);
  ro.mesh.pp = 2;
  const RunResult run = run_training(ro);
  ASSERT_EQ(run.final_params.size(), ref.final_params.size());
  expect_same_run(ref, run, "pp 2 of 5 layers, hsdp 2x2, recompute, sync each micro-batch");
  // The per-step digests cover every stage's gradients and weights in canonical order.
  ASSERT_EQ(run.trace.size(), ref.trace.size());
  for (size_t step = 0; step < ref.trace.size(); ++step) {
    ASSERT_EQ(run.trace[step].size(), ref.trace[step].size()) << step;
    for (size_t i = 0; i < ref.trace[step].size(); ++i) {
      EXPECT_EQ(run.trace[step][i].name, ref.trace[step][i].name) << step;
      EXPECT_EQ(run.trace[step][i].hash, ref.trace[step][i].hash) << ref.trace[step][i].name;
    }
  }
}

// Tensor parallelism inside the stages (pp 2 x dp_shard 2 x tp 2, 8 ranks), with sequence
// parallelism and the vocabulary-parallel embedding and head: the residual stream crosses stages
// as each tp rank's sequence shard; still one stage's bits.
TEST(PipelineTraining, TensorAndSequenceParallelInsideStages) {
  for (bool sp : {false, true}) {
    Config c = pp_config(RecipeKind::kBf16);
    c.model.vocab_parallel = sp;
    c.training.micro_batches = 2;
    c.training.pp_schedule = PpSchedule::kOneFOneB;
    MeshSpec one;
    one.dp_shard = 2;
    one.tp = 2;
    one.sequence_parallel = sp;
    const RunResult ref = run_training(run_options(c, one, 2));
    MeshSpec m = one;
    m.pp = 2;
    const RunResult run = run_training(run_options(c, m, 2));
    ASSERT_EQ(run.final_params.size(), ref.final_params.size());
    expect_same_run(ref, run, sp ? "pp 2 x dp_shard 2 x tp 2, sp, vocab parallel" : "pp 2 x tp 2");
  }
}

// The collective budget with stages (docs/design.md section 29): every rank records exactly its
// own stage's parameter collectives, FP8 gathers and amax reductions included (pp 2 x dp_shard 2
// x tp 2 with sequence parallelism, 1F1B, current scaling, FP8 all-gather); with the first
// stage's last backward skipping its deferred reduction (pp_last_backward_sync_skipped) that
// stage's ranks miss their reduce-scatters and the budget sees it.
TEST(PipelineTraining, RecordedCollectivesAreTheStagesBudget) {
  const auto sorted_strings = [](const std::vector<mesh::CollectiveCall>& calls) {
    std::vector<std::string> out;
    for (const mesh::CollectiveCall& c : calls)
      out.push_back(fmt::format("{} {}", c.step, mesh::describe(c)));
    std::sort(out.begin(), out.end());
    return out;
  };
  Config c = pp_config(RecipeKind::kCurrent);
  c.training.micro_batches = 2;
  c.training.pp_schedule = PpSchedule::kOneFOneB;
  MeshSpec m;
  m.pp = 2;
  m.dp_shard = 2;
  m.tp = 2;
  m.sequence_parallel = true;
  RunOptions ro = run_options(c, m, 2);
  ro.fsdp.fp8_all_gather = true;
  ro.record_collectives = true;
  for (bool fault : {false, true}) {
    ro.faults.pp_last_backward_sync_skipped = fault;
    const RunResult run = run_training(ro);
    ASSERT_EQ(run.ranks.size(), 8U);
    for (const RankReport& r : run.ranks) {
      std::vector<mesh::CollectiveCall> expected;
      for (int64_t step = 0; step < 2; ++step)
        for (mesh::CollectiveCall& e : expected_collectives(ro, r.rank, step))
          expected.push_back(std::move(e));
      ASSERT_FALSE(expected.empty()) << r.rank;
      const bool first_stage = r.rank < 4;
      if (!fault || !first_stage)
        EXPECT_EQ(sorted_strings(r.calls), sorted_strings(expected))
            << "rank " << r.rank << (fault ? " (fault on the first stage only)" : "");
      else
        EXPECT_LT(r.calls.size(), expected.size()) << "rank " << r.rank;
    }
  }
}

// The per-stage report's measurements (docs/design.md section 38): every rank of a pp 2 x
// dp_shard 2 run reports its stage, its layers and one PipelineStepTime per step, each time
// non-negative and the disjoint parts within the step (structure and consistency only: no
// wall-clock value is asserted beyond "the phase ran"); a one-stage run reports none.
TEST(PipelineTraining, StepTimesPerRankAndStage) {
  for (PpSchedule sched : {PpSchedule::kGpipe, PpSchedule::kOneFOneB}) {
    Config c = pp_config(RecipeKind::kBf16);
    c.training.pp_schedule = sched;
    MeshSpec m;
    m.pp = 2;
    m.dp_shard = 2;
    const RunResult run = run_training(run_options(c, m, kSteps));
    ASSERT_EQ(run.ranks.size(), 4U);
    for (const RankReport& r : run.ranks) {
      const std::string ctx = fmt::format("{} rank {}", pp_schedule_name(sched), r.rank);
      // rank = i_pp * dp_shard + i_shard: ranks 0, 1 hold layers 0-1, ranks 2, 3 layers 2-3.
      EXPECT_EQ(r.pipeline.stage, r.rank / 2) << ctx;
      EXPECT_EQ(r.pipeline.first_layer, 2 * (r.rank / 2)) << ctx;
      EXPECT_EQ(r.pipeline.layers, 2) << ctx;
      ASSERT_EQ(r.pipeline.steps.size(), static_cast<size_t>(kSteps)) << ctx;
      for (const PipelineStepTime& t : r.pipeline.steps) {
        // Every phase ran (a pass, a receive, a reduce-scatter over dp_shard, AdamW: each takes
        // more than the clock's nanosecond), so each is positive.
        for (double v : {t.forward, t.backward, t.p2p_wait, t.reduction, t.optimizer, t.total})
          EXPECT_GT(v, 0) << ctx;
        // The parts are disjoint intervals of the step. Relative 1e-9: the seconds are sums of
        // nanosecond counts scaled to double (rounding ~1e-16 per term), never a timing margin.
        const double parts = t.forward + t.backward + t.p2p_wait + t.reduction + t.optimizer;
        EXPECT_LE(parts, t.total * (1 + 1e-9)) << ctx;
      }
    }
  }
  MeshSpec one;
  one.dp_shard = 2;
  const RunResult flat = run_training(run_options(pp_config(RecipeKind::kBf16), one, 1));
  for (const RankReport& r : flat.ranks) EXPECT_TRUE(r.pipeline.steps.empty()) << r.rank;
}

// What pipeline stages do not support is an input error before any work, naming mesh.pp.
TEST(PipelineTraining, UnsupportedCombinationsAreRefused) {
  const auto issue = [](const RunOptions& o) {
    for (const ConfigIssue& i : check_run(o))
      if (i.key_path == "mesh.pp") return i.message;
    return std::string();
  };
  MeshSpec m;
  m.pp = 2;
  Config c = pp_config(RecipeKind::kBf16);
  EXPECT_EQ(issue(run_options(c, m, 1)), "");
  MeshSpec too_many = m;
  too_many.pp = 5;
  EXPECT_NE(issue(run_options(c, too_many, 1)).find("exceeds model.layers = 4"), std::string::npos);
  Config tied = c;
  tied.model.tied_embeddings = true;
  EXPECT_NE(issue(run_options(tied, m, 1)).find("tied_embeddings"), std::string::npos);
  Config delayed = pp_config(RecipeKind::kDelayed);
  EXPECT_NE(issue(run_options(delayed, m, 1)).find("recipe delayed"), std::string::npos);
  Config moe = c;
  moe.model.moe.experts = 2;
  moe.model.moe.top_k = 1;
  EXPECT_NE(issue(run_options(moe, m, 1)).find("model.moe"), std::string::npos);
  RunOptions traced = run_options(c, m, 1);
  traced.trace = true;
  traced.fsdp.fp8_params = true;
  EXPECT_NE(issue(traced).find("tensor digests"), std::string::npos);
  RunOptions saving = run_options(c, m, 1);
  saving.after_step = [](ShardedState&, mesh::RankComms&, int64_t) { return false; };
  EXPECT_NE(issue(saving).find("checkpoints"), std::string::npos);
  // The session refuses them too (the constructor runs the same rules).
  EXPECT_THROW(run_training(run_options(tied, m, 1)), kernels::Error);
}

}  // namespace
}  // namespace meshproof::engine
