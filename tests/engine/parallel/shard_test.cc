#include <gtest/gtest.h>

#include <atomic>
#include <cmath>
#include <mutex>

#include "engine/checkpoint/state_keys.h"
#include "engine/model/trainer.h"
#include "engine/session/session.h"
#include "mesh/local/local_comm.h"
#include "tests/engine/test_config.h"

namespace meshproof::engine {
namespace {

Config tiny() { return testing::make_config({}); }

// Shapes no mesh up to 8 divides: vocab 37 (chunks of 5 and a last of 2 over 8 ranks), ffn 36,
// positions 13 (chunks of 2, then 1, then an empty chunk over 8 ranks), hidden 12 (head dim 3).
Config uneven() {
  Config c = tiny();
  c.model.vocab = 37;
  c.model.hidden = 12;
  c.model.heads = 4;
  c.model.ffn = 36;
  c.model.max_positions = 13;
  return c;
}

struct Reference {
  std::vector<StepMetrics> metrics;
  std::map<std::string, std::vector<float>> params_after_1;
};

Reference single_rank(const Config& c, int steps) {
  Reference r;
  Trainer t(c);
  for (int s = 0; s < steps; ++s) {
    r.metrics.push_back(t.step());
    if (s == 0)
      for (const std::string& n : t.params().names())
        r.params_after_1[n] = t.params().at(n).to_vector<float>();
  }
  return r;
}

double rel_norm_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double d = 0, n = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    d += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    n += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(d) / std::max(std::sqrt(n), 1e-30);
}

using testing::run_options;

std::string mesh_name(const MeshSpec& m) {
  return m.device_mesh().str() + (m.sequence_parallel ? ",sp" : "");
}

using testing::kFp32Rel;

void expect_matches_single_rank(const Config& c, const MeshSpec& m) {
  constexpr int kSteps = 10;
  const Reference ref = single_rank(c, kSteps);
  const RunResult one = run_training(run_options(c, m, 1));
  for (const auto& [name, want] : ref.params_after_1) {
    ASSERT_TRUE(one.final_params.count(name)) << name;
    std::vector<float> got = one.final_params.at(name).to_vector<float>();
    ASSERT_EQ(got.size(), want.size()) << name;
    std::vector<float> expect = want;
    testing::drop_key_bias(c, name, got, expect, 1);  // one step
    EXPECT_LE(rel_norm_diff(got, expect), kFp32Rel) << mesh_name(m) << " " << name;
  }
  const RunResult run = run_training(run_options(c, m, kSteps));
  ASSERT_EQ(run.metrics.size(), static_cast<size_t>(kSteps));
  for (int s = 0; s < kSteps; ++s) {
    const double want = ref.metrics[static_cast<size_t>(s)].loss;
    EXPECT_NEAR(run.metrics[static_cast<size_t>(s)].loss, want, kFp32Rel * std::abs(want))
        << mesh_name(m) << " step " << s;
    const double gn = ref.metrics[static_cast<size_t>(s)].grad_norm;
    // The global norm sums squares over the shards in another order: the same fp32 bound as
    // the loss (measured: worst 2.5e-7 relative over the 13 meshes x even/uneven x 10 steps).
    EXPECT_NEAR(run.metrics[static_cast<size_t>(s)].grad_norm, gn, kFp32Rel * gn)
        << mesh_name(m) << " step " << s;
  }
  EXPECT_EQ(run.ranks.size(), static_cast<size_t>(m.world_size()));
}

class Fp32Mesh : public ::testing::TestWithParam<MeshSpec> {};

TEST_P(Fp32Mesh, MatchesSingleRank) { expect_matches_single_rank(tiny(), GetParam()); }
TEST_P(Fp32Mesh, UnevenShapesMatchSingleRank) { expect_matches_single_rank(uneven(), GetParam()); }

// The acceptance meshes of issue 6 (1, dp_shard 2/4/8, dp_replicate 2 x dp_shard 2, tp 2/4,
// tp 2 + SP, dp_shard 2 x tp 2, dp_shard 4 x tp 2, dp_replicate 2 x dp_shard 2 x tp 2) plus pure
// replication and dp_shard 2 x tp 2 + SP; the recipe matrix below uses the same list.
const std::vector<MeshSpec> kMeshes = {
    MeshSpec{1, 1, 1},      MeshSpec{1, 2, 1}, MeshSpec{1, 4, 1}, MeshSpec{1, 8, 1},
    MeshSpec{2, 2, 1},      MeshSpec{2, 1, 1}, MeshSpec{1, 1, 2}, MeshSpec{1, 1, 4},
    MeshSpec{1, 2, 2},      MeshSpec{1, 4, 2}, MeshSpec{2, 2, 2}, MeshSpec{1, 1, 2, true},
    MeshSpec{1, 2, 2, true}};

// Llama-style models (docs/design.md section 24): RMSNorm, SwiGLU, RoPE (theta 500000), no
// biases, vocabulary-parallel embedding and LM head, grouped-query attention with KV 4 of 8 heads
// (KV % tp holds on every mesh above, tp 4 included) and a vocabulary (37) no tp size divides.
// The Llama-3 layer options both Llama test models share: 8 heads over 4 KV groups, RMSNorm,
// SwiGLU, RoPE (theta 500000), no biases, vocabulary-parallel embedding and LM head.
void llama_layers(ModelConfig& m) {
  m.heads = 8;
  m.kv_heads = 4;
  m.norm = NormKind::kRmsNorm;
  m.activation = Activation::kSwiGlu;
  m.position = PositionKind::kRope;
  m.rope_theta = 500000.0;
  m.bias = false;
  m.vocab_parallel = true;
}

Config llama() {
  Config c = tiny();
  c.model.vocab = 37;
  c.model.hidden = 32;
  c.model.ffn = 32;
  llama_layers(c.model);
  return c;
}

// KV 2 of 4 heads, tied embeddings (both gradients into the one vocabulary-parallel embed.tok),
// learned positions, biases, GELU/LayerNorm. tp 4 breaks KV % tp: an input error naming both.
Config llama_kv2_tied() {
  Config c = tiny();
  c.model.vocab = 37;
  c.model.kv_heads = 2;
  c.model.tied_embeddings = true;
  c.model.vocab_parallel = true;
  return c;
}

TEST_P(Fp32Mesh, LlamaMatchesSingleRank) { expect_matches_single_rank(llama(), GetParam()); }
TEST_P(Fp32Mesh, LlamaKv2TiedMatchesSingleRank) {
  const MeshSpec& m = GetParam();
  if (m.tp == 4) {
    try {
      run_training(run_options(llama_kv2_tied(), m, 1));
      FAIL() << "expected an input error for KV 2 over tp 4";
    } catch (const kernels::Error& e) {
      EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput) << e.what();
      EXPECT_NE(std::string(e.what()).find("model.kv_heads = 2 is not divisible by tp = 4"),
                std::string::npos)
          << e.what();
    }
    return;
  }
  expect_matches_single_rank(llama_kv2_tied(), m);
}

