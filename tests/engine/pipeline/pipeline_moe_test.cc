// MoE layers under pipeline stages (docs/design.md section 33, "MoE under stages"): each stage
// runs its MoE layers with FSDP / HSDP / TP / expert parallelism inside the stage as one stage
// does; each layer's load-balancing loss is computed on its stage and the last stage adds every
// layer's, in one stage's order, to the micro-batch's loss sum; with the aux loss over several
// micro-batches the routing pre-pass is a forward-only sweep over the stages. The loss, the
// gradient norm of every step and every final parameter must be bitwise those of pp = 1 on the
// same inner mesh (the CPU backend is the bitwise reference).
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <string>
#include <utility>
#include <vector>

#include "engine/moe/moe.h"
#include "engine/parallel/collective_budget.h"
#include "engine/pipeline/pipeline.h"
#include "engine/session/session.h"
#include "tests/engine/test_config.h"

namespace meshproof::engine {
namespace {

using testing::expect_same_run;
using testing::make_config;
using testing::run_options;
using testing::TestModel;

constexpr int64_t kSteps = 3;

// 4 layers (pp 2 and 4 both split them), 4 experts, top 2, batch 8 of seq 8. `every` 2: layers 0
// and 2 are MoE, so every stage of pp 2 holds one MoE and one dense layer and pp 4 has stages
// without experts; every 1: all four. The aux coefficient is large enough (0.05) for the aux
// terms to move the loss and the router gradients well above rounding (checked below).
Config moe_pp_config(RecipeKind recipe, int64_t every, MoeRouter router, bool shared, bool swiglu,
                     double aux, int64_t micro_batches) {
  TestModel tm;
  tm.layers = 4;
  tm.recipe = recipe;
  Config c = make_config(tm);
  c.model.moe.experts = 4;
  c.model.moe.top_k = 2;
  c.model.moe.every = every;
  c.model.moe.router = router;
  c.model.moe.shared_expert = shared;
  c.model.moe.aux_loss_coef = aux;
  if (swiglu) c.model.activation = Activation::kSwiGlu;
  c.training.micro_batches = micro_batches;
  return c;
}

// Runs `c` on `one` (pp = 1) and on pp stages of the same inner mesh under both schedules, and
// expects every pipelined run bitwise the one-stage run.
void expect_stages_bitwise(Config c, const MeshSpec& one, const std::vector<int>& pps,
                           const std::string& what) {
  const RunResult ref = run_training(run_options(c, one, kSteps));
  ASSERT_EQ(ref.metrics.size(), static_cast<size_t>(kSteps)) << what;
  for (int pp : pps) {
    for (PpSchedule sched : {PpSchedule::kGpipe, PpSchedule::kOneFOneB}) {
      c.training.pp_schedule = sched;
      MeshSpec m = one;
      m.pp = pp;
      const std::string ctx = fmt::format("{}, {}, pp {} {}", what, testing::mesh_case_name(one),
                                          pp, pp_schedule_name(sched));
      const RunResult run = run_training(run_options(c, m, kSteps));
      ASSERT_EQ(run.final_params.size(), ref.final_params.size()) << ctx;
      expect_same_run(ref, run, ctx);
    }
  }
}

// Softmax router, shared expert, MoE on layers 0 and 2, aux loss over 4 micro-batches (the
// routing pre-pass sweeps the stages): fp32, bf16 and current scaling (FP8), FSDP 1 and 2 inside
// the stages, pp 2 and 4, gpipe and 1f1b.
TEST(PipelineMoe, AuxLossOverMicroBatchesIsBitwiseOneStage) {
  for (RecipeKind recipe : {RecipeKind::kFp32, RecipeKind::kBf16, RecipeKind::kCurrent}) {
    const Config c = moe_pp_config(recipe, 2, MoeRouter::kSoftmax, true, false, 0.05, 4);
    ASSERT_TRUE(moe::needs_routing_prepass(c));
    for (int dp_shard : {1, 2}) {
      MeshSpec one;
      one.dp_shard = dp_shard;
      expect_stages_bitwise(c, one, {2, 4},
                            fmt::format("softmax + shared, every 2, {}", recipe_name(recipe)));
    }
  }
}

// Sigmoid router with SwiGLU experts in every layer: the aux loss in one micro-batch (no
// pre-pass: each layer's statistics are its micro-batch's own, summed over the data ranks), and
// no aux loss with 2 micro-batches.
TEST(PipelineMoe, SigmoidSwiGluEveryLayerWithAndWithoutAuxLoss) {
  for (RecipeKind recipe : {RecipeKind::kFp32, RecipeKind::kBf16, RecipeKind::kCurrent}) {
    using AuxCase = std::pair<double, int64_t>;  // aux coefficient, micro-batches
    for (const auto& [aux, mbs] : {AuxCase{0.05, 1}, AuxCase{0.0, 2}}) {
      const Config c = moe_pp_config(recipe, 1, MoeRouter::kSigmoid, false, true, aux, mbs);
      ASSERT_FALSE(moe::needs_routing_prepass(c));
      MeshSpec one;
      one.dp_shard = 2;
      expect_stages_bitwise(c, one, {2, 4},
                            fmt::format("sigmoid + swiglu, aux {} over {} micro-batches, {}", aux,
                                        mbs, recipe_name(recipe)));
    }
  }
}

// Expert parallelism inside the stages: pp 2 x dp_shard 2 x ep 2 (experts split over each
// stage's dp_shard group), HSDP 2 x FSDP 2 x ep 2 (8 ranks), and dp_shard 2 x tp 2 x ep 2 with
// sequence parallelism (the residual stream crosses stages as each tp rank's sequence shard and
// the router sees the gathered rows); aux loss over 2 micro-batches (pre-pass), both routers.
TEST(PipelineMoe, ExpertAndTensorParallelInsideStages) {
  struct Case {
    RecipeKind recipe;
    MoeRouter router;
    int replicate, tp;
    bool sp;
  };
  for (const Case& k : {Case{RecipeKind::kBf16, MoeRouter::kSoftmax, 1, 1, false},
                        Case{RecipeKind::kCurrent, MoeRouter::kSigmoid, 1, 1, false},
                        Case{RecipeKind::kFp32, MoeRouter::kSoftmax, 2, 1, false},
                        Case{RecipeKind::kBf16, MoeRouter::kSigmoid, 1, 2, true}}) {
    const Config c = moe_pp_config(k.recipe, 1, k.router, true, true, 0.05, 2);
    MeshSpec one;
    one.dp_replicate = k.replicate;
    one.dp_shard = 2;
    one.tp = k.tp;
    one.sequence_parallel = k.sp;
    one.ep = 2;
    expect_stages_bitwise(
        c, one, {2},
        fmt::format("ep 2, {} router, {}", k.router == MoeRouter::kSoftmax ? "softmax" : "sigmoid",
                    recipe_name(k.recipe)));
  }
}

// The aux terms are visible in the bits this suite compares: with the coefficient set to 0 the
// one-stage loss of every step and the router weights differ, so a pipelined run that dropped a
// stage's aux contribution (to the loss or to its router's gradient) could not pass the tests
// above. (Dropping it, or skipping the pre-pass under stages, was also checked by mutation of
// engine/session/session.cc: docs/design.md section 33.)
TEST(PipelineMoe, AuxLossMovesTheComparedBits) {
  MeshSpec one;
  one.dp_shard = 2;
  const Config with =
      moe_pp_config(RecipeKind::kFp32, 2, MoeRouter::kSoftmax, true, false, 0.05, 4);
  Config without = with;
  without.model.moe.aux_loss_coef = 0;
  const RunResult a = run_training(run_options(with, one, kSteps));
  const RunResult b = run_training(run_options(without, one, kSteps));
  for (int64_t s = 0; s < kSteps; ++s)
    EXPECT_NE(a.metrics[static_cast<size_t>(s)].loss, b.metrics[static_cast<size_t>(s)].loss) << s;
  for (const char* router : {"layers.0.moe.router.weight", "layers.2.moe.router.weight"})
    EXPECT_NE(a.final_params.at(router).to_vector<float>(),
              b.final_params.at(router).to_vector<float>())
        << router;
}

// The collective budget with MoE stages (docs/design.md section 29): every rank records exactly
// its own stage's parameter collectives, the routing pre-pass's extra weight gathers and amax
// reductions included (dp_shard 2 x ep 2, current scaling, aux loss over 2 micro-batches,
// reshard_after_forward on and off, 1F1B; pp 2 and pp 4, whose middle stages hold no embeddings or
// head); the expert weights of a stage's layers are counted on that stage only.
TEST(PipelineMoe, RecordedCollectivesAreTheStagesBudget) {
  const auto sorted_strings = [](const std::vector<mesh::CollectiveCall>& calls) {
    std::vector<std::string> out;
    for (const mesh::CollectiveCall& c : calls)
      out.push_back(fmt::format("{} {}", c.step, mesh::describe(c)));
    std::sort(out.begin(), out.end());
    return out;
  };
  Config c = moe_pp_config(RecipeKind::kCurrent, 1, MoeRouter::kSoftmax, true, false, 0.05, 2);
  c.training.pp_schedule = PpSchedule::kOneFOneB;
  for (int pp : {2, 4}) {
    for (bool reshard : {true, false}) {
      MeshSpec m;
      m.pp = pp;
      m.dp_shard = 2;
      m.ep = 2;
      RunOptions ro = run_options(c, m, 2);
      ro.record_collectives = true;
      ro.fsdp.reshard_after_forward = reshard;
      const RunResult run = run_training(ro);
      ASSERT_EQ(run.ranks.size(), static_cast<size_t>(2 * pp));
      for (const RankReport& r : run.ranks) {
        const std::string ctx =
            fmt::format("pp {} reshard_after_forward {} rank {}", pp, reshard, r.rank);
        std::vector<mesh::CollectiveCall> expected;
        for (int64_t step = 0; step < 2; ++step)
          for (mesh::CollectiveCall& e : expected_collectives(ro, r.rank, step))
            expected.push_back(std::move(e));
        ASSERT_FALSE(expected.empty()) << ctx;
        // Stage r.rank / 2 holds layers [first, first + 4 / pp): every layer tensor of the budget
        // is one of them, and its experts are there.
        const int64_t per = 4 / pp, first = (r.rank / 2) * per;
        bool experts = false;
        for (const mesh::CollectiveCall& e : expected) {
          if (!e.tensor.starts_with("layers.")) continue;
          const int64_t layer = std::stoll(e.tensor.substr(7));
          EXPECT_TRUE(layer >= first && layer < first + per) << ctx << " " << e.tensor;
          experts |= e.tensor.find(".moe.experts.") != std::string::npos;
        }
        EXPECT_TRUE(experts) << ctx;
        EXPECT_EQ(sorted_strings(r.calls), sorted_strings(expected)) << ctx;
      }
      // The pre-pass's terms are in the budget that matched: the same run without the aux loss
      // (no pre-pass) expects fewer calls on every rank.
      RunOptions no_prepass = ro;
      no_prepass.config.model.moe.aux_loss_coef = 0;
      ASSERT_FALSE(moe::needs_routing_prepass(no_prepass.config));
      for (int rank = 0; rank < 2 * pp; ++rank)
        EXPECT_LT(expected_collectives(no_prepass, rank, 0).size(),
                  expected_collectives(ro, rank, 0).size())
            << "pp " << pp << " rank " << rank;
    }
  }
}

}  // namespace
}  // namespace meshproof::engine
