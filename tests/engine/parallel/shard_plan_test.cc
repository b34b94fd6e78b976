// The declarative sharding plan (engine/model/params.h, engine/parallel/shard_plan.h): each
// parameter spec says its FSDP unit, TP style, quantized linear and kind, and the placements follow
// from the style and the mesh alone (the table at the top of engine/parallel/shard_plan.h). The
// expected values below are written out by hand from docs/design.md section 5, not derived from the
// code under test.
#include "engine/parallel/shard_plan.h"

#include <gtest/gtest.h>

#include <map>
#include <string>

#include "engine/parallel/amax_groups.h"
#include "kernels/core/error.h"
#include "tests/engine/test_config.h"

namespace meshproof::engine {
namespace {

using mesh::DeviceMesh;
using mesh::MeshDim;
using mesh::Placement;

std::map<std::string, ParamSpec> by_name(const ModelConfig& m) {
  std::map<std::string, ParamSpec> out;
  for (const ParamSpec& s : param_specs(m)) out.emplace(s.name, s);
  return out;
}

std::string placement_str(const std::vector<Placement>& p) {
  std::string s;
  for (const Placement& x : p) s += x.str() + " ";
  return s;
}

TEST(ShardPlan, SpecsCarryUnitStyleAndLinear) {
  ModelConfig m = testing::make_config({.layers = 2}).model;
  const auto s = by_name(m);
  EXPECT_EQ(s.at("embed.tok").unit, kRootUnit);
  EXPECT_TRUE(s.at("embed.tok").vocab_rows);
  EXPECT_FALSE(s.at("embed.pos").vocab_rows);
  EXPECT_TRUE(s.at("lm_head.weight").vocab_rows);
  EXPECT_EQ(s.at("final_ln.weight").unit, kRootUnit);
  EXPECT_EQ(s.at("layers.0.ln1.weight").unit, 0);
  EXPECT_EQ(s.at("layers.1.mlp.fc2.bias").unit, 1);
  // Quantized linears: the weights only, named without ".weight".
  EXPECT_EQ(s.at("layers.1.attn.qkv.weight").linear, "layers.1.attn.qkv");
  EXPECT_EQ(s.at("layers.1.attn.qkv.weight").linear_kind, LinearKind::kColumnParallel);
  EXPECT_EQ(s.at("layers.0.attn.proj.weight").linear_kind, LinearKind::kRowParallel);
  EXPECT_EQ(s.at("layers.0.mlp.fc2.weight").linear, "layers.0.mlp.fc2");
  EXPECT_FALSE(s.at("layers.0.attn.qkv.bias").quantized());
  EXPECT_FALSE(s.at("embed.tok").quantized());
  // TP styles: column weights and biases split rows; row weights split columns, their biases
  // stay whole; everything else replicated.
  EXPECT_EQ(s.at("layers.0.attn.qkv.bias").tp, TpStyle::kColumn);
  EXPECT_EQ(s.at("layers.0.mlp.fc1.weight").tp, TpStyle::kColumn);
  EXPECT_EQ(s.at("layers.0.attn.proj.weight").tp, TpStyle::kRow);
  EXPECT_EQ(s.at("layers.0.attn.proj.bias").tp, TpStyle::kReplicated);
  EXPECT_EQ(s.at("layers.0.mlp.fc2.bias").tp, TpStyle::kReplicated);
  EXPECT_EQ(s.at("layers.0.ln2.weight").tp, TpStyle::kReplicated);
  EXPECT_EQ(s.at("lm_head.weight").tp, TpStyle::kReplicated);
}

// The canonical order (the checkpoint and export order) of one SwiGLU RMSNorm block.
TEST(ShardPlan, SwiGluBlockOrder) {
  ModelConfig m = testing::make_config({}).model;
  m.activation = Activation::kSwiGlu;
  m.norm = NormKind::kRmsNorm;
  m.tied_embeddings = true;
  std::vector<std::string> names;
  for (const ParamSpec& s : param_specs(m)) names.push_back(s.name);
  const std::vector<std::string> want = {
      "embed.tok",
      "embed.pos",
      "layers.0.ln1.weight",
      "layers.0.attn.qkv.weight",
      "layers.0.attn.qkv.bias",
      "layers.0.attn.proj.weight",
      "layers.0.attn.proj.bias",
      "layers.0.ln2.weight",
      "layers.0.mlp.fc1_gate.weight",
      "layers.0.mlp.fc1_gate.bias",
      "layers.0.mlp.fc1_up.weight",
      "layers.0.mlp.fc1_up.bias",
      "layers.0.mlp.fc2.weight",
      "layers.0.mlp.fc2.bias",
      "final_ln.weight",
  };
  EXPECT_EQ(names, want);
  const auto s = by_name(m);
  EXPECT_EQ(s.at("layers.0.mlp.fc1_up.weight").shape, (kernels::Shape{m.ffn, m.hidden}));
  EXPECT_EQ(s.at("layers.0.mlp.fc2.weight").shape, (kernels::Shape{m.hidden, m.ffn}));
  EXPECT_EQ(s.at("layers.0.attn.qkv.weight").shape, (kernels::Shape{3 * m.hidden, m.hidden}));
}

TEST(ShardPlan, BlockLinearsPerActivation) {
  std::vector<std::string> gelu, swiglu;
  for (const LinearLayer& l : block_linears(Activation::kGelu)) gelu.emplace_back(l.name);
  for (const LinearLayer& l : block_linears(Activation::kSwiGlu)) swiglu.emplace_back(l.name);
  EXPECT_EQ(gelu, (std::vector<std::string>{"attn.qkv", "attn.proj", "mlp.fc1", "mlp.fc2"}));
  EXPECT_EQ(swiglu, (std::vector<std::string>{"attn.qkv", "attn.proj", "mlp.fc1_gate", "mlp.fc1_up",
                                              "mlp.fc2"}));
}

// Placements per style (docs/design.md section 5), on FSDP x TP, TP alone and FSDP alone.
TEST(ShardPlan, PlacementsFollowStyleAndMesh) {
  ParamSpec col, row, rep;
  col.tp = TpStyle::kColumn;
  col.shape = {8, 4};
  row.tp = TpStyle::kRow;
  row.shape = {8, 4};
  rep.shape = {8, 4};
  const DeviceMesh fsdp_tp(1, 2, 2), tp_only(1, 1, 2), fsdp(2, 2, 1);
  EXPECT_EQ(placement_str(placements(col, fsdp_tp)), "Replicate() StridedShard(0, sf=2) Shard(0) ");
  EXPECT_EQ(placement_str(placements(row, fsdp_tp)), "Replicate() Shard(0) Shard(1) ");
  EXPECT_EQ(placement_str(placements(rep, fsdp_tp)), "Replicate() Shard(0) Replicate() ");
  EXPECT_EQ(placement_str(placements(col, tp_only)), "Replicate() Shard(0) Shard(0) ");
  EXPECT_EQ(placement_str(placements(col, fsdp)), "Replicate() Shard(0) Replicate() ");
  EXPECT_EQ(placement_str(placements(row, fsdp)), "Replicate() Shard(0) Replicate() ");
}

// The plan's units and linears, and the kinds the amax table reads, agree with the specs.
TEST(ShardPlan, UnitsAndLinearKinds) {
  const Config c = testing::make_config({.layers = 2});
  const ShardPlan plan(c, DeviceMesh(1, 2, 1), 1, FaultHooks{});
  size_t in_units = 0;
  for (int64_t u : {kRootUnit, int64_t{0}, int64_t{1}}) {
    for (size_t i : plan.unit(u)) EXPECT_EQ(plan.params()[i].spec.unit, u);
    in_units += plan.unit(u).size();
  }
  EXPECT_EQ(in_units, plan.params().size());
  EXPECT_EQ(plan.linears().size(), 8u);  // 4 per GELU block
  for (const ShardedParam& p : plan.params()) {
    if (p.spec.quantized()) {
      EXPECT_EQ(plan.linear_kind(p.spec.linear), p.spec.linear_kind) << p.spec.name;
    }
  }
  EXPECT_THROW(plan.linear_kind("layers.0.attn.qkv.weight"), kernels::Error);
}

}  // namespace
}  // namespace meshproof::engine