// tp 3: vocabulary 37 in torch.chunk rows 13, 13, 11 (and 7 rows per dp_shard piece with FSDP);
// KV 3 of 6 heads; sequence 9 for the SP mesh.
class Fp32MeshTp3 : public ::testing::TestWithParam<MeshSpec> {};

TEST_P(Fp32MeshTp3, LlamaUnevenVocabularyMatchesSingleRank) {
  Config c = llama();
  c.model.heads = 6;
  c.model.kv_heads = 3;
  c.model.hidden = 24;
  c.model.ffn = 36;
  c.model.max_positions = 9;
  c.training.seq_len = 9;
  expect_matches_single_rank(c, GetParam());
}

INSTANTIATE_TEST_SUITE_P(Meshes, Fp32MeshTp3,
                         ::testing::Values(MeshSpec{1, 1, 3}, MeshSpec{1, 2, 3},
                                           MeshSpec{1, 1, 3, true}),
                         testing::MeshCaseName{});

INSTANTIATE_TEST_SUITE_P(Meshes, Fp32Mesh, ::testing::ValuesIn(kMeshes), testing::MeshCaseName{});

TEST(ShardedMemory, FsdpParamAndOptimizerBytesScaleAsOneOverN) {
  const Config c = tiny();
  const RunResult one = run_training(run_options(c, {1, 1, 1}, 1));
  const int64_t full = one.ranks[0].memory.params + one.ranks[0].memory.optimizer;
  for (int n : {2, 4, 8}) {
    const RunResult r = run_training(run_options(c, {1, n, 1}, 1));
    for (const RankReport& rr : r.ranks) {
      const int64_t mine = rr.memory.params + rr.memory.optimizer;
      // Shard(0) chunks are ceil(rows/n): for these shapes (all row counts divisible by 8) the
      // share is exactly 1/n.
      EXPECT_EQ(mine * n, full) << "dp_shard=" << n << " rank " << rr.rank;
    }
  }
}

// Uneven shapes over dp_shard 8 (vocab 37 -> chunks of 5 and a last of 2; positions 13 -> 2,
// ..., 1, 0): every rank holds exactly its torch.chunk rows of each master, gradient shard and
// the two AdamW moments; HSDP replicas (dp_replicate 2 x dp_shard 4) hold what the dp_shard 4
// rank of the same shard index holds: nothing shrinks over dp_replicate.
TEST(ShardedMemory, UnevenChunksGradientsAndHsdpReplicas) {
  const Config c = uneven();
  const RunResult one = run_training(run_options(c, {1, 1, 1}, 1));
  constexpr int kShards = 8;
  const RunResult r = run_training(run_options(c, {1, kShards, 1}, 1));
  ASSERT_EQ(r.ranks.size(), static_cast<size_t>(kShards));
  for (const RankReport& rr : r.ranks) {
    int64_t elems = 0;
    for (const auto& [name, t] : one.final_params) {
      const int64_t rows = t.shape()[0], per_row = t.numel().value / rows;
      const int64_t chunk = (rows + kShards - 1) / kShards;
      const int64_t begin = std::min<int64_t>(rr.rank * chunk, rows);
      elems += (std::min(begin + chunk, rows) - begin) * per_row;
    }
    const int64_t bytes = elems * static_cast<int64_t>(sizeof(float));
    EXPECT_EQ(rr.memory.params, bytes) << "rank " << rr.rank;
    EXPECT_EQ(rr.memory.grads, bytes) << "rank " << rr.rank;
    EXPECT_EQ(rr.memory.optimizer, 2 * bytes) << "rank " << rr.rank;
  }
  const RunResult fsdp4 = run_training(run_options(c, {1, 4, 1}, 1));
  const RunResult hsdp = run_training(run_options(c, {2, 4, 1}, 1));
  for (const RankReport& rr : hsdp.ranks) {
    const RankReport& peer = fsdp4.ranks.at(static_cast<size_t>(rr.coords[1]));
    EXPECT_EQ(rr.memory.params, peer.memory.params) << "rank " << rr.rank;
    EXPECT_EQ(rr.memory.grads, peer.memory.grads) << "rank " << rr.rank;
    EXPECT_EQ(rr.memory.optimizer, peer.memory.optimizer) << "rank " << rr.rank;
  }
}

TEST(ShardedCollectives, OneGradientReductionPerParameterPerStepWithMicroBatches) {
  Config c = tiny();
  c.training.micro_batches = 2;
  const RunResult r = run_training(run_options(c, {2, 2, 1}, 3));
  const int64_t nparams = static_cast<int64_t>(param_specs(c.model).size());
  for (const RankReport& rr : r.ranks) {
    const int64_t rs = testing::collective_total(rr, "reduce_scatter", "dp_shard");
    const int64_t ar = testing::collective_total(rr, "all_reduce", "dp_replicate");
    // Deferred sync: one reduce-scatter and one replica all-reduce per parameter per step,
    // however many micro-batches.
    EXPECT_EQ(rs, 3 * nparams) << rr.rank;
    EXPECT_EQ(ar, 3 * nparams) << rr.rank;
  }
}

TEST(ShardedAccumulation, DeferredSyncMatchesPerMicroBatchSplit) {
  // Two micro-batches per rank accumulate locally before one reduction; the same global batch
  // without micro-batching differs only by the order of fp32 additions in the weight gradients.
  Config a = tiny(), b = tiny();
  b.training.micro_batches = 2;
  const RunResult ra = run_training(run_options(a, {1, 2, 1}, 3));
  const RunResult rb = run_training(run_options(b, {1, 2, 1}, 3));
  for (int s = 0; s < 3; ++s) {
    // fp32 rounding of differently ordered gradient sums: measured < 1e-7 relative.
    EXPECT_NEAR(ra.metrics[static_cast<size_t>(s)].loss, rb.metrics[static_cast<size_t>(s)].loss,
                1e-6 * ra.metrics[static_cast<size_t>(s)].loss);
  }
}

