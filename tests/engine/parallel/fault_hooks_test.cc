// The fault hook points (engine/faults/fault_hooks.h): neutral without faults, each fault acting at
// its point only from its from_step on, a hook registered by hand (the way issue #20's user-defined
// faults will add theirs) folding with the built-in ones, and a bad fault parameter reported when
// its point is asked. The end-to-end effect of every fault on a run is in session_checks_test.cc
// and tests/engine/checkpoint.
#include "engine/faults/fault_hooks.h"

#include <gtest/gtest.h>

#include "engine/checkpoint/state_keys.h"
#include "engine/parallel/shard_plan.h"
#include "kernels/core/error.h"

namespace meshproof::engine {
namespace {

using mesh::DimSet;
using mesh::Layout;
using mesh::MeshDim;
using mesh::Padding;
using mesh::Placement;

ParamSpec vocab_weight() {
  ParamSpec p;
  p.name = "embed.tok";
  p.shape = {9, 4};
  p.vocab_rows = true;
  return p;
}

TEST(FaultHooks, NeutralWithoutFaults) {
  const FaultHooks h = make_fault_hooks(FaultInjection{});
  const DimSet g{MeshDim::kDpShard, MeshDim::kTp};
  EXPECT_EQ(h.weight_gather_padding(vocab_weight(), 5), Padding::kCut);
  EXPECT_EQ(h.amax_group("layers.0.attn.qkv", Fp8Role::kWeight, 5, g), g);
  EXPECT_TRUE(h.gradient_replicas(5));
  EXPECT_FALSE(h.needs_quantized_weights());
  EXPECT_TRUE(h.checkpoint_keeps("fp8/layers.0.attn.qkv/weight/scale", 5));
  EXPECT_TRUE(h.restores(keys::kDataCursor, 5));
  EXPECT_TRUE(h.restores("optim/embed.tok/exp_avg", 5));
  const mesh::DeviceMesh mesh(1, 2, 2);
  ParamSpec col;
  col.tp = TpStyle::kColumn;
  col.shape = {8, 4};
  const Layout l(mesh, col.shape, placements(col, mesh));
  EXPECT_EQ(h.state_layout(col, l, 1).str(), l.str());
}

TEST(FaultHooks, EachFaultActsFromItsStep) {
  FaultInjection f;
  f.from_step = 3;
  f.amax_not_reduced = f.uneven_shard_padding_leak = f.hsdp_replicas_not_reduced = true;
  f.fp8_state_dropped_from_checkpoint = f.data_cursor_not_restored = true;
  f.optimizer_state_not_restored = true;
  f.optimizer_state_part = "exp_avg_sq";
  const FaultHooks h = make_fault_hooks(f);
  const DimSet g{MeshDim::kDpShard};
  for (int64_t step : {2, 3}) {
    const bool on = step >= 3;
    EXPECT_EQ(h.amax_group("layers.0.mlp.fc2", Fp8Role::kInput, step, g), on ? DimSet{} : g);
    EXPECT_EQ(h.weight_gather_padding(vocab_weight(), step), on ? Padding::kKeep : Padding::kCut);
    ParamSpec pos = vocab_weight();
    pos.vocab_rows = false;
    EXPECT_EQ(h.weight_gather_padding(pos, step), Padding::kCut);
    EXPECT_EQ(h.gradient_replicas(step), !on);
    EXPECT_EQ(h.checkpoint_keeps("fp8/params/layers.0.mlp.fc2.weight/scale_inv", step), !on);
    EXPECT_TRUE(h.checkpoint_keeps("model/embed.tok", step));
    EXPECT_EQ(h.restores(keys::kDataCursor, step), !on);
    EXPECT_EQ(h.restores(keys::exp_avg_sq("embed.tok"), step), !on);
    EXPECT_TRUE(h.restores(keys::exp_avg("embed.tok"), step));
    EXPECT_TRUE(h.restores(keys::kOptimStep, step));
  }
}

// scale_inv_saved_bf16 rounds fp32 scales through bf16 in a copy; other keys and dtypes pass.
TEST(FaultHooks, ScalesSavedThroughBf16) {
  FaultInjection f;
  f.scale_inv_saved_bf16 = true;
  const FaultHooks h = make_fault_hooks(f);
  const kernels::Tensor live = kernels::Tensor::from_vector<float>({1}, {1.0f / 3.0f});
  const kernels::Tensor saved = h.checkpoint_bytes("fp8/params/w/scale_inv", 0, live);
  EXPECT_NE(saved.to_vector<float>()[0], 1.0f / 3.0f);
  EXPECT_EQ(saved.to_vector<float>()[0], 0.333984375f);  // bf16 RNE of 1/3
  EXPECT_EQ(live.to_vector<float>()[0], 1.0f / 3.0f);    // the live tensor is untouched
  EXPECT_EQ(h.checkpoint_bytes("model/w", 0, live).to_vector<float>()[0], 1.0f / 3.0f);
}

// tp_fsdp_left_to_right describes strided shards as Shard(0) then Shard(0).
TEST(FaultHooks, LeftToRightStateLayout) {
  FaultInjection f;
  f.tp_fsdp_left_to_right = true;
  const FaultHooks h = make_fault_hooks(f);
  const mesh::DeviceMesh mesh(1, 2, 2);
  ParamSpec col;
  col.tp = TpStyle::kColumn;
  col.shape = {8, 4};
  const Layout real(mesh, col.shape, placements(col, mesh));
  ASSERT_EQ(real.placement(MeshDim::kDpShard).kind, Placement::Kind::kStridedShard);
  const Layout described = h.state_layout(col, real, 1);
  EXPECT_EQ(described.placement(MeshDim::kDpShard), Placement::shard(0));
  EXPECT_EQ(described.placement(MeshDim::kTp), Placement::shard(0));
  // Rank 1 = (dp_shard 0, tp 1): strided rows [4, 6), left to right rows [2, 4).
  EXPECT_EQ(real.box(1).offset[0].value, 4);
  EXPECT_EQ(described.box(1).offset[0].value, 2);
}

// A hook registered by hand folds with the built-in ones (issue #20's user-defined faults, e.g.
// drop_checkpoint_key(glob), register on the same points).
TEST(FaultHooks, RegisteredHooksFold) {
  FaultInjection f;
  f.data_cursor_not_restored = true;
  FaultHooks h = make_fault_hooks(f);
  h.on_checkpoint_save(
      {.keeps = [](std::string_view key, int64_t) { return key != "model/x"; }, .bytes = nullptr});
  h.on_checkpoint_restore([](std::string_view key, int64_t) { return key != "lr/step"; });
  EXPECT_FALSE(h.checkpoint_keeps("model/x", 0));
  EXPECT_TRUE(h.checkpoint_keeps("model/y", 0));
  EXPECT_FALSE(h.restores(keys::kDataCursor, 0));
  EXPECT_FALSE(h.restores(keys::kLrStep, 0));
  EXPECT_TRUE(h.restores(keys::kOptimStep, 0));
}

TEST(FaultHooks, UnknownOptimizerPartIsAnInputError) {
  FaultInjection f;
  f.optimizer_state_not_restored = true;
  f.optimizer_state_part = "moments";
  const FaultHooks h = make_fault_hooks(f);
  EXPECT_TRUE(h.restores(keys::kDataCursor, 0));  // not an optim/ key: not asked
  try {
    h.restores(keys::kOptimStep, 0);
    FAIL() << "no error";
  } catch (const kernels::Error& e) {
    EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
    EXPECT_NE(std::string(e.what()).find("unknown part 'moments'"), std::string::npos);
  }
}

}  // namespace
}  // namespace meshproof::engine
