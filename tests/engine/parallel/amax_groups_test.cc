// Amax reduction groups as data (engine/parallel/amax_groups.h): the default table per linear kind
// and role on several meshes, runs whose groups are widened to the whole mesh (bitwise the same:
// MAX over extra copies changes nothing) and a run whose weight group misses the tp pieces (the
// gathered weights are no longer the single-rank quantization).
#include "engine/parallel/amax_groups.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>

#include "engine/faults/fault_hooks.h"
#include "engine/parallel/shard_plan.h"
#include "engine/session/session.h"
#include "kernels/core/error.h"
#include "tests/engine/test_config.h"

namespace meshproof::engine {
namespace {

using mesh::DimSet;
using mesh::MeshDim;

constexpr LinearKind kCol = LinearKind::kColumnParallel;
constexpr LinearKind kRow = LinearKind::kRowParallel;

std::string group(LinearKind k, Fp8Role r, const MeshSpec& m) {
  return default_amax_group({k, r}, m).str();
}

// The kind of every quantized linear is data on its parameter spec (engine/model/params.h), filled
// from the block's linear table when the model is described, experts and the shared expert
// included; the plan answers by name from those specs and refuses a name that is no quantized
// linear.
TEST(AmaxGroups, LinearKindsAreOnTheParameterSpecs) {
  testing::TestModel tm;
  tm.layers = 2;
  tm.recipe = RecipeKind::kCurrent;
  Config c = testing::make_config(tm);
  c.model.activation = Activation::kSwiGlu;
  c.model.moe.experts = 2;
  c.model.moe.top_k = 1;
  c.model.moe.every = 2;  // layer 0 MoE, layer 1 dense
  c.model.moe.shared_expert = true;
  const mesh::DeviceMesh one = MeshSpec{}.device_mesh();
  const ShardPlan plan(c, one, 0, FaultHooks{});
  const std::vector<std::pair<std::string, LinearKind>> expected = {
      {"layers.0.attn.qkv", kCol},          {"layers.0.attn.proj", kRow},
      {"layers.1.mlp.fc1_gate", kCol},      {"layers.1.mlp.fc1_up", kCol},
      {"layers.1.mlp.fc2", kRow},           {"layers.0.moe.experts.1.fc1_gate", kCol},
      {"layers.0.moe.experts.0.fc2", kRow}, {"layers.0.moe.shared.fc1_up", kCol},
      {"layers.0.moe.shared.fc2", kRow}};
  const std::vector<std::string> linears = plan.linears();
  for (const auto& [name, kind] : expected) {
    if (std::find(linears.begin(), linears.end(), name) == linears.end()) {
      ADD_FAILURE() << name << " is not a quantized linear of the plan";
      continue;
    }
    EXPECT_EQ(plan.linear_kind(name), kind) << name;
  }
  EXPECT_EQ(linear_kind_name(kCol), "column_parallel");
  EXPECT_EQ(linear_kind_name(kRow), "row_parallel");
  EXPECT_THROW(plan.linear_kind("lm_head"), kernels::Error);
}

TEST(AmaxGroups, SingleRankReducesOverNobody) {
  for (LinearKind k : {kCol, kRow})
    for (Fp8Role r : {Fp8Role::kInput, Fp8Role::kWeight, Fp8Role::kGradOutput})
      EXPECT_TRUE(default_amax_group({k, r}, MeshSpec{1, 1, 1}).empty());
}

TEST(AmaxGroups, DataParallelOnly) {
  // FSDP: weights over their dp_shard shards, activations/gradients over the data ranks.
  const MeshSpec fsdp{1, 4, 1};
  for (LinearKind k : {kCol, kRow}) {
    EXPECT_EQ(group(k, Fp8Role::kWeight, fsdp), "dp_shard");
    EXPECT_EQ(group(k, Fp8Role::kInput, fsdp), "dp_shard");
    EXPECT_EQ(group(k, Fp8Role::kGradOutput, fsdp), "dp_shard");
  }
  // Pure replication: every replica holds the whole weight; rows differ per replica.
  const MeshSpec ddp{2, 1, 1};
  for (LinearKind k : {kCol, kRow}) {
    EXPECT_EQ(group(k, Fp8Role::kWeight, ddp), "none");
    EXPECT_EQ(group(k, Fp8Role::kInput, ddp), "dp_replicate");
    EXPECT_EQ(group(k, Fp8Role::kGradOutput, ddp), "dp_replicate");
  }
  // HSDP: weights skip the replicas.
  const MeshSpec hsdp{2, 2, 1};
  EXPECT_EQ(group(kCol, Fp8Role::kWeight, hsdp), "dp_shard");
  EXPECT_EQ(group(kRow, Fp8Role::kInput, hsdp), "dp_replicate+dp_shard");
}

TEST(AmaxGroups, TensorParallelWithAndWithoutSequenceParallelism) {
  for (bool sp : {false, true}) {
    // Sequence parallelism gathers the sequence before every quantized GEMM: same table.
    const MeshSpec tp{1, 1, 2, sp};
    EXPECT_EQ(group(kCol, Fp8Role::kWeight, tp), "tp") << sp;
    EXPECT_EQ(group(kRow, Fp8Role::kWeight, tp), "tp") << sp;
    EXPECT_EQ(group(kCol, Fp8Role::kInput, tp), "none") << sp;       // replicated over tp
    EXPECT_EQ(group(kRow, Fp8Role::kInput, tp), "tp") << sp;         // K split over tp
    EXPECT_EQ(group(kCol, Fp8Role::kGradOutput, tp), "tp") << sp;    // N split over tp
    EXPECT_EQ(group(kRow, Fp8Role::kGradOutput, tp), "none") << sp;  // full on every tp rank

    const MeshSpec all{2, 2, 2, sp};
    EXPECT_EQ(group(kCol, Fp8Role::kWeight, all), "dp_shard+tp") << sp;
    EXPECT_EQ(group(kRow, Fp8Role::kWeight, all), "dp_shard+tp") << sp;
    EXPECT_EQ(group(kCol, Fp8Role::kInput, all), "dp_replicate+dp_shard") << sp;
    EXPECT_EQ(group(kRow, Fp8Role::kInput, all), "dp_replicate+dp_shard+tp") << sp;
    EXPECT_EQ(group(kCol, Fp8Role::kGradOutput, all), "dp_replicate+dp_shard+tp") << sp;
    EXPECT_EQ(group(kRow, Fp8Role::kGradOutput, all), "dp_replicate+dp_shard") << sp;
  }
  const MeshSpec fsdp_tp{1, 4, 2};
  EXPECT_EQ(group(kCol, Fp8Role::kWeight, fsdp_tp), "dp_shard+tp");
  EXPECT_EQ(group(kCol, Fp8Role::kInput, fsdp_tp), "dp_shard");
  EXPECT_EQ(group(kRow, Fp8Role::kInput, fsdp_tp), "dp_shard+tp");
}

TEST(AmaxGroups, OverridesReplaceSingleEntries) {
  const MeshSpec m{1, 2, 2};
  const AmaxGroupOverrides o{{{kRow, Fp8Role::kWeight}, DimSet{MeshDim::kDpShard}}};
  EXPECT_EQ(amax_group({kRow, Fp8Role::kWeight}, m, o).str(), "dp_shard");
  EXPECT_EQ(amax_group({kCol, Fp8Role::kWeight}, m, o).str(), "dp_shard+tp");
  EXPECT_EQ(amax_group({kRow, Fp8Role::kInput}, m, o),
            default_amax_group({kRow, Fp8Role::kInput}, m));
}

// ---- runs

using testing::fp8_model;

AmaxGroupOverrides every_entry(DimSet g) {
  AmaxGroupOverrides o;
  for (LinearKind k : {kCol, kRow})
    for (Fp8Role r : {Fp8Role::kInput, Fp8Role::kWeight, Fp8Role::kGradOutput}) o[{k, r}] = g;
  return o;
}

// All-reduce calls over `group` on one rank.
int64_t all_reduces_over(const RankReport& r, const std::string& group) {
  return testing::collective_total(r, "all_reduce", group);
}

struct WideCase {
  RecipeKind kind;
  bool fp8_all_gather;
};
class AmaxGroupsWholeMesh : public ::testing::TestWithParam<WideCase> {};

TEST_P(AmaxGroupsWholeMesh, BitwiseEqualToTheDefaultGroups) {
  // Every tensor's default group covers all of its pieces; the whole mesh adds only ranks holding
  // copies, whose MAX is the same float: the runs are bitwise equal.
  const WideCase& wc = GetParam();
  const Config c = fp8_model(wc.kind);
  RunOptions def = testing::run_options(c, {2, 2, 2}, 2), wide = def;
  def.fsdp.fp8_all_gather = wide.fsdp.fp8_all_gather = wc.fp8_all_gather;
  const DimSet world{MeshDim::kDpReplicate, MeshDim::kDpShard, MeshDim::kTp};
  wide.amax_groups = every_entry(world);
  const RunResult a = run_training(def), b = run_training(wide);
  testing::expect_same_run(a, b, "whole-mesh amax groups");
  // The groups did change: the default run reduces weights over dp_shard+tp and activations over
  // the data dims; the widened run sends every amax over the whole mesh (the default run's
  // whole-mesh all-reduces are the row input and column grad_output amaxes).
  const RankReport& ra = a.ranks[0];
  const RankReport& rb = b.ranks[0];
  EXPECT_GT(all_reduces_over(ra, "dp_replicate+dp_shard"), 0);
  EXPECT_EQ(all_reduces_over(rb, "dp_replicate+dp_shard"), 0);
  EXPECT_EQ(all_reduces_over(rb, world.str()), all_reduces_over(ra, world.str()) +
                                                   all_reduces_over(ra, "dp_replicate+dp_shard") +
                                                   all_reduces_over(ra, "dp_shard+tp"));
}

INSTANTIATE_TEST_SUITE_P(Recipes, AmaxGroupsWholeMesh,
                         ::testing::Values(WideCase{RecipeKind::kCurrent, false},
                                           WideCase{RecipeKind::kCurrent, true},
                                           WideCase{RecipeKind::kDelayed, false},
                                           WideCase{RecipeKind::kDelayed, true}),
                         [](const auto& info) {
                           return fmt::format("{}{}", recipe_name(info.param.kind),
                                              info.param.fp8_all_gather ? "_fp8_all_gather" : "");
                         });

TEST(AmaxGroupsData, WeightGroupWithoutTpIsNotTheSingleRankQuantization) {
  // Current scaling with the FP8 all-gather on dp_shard 2 x tp 2: with the default weight group
  // (dp_shard+tp) every gathered weight is bitwise quantize(full weight), the single-rank
  // quantization (allgather_parity). Dropping tp from the weight entries makes each tp rank scale
  // its TP shard by that shard's own amax: the bytes differ and the run changes.
  const Config c = fp8_model(RecipeKind::kCurrent);
  RunOptions def = testing::run_options(c, {1, 2, 2}, 2), no_tp = def;
  def.fsdp.fp8_all_gather = no_tp.fsdp.fp8_all_gather = true;
  def.allgather_parity = no_tp.allgather_parity = true;
  for (LinearKind k : {kCol, kRow})
    no_tp.amax_groups[{k, Fp8Role::kWeight}] = DimSet{MeshDim::kDpShard};
  const RunResult a = run_training(def), b = run_training(no_tp);
  ASSERT_FALSE(a.parity.empty());
  ASSERT_EQ(a.parity.size(), b.parity.size());
  int64_t mismatched_default = 0, mismatched_no_tp = 0;
  for (const AllGatherParity& p : a.parity) mismatched_default += p.mismatched_bytes;
  for (const AllGatherParity& p : b.parity) mismatched_no_tp += p.mismatched_bytes;
  EXPECT_EQ(mismatched_default, 0);
  EXPECT_GT(mismatched_no_tp, 0);
  EXPECT_NE(a.metrics[1].loss, b.metrics[1].loss);
}

}  // namespace
}  // namespace meshproof::engine
