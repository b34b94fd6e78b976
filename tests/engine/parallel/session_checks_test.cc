// The session's side of two checks: allgather_parity records (RunOptions::allgather_parity) and
// the uneven_shard_padding_leak fault (the padded vocabulary rows of uneven dp_shard chunks reach
// the logits).
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <set>

#include "engine/model/data.h"
#include "engine/model/model.h"
#include "engine/model/params.h"
#include "engine/session/session.h"
#include "tests/engine/test_config.h"

namespace meshproof::engine {
namespace {

Config small_fp8(RecipeKind kind) {
  Config c;
  c.model.vocab = 64;
  c.model.hidden = 64;
  c.model.heads = 4;
  c.model.layers = 1;
  c.model.ffn = 128;
  c.model.max_positions = 8;
  c.training.batch = 8;
  c.training.seq_len = 8;
  c.training.lr = 1e-2;
  c.recipe.kind = kind;
  return c;
}

RunOptions options(const Config& c, MeshSpec m, int64_t steps) {
  RunOptions o;
  o.config = c;
  o.mesh = m;
  o.steps = steps;
  return o;
}

const std::set<std::string> kLinearWeights = {"layers.0.attn.qkv.weight",
                                              "layers.0.attn.proj.weight",
                                              "layers.0.mlp.fc1.weight", "layers.0.mlp.fc2.weight"};

struct ParityCase {
  RecipeKind kind;
  MeshSpec mesh;
};
class SessionParity : public ::testing::TestWithParam<ParityCase> {};

TEST_P(SessionParity, EveryFp8GatheredWeightIsComparedAndEqual) {
  const ParityCase& pc = GetParam();
  RunOptions o = options(small_fp8(pc.kind), pc.mesh, 2);
  o.fsdp.fp8_all_gather = true;
  RunOptions checked = o;
  checked.allgather_parity = true;
  const RunResult plain = run_training(o), r = run_training(checked);
  EXPECT_TRUE(plain.parity.empty());
  // One record per all-gather of a quantized linear weight, compared on every rank: each weight
  // is gathered for the forward and again for the backward (reshard_after_forward).
  ASSERT_EQ(r.parity.size(), 2 * kLinearWeights.size() * 2);
  std::map<std::pair<int64_t, std::string>, int> gathers;
  for (const AllGatherParity& p : r.parity) ++gathers[{p.step, p.tensor}];
  EXPECT_EQ(gathers.size(), 2 * kLinearWeights.size());
  for (const auto& [key, n] : gathers) EXPECT_EQ(n, 2) << key.second << " step " << key.first;
  const int64_t world = pc.mesh.world_size();
  for (const AllGatherParity& p : r.parity) {
    EXPECT_TRUE(kLinearWeights.count(p.tensor)) << p.tensor;
    EXPECT_TRUE(p.step == 0 || p.step == 1) << p.step;
    EXPECT_EQ(p.mismatched_bytes, 0) << p.tensor << " step " << p.step;
    EXPECT_EQ(p.max_abs_error, 0.0) << p.tensor;
    EXPECT_EQ(p.scale_inv, p.reference_scale_inv) << p.tensor;
    EXPECT_GT(p.bytes, 0);
    EXPECT_EQ(p.bytes % world, 0) << "each rank compares the same-size gathered weight";
  }
  // The comparison observes; it does not change the run.
  for (size_t s = 0; s < 2; ++s) {
    EXPECT_EQ(plain.metrics[s].loss, r.metrics[s].loss) << s;
    EXPECT_EQ(plain.metrics[s].grad_norm, r.metrics[s].grad_norm) << s;
  }
}

INSTANTIATE_TEST_SUITE_P(Recipes, SessionParity,
                         ::testing::Values(ParityCase{RecipeKind::kCurrent, {1, 2, 1}},
                                           ParityCase{RecipeKind::kCurrent, {1, 2, 2}},
                                           ParityCase{RecipeKind::kDelayed, {1, 2, 1}},
                                           ParityCase{RecipeKind::kMxfp8, {1, 2, 1}}),
                         [](const auto& info) {
                           const ParityCase& p = info.param;
                           return fmt::format("{}_r{}_s{}_t{}", recipe_name(p.kind),
                                              p.mesh.dp_replicate, p.mesh.dp_shard, p.mesh.tp);
                         });

TEST(SessionParityFaults, AmaxNotReducedShowsMismatchedBytes) {
  RunOptions o = options(small_fp8(RecipeKind::kCurrent), {1, 2, 1}, 1);
  o.fsdp.fp8_all_gather = true;
  o.allgather_parity = true;
  o.faults.amax_not_reduced = true;
  const RunResult r = run_training(o);
  ASSERT_EQ(r.parity.size(), 2 * kLinearWeights.size());  // forward and backward gathers
  int64_t mismatched = 0;
  for (const AllGatherParity& p : r.parity) mismatched += p.mismatched_bytes;
  // Each rank quantized its half with its own amax: at least one weight's gathered bytes differ
  // (in practice all four: two random halves rarely share their amax).
  EXPECT_GT(mismatched, 0);
}

// ---- uneven_shard_padding_leak

Config small_fp32(int64_t vocab, bool tied) {
  Config c;
  c.model.vocab = vocab;
  c.model.hidden = 16;
  c.model.heads = 4;
  c.model.layers = 1;
  c.model.ffn = 32;
  c.model.max_positions = 8;
  c.model.tied_embeddings = tied;
  c.training.batch = 6;
  c.training.seq_len = 8;
  c.training.lr = 1e-2;
  return c;
}

// The mean loss of step 0's global batch computed by one rank with the output projection padded
// by `pad` zero rows (what the fault claims to do), in fp32.
double padded_vocab_loss(const Config& c, int64_t pad) {
  const TensorMap init = init_params(c.model, c.seed);
  TensorMap w;
  const std::string out = c.model.tied_embeddings ? "embed.tok" : "lm_head.weight";
  for (const std::string& n : init.names()) {
    if (n != out) {
      w.insert(n, init.at(n));
      continue;
    }
    const kernels::Tensor& t = init.at(n);
    kernels::Tensor p = kernels::Tensor::zeros({t.shape()[0] + pad, t.shape()[1]},
                                               kernels::DType::kFloat32, kernels::Device::cpu());
    std::memcpy(p.raw_data(), t.raw_data(), static_cast<size_t>(t.nbytes().value));
    w.insert(n, p);
  }
  const MarkovSource data(c.model.vocab, c.data, c.training.batch, c.training.seq_len);
  const double sum = GptModel(c).forward_loss(w, data.batch(0), {0, 0});
  return sum / static_cast<double>(c.training.batch * c.training.seq_len);
}

using testing::kFp32Rel;

TEST(UnevenShardPaddingLeak, PaddedVocabularyRowsBecomeZeroLogitClasses) {
  for (bool tied : {false, true}) {
    // vocab 32 over dp_shard 3: torch.chunk rows 11, 11, 10 -> 3 x 11 = 33 rows, 1 zero row.
    const Config c = small_fp32(32, tied);
    RunOptions clean = options(c, {1, 3, 1}, 2), leak = clean;
    leak.faults.uneven_shard_padding_leak = true;
    const RunResult rc = run_training(clean), rl = run_training(leak);
    const double want = padded_vocab_loss(c, 1), right = padded_vocab_loss(c, 0);
    EXPECT_NEAR(rl.metrics[0].loss, want, kFp32Rel * want) << "tied " << tied;
    EXPECT_NEAR(rc.metrics[0].loss, right, kFp32Rel * right) << "tied " << tied;
    // One extra zero logit among 32 near-zero ones at init: the loss rises by ~ln(33/32) = 0.03,
    // three orders of magnitude above the mesh tolerance.
    EXPECT_GT(rl.metrics[0].loss - rc.metrics[0].loss, 100 * kFp32Rel * right) << "tied " << tied;
    EXPECT_NE(rl.metrics[1].grad_norm, rc.metrics[1].grad_norm);
    // The master weights keep their real shapes (the padding's gradient rows are dropped).
    EXPECT_EQ(rl.final_params.at("embed.tok").shape(), rc.final_params.at("embed.tok").shape());
  }
}

TEST(UnevenShardPaddingLeak, NoEffectWhenTheVocabularySplitsEvenly) {
  // vocab 30 over dp_shard 3 splits evenly (hidden 16 and ffn 32 do not, but their padding is
  // cut off by the gather either way): the faulty run is bitwise the clean run.
  const Config c = small_fp32(30, false);
  RunOptions clean = options(c, {1, 3, 1}, 2), leak = clean;
  leak.faults.uneven_shard_padding_leak = true;
  const RunResult rc = run_training(clean), rl = run_training(leak);
  for (size_t s = 0; s < 2; ++s) {
    EXPECT_EQ(rl.metrics[s].loss, rc.metrics[s].loss) << s;
    EXPECT_EQ(rl.metrics[s].grad_norm, rc.metrics[s].grad_norm) << s;
  }
}

}  // namespace
}  // namespace meshproof::engine
