// Small GPT configurations for engine tests: one place for the knobs the suites vary (sizes,
// recipe, learning rate, seed) with the rest at values every suite shares.
#pragma once

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <vector>

#include "engine/config/config.h"
#include "engine/session/session.h"
#include "kernels/core/error.h"

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

// fp32 on any mesh reorders only reductions (gradient averaging over ranks, the loss and norm
// sums): docs/design.md section 8 allows rel 1e-5 per step. Measured: the largest loss deviation
// of the shard suites' meshes from one rank is ~1e-7 relative (fp32 rounding of reordered sums).
constexpr double kFp32Rel = 1e-5;

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

// The shard suites' model for the FP8 recipes: the default test model at hidden 64, ffn 128,
// vocab 64 (every dimension a multiple of the MXFP8 block of 32) and global batch 16.
inline Config fp8_model(RecipeKind kind) {
  return make_config(
      {.vocab = 64, .hidden = 64, .heads = 4, .ffn = 128, .batch = 16, .recipe = kind});
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

// The MoE model of the mesh tests (tests/engine/moe/moe_test.cc, moe_ep_test.cc): 2 layers, hidden
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

// Cross-mesh comparisons of attn.qkv.bias leave its key entries out: the key bias adds q·b_k to
// every score of a query row, which softmax ignores, so its true gradient is exactly 0 and the
// computed one is fp32 rounding noise (~1e-10) whose sign depends on the summation order; AdamW
// normalises any nonzero gradient to a ±lr step, so those entries are mesh-dependent by
// construction (measured: the only entries above rel 1e-5). Checks that each key entry of `got`
// moved by at most lr per step (`steps` steps from 0) and zeroes it in `got` and `want`. Key rows
// of KV group g: g(r+2)d + rd + [0, d) (docs/design.md section 24; r = 1 without grouped-query
// attention). Does nothing for another tensor.
inline void drop_key_bias(const Config& c, const std::string& name, std::vector<float>& got,
                          std::vector<float>& want, int64_t steps) {
  if (!name.ends_with("attn.qkv.bias")) return;
  const int64_t d = c.model.hidden / c.model.heads, kv = kv_heads_of(c.model);
  const int64_t r = c.model.heads / kv;
  for (int64_t g = 0; g < kv; ++g)
    for (int64_t k = 0; k < d; ++k) {
      const auto i = static_cast<size_t>(g * (r + 2) * d + r * d + k);
      EXPECT_LE(std::abs(got[i]), 1.01 * c.training.lr * static_cast<double>(steps))
          << name << " key bias " << i;
      got[i] = want[i] = 0;
    }
}

// Calls f, which must throw a kernels::Error of `kind`; returns its message ("" and a test
// failure when f returns).
template <class F>
std::string error_of(F&& f, kernels::ErrorKind kind) {
  try {
    f();
  } catch (const kernels::Error& e) {
    EXPECT_EQ(e.kind(), kind) << e.message();
    return e.message();
  }
  ADD_FAILURE() << "no error";
  return {};
}

}  // namespace meshproof::engine::testing
