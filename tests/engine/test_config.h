// Small GPT configurations for engine tests: one place for the knobs the suites vary (sizes,
// recipe, learning rate, seed) with the rest at values every suite shares.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cstring>
#include <string>

#include "engine/config.h"
#include "engine/session.h"

namespace meshproof::engine::testing {

// A mesh as a gtest case name: r<dp_replicate>_s<dp_shard>_t<tp>, then _sp with sequence
// parallelism and _ep<n> with expert parallelism, so a failing case names its mesh.
inline std::string mesh_case_name(const MeshSpec& m) {
  // fmt rather than operator+ chains: GCC 12 at -O3 reports a false -Wrestrict on those.
  return fmt::format("r{}_s{}_t{}{}{}", m.dp_replicate, m.dp_shard, m.tp,
                     m.sequence_parallel ? "_sp" : "", m.ep > 1 ? fmt::format("_ep{}", m.ep) : "");
}
// The INSTANTIATE_TEST_SUITE_P name generator of a suite parameterised over MeshSpec.
struct MeshCaseName {
  std::string operator()(const ::testing::TestParamInfo<MeshSpec>& info) const {
    return mesh_case_name(info.param);
  }
};

struct TestModel {
  int64_t vocab = 32;
  int64_t hidden = 16;
  int64_t heads = 4;
  int64_t layers = 1;
  int64_t ffn = 32;
  int64_t seq = 8;    // training.seq_len and model.max_positions
  int64_t batch = 8;  // global batch (rows)
  RecipeKind recipe = RecipeKind::kFp32;
  double lr = 1e-2;
  uint64_t seed = 7;
};

inline Config make_config(const TestModel& m) {
  Config c;
  c.model.vocab = m.vocab;
  c.model.hidden = m.hidden;
  c.model.heads = m.heads;
  c.model.layers = m.layers;
  c.model.ffn = m.ffn;
  c.model.max_positions = m.seq;
  c.training.batch = m.batch;
  c.training.seq_len = m.seq;
  c.training.lr = m.lr;
  c.training.weight_decay = 0.1;
  c.data.decay = 0.3;
  c.recipe.kind = m.recipe;
  c.seed = m.seed;
  // The data stream the suites' measured bounds were taken on (keyed by Config::seed before
  // data.seed existed).
  c.data.seed = m.seed;
  return c;
}

// A sharded run of `steps` steps of `c` on `mesh` with default FSDP options, CPU, local launcher.
// The smallest MoE model of the engine tests: the default test model with 2 layers, 4 experts,
// top 2 (no aux loss).
inline Config tiny_moe_config() {
  TestModel tm;
  tm.layers = 2;
  Config c = make_config(tm);
  c.model.moe.experts = 4;
  c.model.moe.top_k = 2;
  return c;
}

// The MoE model of the mesh tests (tests/engine/moe_test.cc, moe_ep_test.cc): 2 layers, hidden
// 32, ffn 64, 4 experts, top 2, aux loss 0.01, batch 16 (128 tokens: 32 per rank on 4 data ranks,
// whole MXFP8 32x1 blocks), under `recipe`.
inline Config moe_mesh_config(RecipeKind recipe) {
  TestModel tm;
  tm.layers = 2;
  tm.hidden = 32;
  tm.ffn = 64;
  tm.batch = 16;
  tm.recipe = recipe;
  Config c = make_config(tm);
  c.model.moe.experts = 4;
  c.model.moe.top_k = 2;
  c.model.moe.aux_loss_coef = 0.01;
  return c;
}

inline RunOptions run_options(const Config& c, MeshSpec mesh, int64_t steps) {
  RunOptions o;
  o.config = c;
  o.mesh = mesh;
  o.steps = steps;
  return o;
}

// Calls (or bytes, `bytes` true) of collective `kind` over `group` ("dp_shard", "tp",
// "dp_replicate+dp_shard", ...) recorded on one rank.
inline int64_t collective_total(const RankReport& r, const std::string& kind,
                                const std::string& group, bool bytes = false) {
  int64_t n = 0;
  for (const CollectiveRecord& c : r.collectives)
    if (c.kind == kind && c.group == group) n += bytes ? c.bytes : c.count;
  return n;
}

// Two runs bitwise equal: every step's loss and grad norm, every final parameter's bytes.
inline void expect_same_run(const RunResult& a, const RunResult& b, const std::string& ctx) {
  ASSERT_EQ(a.metrics.size(), b.metrics.size()) << ctx;
  for (size_t s = 0; s < a.metrics.size(); ++s) {
    EXPECT_EQ(a.metrics[s].loss, b.metrics[s].loss) << ctx << " step " << s;
    EXPECT_EQ(a.metrics[s].grad_norm, b.metrics[s].grad_norm) << ctx << " step " << s;
  }
  for (const auto& [name, t] : a.final_params) {
    const kernels::Tensor& u = b.final_params.at(name);
    EXPECT_EQ(std::memcmp(t.raw_data(), u.raw_data(), static_cast<size_t>(t.nbytes().value)), 0)
        << ctx << ": " << name;
  }
}

}  // namespace meshproof::engine::testing