// Global AdamW first moments after one step (exp_avg = (1 - beta1) * gradient when clipping is
// off), assembled from every rank's state entries by an after_step hook.
// Global AdamW first moments after one step (exp_avg = (1 - beta1) * gradient when clipping is
// off), assembled from every rank's state entries by an after_step hook. The global tensors are
// made here: tensors made on a rank thread belong to that rank's memory tracker.
std::map<std::string, std::vector<float>> first_moments(const RunOptions& base, RunResult* out) {
  std::map<std::string, kernels::Tensor> global;
  for (const ParamSpec& p : param_specs(base.config.model))
    global.emplace(
        p.name, kernels::Tensor::zeros(p.shape, kernels::DType::kFloat32, kernels::Device::cpu()));
  std::mutex mu;
  RunOptions o = base;
  o.after_step = [&](ShardedState& st, mesh::RankComms& comms, int64_t) {
    const int rank = comms.rank();
    std::lock_guard<std::mutex> lock(mu);
    for (const StateEntry& e : st.entries) {
      if (!e.key.ends_with("/exp_avg")) continue;
      const std::string name = e.key.substr(6, e.key.size() - 6 - 8);  // optim/<name>/exp_avg
      kernels::Tensor& g = global.at(name);
      const mesh::Box& b = e.layout.box(rank);
      if (!b.empty()) mesh::copy_region(e.local, b, g, mesh::Box::whole(g.shape()), b);
    }
    return false;  // no checkpoint saved
  };
  *out = run_training(o);
  std::map<std::string, std::vector<float>> m;
  for (const auto& [n, t] : global) m[n] = t.to_vector<float>();
  return m;
}

TEST(ShardedAccumulation, DeferredSyncMatchesSyncEachMicroBatchWithinTheFp32Bound) {
  // One step, 4 micro-batches per data-parallel rank, clipping off: the reduced gradient is
  // g = sum over ranks r and micro-batches k of t_{r,k} / dp in both modes; only the order of the
  // fp32 additions differs. Deferred sync adds each micro-batch's contribution into the rank's
  // accumulator and then reduces over the dp ranks (rank order); per-micro-batch sync reduces
  // every micro-batch's gradient over the ranks and sums the n_mb reduced shards. Division by
  // dp (2 or 4) is exact. GEMM weights, biases and norm weights add one partial sum per
  // micro-batch (computed from zero, identical in both modes); the embedding backward adds each
  // token's row one by one into the accumulator. With u = 2^-24, every result is within
  // h * u * S of the exact sum (recursive summation, first order), h the longest chain of
  // roundings, S_i = sum of |terms| of element i: so
  //   |g_deferred - g_each| <= 2 h u S_i,  h = T + n_mb + dp,
  // T = tokens per rank and step (the embedding's per-token chain; n_mb + dp suffices for the
  // other parameters, T keeps one bound for all). S_i is computed here from per-row single-rank
  // backward passes: for one row, embed.pos's gradient is that row's token gradients dx[b, s]
  // exactly (one term per position), which give the embedding's per-token terms; for every other
  // parameter sum_b |grad_b| bounds the sum of |micro-batch partial sums|. (On the tp mesh the
  // rank-local terms are TP pieces of the same sums: S changes by fp32 rounding only.)
  // Compared through exp_avg = fl((1 - beta1) g): |dm| <= (1 - beta1) |dg| + u (|m_a| + |m_b|).
  // Measured: worst |dm| 1.9e-9 on each mesh, at most 2.1% (1,2,1), 4.6% (2,2,1), 2.5% (1,2,2)
  // of its element's bound; 1479 / 1629 / 1422 elements differ, so the modes do round apart.
  Config c = tiny();
  c.training.batch = 16;  // 4 micro-batches of one row on each of the 4 ranks of (2, 2, 1)
  c.training.micro_batches = 4;
  c.training.max_grad_norm = 0;  // clipping off: exp_avg is (1 - beta1) * gradient
  const int64_t B = c.training.batch, S = c.training.seq_len;
  const double positions = static_cast<double>(B * S);
  const double u = std::ldexp(1.0, -24);

  // Per-row gradients of step 0 (fp32, single rank, scaled to the mean loss).
  const GptModel model(c);
  const TensorMap w0 = init_params(c.model, c.seed);
  const MarkovSource data(c.model.vocab, c.data, B, S);
  std::map<std::string, std::vector<double>> sum_abs;
  const int64_t H = c.model.hidden;
  for (int64_t b = 0; b < B; ++b) {
    TensorMap g;
    for (const std::string& n : w0.names())
      g.insert(n, kernels::Tensor::zeros(w0.at(n).shape(), kernels::DType::kFloat32,
                                         kernels::Device::cpu()));
    const kernels::Tensor tokens = data.rows(0, b, b + 1);
    model.forward_backward(w0, tokens, {0, b}, 1.0 / positions, g);
    for (const std::string& n : g.names()) {
      const std::vector<float> v = g.at(n).to_vector<float>();
      std::vector<double>& acc = sum_abs[n];
      acc.resize(v.size(), 0.0);
      for (size_t i = 0; i < v.size(); ++i) acc[i] += std::abs(v[i]);
    }
    // embed.tok: token id[s]'s row also gets |dx[b, s]| = |grad_b(embed.pos)[s]| per position
    // (its per-token terms; the line above covers a tied lm_head's GEMM partial sums).
    const std::vector<float> dpos = g.at("embed.pos").to_vector<float>();
    const std::vector<int32_t> ids = tokens.to_vector<int32_t>();
    std::vector<double>& tok = sum_abs["embed.tok"];
    for (int64_t s = 0; s < S; ++s)
      for (int64_t h = 0; h < H; ++h)
        tok[static_cast<size_t>(ids[static_cast<size_t>(s)] * H + h)] +=
            std::abs(dpos[static_cast<size_t>(s * H + h)]);
  }

  const double c1 = static_cast<float>(1.0 - c.training.beta1);
  const int64_t nparams = static_cast<int64_t>(param_specs(c.model).size());
  for (const MeshSpec& m : {MeshSpec{1, 2, 1}, MeshSpec{2, 2, 1}, MeshSpec{1, 2, 2}}) {
    RunOptions deferred = run_options(c, m, 1), each = deferred;
    each.fsdp.sync_each_micro_batch = true;
    RunResult rd, re;
    const auto md = first_moments(deferred, &rd), me = first_moments(each, &re);
    const int64_t dp = m.dp_replicate * m.dp_shard;
    const double h = static_cast<double>(B / dp * S + c.training.micro_batches + dp);
    double worst_ratio = 0, worst_abs = 0;
    int64_t differing = 0;
    for (const auto& [name, a] : md) {
      const std::vector<float>& b = me.at(name);
      const std::vector<double>& sa = sum_abs.at(name);
      ASSERT_EQ(a.size(), b.size()) << name;
      for (size_t i = 0; i < a.size(); ++i) {
        const double d = std::abs(static_cast<double>(a[i]) - b[i]);
        const double bound = c1 * 2 * h * u * sa[i] + u * (std::abs(a[i]) + std::abs(b[i]));
        EXPECT_LE(d, bound) << mesh_name(m) << " " << name << "[" << i << "]";
        differing += d > 0;
        worst_abs = std::max(worst_abs, d);
        if (bound > 0) worst_ratio = std::max(worst_ratio, d / bound);
      }
    }
    RecordProperty(fmt::format("{}_worst_abs", mesh_name(m)), fmt::format("{:.3g}", worst_abs));
    RecordProperty(fmt::format("{}_worst_of_bound", mesh_name(m)),
                   fmt::format("{:.3g}", worst_ratio));
    RecordProperty(fmt::format("{}_elements_differing", mesh_name(m)), std::to_string(differing));
    // Collective counters: deferred sync reduce-scatters each parameter's gradient once per
    // step, per-micro-batch sync once per micro-batch (HSDP: the replica all-reduce likewise).
    for (size_t r = 0; r < rd.ranks.size(); ++r) {
      const int64_t rs_d = testing::collective_total(rd.ranks[r], "reduce_scatter", "dp_shard");
      const int64_t rs_e = testing::collective_total(re.ranks[r], "reduce_scatter", "dp_shard");
      const int64_t ar_d = testing::collective_total(rd.ranks[r], "all_reduce", "dp_replicate");
      const int64_t ar_e = testing::collective_total(re.ranks[r], "all_reduce", "dp_replicate");
      EXPECT_EQ(rs_d, nparams) << mesh_name(m) << " rank " << r;
      EXPECT_EQ(rs_e, c.training.micro_batches * nparams) << mesh_name(m) << " rank " << r;
      const int64_t replicas = m.dp_replicate > 1 ? 1 : 0;
      EXPECT_EQ(ar_d, replicas * nparams) << mesh_name(m) << " rank " << r;
      EXPECT_EQ(ar_e, replicas * c.training.micro_batches * nparams)
          << mesh_name(m) << " rank " << r;
    }
  }
}

