// Per-layer FSDP execution (engine/model/model.h UnitHooks, engine/session/session.cc): weights are
// gathered unit by unit as the model reaches them, freed after a layer's forward with
// reshard_after_forward (and gathered again for its backward) or kept; gradients are reduced per
// unit after its backward in the last micro-batch. FP8 primary weights (fsdp.fp8_params): the
// GEMM weights live as FP8 shards re-quantized from the fp32 master after every optimizer step.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <set>
#include <string>

#include "engine/checkpoint/state_keys.h"
#include "engine/session/session.h"
#include "kernels/core/device.h"
#include "kernels/core/error.h"
#include "kernels/quantize/quantize.h"
#include "mesh/core/layout.h"
#include "mesh/local/local_comm.h"
#include "tests/engine/test_config.h"

namespace meshproof::engine {
namespace {

using kernels::DType;
using kernels::Tensor;

Config two_layers(RecipeKind kind) {
  return testing::make_config(
      {.vocab = 64, .hidden = 64, .layers = 2, .ffn = 128, .batch = 16, .recipe = kind, .seed = 5});
}

using testing::run_options;

using testing::collective_total;
using testing::expect_same_run;

struct UnitCase {
  RecipeKind kind;
  MeshSpec mesh;
  bool fp8_all_gather;
  bool recompute;
};
class ReshardAfterForward : public ::testing::TestWithParam<UnitCase> {};

TEST_P(ReshardAfterForward, SameNumericsFewerGatheredBytesMoreGathers) {
  const UnitCase& uc = GetParam();
  Config c = two_layers(uc.kind);
  c.training.micro_batches = 2;
  c.training.recompute = uc.recompute;
  constexpr int64_t kSteps = 2;
  RunOptions keep = run_options(c, uc.mesh, kSteps), reshard = keep;
  keep.fsdp.reshard_after_forward = false;
  reshard.fsdp.reshard_after_forward = true;
  keep.fsdp.fp8_all_gather = reshard.fsdp.fp8_all_gather = uc.fp8_all_gather;
  const RunResult k = run_training(keep), r = run_training(reshard);
  const std::string ctx =
      fmt::format("{} on {}", recipe_name(uc.kind), uc.mesh.device_mesh().str());
  // Re-gathering a layer for its backward gathers the same bytes (FP8 shards are quantized once
  // per step), so the two runs are bitwise equal.
  expect_same_run(k, r, ctx);

  // Each layer's parameters are gathered twice per micro-batch instead of once. One all-gather
  // per parameter, except FP8-gathered MXFP8 GEMM weights: 4 (row/columnwise data and scales).
  int64_t per_layer = 0;
  for (const ParamSpec& s : param_specs(c.model)) {
    if (!s.name.starts_with("layers.0.")) continue;
    const bool gemm_weight = s.shape.rank() == 2;  // qkv, proj, fc1, fc2 weights
    per_layer += uc.fp8_all_gather && gemm_weight && uc.kind == RecipeKind::kMxfp8 ? 4 : 1;
  }
  for (size_t i = 0; i < r.ranks.size(); ++i) {
    EXPECT_EQ(collective_total(r.ranks[i], "all_gather", "dp_shard") -
                  collective_total(k.ranks[i], "all_gather", "dp_shard"),
              kSteps * c.training.micro_batches * c.model.layers * per_layer)
        << ctx << " rank " << i;
    // Peak gathered weights: the root unit plus one layer instead of plus every layer.
    const int64_t pk = k.ranks[i].memory.gathered_weights, pr = r.ranks[i].memory.gathered_weights;
    EXPECT_LT(pr, pk) << ctx << " rank " << i;
    if (!uc.fp8_all_gather && uc.mesh.tp == 1) {
      const int64_t esize = uc.kind == RecipeKind::kFp32 ? 4 : 2;
      int64_t root = 0, layer = 0;
      for (const ParamSpec& s : param_specs(c.model)) {
        if (!s.name.starts_with("layers.")) root += s.shape.numel().value * esize;
        if (s.name.starts_with("layers.0.")) layer += s.shape.numel().value * esize;
      }
      EXPECT_EQ(pr, root + layer) << ctx;
      EXPECT_EQ(pk, root + c.model.layers * layer) << ctx;
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Units, ReshardAfterForward,
                         ::testing::Values(UnitCase{RecipeKind::kFp32, {1, 2, 1}, false, false},
                                           UnitCase{RecipeKind::kBf16, {2, 2, 1}, false, true},
                                           UnitCase{RecipeKind::kFp32, {1, 2, 2}, false, false},
                                           UnitCase{RecipeKind::kCurrent, {1, 2, 1}, true, true},
                                           UnitCase{RecipeKind::kDelayed, {1, 2, 1}, true, false},
                                           UnitCase{RecipeKind::kMxfp8, {1, 2, 1}, true, true}),
                         [](const auto& info) {
                           const UnitCase& u = info.param;
                           return fmt::format("{}_r{}_s{}_t{}{}{}", recipe_name(u.kind),
                                              u.mesh.dp_replicate, u.mesh.dp_shard, u.mesh.tp,
                                              u.fp8_all_gather ? "_fp8ag" : "",
                                              u.recompute ? "_recompute" : "");
                         });

// ---------------------------------------------------------------------------------------------
// fsdp.fp8_params

// Current scaling on dp_shard 2 and on dp_shard 2 x tp 2 (qkv/fc1 StridedShard(0) over dp_shard
// inside their TP Shard(0), proj/fc2 Shard(1) over tp): after each step the FP8 primary weight
// of every GEMM weight (the weight of a quantized linear: ParamSpec::linear set) is this rank's
// box of quantize(master) with the amax of the whole weight (MAX-reduced over dp_shard + tp), and
// its bytes are what the checkpoint state holds.
class Fp8ParamsState : public ::testing::TestWithParam<MeshSpec> {};

TEST_P(Fp8ParamsState, HoldsTheMasterRequantizedAfterEveryStep) {
  const MeshSpec m = GetParam();
  RunOptions o = run_options(two_layers(RecipeKind::kCurrent), m, 0);
  o.fsdp.fp8_params = true;
  std::set<std::string> gemm_weights;
  for (const ParamSpec& spec : param_specs(o.config.model)) {
    if (!spec.linear.empty()) gemm_weights.insert(spec.name);
  }
  mesh::LocalWorld world(o.mesh.device_mesh());
  std::vector<int> checked(static_cast<size_t>(m.world_size()), 0);
  world.run([&](mesh::RankComms& comms) {
    TrainingSession s(o, comms);
    for (int step = 0; step < 2; ++step) {
      s.step();
      const std::map<std::string, Tensor> full = s.gather_params();
      std::map<std::string, const StateEntry*> by_key;
      for (const StateEntry& e : s.state().entries) by_key[e.key] = &e;
      for (const auto& [name, w] : full) {
        const auto data = by_key.find(keys::fp8_param(name, "rowwise_data"));
        const bool gemm = gemm_weights.contains(name);
        ASSERT_EQ(data != by_key.end(), gemm) << name;
        if (!gemm) continue;
        const Tensor amax = kernels::compute_amax(w);
        const kernels::QuantizedTensor q = kernels::quantize_per_tensor(
            w, kernels::compute_current_scale(amax, DType::kE4M3), DType::kE4M3,
            {.rowwise = true, .columnwise = false}, kernels::ScalingMode::kCurrentTensor, amax);
        const StateEntry& e = *data->second;
        const Tensor want = mesh::shard(q.rowwise_data, e.layout, comms.rank());
        EXPECT_EQ(e.local.dtype(), DType::kE4M3) << name;
        ASSERT_EQ(e.local.shape(), want.shape()) << name << " on " << m.device_mesh().str();
        EXPECT_EQ(std::memcmp(e.local.raw_data(), want.raw_data(),
                              static_cast<size_t>(want.nbytes().value)),
                  0)
            << name << " step " << step << " rank " << comms.rank() << " on "
            << m.device_mesh().str();
        const StateEntry& si = *by_key.at(keys::fp8_param(name, "scale_inv"));
        EXPECT_EQ(si.local.to_vector<float>(), q.rowwise_scale_inv.to_vector<float>()) << name;
        ++checked[static_cast<size_t>(comms.rank())];
      }
    }
  });
  // 2 layers x 4 GEMM weights x 2 steps per rank.
  EXPECT_EQ(gemm_weights.size(), 8u);
  for (int n : checked) EXPECT_EQ(n, 16) << m.device_mesh().str();
}

INSTANTIATE_TEST_SUITE_P(Fp8Params, Fp8ParamsState,
                         ::testing::Values(MeshSpec{1, 2, 1}, MeshSpec{1, 2, 2}),
                         testing::MeshCaseName{});

class Fp8ParamsRecipe : public ::testing::TestWithParam<RecipeKind> {};

TEST_P(Fp8ParamsRecipe, MeshInvariantAndCloseToTheFp8AllGatherRun) {
  // lr 1e-3: at 1e-2 this small FP8 model trains chaotically (the loss rises after step 2), so
  // any one-ulp difference grows to percent-level within 4 steps and nothing could be compared.
  constexpr int64_t kSteps = 6;
  const RecipeKind kind = GetParam();
  Config c = two_layers(kind);
  c.training.lr = 1e-3;
  RunOptions one = run_options(c, {1, 1, 1}, kSteps);
  one.fsdp.fp8_params = true;
  RunOptions dp2 = one;
  dp2.mesh = {1, 2, 1};
  RunOptions ag = dp2;  // FP8 all-gather of the bf16 compute copy instead of FP8 weights
  ag.fsdp.fp8_params = false;
  ag.fsdp.fp8_all_gather = true;
  const RunResult a = run_training(one), b = run_training(dp2), g = run_training(ag);
  double mesh_worst = 0, ag_worst = 0;
  for (size_t s = 0; s < kSteps; ++s) {
    const double want = a.metrics[s].loss;
    mesh_worst = std::max(mesh_worst, std::abs(b.metrics[s].loss - want) / want);
    ag_worst = std::max(ag_worst, std::abs(g.metrics[s].loss - b.metrics[s].loss) / want);
  }
  // The FP8 weights are quantize(fp32 master) with the whole weight's scale on every mesh, so
  // for current and mxfp8 scaling a data-parallel mesh changes only the order of the double
  // loss sum over ranks (measured worst 4.6e-16 over 6 steps; 1e-12 leaves room for that
  // order and nothing else). Delayed scaling on dp_shard 2 drifts from one rank as it does
  // without fp8_params (RecipeMesh above: 1.5e-3); measured here 1.6e-4, bound 1e-3.
  EXPECT_LE(mesh_worst, kind == RecipeKind::kDelayed ? 1e-3 : 1e-12) << recipe_name(kind);
  // Against the FP8 all-gather run the weights differ by the bf16 rounding before the FP8 cast
  // (and so, for per-tensor recipes, by a slightly different amax and scale). Measured worst
  // relative loss deviation over 6 steps: current 2.5e-4, delayed 2.4e-4, mxfp8 1.9e-4;
  // bound 1e-3 (well inside docs/design.md section 8's FP8 budget of 1e-2).
  EXPECT_LE(ag_worst, 1e-3) << recipe_name(kind);
  RecordProperty(fmt::format("worst_rel_loss_{}", recipe_name(kind)),
                 fmt::format("mesh {:.2e}, vs fp8_all_gather {:.2e}", mesh_worst, ag_worst));
}

INSTANTIATE_TEST_SUITE_P(Fp8Params, Fp8ParamsRecipe,
                         ::testing::Values(RecipeKind::kCurrent, RecipeKind::kDelayed,
                                           RecipeKind::kMxfp8),
                         [](const auto& info) { return std::string(recipe_name(info.param)); });

TEST(Fp8Params, MemoryCountsTheFp8Weights) {
  RunOptions o = run_options(two_layers(RecipeKind::kCurrent), {1, 2, 1}, 1);
  const RunResult plain = run_training(o);
  o.fsdp.fp8_params = true;
  const RunResult fp8 = run_training(o);
  // One byte per element of the rank's GEMM weight shards plus a 4-byte scale_inv each.
  int64_t gemm_elems = 0, gemm_weights = 0;
  for (const ParamSpec& s : param_specs(o.config.model))
    if (s.name.ends_with("qkv.weight") || s.name.ends_with("proj.weight") ||
        s.name.ends_with("fc1.weight") || s.name.ends_with("fc2.weight")) {
      gemm_elems += s.shape.numel().value;
      ++gemm_weights;
    }
  for (size_t r = 0; r < 2; ++r)
    EXPECT_EQ(fp8.ranks[r].memory.params - plain.ranks[r].memory.params,
              gemm_elems / 2 + 4 * gemm_weights)
        << r;
}

TEST(Fp8Params, Mxfp8KeepsRowAndColumnwiseShards) {
  // hidden 64 / ffn 128 on dp_shard 2: every GEMM weight shard has a multiple of 32 rows.
  Config c = two_layers(RecipeKind::kMxfp8);
  c.training.lr = 1e-3;  // see MeshInvariantAndCloseToTheFp8AllGatherRun
  RunOptions o = run_options(c, {1, 2, 1}, 3);
  o.fsdp.fp8_params = true;
  const RunResult r = run_training(o);
  ASSERT_EQ(r.metrics.size(), 3u);
  for (const StepMetrics& m : r.metrics) EXPECT_TRUE(std::isfinite(m.loss));
  EXPECT_TRUE(r.notes.empty()) << r.notes.front();
  RunOptions hp = o;
  hp.fsdp.fp8_params = false;
  const RunResult h = run_training(hp);
  // Quantizing the fp32 master instead of its bf16 copy: measured < 2e-4 relative over 3 steps
  // (see MeshInvariantAndCloseToTheFp8AllGatherRun); bound 1e-3.
  for (size_t s = 0; s < 3; ++s)
    EXPECT_NEAR(r.metrics[s].loss, h.metrics[s].loss, 1e-3 * h.metrics[s].loss) << s;
}

TEST(Fp8Params, UnsupportedCombinationsAreInputErrors) {
  RunOptions bf16 = run_options(two_layers(RecipeKind::kBf16), {1, 2, 1}, 1);
  bf16.fsdp.fp8_params = true;
  try {
    run_training(bf16);
    FAIL() << "bf16 + fp8_params accepted";
  } catch (const kernels::Error& e) {
    EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
    EXPECT_NE(std::string(e.what()).find("needs recipe current, delayed or mxfp8, got bf16"),
              std::string::npos)
        << e.what();
  }
  // qkv [192, 64] over dp_shard 4: shards of 48 rows cannot hold 32x1 columnwise blocks.
  RunOptions mx = run_options(two_layers(RecipeKind::kMxfp8), {1, 4, 1}, 1);
  mx.fsdp.fp8_params = true;
  try {
    run_training(mx);
    FAIL() << "unaligned mxfp8 fp8_params accepted";
  } catch (const kernels::Error& e) {
    EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
    EXPECT_NE(std::string(e.what()).find("layers.0.attn.qkv.weight [192, 64]"), std::string::npos)
        << e.what();
  }
}

TEST(ShardedBackend, CudaWithoutAUsableGpuIsAnInputError) {
  if (kernels::cuda_status().usable) GTEST_SKIP() << "a GPU is usable here (shard_gpu_test runs)";
  RunOptions o = run_options(two_layers(RecipeKind::kFp32), {1, 2, 1}, 1);
  o.backend = kernels::Device::cuda(0);
  try {
    run_training(o);
    FAIL() << "backend cuda accepted without a usable GPU";
  } catch (const kernels::Error& e) {
    EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
    EXPECT_NE(std::string(e.what()).find("backend cuda:0 is not usable here"), std::string::npos)
        << e.what();
  }
}

// --trace holds the FP8 state (docs/design.md section 16): per step the forward's state
// ("fp8/<checkpoint key>") first, then gradients and weights, then the state after the step
// ("updated/fp8/<key>"), all global fp32. The state a step's forward reads is the state the
// previous step left, and the traced FP8 primary weight (codes as values, gathered over dp_shard x
// tp) times its scale_inv is the weight it was quantized from.
TEST(Fp8Params, TraceHoldsTheFp8StateInStepOrder) {
  RunOptions o = run_options(two_layers(RecipeKind::kDelayed), {1, 2, 2}, 2);
  o.fsdp.fp8_params = true;
  o.trace = true;
  const RunResult r = run_training(o);
  ASSERT_EQ(r.trace.size(), 2u);
  const size_t nparams = param_specs(o.config.model).size();
  // 2 layers x 4 linears (qkv, proj, fc1, fc2) x 3 roles x (scale, amax_history), and 8 FP8
  // weights x (rowwise_data, scale_inv): 64 entries before and 64 after the step.
  constexpr size_t kFp8 = 2 * 4 * 3 * 2 + 8 * 2;
  for (const std::vector<TensorDigest>& step : r.trace) {
    ASSERT_EQ(step.size(), 2 * nparams + 2 * kFp8);
    EXPECT_EQ(step[0].name, "fp8/layers.0.attn.qkv/input/scale");
    EXPECT_EQ(step[1].name, "fp8/layers.0.attn.qkv/input/amax_history");
    EXPECT_EQ(step[6].name, "fp8/params/layers.0.attn.qkv.weight/rowwise_data");
    EXPECT_EQ(step[7].name, "fp8/params/layers.0.attn.qkv.weight/scale_inv");
    EXPECT_EQ(step[8].name, "fp8/layers.0.attn.proj/input/scale");
    for (size_t i = 0; i < kFp8; ++i) {
      EXPECT_TRUE(step[i].name.starts_with("fp8/")) << step[i].name;
      EXPECT_EQ(step[kFp8 + 2 * nparams + i].name, "updated/" + step[i].name);
    }
    EXPECT_TRUE(step[kFp8].name.starts_with("grad/")) << step[kFp8].name;
    EXPECT_TRUE(step[kFp8 + nparams].name.starts_with("param/")) << step[kFp8 + nparams].name;
  }
  // Step 1's forward reads fresh delayed states (scale 1); its amax update moves the input scale.
  EXPECT_EQ(r.trace[0][0].values, std::vector<float>{1.0f});
  EXPECT_NE(r.trace[0][kFp8 + 2 * nparams].values, std::vector<float>{1.0f});
  // Step 2's forward state is bitwise what step 1 left.
  for (size_t i = 0; i < kFp8; ++i)
    EXPECT_EQ(r.trace[1][i].values, r.trace[0][kFp8 + 2 * nparams + i].values)
        << r.trace[1][i].name;
  // The FP8 weight step 2 reads decodes to the weight step 1's update wrote, within e4m3's
  // rounding: half a unit in the last of 3 mantissa bits (rel 2^-4), or half the smallest
  // subnormal step (2^-10) times scale_inv near zero. Delayed scaling quantizes with the scale of
  // the amax history, not of this weight, so codes may saturate at +-448: then the weight is at
  // least that large (less the rounding), with the same sign.
  const TensorDigest* data = &r.trace[1][6];
  const float scale_inv = r.trace[1][7].values.at(0);
  const TensorDigest* weight = nullptr;
  for (const TensorDigest& d : r.trace[0])
    if (d.name == "param/layers.0.attn.qkv.weight") weight = &d;
  ASSERT_NE(weight, nullptr);
  ASSERT_EQ(data->shape, weight->shape);
  for (size_t k = 0; k < weight->values.size(); ++k) {
    const double w = weight->values[k];
    const double decoded = static_cast<double>(data->values[k]) * scale_inv;
    if (std::abs(data->values[k]) == 448.0f) {
      ASSERT_GE(w * (decoded > 0 ? 1 : -1), std::abs(decoded) * (1 - 1.0 / 16)) << k;
      continue;
    }
    ASSERT_LE(std::abs(decoded - w), std::abs(w) / 16 + scale_inv / 1024.0 + 1e-12) << k;
  }
}

}  // namespace
}  // namespace meshproof::engine
