// The pipelined training step with the real model (docs/design.md section 33): pp stages, each
// running its layers' forward and backward per micro-batch under GPipe or 1F1B with FSDP inside
// the stage, must give the loss, the gradient norm and the final parameters of one stage on the
// same global problem bit for bit (the CPU backend is the bitwise reference): the backwards run
// in micro-batch order, each stage's deferred reduction follows the schedule's last backward,
// the norm adds the per-parameter sums in model order and the loss comes from the last stage.
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <mutex>
#include <set>

#include "engine/config/run_rules.h"
#include "engine/parallel/collective_budget.h"
#include "engine/parallel/shard_plan.h"
#include "engine/pipeline/pipeline.h"
#include "engine/session/session.h"
#include "kernels/core/error.h"
#include "tests/engine/test_config.h"

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

// Tensor parallelism inside the stages: 2 micro-batches under 1F1B, with sequence parallelism
// the vocabulary-parallel embedding and head; the one-stage mesh dp_shard 2 x tp 2 (pp added by
// the test).
Config tp_stage_config(RecipeKind recipe, bool sp) {
  Config c = pp_config(recipe);
  c.model.vocab_parallel = sp;
  c.training.micro_batches = 2;
  c.training.pp_schedule = PpSchedule::kOneFOneB;
  return c;
}
MeshSpec tp_inner_mesh(bool sp) {
  MeshSpec m;
  m.dp_shard = 2;
  m.tp = 2;
  m.sequence_parallel = sp;
  return m;
}

// The recipe's delayed-scaling state after a run's last step: every
// "fp8/<linear>/<role>/{scale,amax_history}" entry of every rank, by key. Each stage holds its own
// linears' entries; the ranks holding a key must hold the same bits (the state is replicated),
// else the key is listed in `disagree`.
struct ScalingState {
  std::mutex mu;
  std::map<std::string, std::vector<float>> values;
  std::set<std::string> disagree;

  // Sets o.after_step to record the state after step `steps`.
  void capture(RunOptions& o, int64_t steps) {
    o.after_step = [this, steps](ShardedState& state, mesh::RankComms&, int64_t done) {
      if (done != steps) return false;
      const std::lock_guard<std::mutex> lock(mu);
      for (const StateEntry& e : state.entries) {
        if (!e.key.starts_with("fp8/")) continue;
        const std::vector<float> v = e.local.to(kernels::Device::cpu()).to_vector<float>();
        const auto [it, fresh] = values.emplace(e.key, v);
        if (!fresh && (it->second.size() != v.size() ||
                       std::memcmp(it->second.data(), v.data(), v.size() * sizeof(float)) != 0))
          disagree.insert(e.key);
      }
      return false;
    };
  }
};

// Both states hold the same keys with the same bits, and the ranks agreed on every key.
void expect_same_scaling(const ScalingState& want, const ScalingState& got,
                         const std::string& ctx) {
  EXPECT_TRUE(want.disagree.empty()) << ctx << ": " << fmt::format("{}", want.disagree);
  EXPECT_TRUE(got.disagree.empty()) << ctx << ": " << fmt::format("{}", got.disagree);
  ASSERT_EQ(got.values.size(), want.values.size()) << ctx;
  for (const auto& [key, v] : want.values) {
    const auto it = got.values.find(key);
    ASSERT_NE(it, got.values.end()) << ctx << ": " << key;
    ASSERT_EQ(it->second.size(), v.size()) << ctx << ": " << key;
    EXPECT_EQ(std::memcmp(it->second.data(), v.data(), v.size() * sizeof(float)), 0)
        << ctx << ": " << key;
  }
}

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