TEST(ShardedFaults, HsdpReplicasNotReducedDiverge) {
  const Config c = tiny();
  RunOptions good = run_options(c, {2, 2, 1}, 3), bad = good;
  bad.faults.hsdp_replicas_not_reduced = true;
  const RunResult rg = run_training(good), rb = run_training(bad);
  // Without the replica all-reduce the two replica groups update with different gradients, so
  // the final weights differ from the correct run.
  double worst = 0;
  for (const auto& [n, t] : rg.final_params)
    worst = std::max(worst,
                     rel_norm_diff(rb.final_params.at(n).to_vector<float>(), t.to_vector<float>()));
  EXPECT_GT(worst, 1e-3);
}

TEST(ShardedState, EntriesCoverModelOptimizerAndDelayedScalingState) {
  Config c = tiny();
  c.model.hidden = 32;
  c.model.ffn = 64;
  c.recipe.kind = RecipeKind::kDelayed;
  c.recipe.amax_history_len = 4;
  mesh::LocalWorld world(mesh::DeviceMesh(1, 2, 2));
  world.run([&](mesh::RankComms& comms) {
    RunOptions o = run_options(c, {1, 2, 2}, 1);
    TrainingSession s(o, comms);
    const ShardedState& st = s.state();
    const size_t nparams = param_specs(c.model).size();
    // 3 entries per parameter + (scale, amax_history) x 3 roles x 4 linears per layer.
    EXPECT_EQ(st.entries.size(), 3 * nparams + 2 * 3 * 4 * c.model.layers);
    for (const StateEntry& e : st.entries)
      EXPECT_EQ(e.local.shape(), e.layout.local_shape(comms.rank())) << e.key;
    EXPECT_EQ(st.scalars.at(keys::kOptimStep), 0);
    s.step();
    // The entries alias the live tensors: after a step the amax history holds the step's amax.
    bool any_nonzero = false;
    for (const StateEntry& e : s.state().entries)
      if (e.key.ends_with("attn.qkv/weight/amax_history"))
        for (float v : e.local.to_vector<float>()) any_nonzero |= v != 0.0f;
    EXPECT_TRUE(any_nonzero);
    EXPECT_EQ(s.state().scalars.at(keys::kOptimStep), 1);
    EXPECT_EQ(s.state().scalars.at(keys::kDataCursor), 1);
  });
}

