// Expert parallelism (docs/design.md "Expert parallelism"): the exchange plan and the two
// all_to_all_v directions on uneven routings (experts with no tokens, ranks that send nothing),
// training with ep in {2, 4} on FSDP and HSDP meshes against one rank and against the same mesh
// with ep = 1, the quantized recipes, the run rules and the expert_grad_scaled_by_ep hook.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "engine/config/run_rules.h"
#include "engine/model/trainer.h"
#include "engine/moe/moe.h"
#include "engine/session/session.h"
#include "kernels/core/error.h"
#include "mesh/local/local_comm.h"
#include "tests/engine/test_config.h"

namespace meshproof::engine {
namespace {

using kernels::DType;
using kernels::Tensor;

// A routing of `tokens` tokens over `experts` experts with top_k 2 whose choices depend on the
// rank: the last expert never chosen, and rank 1 routes every token to experts 0 and 1 only.
moe::Routing uneven_routing(int rank, int64_t tokens, int64_t experts) {
  std::vector<int32_t> expert;
  for (int64_t t = 0; t < tokens; ++t) {
    const int32_t a = rank == 1 ? static_cast<int32_t>(t % 2)
                                : static_cast<int32_t>((t * 5 + rank) % (experts - 1));
    int32_t b = rank == 1 ? static_cast<int32_t>(1 - t % 2)
                          : static_cast<int32_t>((t * 3 + 1 + rank) % (experts - 1));
    if (b == a) b = static_cast<int32_t>((a + 1) % (experts - 1));
    expert.push_back(a);
    expert.push_back(b);
  }
  return moe::routing_from_choices(experts, 2, expert, std::vector<double>(expert.size(), 0.5));
}

// Row i of rank q's local layout holds q * 1000 + i in every column.
Tensor local_rows(int rank, int64_t rows, int64_t width) {
  std::vector<float> v;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t c = 0; c < width; ++c) v.push_back(static_cast<float>(rank * 1000 + i));
  return Tensor::from_vector<float>({rows, width}, v);
}

// The owner layout holds, per owned expert, the rows of the group's members in member order and
// token order, then zero padding to the alignment; experts it does not own have no rows (one
// zero block with keep_empty); from_owners(to_owners(x)) is x bit for bit.
TEST(MoeEpExchange, OwnerLayoutAndRoundTripOnUnevenRoutings) {
  for (const auto& [members_, ep_, align_, keep_] :
       {std::tuple{2, 2, 1, false}, std::tuple{4, 2, 32, true}, std::tuple{4, 4, 16, false},
        std::tuple{4, 4, 128, true}}) {
    // Copies the rank lambda can capture (clang before 16 cannot capture structured bindings).
    const int members = members_, ep = ep_, align = align_;
    const bool keep = keep_;
    constexpr int64_t kTokens = 6, kExperts = 8, kWidth = 3;
    mesh::LocalWorldOptions wo;
    wo.timeout = std::chrono::seconds(30);
    mesh::LocalWorld world(mesh::DeviceMesh(1, members, 1), wo);
    world.run([&](mesh::RankComms& comms) {
      mesh::Communicator& c = comms.group({mesh::MeshDim::kDpShard});
      const int me = c.rank(), base = me - me % ep;
      const moe::Dispatch local = moe::dispatch(uneven_routing(me, kTokens, kExperts), 1);
      const moe::EpExchange x = moe::plan_exchange(c, ep, local, align, keep);
      const Tensor rows = local_rows(me, local.padded_rows(), kWidth);
      const Tensor owned = moe::to_owners(c, x, local, rows);
      ASSERT_EQ(owned.shape()[0], x.owner.padded_rows());
      const std::vector<float> o = owned.to_vector<float>();
      const int64_t per = kExperts / ep;
      for (int64_t e = 0; e < kExperts; ++e) {
        const int64_t b = x.owner.offset[static_cast<size_t>(e)];
        const int64_t end = x.owner.offset[static_cast<size_t>(e) + 1];
        EXPECT_EQ(b % align, 0);
        const bool mine = e / per == me % ep;
        std::vector<float> want;  // (member, token) order
        if (mine)
          for (int q = base; q < base + ep; ++q) {
            const moe::Dispatch dq = moe::dispatch(uneven_routing(q, kTokens, kExperts), 1);
            for (int64_t i = 0; i < dq.rows[static_cast<size_t>(e)]; ++i)
              want.push_back(static_cast<float>(q * 1000 + dq.offset[static_cast<size_t>(e)] + i));
          }
        ASSERT_EQ(x.owner.rows[static_cast<size_t>(e)], static_cast<int64_t>(want.size()))
            << "expert " << e << " on member " << me;
        const int64_t rows_n = static_cast<int64_t>(want.size());
        const int64_t block = end - b;
        EXPECT_EQ(block, (std::max<int64_t>(rows_n, keep ? 1 : 0) + align - 1) / align * align);
        for (int64_t i = 0; i < block; ++i)
          for (int64_t col = 0; col < kWidth; ++col)
            EXPECT_EQ(o[static_cast<size_t>((b + i) * kWidth + col)],
                      i < rows_n ? want[static_cast<size_t>(i)] : 0.0f)
                << "expert " << e << " row " << i << " on member " << me;
      }
      // The last expert is chosen by no one: no rows anywhere (one zero block with keep_empty,
      // on its owner as on every other member).
      EXPECT_EQ(x.owner.rows[kExperts - 1], 0);
      EXPECT_EQ(x.owner.offset[kExperts] - x.owner.offset[kExperts - 1], keep ? align : 0);
      const Tensor back = moe::from_owners(c, x, local, owned);
      ASSERT_EQ(back.shape()[0], local.padded_rows());
      EXPECT_EQ(
          std::memcmp(back.raw_data(), rows.raw_data(), static_cast<size_t>(rows.nbytes().value)),
          0)
          << "member " << me << " of " << members << ", ep " << ep;
    });
  }
}

TEST(MoeEpExchange, PlanRefusesAPaddedLocalLayoutAndAnUnevenSplit) {
  mesh::LocalWorld world(mesh::DeviceMesh(1, 2, 1));
  world.run([&](mesh::RankComms& comms) {
    mesh::Communicator& c = comms.group({mesh::MeshDim::kDpShard});
    const moe::Routing r = uneven_routing(0, 4, 4);
    EXPECT_THROW(moe::plan_exchange(c, 2, moe::dispatch(r, 16), 16, false), kernels::Error);
    const moe::Routing r3 = uneven_routing(0, 4, 3);
    EXPECT_THROW(moe::plan_exchange(c, 2, moe::dispatch(r3, 1), 1, false), kernels::Error);
  });
}

MeshSpec with_ep(MeshSpec m, int ep) {
  m.ep = ep;
  return m;
}

// Training with ep against one rank (fp32 bound 1e-5, docs/design.md section 8) and against the
// same mesh with ep = 1. The forward is the same arithmetic per row (each expert GEMM's output
// row depends on its input row and the weights only, wherever the row sits), so step 0's loss
// is bitwise the ep = 1 loss; the expert weight gradients are summed over the tokens of the ep
// group in one GEMM on the owner instead of per rank and then over the ranks, so later steps
// differ by fp32 summation order. Measured 2026-11-24 (RecordProperty, this CPU backend).
void expect_ep_matches(const Config& c, double rel, const std::string& tag,
                       const std::vector<MeshSpec>& meshes) {
  constexpr int kSteps = 3;
  Trainer t(c);
  std::vector<StepMetrics> ref;
  for (int s = 0; s < kSteps; ++s) ref.push_back(t.step());
  for (const MeshSpec& m : meshes) {
    MeshSpec base = m;
    base.ep = 1;
    const RunResult one = run_training(testing::run_options(c, base, kSteps));
    const RunResult run = run_training(testing::run_options(c, m, kSteps));
    ASSERT_EQ(run.metrics.size(), static_cast<size_t>(kSteps));
    const std::string where = fmt::format("{} ep {}", m.device_mesh().str(), m.ep);
    EXPECT_EQ(run.metrics[0].loss, one.metrics[0].loss) << where << ": step 0 loss not bitwise";
    for (int s = 0; s < kSteps; ++s) {
      const StepMetrics& want = ref[static_cast<size_t>(s)];
      const StepMetrics& got = run.metrics[static_cast<size_t>(s)];
      EXPECT_NEAR(got.loss, want.loss, rel * want.loss) << where << " step " << s;
      EXPECT_NEAR(got.grad_norm, want.grad_norm, rel * want.grad_norm) << where << " step " << s;
      const StepMetrics& same = one.metrics[static_cast<size_t>(s)];
      ::testing::Test::RecordProperty(
          fmt::format("rel_{}_{}_ep{}_step{}", tag, m.device_mesh().str(), m.ep, s),
          fmt::format("loss vs 1 rank {:.3e}, vs ep 1 {:.3e}; grad_norm vs ep 1 {:.3e}",
                      std::abs(got.loss - want.loss) / want.loss,
                      std::abs(got.loss - same.loss) / same.loss,
                      std::abs(got.grad_norm - same.grad_norm) / same.grad_norm));
    }
  }
}

TEST(MoeEpMeshes, Fp32EpTwoAndFourMatchOneRankAndEpOne) {
  Config c = testing::tiny_moe_config();
  c.model.moe.shared_expert = true;
  c.model.moe.aux_loss_coef = 0.01;
  expect_ep_matches(
      c, 1e-5, "fp32_softmax",
      {with_ep({1, 2, 1}, 2), with_ep({1, 4, 1}, 2), with_ep({1, 4, 1}, 4), with_ep({2, 2, 1}, 2)});
  Config g = testing::tiny_moe_config();
  g.model.activation = Activation::kSwiGlu;
  g.model.moe.router = MoeRouter::kSigmoid;
  g.model.moe.experts = 8;
  g.training.micro_batches = 2;  // deferred sync: one reduction after the last micro-batch
  expect_ep_matches(g, 1e-5, "fp32_sigmoid_swiglu_mb2",
                    {with_ep({1, 2, 1}, 2), with_ep({1, 4, 1}, 4), with_ep({2, 2, 1}, 2)});
}

// Current scaling and MXFP8: every rank quantizes every expert (zero blocks for experts it does
// not own), the activation and gradient amaxes MAX-reduced over the data ranks, so each owner
// quantizes with the single-rank scales; MXFP8 owner blocks are 32-row aligned. Bound: the fp32
// bound 1e-5 (a wrong scale moves the loss by ~2^-3 relative on an element).
TEST(MoeEpMeshes, CurrentAndMxfp8MatchOneRank) {
  for (RecipeKind r : {RecipeKind::kCurrent, RecipeKind::kMxfp8}) {
    const Config c = testing::moe_mesh_config(r);
    expect_ep_matches(c, 1e-5, std::string(recipe_name(r)),
                      {with_ep({1, 4, 1}, 2), with_ep({1, 4, 1}, 4)});
  }
}

// expert_grad_scaled_by_ep through its hook: at ep 2 the step-0 gradient norm grows (the expert
// gradients are doubled) while the loss of step 0 does not move; at ep 1 the factor is 1.
TEST(MoeEpMeshes, ExpertGradScaledByEpHookDoublesExpertGradients) {
  const Config c = testing::tiny_moe_config();
  RunOptions clean = testing::run_options(c, with_ep({1, 2, 1}, 2), 1);
  RunOptions bad = clean;
  bad.faults.expert_grad_scaled_by_ep = true;
  const RunResult a = run_training(clean), b = run_training(bad);
  EXPECT_EQ(a.metrics[0].loss, b.metrics[0].loss);
  EXPECT_GT(b.metrics[0].grad_norm, a.metrics[0].grad_norm * 1.05);
  EXPECT_EQ(make_fault_hooks(bad.faults).expert_grad_factor(0, 1), 1.0);
  EXPECT_EQ(make_fault_hooks(bad.faults).expert_grad_factor(0, 4), 4.0);
  EXPECT_EQ(make_fault_hooks(clean.faults).expert_grad_factor(0, 4), 1.0);
}

// The expert_split_padding_too_small hook (docs/design.md section 27): the grouped columnwise
// quantization of the experts' wgrad inputs with each expert padded to 16 rows changes the
// gradients (a 32x1 / 128x1 block spans two experts and each expert reads its scales as if its
// rows started on a block boundary); padded to the recipe's alignment instead, the same grouped
// path is bitwise the per-expert run, so the fault's effect is the padding and nothing else.
// MXFP8 and block scaling on one rank, FSDP 2 and FSDP 2 x ep 2 (the owner layout).
class MoeExpertSplitPadding : public ::testing::TestWithParam<MeshSpec> {};
TEST_P(MoeExpertSplitPadding, FaultChangesGradientsOnlyBelowTheAlignment) {
  const MeshSpec m = GetParam();
  for (const RecipeKind recipe : {RecipeKind::kMxfp8, RecipeKind::kBlock}) {
    const Config c = testing::moe_mesh_config(recipe);
    {
      const std::string name(recipe_name(recipe));
      RunOptions clean = testing::run_options(c, m, 3);
      RunOptions aligned = clean, bad = clean;
      aligned.faults.expert_split_padding_too_small = true;
      aligned.faults.expert_split_padding_rows = moe::row_alignment(recipe);
      bad.faults.expert_split_padding_too_small = true;
      const RunResult a = run_training(clean), b = run_training(aligned), f = run_training(bad);
      bool differs = false;
      for (size_t s = 0; s < a.metrics.size(); ++s) {
        EXPECT_EQ(a.metrics[s].loss, b.metrics[s].loss) << name << " step " << s;
        EXPECT_EQ(a.metrics[s].grad_norm, b.metrics[s].grad_norm) << name << " step " << s;
        differs = differs || a.metrics[s].grad_norm != f.metrics[s].grad_norm;
      }
      EXPECT_TRUE(differs) << name << ": padding to 16 changed no gradient norm";
      // The first step's loss comes before any gradient: unchanged.
      EXPECT_EQ(a.metrics[0].loss, f.metrics[0].loss) << name;
    }
  }
  EXPECT_EQ(make_fault_hooks(FaultInjection{}).expert_split_padding(0), 0);
  FaultInjection on;
  on.expert_split_padding_too_small = true;
  EXPECT_EQ(make_fault_hooks(on).expert_split_padding(0), 16);
}
INSTANTIATE_TEST_SUITE_P(Meshes, MoeExpertSplitPadding,
                         ::testing::Values(MeshSpec{1, 1, 1}, MeshSpec{1, 2, 1},
                                           with_ep({1, 2, 1}, 2)),
                         testing::MeshCaseName{});

// mesh.ep rules: each refused with the key and the reason, before any work.
TEST(MoeEpRules, BadEpValuesAreInputErrorsNamingMeshEp) {
  const auto issue = [](const Config& c, MeshSpec m) {
    const std::vector<ConfigIssue> is = check_run(testing::run_options(c, m, 1), HostLimits{});
    return is.empty() ? std::string() : is.front().key_path + ": " + is.front().message;
  };
  const Config moe = testing::tiny_moe_config();
  EXPECT_EQ(issue(moe, with_ep({1, 4, 1}, 2)), "");
  EXPECT_NE(issue(moe, with_ep({1, 4, 1}, 3))
                .find("mesh.ep: mesh.ep = 3 does not divide "
                      "mesh.dp_shard = 4"),
            std::string::npos);
  Config six = testing::tiny_moe_config();
  six.model.moe.experts = 6;
  EXPECT_NE(issue(six, with_ep({1, 4, 1}, 4)).find("does not divide model.moe.experts = 6"),
            std::string::npos);
  testing::TestModel tm;
  EXPECT_NE(issue(testing::make_config(tm), with_ep({1, 2, 1}, 2)).find("needs model.moe"),
            std::string::npos);
  EXPECT_NE(issue(moe, with_ep({1, 2, 1}, 0)).find("mesh.ep = 0 must be >= 1"), std::string::npos);
}

}  // namespace
}  // namespace meshproof::engine