// The block-scaled recipes (MXFP8, 128x128 block scaling, NVFP4 with its random Hadamard
// transform and stochastic rounding keyed by global coordinates) under stages: their quantizers
// keep no state across passes, so the pipelined step is one stage's bit for bit as well; with
// the recipe's low-precision all-gather where it has one (not block: refused by the FSDP rules).
TEST(PipelineTraining, BlockScaledRecipesAreBitwiseOneStage) {
  for (RecipeKind recipe : {RecipeKind::kMxfp8, RecipeKind::kBlock, RecipeKind::kNvfp4}) {
    // Hidden 32 / ffn 64 and 8 rows x 16 positions = 128 tokens per rank and micro-batch: whole
    // MXFP8 (32), NVFP4 (16) and 128-row blocks along every GEMM's K, the wgrad's included.
    TestModel tm;
    tm.layers = 4;
    tm.hidden = 32;
    tm.ffn = 64;
    tm.seq = 16;
    tm.batch = 32;
    tm.recipe = recipe;
    Config c = make_config(tm);
    c.training.micro_batches = 2;
    MeshSpec one;
    one.dp_shard = 2;
    RunOptions ro = run_options(c, one, kSteps);
    ro.fsdp.fp8_all_gather = recipe != RecipeKind::kBlock;
    for (const ConfigIssue& i : check_run(ro)) ADD_FAILURE() << i.key_path << ": " << i.message;
    const RunResult ref = run_training(ro);
    for (const auto& [pp, sched] :
         {std::pair{2, PpSchedule::kGpipe}, std::pair{2, PpSchedule::kOneFOneB},
          std::pair{4, PpSchedule::kOneFOneB}}) {
      RunOptions staged = ro;
      staged.config.training.pp_schedule = sched;
      staged.mesh.pp = pp;
      const std::string ctx =
          fmt::format("recipe {} pp {} {}", recipe_name(recipe), pp, pp_schedule_name(sched));
      ASSERT_TRUE(check_run(staged).empty()) << ctx;
      const RunResult run = run_training(staged);
      ASSERT_EQ(run.final_params.size(), ref.final_params.size()) << ctx;
      expect_same_run(ref, run, ctx);
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
    const Config c = tp_stage_config(RecipeKind::kBf16, sp);
    const MeshSpec one = tp_inner_mesh(sp);
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

// model.pp_layers: an explicit uneven split (pp 2 as [3, 1] and [1, 3], pp 3 as [1, 2, 1]) with
// FSDP inside the stages is still one stage's bits, for both schedules; a split that is not one
// of model.layers over mesh.pp stages is an input error naming model.pp_layers.
TEST(PipelineTraining, ExplicitUnevenSplitIsBitwiseOneStage) {
  Config c = pp_config(RecipeKind::kFp32);
  c.training.micro_batches = 2;
  MeshSpec one;
  one.dp_shard = 2;
  const RunResult ref = run_training(run_options(c, one, 2));
  for (const std::vector<int64_t>& split :
       {std::vector<int64_t>{3, 1}, std::vector<int64_t>{1, 3}, std::vector<int64_t>{1, 2, 1}}) {
    for (PpSchedule sched : {PpSchedule::kGpipe, PpSchedule::kOneFOneB}) {
      Config sc = c;
      sc.model.pp_layers = split;
      sc.training.pp_schedule = sched;
      MeshSpec m = one;
      m.pp = static_cast<int>(split.size());
      const std::string ctx =
          fmt::format("split [{}] {}", fmt::join(split, ", "), pp_schedule_name(sched));
      const RunResult run = run_training(run_options(sc, m, 2));
      ASSERT_EQ(run.final_params.size(), ref.final_params.size()) << ctx;
      expect_same_run(ref, run, ctx);
    }
  }
  // The first stage of [3, 1] holds layers 0-2: its ranks' collective budget is its own.
  Config sc = c;
  sc.model.pp_layers = {3, 1};
  MeshSpec m = one;
  m.pp = 2;
  RunOptions ro = run_options(sc, m, 1);
  std::set<std::string> first_stage_tensors;
  for (const mesh::CollectiveCall& call : expected_collectives(ro, 0, 0))
    first_stage_tensors.insert(call.tensor.substr(0, call.tensor.find(".", 7)));
  EXPECT_TRUE(first_stage_tensors.count("layers.2"))
      << fmt::format("{}", fmt::join(first_stage_tensors, " "));
  EXPECT_FALSE(first_stage_tensors.count("layers.3"));

  const auto issue = [&](std::vector<int64_t> split, int pp) {
    Config bad = c;
    bad.model.pp_layers = std::move(split);
    MeshSpec bm = one;
    bm.pp = pp;
    for (const ConfigIssue& i : check_run(run_options(bad, bm, 1)))
      if (i.key_path == "model.pp_layers") return i.message;
    return std::string();
  };
  EXPECT_EQ(issue({2, 2}, 2), "");
  EXPECT_NE(issue({4}, 2).find("has 1 entries; mesh.pp = 2 needs one per stage"),
            std::string::npos);
  EXPECT_NE(issue({3, 0, 1}, 3).find("every stage needs at least one layer"), std::string::npos);
  EXPECT_NE(issue({2, 1}, 2).find("sums to 3, model.layers = 4"), std::string::npos);
  Config bad = c;
  bad.model.pp_layers = {2, 1};
  m.pp = 2;
  EXPECT_THROW(run_training(run_options(bad, m, 1)), kernels::Error);
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

// Recipe delayed (docs/design.md section 33): each stage updates its own linears' amax histories
// and scales after each of its forwards (input, weight) and backwards (grad_output); both run in
// micro-batch order on every stage, and each role's state is touched only by its own passes, so
// 1F1B's interleaving of forwards and backwards of different micro-batches changes nothing.
// Loss, grad norm, every final parameter and every scaling state (the amax histories and scales
// of every linear, gathered from the stages that hold them) bitwise one stage's: pp 2 and 4 x
// gpipe and 1f1b x dp_shard 1 and 2, then once each with tp 2 (sequence parallel, vocabulary
// parallel) inside the stages, the FP8 all-gather, recompute (whose re-quantization uses the
// scales of its own micro-batch's forward, not the stage's latest) and MoE layers with the
// routing pre-pass.
TEST(PipelineTraining, DelayedScalingIsBitwiseOneStage) {
  // `entries`: the scaling entries of the model (0: not counted here).
  const auto check = [](const RunOptions& base, int pp, PpSchedule sched, const std::string& what,
                        size_t entries = 96) {
    RunOptions ro = base;
    ScalingState want;
    want.capture(ro, kSteps);
    const RunResult ref = run_training(ro);
    ASSERT_EQ(ref.metrics.size(), static_cast<size_t>(kSteps)) << what;
    // Dense: 4 linears x 4 layers x 3 roles x (scale, amax_history).
    if (entries > 0) {
      ASSERT_EQ(want.values.size(), entries) << what;
    }
    ASSERT_FALSE(want.values.empty()) << what;
    ro = base;
    ro.mesh.pp = pp;
    ro.config.training.pp_schedule = sched;
    ScalingState got;
    got.capture(ro, kSteps);
    const RunResult run = run_training(ro);
    const std::string ctx = fmt::format("delayed, {} pp {} {}", what, pp, pp_schedule_name(sched));
    ASSERT_EQ(run.final_params.size(), ref.final_params.size()) << ctx;
    expect_same_run(ref, run, ctx);
    expect_same_scaling(want, got, ctx);
  };
  for (int dp_shard : {1, 2}) {
    MeshSpec one;
    one.dp_shard = dp_shard;
    const RunOptions base = run_options(pp_config(RecipeKind::kDelayed), one, kSteps);
    for (int pp : {2, 4})
      for (PpSchedule sched : {PpSchedule::kGpipe, PpSchedule::kOneFOneB})
        check(base, pp, sched, fmt::format("dp_shard {}", dp_shard));
  }
  check(run_options(tp_stage_config(RecipeKind::kDelayed, true), tp_inner_mesh(true), kSteps), 2,
        PpSchedule::kOneFOneB, "dp_shard 2 x tp 2 sp vocab parallel");
  MeshSpec two;
  two.dp_shard = 2;
  RunOptions gathered = run_options(pp_config(RecipeKind::kDelayed), two, kSteps);
  gathered.fsdp.fp8_all_gather = true;
  check(gathered, 2, PpSchedule::kOneFOneB, "dp_shard 2 fp8_all_gather");
  Config recompute = pp_config(RecipeKind::kDelayed);
  recompute.training.recompute = true;
  check(run_options(recompute, two, kSteps), 2, PpSchedule::kOneFOneB, "dp_shard 2 recompute");
  // MoE layers (every second layer, 4 experts, top 2) with the load-balancing loss over 4
  // micro-batches: the routing pre-pass's forwards update the delayed state and put it back
  // (Fp8Recipe::snapshot/restore) on every stage, as on one stage.
  Config moe = pp_config(RecipeKind::kDelayed);
  moe.model.moe.experts = 4;
  moe.model.moe.top_k = 2;
  moe.model.moe.every = 2;
  moe.model.moe.aux_loss_coef = 0.05;
  check(run_options(moe, two, kSteps), 2, PpSchedule::kOneFOneB, "dp_shard 2 moe aux loss", 0);
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
  // Tied embeddings run (TiedEmbeddings* below), with checkpoint hooks and with a reduction
  // after every micro-batch too; so does recipe delayed, traced too (its scaling state's digests
  // merged over pp: PipelineChecks.Fp8PrimaryWeightDigestsAreOneStages).
  Config tied = c;
  tied.model.tied_embeddings = true;
  EXPECT_EQ(issue(run_options(tied, m, 1)), "");
  RunOptions tied_saving = run_options(tied, m, 1);
  tied_saving.before_start = [](ShardedState&, mesh::RankComms&) {};
  tied_saving.fsdp.sync_each_micro_batch = true;
  EXPECT_TRUE(check_run(tied_saving).empty());
  Config delayed = pp_config(RecipeKind::kDelayed);
  EXPECT_EQ(issue(run_options(delayed, m, 1)), "");
  RunOptions delayed_traced = run_options(delayed, m, 1);
  delayed_traced.trace = true;
  EXPECT_EQ(issue(delayed_traced), "");
  // MoE runs with stages (tests/engine/pipeline/pipeline_moe_test.cc).
  Config moe = c;
  moe.model.moe.experts = 2;
  moe.model.moe.top_k = 1;
  moe.model.moe.aux_loss_coef = 0.01;
  EXPECT_EQ(issue(run_options(moe, m, 1)), "");
  // FP8 primary weight digests, the all-gather parity check and faults are built with stages
  // (pipeline_checks_test.cc, runner.pp_fault.*); an amax reduction over pp is not: the linear
  // lives on one stage.
  RunOptions traced = run_options(pp_config(RecipeKind::kCurrent), m, 1);
  traced.trace = true;
  traced.fsdp.fp8_params = true;
  traced.fsdp.fp8_all_gather = true;
  traced.allgather_parity = true;
  traced.faults.amax_not_reduced = true;
  EXPECT_TRUE(check_run(traced).empty());
  RunOptions amax_over_pp = run_options(pp_config(RecipeKind::kCurrent), m, 1);
  amax_over_pp.faults.amax_group_linear = "layers.*.attn.qkv";
  amax_over_pp.faults.amax_group_dims = "dp_shard+pp";
  bool amax_refused = false;
  for (const ConfigIssue& i : check_run(amax_over_pp))
    amax_refused |=
        i.key_path == "faults" && i.message.find(
                                      "amax_group over dims 'dp_shard+pp' cannot run with pipeline "
                                      "stages") != std::string::npos;
  EXPECT_TRUE(amax_refused);
  EXPECT_THROW(run_training(amax_over_pp), kernels::Error);
  amax_over_pp.faults.amax_group_dims = "dp_shard";
  EXPECT_TRUE(check_run(amax_over_pp).empty());
  // Checkpoint hooks are built with stages (each stage saves and loads its own entries).
  RunOptions saving = run_options(c, m, 1);
  saving.after_step = [](ShardedState&, mesh::RankComms&, int64_t) { return false; };
  saving.before_start = [](ShardedState&, mesh::RankComms&) {};
  EXPECT_EQ(issue(saving), "");
}

// Tied embeddings (docs/design.md section 33): embed.tok is held by the first stage (the
// embedding) and the last (the LM head); each accumulates its part of the gradient over the
// micro-batches (E, H), the two exchange them after the schedule and both reduce E + H, which
// one stage adds once too. pp 2 and 4 (a middle stage holds no copy), both schedules, dp_shard 1
// and 2, fp32 and bf16: loss, grad norm (the tied weight counted once) and every parameter
// bitwise one stage's, every step; the losses after step 0 use both copies (the first stage's
// embedding, the last stage's head), so they also show the copies stay equal.
// The tied model (fp32 and bf16 x dp_shard 1 and 2) on pp 2 and 4 under both schedules, against
// one stage: loss, grad norm and every parameter bitwise, every step; deferred gradient sync or
// a reduction after every micro-batch.
void expect_tied_stages_bitwise_one_stage(bool sync_each_micro_batch) {
  for (RecipeKind recipe : {RecipeKind::kFp32, RecipeKind::kBf16}) {
    for (int dp_shard : {1, 2}) {
      Config c = pp_config(recipe);
      c.model.tied_embeddings = true;
      MeshSpec one;
      one.dp_shard = dp_shard;
      RunOptions ro = run_options(c, one, kSteps);
      ro.fsdp.sync_each_micro_batch = sync_each_micro_batch;
      const RunResult ref = run_training(ro);
      ASSERT_EQ(ref.metrics.size(), static_cast<size_t>(kSteps));
      ASSERT_EQ(ref.final_params.count("lm_head.weight"), 0U);
      for (int pp : {2, 4}) {
        for (PpSchedule sched : {PpSchedule::kGpipe, PpSchedule::kOneFOneB}) {
          RunOptions p = ro;
          p.config.training.pp_schedule = sched;
          p.mesh.pp = pp;
          const std::string ctx =
              fmt::format("tied{}, recipe {} dp_shard {} pp {} {}",
                          sync_each_micro_batch ? ", sync each micro-batch" : "",
                          recipe_name(recipe), dp_shard, pp, pp_schedule_name(sched));
          const RunResult run = run_training(p);
          ASSERT_EQ(run.final_params.size(), ref.final_params.size()) << ctx;
          expect_same_run(ref, run, ctx);
        }
      }
    }
  }
}

TEST(PipelineTraining, TiedEmbeddingsAreBitwiseOneStage) {
  expect_tied_stages_bitwise_one_stage(false);
}

// Which stages hold a tied embed.tok (stage_holds) and which copy is counted and reported
// (stage_reports): pp 3 of 4 layers, the first and the last stage hold it, the middle one not;
// only the first stage's copy is reported. Untied, the embeddings stay on the first stage and
// lm_head on the last.
TEST(PipelineTraining, TiedEmbeddingIsHeldByBothEndStages) {
  for (bool tied : {false, true}) {
    Config c = pp_config(RecipeKind::kFp32);
    c.model.tied_embeddings = tied;
    for (const ParamSpec& spec : param_specs(c.model)) {
      if (spec.unit != kRootUnit) continue;
      EXPECT_EQ(spec.tied_head, tied && spec.name == "embed.tok") << spec.name;
      for (int s = 0; s < 3; ++s) {
        const StageLayers span = stage_layers(4, 3, s);
        // The test names the ends independently of the spec's `end` field, which places them.
        const bool embed = spec.name.starts_with("embed.");
        EXPECT_EQ(spec.end == ModelEnd::kInput, embed) << spec.name;
        const bool holds = embed ? s == 0 || (spec.tied_head && s == 2) : s == 2;
        EXPECT_EQ(stage_holds(spec, span), holds) << spec.name << " stage " << s;
        EXPECT_EQ(stage_reports(spec, span), embed ? s == 0 : s == 2)
            << spec.name << " stage " << s;
      }
    }
  }
}

// Tied embeddings with tensor parallelism inside the stages (pp 2 x dp_shard 2 x tp 2): the
// tp-replicated embed.tok, and the vocabulary-parallel one (its rows split over tp on both end
// stages) under sequence parallelism, whose parts are partial sums over tp reduced after E + H.
// Traced: every step's gradient and weight digests hash for hash (one copy of embed.tok each).
TEST(PipelineTraining, TiedEmbeddingsWithTensorParallelInsideStages) {
  for (bool sp : {false, true}) {
    Config c = tp_stage_config(RecipeKind::kFp32, sp);
    c.model.tied_embeddings = true;
    const MeshSpec one = tp_inner_mesh(sp);
    RunOptions ro = run_options(c, one, 2);
    ro.trace = true;
    const RunResult ref = run_training(ro);
    ro.mesh.pp = 2;
    const RunResult run = run_training(ro);
    const std::string ctx =
        sp ? "tied, pp 2 x dp_shard 2 x tp 2, sp, vocab parallel" : "tied, pp 2 x tp 2";
    ASSERT_EQ(run.final_params.size(), ref.final_params.size()) << ctx;
    expect_same_run(ref, run, ctx);
    ASSERT_EQ(run.trace.size(), ref.trace.size()) << ctx;
    for (size_t step = 0; step < ref.trace.size(); ++step) {
      ASSERT_EQ(run.trace[step].size(), ref.trace[step].size()) << ctx << " step " << step;
      for (size_t i = 0; i < ref.trace[step].size(); ++i)
        EXPECT_EQ(run.trace[step][i].hash, ref.trace[step][i].hash)
            << ctx << " " << ref.trace[step][i].name << " step " << step;
    }
  }
}

// pp_tied_embedding_grad_not_synced: the end stages skip the exchange, so the first stage's copy
// is updated with the embedding's part only and the last stage's with the head's. Step 0's loss
// is still one stage's (the forward precedes the update), every later one differs, and the
// reported (first stage's) embed.tok differs; the same run without the fault (the negative
// control) is one stage's bit for bit (TiedEmbeddingsAreBitwiseOneStage covers it too).
// Deferred sync and fsdp.sync_each_micro_batch (the per-micro-batch parts exchanged after the
// schedule).
TEST(PipelineTraining, TiedEmbeddingGradNotSyncedIsSeen) {
  for (bool each : {false, true}) {
    Config c = pp_config(RecipeKind::kFp32);
    c.model.tied_embeddings = true;
    c.training.pp_schedule = PpSchedule::kOneFOneB;
    MeshSpec one;
    one.dp_shard = 2;
    RunOptions ro = run_options(c, one, kSteps);
    ro.fsdp.sync_each_micro_batch = each;
    const RunResult ref = run_training(ro);
    const std::string ctx = each ? "sync each micro-batch" : "deferred sync";
    ro.mesh.pp = 2;
    const RunResult clean = run_training(ro);
    expect_same_run(ref, clean, "tied pp 2, no fault, " + ctx);
    ro.faults.pp_tied_embedding_grad_not_synced = true;
    const RunResult bad = run_training(ro);
    ASSERT_EQ(bad.metrics.size(), static_cast<size_t>(kSteps)) << ctx;
    EXPECT_EQ(bad.metrics[0].loss, ref.metrics[0].loss) << ctx;
    // The norm of step 0 counts the first stage's gradient, E alone.
    EXPECT_NE(bad.metrics[0].grad_norm, ref.metrics[0].grad_norm) << ctx;
    for (int64_t s = 1; s < kSteps; ++s)
      EXPECT_NE(bad.metrics[static_cast<size_t>(s)].loss, ref.metrics[static_cast<size_t>(s)].loss)
          << ctx << " step " << s;
    EXPECT_NE(bad.final_params.at("embed.tok").to_vector<float>(),
              ref.final_params.at("embed.tok").to_vector<float>())
        << ctx;
  }
}

// Each end stage allocates only the tied embedding's gradient accumulator it uses (the first
// stage embed.tok's, the last stage the head's kTiedHeadGrad), so a tied model's stages need no
// more memory than an untied one's, whose last stage holds lm_head.weight's [V, H] accumulator in
// the same place: pp 2 x dp_shard 2, bf16, vocab 256, each rank's peak (the memory tracker's
// high-water mark, the per-stage report's peak_bytes) tied <= untied. Measured 2026-11-25 on the
// CPU backend: first stage 151744 bytes both, last stage 163488 tied vs 163552 untied; with the
// last stage also allocating embed.tok's accumulator (which stayed zero) it was 179872, V x H x 4
// = 16384 bytes more, and this test fails.
TEST(PipelineTraining, TiedEmbeddingEndStagesAllocateOnlyTheirAccumulator) {
  std::map<bool, RunResult> runs;
  for (bool tied : {false, true}) {
    Config c = pp_config(RecipeKind::kBf16);
    c.model.vocab = 256;
    c.model.tied_embeddings = tied;
    MeshSpec m;
    m.dp_shard = 2;
    m.pp = 2;
    runs[tied] = run_training(run_options(c, m, 2));
  }
  ASSERT_EQ(runs[true].ranks.size(), 4U);
  ASSERT_EQ(runs[false].ranks.size(), 4U);
  for (size_t r = 0; r < 4; ++r) {
    const RankReport& tied = runs[true].ranks[r];
    const RankReport& untied = runs[false].ranks[r];
    ASSERT_EQ(tied.pipeline.stage, untied.pipeline.stage);
    EXPECT_GT(tied.memory.peak, 0) << "rank " << r;
    EXPECT_LE(tied.memory.peak, untied.memory.peak)
        << "rank " << r << " stage " << tied.pipeline.stage;
  }
}

// Tied embeddings with fsdp.sync_each_micro_batch (docs/design.md section 33): one stage reduces
// E_i + H_i after each micro-batch's backward; the end stages keep each micro-batch's unreduced
// part, exchange them after the schedule and reduce E_i + H_i in micro-batch order then (every
// other parameter still reduces per micro-batch). fp32 and bf16 x dp_shard 1 and 2 x pp 2 and 4
// x gpipe and 1f1b: loss, grad norm and every parameter bitwise one stage's.
TEST(PipelineTraining, TiedEmbeddingsWithSyncEachMicroBatchAreBitwiseOneStage) {
  expect_tied_stages_bitwise_one_stage(true);
}

}  // namespace
}  // namespace meshproof::engine