TEST(ShardedInput, BadMeshAndBatchAreInputErrors) {
  Config c = tiny();
  c.training.batch = 6;
  try {
    run_training(run_options(c, {1, 4, 1}, 1));
    FAIL() << "expected an input error";
  } catch (const kernels::Error& e) {
    EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
    EXPECT_NE(std::string(e.what()).find("training.batch"), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace meshproof::engine

namespace meshproof::engine {
namespace {

using testing::fp8_model;

struct RecipeCase {
  RecipeKind kind;
  MeshSpec mesh;
};

class RecipeMesh : public ::testing::TestWithParam<RecipeCase> {};

// MXFP8 needs every GEMM operand in 32-element blocks along both dims (engine/config/config.cc for
// the single-rank shapes, the session for the sharded ones). With fp8_model two meshes of the
// matrix break that and are rejected as input errors before the first step: dp_shard 8 leaves 16 /
// 8 rows x 8 positions = 16 tokens per rank, and tp 4 cuts qkv [192, 64] into [48, 64] shards.
// Those cases assert the rejection instead of a loss.
bool mxfp8_rejects(const MeshSpec& m) { return m.dp_replicate * m.dp_shard == 8 || m.tp == 4; }

// The Llama-style FP8 model (docs/design.md section 24): 8 heads over 4 KV groups (KV % tp holds
// up to tp 4), RoPE, SwiGLU, RMSNorm, no biases, an odd vocabulary (67) split by rows over tp.
Config llama_fp8_model(RecipeKind kind) {
  Config c = fp8_model(kind);
  c.model.vocab = 67;
  llama_layers(c.model);
  return c;
}

void expect_loss_tracks_single_rank(const Config& c, const RecipeCase& rc) {
  if (rc.kind == RecipeKind::kMxfp8 && mxfp8_rejects(rc.mesh)) {
    try {
      run_training(run_options(c, rc.mesh, 1));
      FAIL() << "expected an input error for mxfp8 on " << mesh_name(rc.mesh);
    } catch (const kernels::Error& e) {
      EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput) << e.what();
      EXPECT_NE(std::string(e.what()).find("recipe = mxfp8 on mesh"), std::string::npos)
          << e.what();
    }
    return;
  }
  constexpr int kSteps = 4;
  const Reference ref = single_rank(c, kSteps);
  const RunResult run = run_training(run_options(c, rc.mesh, kSteps));
  double worst = 0;
  for (int s = 0; s < kSteps; ++s) {
    const double want = ref.metrics[static_cast<size_t>(s)].loss;
    worst = std::max(worst, std::abs(run.metrics[static_cast<size_t>(s)].loss - want) / want);
  }
  // Sharding changes GEMM reduction lengths (TP) and gradient summation order (DP); in bf16 and
  // FP8 the rounding of reordered sums and of re-quantized operands near a rounding boundary
  // shifts the loss slightly. docs/design.md section 8 allows 1e-2 for bf16; the same bound is used
  // for the FP8 recipes. Measured worst relative loss deviation over 4 steps on the 13 meshes
  // (kMeshes):
  //   bf16     2.5e-3 (every tp 2 mesh, with or without SP), 1.2e-3 (tp 4), <= 2.9e-5 on the
  //            data-parallel meshes (dp_shard 8);
  //   delayed  3.7e-3 (tp 2, tp 2 + SP), 2.9e-3 (tp 4), 2.2e-3 (dp_shard 4, dp_replicate 2 x
  //            dp_shard 2), 1.4e-3 (dp_replicate 2 x dp_shard 2 x tp 2);
  //   current  3.3e-3 (every tp 2 mesh), 2.4e-3 (tp 4), 0 on every data-parallel mesh;
  //   mxfp8    1.4e-3 (every tp 2 mesh), 0 on the data-parallel meshes (dp_shard 8 and tp 4 are
  //            rejected, see mxfp8_rejects);
  //   block    1.4e-3 (every tp mesh), 0 on the data-parallel meshes.
  //   nvfp4    7.2e-3 (tp 2, with or without SP, and every dp x tp 2 mesh), 1.5e-3 (tp 4),
  //            2.7e-3 (dp 2: dp_shard 2 or dp_replicate 2), 0 on dp 4 and dp 8 (2026-11-24).
  //            The decoded NVFP4 values carry gds (any fp32), so unlike FP8 products their fp32
  //            sums round and a reordered sum moves values across E2M1 boundaries; 7.2e-3 is
  //            within the bound by a factor 1.4 only.
  // The worst case, 3.7e-3, leaves a factor 2.7 to the bound. Pure data parallelism is exact for
  // current/mxfp8/block: the amax is MAX-reduced over the ranks sharing each tensor, and the
  // output gradients, which each rank computes for its objective scaled by the (power-of-2)
  // data-parallel size, get scales derived from their own amax that absorb that factor exactly.
  // Delayed scaling quantizes with the history's scale (1 at step 0), so the scaled gradients
  // round differently (e5m2 subnormals), hence its deviation on data-parallel meshes.
  EXPECT_LE(worst, 1e-2) << recipe_name(rc.kind) << " on " << mesh_name(rc.mesh);
  ::testing::Test::RecordProperty("worst_rel_loss", std::to_string(worst));
}

TEST_P(RecipeMesh, LossTracksSingleRank) {
  expect_loss_tracks_single_rank(fp8_model(GetParam().kind), GetParam());
}
// The same bound for the Llama-style model (its mxfp8 rejections are the same meshes: hidden 64
// over tp 4 and 16 tokens per rank on 8 data-parallel ranks). Measured worst relative loss
// deviation over 4 steps (this machine, 2026-11-24): delayed 4.1e-3 (tp 4), 3.1e-3 (tp 2, with or
// without SP); current 2.6e-3 (tp 4); block 1.9e-3 (tp 4); every other case below 1.7e-3. The
// worst leaves a factor 2.4 to the bound.
TEST_P(RecipeMesh, LlamaLossTracksSingleRank) {
  expect_loss_tracks_single_rank(llama_fp8_model(GetParam().kind), GetParam());
}

TEST(ShardedFaults, AmaxNotReducedChangesCurrentScalingOnDataParallelRanks) {
  // With the amax reduced, current scaling on dp_shard=2 reproduces the single-rank losses
  // exactly (measured above); without it each rank scales its half of the rows by its own amax.
  const Config c = fp8_model(RecipeKind::kCurrent);
  RunOptions good = run_options(c, {1, 2, 1}, 3), bad = good;
  bad.faults.amax_not_reduced = true;
  const RunResult rg = run_training(good), rb = run_training(bad);
  double diff = 0;
  for (int s = 0; s < 3; ++s)
    diff = std::max(diff, std::abs(rg.metrics[static_cast<size_t>(s)].loss -
                                   rb.metrics[static_cast<size_t>(s)].loss));
  EXPECT_GT(diff, 0.0);
}

std::vector<RecipeCase> recipe_cases() {
  std::vector<RecipeCase> out;
  for (RecipeKind k : {RecipeKind::kBf16, RecipeKind::kDelayed, RecipeKind::kCurrent,
                       RecipeKind::kMxfp8, RecipeKind::kBlock, RecipeKind::kNvfp4})
    for (const MeshSpec& m : kMeshes) out.push_back({k, m});
  return out;
}

INSTANTIATE_TEST_SUITE_P(Recipes, RecipeMesh, ::testing::ValuesIn(recipe_cases()),
                         [](const auto& info) {
                           const RecipeCase& rc = info.param;
                           return fmt::format("{}_r{}_s{}_t{}{}", recipe_name(rc.kind),
                                              rc.mesh.dp_replicate, rc.mesh.dp_shard, rc.mesh.tp,
                                              rc.mesh.sequence_parallel ? "_sp" : "");
                         });

}  // namespace
}  // namespace meshproof::engine

namespace meshproof::engine {
namespace {

std::vector<float> bytes_of(const kernels::Tensor& t) { return t.to_vector<float>(); }

struct GatherCase {
  RecipeKind kind;
  MeshSpec mesh;
};
class Fp8GatherRun : public ::testing::TestWithParam<GatherCase> {};

void expect_fp8_gather_bitwise(const Config& c, const GatherCase& gc) {
  // gather(quantize(shard)) is bitwise quantize(gather(shard)) (amax reduced over the same
  // group), so the FP8 all-gather run must reproduce the high-precision-gather run exactly.
  RunOptions hp = run_options(c, gc.mesh, 3), f8 = hp;
  f8.fsdp.fp8_all_gather = true;
  const RunResult a = run_training(hp), b = run_training(f8);
  for (int s = 0; s < 3; ++s) {
    EXPECT_EQ(a.metrics[static_cast<size_t>(s)].loss, b.metrics[static_cast<size_t>(s)].loss) << s;
    EXPECT_EQ(a.metrics[static_cast<size_t>(s)].grad_norm,
              b.metrics[static_cast<size_t>(s)].grad_norm)
        << s;
  }
  // No MXFP8 fallback note: every GEMM weight travelled as FP8.
  EXPECT_TRUE(b.notes.empty()) << b.notes.front();
  // Gathered bytes (collective counters, rank 0, dp_shard all-gathers): the high-precision run
  // gathers fp32 master shards (4 bytes per element); the FP8 run gathers the GEMM weights as
  // FP8 data + scales and everything else as before. E = GEMM-weight elements gathered (TP-local
  // boxes, gathered for the forward and again for the backward: reshard_after_forward).
  const auto gathered = [](const RunResult& r) {
    return testing::collective_total(r.ranks[0], "all_gather", "dp_shard", /*bytes=*/true);
  };
  int64_t e = 0;
  for (const ParamSpec& p : param_specs(c.model)) {
    const bool gemm = p.shape.rank() == 2 && p.name.starts_with("layers.");
    if (gemm) e += 3 * 2 * p.shape.numel().value / gc.mesh.tp;
  }
  const double saved_per_element = static_cast<double>(gathered(a) - gathered(b)) / e;
  ::testing::Test::RecordProperty("saved_bytes_per_gemm_element",
                                  fmt::format("{:.3f}", saved_per_element));
  // Per-tensor FP8: 1 byte per element (+ a 4-byte scale per shard), so ~3 bytes saved; mxfp8:
  // rowwise and columnwise data + e8m0 scales, ~2.06 bytes, so ~1.94 saved. Measured: 3.000 for
  // current and delayed on every mesh here, 1.938 for mxfp8. At least 1.5 bytes saved per
  // element means the weights did not travel in 16 or 32 bits.
  EXPECT_GE(saved_per_element, 1.5) << gathered(a) << " vs " << gathered(b);
}

TEST_P(Fp8GatherRun, BitwiseEqualToHighPrecisionGather) {
  expect_fp8_gather_bitwise(fp8_model(GetParam().kind), GetParam());
}
// The Llama-style model: KV-grouped qkv rows [128, 64] (64 rows = 2 whole groups per tp 2 rank),
// gate/up/fc2 without biases; the vocabulary-parallel embedding and LM head are not quantized.
TEST_P(Fp8GatherRun, LlamaBitwiseEqualToHighPrecisionGather) {
  expect_fp8_gather_bitwise(llama_fp8_model(GetParam().kind), GetParam());
}

INSTANTIATE_TEST_SUITE_P(Recipes, Fp8GatherRun,
                         // mxfp8 only where every dp_shard shard has 32-aligned rows:
                         // qkv [192, 64] over dp_shard 2 gives 96-row shards; with tp 2 or
                         // dp_shard 4 they would have 48 or 24 rows (the fallback, tested by
                         // Fp8GatherRunNotes).
                         ::testing::Values(GatherCase{RecipeKind::kCurrent, {1, 2, 1}},
                                           GatherCase{RecipeKind::kCurrent, {1, 2, 2}},
                                           GatherCase{RecipeKind::kDelayed, {1, 2, 1}},
                                           GatherCase{RecipeKind::kDelayed, {1, 2, 2}},
                                           GatherCase{RecipeKind::kCurrent, {2, 2, 1}},
                                           GatherCase{RecipeKind::kDelayed, {2, 2, 1}},
                                           GatherCase{RecipeKind::kCurrent, {1, 4, 2}},
                                           GatherCase{RecipeKind::kDelayed, {1, 4, 2}},
                                           GatherCase{RecipeKind::kMxfp8, {1, 2, 1}},
                                           GatherCase{RecipeKind::kMxfp8, {2, 2, 1}}),
                         [](const auto& info) {
                           const GatherCase& g = info.param;
                           return fmt::format("{}_r{}_s{}_t{}", recipe_name(g.kind),
                                              g.mesh.dp_replicate, g.mesh.dp_shard, g.mesh.tp);
                         });

// Current scaling with recipe.power_2_scale and recipe.eps: the FP8 all-gather quantizes the
// weight shards with the recipe's scale options, so it still reproduces the high-precision-gather
// run bitwise (it used plain fp8_max / amax scales before, issue #17.2).
TEST(Fp8GatherRunOptions, CurrentScaleOptionsReachTheGatheredWeights) {
  Config c = fp8_model(RecipeKind::kCurrent);
  c.recipe.power_2_scale = true;
  c.recipe.eps = 0.25;  // above some weight shards' amax (N(0, 0.02) init)
  RunOptions hp = run_options(c, {1, 2, 2}, 3), f8 = hp;
  f8.fsdp.fp8_all_gather = true;
  testing::expect_same_run(run_training(hp), run_training(f8), "current pow2 eps 0.25");
}

TEST(ShardedFaults, StaleColumnwiseCopyChangesTheRun) {
  // Step 0 has no previous copy; from step 1 on dgrad uses the weight of the previous step.
  const Config c = fp8_model(RecipeKind::kCurrent);
  RunOptions good = run_options(c, {1, 2, 1}, 3), bad = good;
  bad.faults.stale_columnwise_copy = true;
  const RunResult rg = run_training(good), rb = run_training(bad);
  EXPECT_EQ(rg.metrics[0].loss, rb.metrics[0].loss);
  EXPECT_EQ(rg.metrics[1].loss, rb.metrics[1].loss);  // step 1's forward is still right
  EXPECT_NE(rg.metrics[1].grad_norm, rb.metrics[1].grad_norm);
  EXPECT_NE(rg.metrics[2].loss, rb.metrics[2].loss);
}

TEST(ShardedFaults, TpFsdpLeftToRightDescribesTheWrongRows) {
  const Config c = tiny();
  mesh::LocalWorld world(mesh::DeviceMesh(1, 2, 2));
  world.run([&](mesh::RankComms& comms) {
    RunOptions o = run_options(c, {1, 2, 2}, 1);
    TrainingSession good(o, comms);
    o.faults.tp_fsdp_left_to_right = true;
    TrainingSession bad(o, comms);
    for (size_t i = 0; i < good.state().entries.size(); ++i) {
      const StateEntry& g = good.state().entries[i];
      const StateEntry& b = bad.state().entries[i];
      EXPECT_EQ(bytes_of(g.local), bytes_of(b.local)) << g.key;  // same data
      if (g.key == "model/layers.0.attn.qkv.weight") {
        EXPECT_EQ(g.layout.placement(mesh::MeshDim::kDpShard).str(), "StridedShard(0, sf=2)");
        EXPECT_EQ(b.layout.placement(mesh::MeshDim::kDpShard).str(), "Shard(0)");
        // (dp=1, tp=0) holds rows 12..23 of 48 (strided); left-to-right says rows 24..35.
        if (comms.rank() == 2) {
          EXPECT_NE(g.layout.box(2), b.layout.box(2));
        }
      }
    }
  });
}

TEST(Fp8GatherRunNotes, Mxfp8UnalignedShardsReportTheFallback) {
  Config c = fp8_model(RecipeKind::kMxfp8);
  // qkv [192, 64] over 4 ranks: 48-row shards, not multiples of 32 (fc1 [128, 64]: 32, aligned).
  RunOptions o = run_options(c, {1, 4, 1}, 1);
  o.fsdp.fp8_all_gather = true;
  const RunResult r = run_training(o);
  ASSERT_FALSE(r.notes.empty());
  EXPECT_NE(r.notes.front().find("fell back to a high-precision gather"), std::string::npos)
      << r.notes.front();
}

}  // namespace
}  // namespace meshproof::engine

namespace meshproof::engine {
namespace {

TEST(ShardedRun, TraceHooksAndReports) {
  const Config c = tiny();
  RunOptions o = run_options(c, {1, 2, 2}, 2);
  o.trace = true;
  std::atomic<int> saves{0};
  int progress = 0;
  o.on_step = [&](const StepMetrics&) { ++progress; };
  o.after_step = [&](ShardedState& st, mesh::RankComms&, int64_t done) {
    EXPECT_EQ(st.scalars.at(keys::kOptimStep), done);
    ++saves;
    return false;
  };
  const RunResult r = run_training(o);
  EXPECT_EQ(progress, 2);
  EXPECT_EQ(saves.load(), 2 * 4);  // every rank, every step
  ASSERT_EQ(r.trace.size(), 2u);
  const size_t nparams = param_specs(c.model).size();
  EXPECT_EQ(r.trace[0].size(), 2 * nparams);  // grads and params
  // The traced parameters after the last step are the final parameters.
  for (const TensorDigest& d : r.trace[1])
    if (d.name == "param/embed.tok") {
      const std::vector<float> v = r.final_params.at("embed.tok").to_vector<float>();
      double sum = 0;
      for (float x : v) sum += x;
      EXPECT_EQ(d.sum, sum);
      EXPECT_EQ(d.values, v);  // the values the first-diverging-tensor evidence measures
    }
  ASSERT_EQ(r.ranks.size(), 4u);
  for (const RankReport& rr : r.ranks) {
    EXPECT_GT(rr.memory.params, 0);
    EXPECT_GT(rr.memory.peak, 0);
    EXPECT_GT(testing::collective_total(rr, "all_reduce", "tp"), 0) << rr.rank;
  }
  ASSERT_EQ(r.times.size(), 2u);
  EXPECT_GT(r.times[0].total, 0.0);
  // The breakdown's parts are disjoint: every collective runs inside the compute or optimizer
  // interval (or the loss reduction between them) and is subtracted from it, so the parts add up
  // to at most the step. All intervals are read from one steady clock and nest; the 1 us slack
  // covers the double rounding of summing a few hundred per-collective durations.
  for (const StepTime& t : r.times) {
    double coll = 0;
    for (const auto& [kind, seconds] : t.collectives) coll += seconds;
    EXPECT_GT(coll, 0.0);
    EXPECT_GE(t.compute, -1e-6);
    EXPECT_GE(t.optimizer, -1e-6);
    EXPECT_LE(t.compute + coll + t.optimizer, t.total + 1e-6);
  }
}

}  // namespace
}  // namespace meshproof::engine

// ---- NVFP4 all-gather on the mesh matrix (docs/design.md section 28)
namespace meshproof::engine {
namespace {

// fp8_model's GEMM weights (qkv [192, 64], proj [64, 64], fc1 [128, 64], fc2 [64, 128]) cut into
// dp_shard pieces of their TP-local rows: the FP4 all-gather needs whole 16x16 tiles per shard.
// Two meshes of the matrix break that and are refused up front: dp_shard 8 (qkv 24-row shards,
// proj/fc2 8-row shards) and dp_shard 4 x tp 2 (qkv 96 rows per tp rank in 24-row shards).
bool nvfp4_gather_rejects(const MeshSpec& m) {
  return m.dp_shard == 8 || (m.dp_shard == 4 && m.tp == 2);
}

class Nvfp4GatherMesh : public ::testing::TestWithParam<MeshSpec> {};

// The FP4 all-gather run reproduces the high-precision-gather run bitwise (gather(quantize(shard))
// is quantize(gather(shard)) with the reduced global amax), and allgather_parity finds every
// gathered weight, every gather of every step, byte-equal to the single-rank quantization.
TEST_P(Nvfp4GatherMesh, BitwiseEqualToHighPrecisionGatherWithParity) {
  const MeshSpec m = GetParam();
  const Config c = fp8_model(RecipeKind::kNvfp4);
  constexpr int64_t kSteps = 2;
  RunOptions hp = run_options(c, m, kSteps), f4 = hp;
  f4.fsdp.fp8_all_gather = true;
  f4.allgather_parity = true;
  if (nvfp4_gather_rejects(m)) {
    try {
      run_training(f4);
      FAIL() << "expected an input error for the FP4 all-gather on " << mesh_name(m);
    } catch (const kernels::Error& e) {
      EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput) << e.what();
      EXPECT_NE(std::string(e.what()).find("the FP4 all-gather needs every shard to hold a "
                                           "non-empty multiple of 16 rows"),
                std::string::npos)
          << e.what();
    }
    return;
  }
  const RunResult a = run_training(hp), b = run_training(f4);
  testing::expect_same_run(a, b, "nvfp4 fp4 all-gather on " + mesh_name(m));
  // One record per GEMM weight per gather: before the forward and again before the backward
  // (reshard_after_forward), every step.
  int64_t gemm_weights = 0;
  for (const ParamSpec& p : param_specs(c.model)) gemm_weights += p.quantized() ? 1 : 0;
  ASSERT_EQ(static_cast<int64_t>(b.parity.size()), kSteps * 2 * gemm_weights) << mesh_name(m);
  for (const AllGatherParity& p : b.parity) {
    EXPECT_GT(p.bytes, 0) << p.tensor;
    EXPECT_EQ(p.mismatched_bytes, 0) << p.tensor << " step " << p.step << " on " << mesh_name(m);
    EXPECT_EQ(p.scale_inv, p.reference_scale_inv) << p.tensor;
  }
}

INSTANTIATE_TEST_SUITE_P(Meshes, Nvfp4GatherMesh, ::testing::ValuesIn(kMeshes),
                         testing::MeshCaseName{});

// The bytes on the wire (the dp_shard all-gather figures of the collective records, rank 0): the
// FP4 all-gather moves each GEMM weight element as half a byte plus one E4M3 code per 16x16 tile
// (1/256 byte), against one byte for per-tensor FP8 and four for the fp32 master: exactly
// 0.5 + 1/256 bytes per element, 0.504 of FP8's. Every other parameter travels as its fp32
// master in all three runs. Counts, not timings: deterministic.
class Nvfp4GatherBytes : public ::testing::TestWithParam<MeshSpec> {};

TEST_P(Nvfp4GatherBytes, GemmWeightsTravelAsFp4) {
  const MeshSpec m = GetParam();
  const auto gathered = [&](RecipeKind kind, bool fp8_all_gather) {
    RunOptions o = run_options(fp8_model(kind), m, 1);
    o.fsdp.fp8_all_gather = fp8_all_gather;
    const RunResult r = run_training(o);
    return testing::collective_total(r.ranks[0], "all_gather", "dp_shard", /*bytes=*/true);
  };
  // GEMM weight elements gathered in the step: TP-local boxes, forward and backward.
  int64_t e = 0;
  for (const ParamSpec& p : param_specs(fp8_model(RecipeKind::kNvfp4).model))
    if (p.quantized()) e += 2 * p.shape.numel().value / m.tp;
  const int64_t hp = gathered(RecipeKind::kNvfp4, false);
  const int64_t rest = hp - 4 * e;  // everything but the GEMM weights, as fp32
  const double fp4 = static_cast<double>(gathered(RecipeKind::kNvfp4, true) - rest) / e;
  const double fp8 = static_cast<double>(gathered(RecipeKind::kCurrent, true) - rest) / e;
  EXPECT_EQ(fp4, 0.5 + 1.0 / 256) << mesh_name(m);
  EXPECT_EQ(fp8, 1.0) << mesh_name(m);
  ::testing::Test::RecordProperty("fp4_bytes_per_gemm_element_" + mesh_name(m),
                                  fmt::format("{:.6f}", fp4));
}

INSTANTIATE_TEST_SUITE_P(Meshes, Nvfp4GatherBytes,
                         ::testing::Values(MeshSpec{1, 2, 1}, MeshSpec{1, 2, 2}),
                         testing::MeshCaseName{});

// The fault's engine side: with the weights' global amax not reduced the FP4 all-gather no longer
// equals the single-rank quantization, and allgather_parity names the weights (every GEMM weight
// here: of its two shards the one without the weight's largest element has a smaller amax; the
// byte counts are summed over the ranks, the scale_inv values are rank 0's, which is right where
// rank 0 holds the largest element).
TEST(Nvfp4GatherFaults, GlobalAmaxNotReducedFailsParity) {
  RunOptions o = run_options(fp8_model(RecipeKind::kNvfp4), {1, 2, 1}, 1);
  o.fsdp.fp8_all_gather = true;
  o.allgather_parity = true;
  RunOptions bad = o;
  bad.faults.nvfp4_global_amax_not_reduced = true;
  const RunResult good = run_training(o), r = run_training(bad);
  ASSERT_FALSE(r.parity.empty());
  for (const AllGatherParity& p : good.parity) EXPECT_EQ(p.mismatched_bytes, 0) << p.tensor;
  int64_t other_scale = 0;
  for (const AllGatherParity& p : r.parity) {
    EXPECT_GT(p.mismatched_bytes, 0) << p.tensor;
    other_scale += p.scale_inv != p.reference_scale_inv ? 1 : 0;
  }
  EXPECT_GT(other_scale, 0);
  EXPECT_NE(good.metrics[0].loss, r.metrics[0].loss);
}

}  // namespace
}  // namespace meshproof::engine
