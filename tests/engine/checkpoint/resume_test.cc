// Resume parity with the real sharded engine (engine/session/session.h): 2k steps straight against
// k steps, save, a fresh session, load, k more steps. Losses, grad norms, scalars and every state
// tensor (fp32 masters, AdamW moments, delayed-scaling scales and amax histories) must be bitwise
// equal, per recipe, with FP8 primary weights (fp8_params) and with dropout plus gradient
// accumulation. The checkpoint-side faults must break that parity (so the resume check catches
// them).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <map>
#include <set>

#include "engine/checkpoint/checkpoint.h"
#include "engine/session/session.h"
#include "mesh/local/local_comm.h"
#include "tests/engine/checkpoint/ckpt_test_state.h"
#include "tests/engine/test_config.h"

namespace meshproof::engine {
namespace {

namespace fs = std::filesystem;
using kernels::Tensor;
using testing::detach;

// hidden 32 / ffn 64 / 64 tokens per step: every linear layer is MXFP8-quantizable (K % 32 == 0,
// M % 32 == 0) on one rank and on dp_shard 2.
Config small(RecipeKind recipe) {
  Config c = testing::make_config({.hidden = 32, .ffn = 64, .recipe = recipe, .seed = 11});
  c.training.schedule = LrSchedule::kWarmupCosine;  // the LR position is resumed state too
  c.training.warmup_steps = 2;
  c.training.steps = 8;
  c.recipe.amax_history_len = 3;  // shorter than the run: the history window wraps
  return c;
}

struct Capture {
  std::vector<StepMetrics> metrics;  // rank 0, every step run
  std::vector<ShardedState> states;  // per rank, at the end
};

void run_steps(TrainingSession& s, int64_t n, int rank, Capture& c) {
  for (int64_t i = 0; i < n; ++i) {
    const StepMetrics m = s.step();
    if (rank == 0) c.metrics.push_back(m);
  }
}

Capture straight(const RunOptions& o, int64_t steps) {
  Capture c;
  c.states.resize(static_cast<size_t>(o.mesh.world_size()));
  mesh::LocalWorld world(o.mesh.device_mesh());
  world.run([&](mesh::RankComms& comms) {
    TrainingSession s(o, comms);
    run_steps(s, steps, comms.rank(), c);
    c.states[static_cast<size_t>(comms.rank())] = s.state();
  });
  detach(c.states);
  return c;
}

Capture resumed(const RunOptions& o, int64_t k, const fs::path& root,
                const CheckpointOptions& save_options, const CheckpointOptions& load_options) {
  Capture c;
  c.states.resize(static_cast<size_t>(o.mesh.world_size()));
  mesh::LocalWorld world(o.mesh.device_mesh());
  world.run([&](mesh::RankComms& comms) {
    fs::path dir;
    {
      TrainingSession first(o, comms);
      run_steps(first, k, comms.rank(), c);
      dir = save_checkpoint(root, k, first.state(), comms, save_options);
    }
    TrainingSession second(o, comms);  // a fresh engine: initial weights, zero moments
    load_checkpoint(dir, second.state(), comms, load_options);
    second.load_scalars();
    run_steps(second, k, comms.rank(), c);
    c.states[static_cast<size_t>(comms.rank())] = second.state();
  });
  detach(c.states);
  return c;
}

// A straight run of 2k steps on o.mesh that saves a checkpoint under `root` after step k: rank
// 0's metrics of all 2k steps and the checkpoint's directory (to resume on another mesh).
struct SavedRun {
  std::vector<StepMetrics> metrics;
  fs::path dir;
};

SavedRun straight_saving(const RunOptions& o, int64_t k, const fs::path& root) {
  SavedRun r;
  mesh::LocalWorld world(o.mesh.device_mesh());
  world.run([&](mesh::RankComms& comms) {
    TrainingSession s(o, comms);
    std::vector<StepMetrics> m;
    for (int64_t i = 0; i < k; ++i) m.push_back(s.step());
    fs::path d = save_checkpoint(root, k, s.state(), comms);
    for (int64_t i = 0; i < k; ++i) m.push_back(s.step());
    if (comms.rank() == 0) {
      r.metrics = m;
      r.dir = d;
    }
  });
  return r;
}

// A fresh session on o.mesh loads `dir` and trains k steps: rank 0's metrics.
std::vector<StepMetrics> resumed_from(const RunOptions& o, const fs::path& dir, int64_t k) {
  std::vector<StepMetrics> got;
  mesh::LocalWorld world(o.mesh.device_mesh());
  world.run([&](mesh::RankComms& comms) {
    TrainingSession s(o, comms);
    load_checkpoint(dir, s.state(), comms);
    s.load_scalars();
    std::vector<StepMetrics> m;
    for (int64_t i = 0; i < k; ++i) m.push_back(s.step());
    if (comms.rank() == 0) got = m;
  });
  return got;
}

// The cross-mesh resume matrix: for each source mesh, the straight 2k-step run saving after step k
// (under root/<mesh>), resumed on every target mesh for k steps; `check` gets each resumed step
// with the straight run's same step, whether the mesh is the saving one, and a context naming
// the pair and the step. One checkpoint per source serves every target.
struct ResumedStep {
  const StepMetrics& want;  // the straight run on the source mesh
  const StepMetrics& got;   // the resumed run on the target mesh
  bool same_mesh;
  std::string ctx;  // "src -> dst step N"
};
void for_each_resumed_step(const RunOptions& base, const std::vector<MeshSpec>& sources,
                           const std::vector<MeshSpec>& targets, int64_t k, const fs::path& root,
                           const std::function<void(const ResumedStep&)>& check) {
  for (const MeshSpec& src : sources) {
    RunOptions a = base;
    a.mesh = src;
    const SavedRun saved = straight_saving(a, k, root / src.device_mesh().str());
    for (const MeshSpec& dst : targets) {
      RunOptions b = a;
      b.mesh = dst;
      const std::vector<StepMetrics> got = resumed_from(b, saved.dir, k);
      const std::string pair =
          fmt::format("{} -> {}", src.device_mesh().str(), dst.device_mesh().str());
      ASSERT_EQ(got.size(), static_cast<size_t>(k)) << pair;
      for (int64_t i = 0; i < k; ++i) {
        check({saved.metrics[static_cast<size_t>(k + i)], got[static_cast<size_t>(i)],
               src.device_mesh() == dst.device_mesh(), fmt::format("{} step {}", pair, k + i)});
      }
    }
  }
}

// Number of state tensors whose reassembled global bytes differ; also checks scalars.
int differing_tensors(const Capture& a, const Capture& b, const std::string& ctx, bool report) {
  int differ = 0;
  EXPECT_EQ(a.states[0].entries.size(), b.states[0].entries.size()) << ctx;
  for (size_t e = 0; e < a.states[0].entries.size(); ++e) {
    std::vector<Tensor> la, lb;
    for (const auto& s : a.states) la.push_back(s.entries[e].local);
    for (const auto& s : b.states) lb.push_back(s.entries[e].local);
    const Tensor ga = mesh::unshard(la, a.states[0].entries[e].layout);
    const Tensor gb = mesh::unshard(lb, b.states[0].entries[e].layout);
    const bool same =
        std::memcmp(ga.raw_data(), gb.raw_data(), static_cast<size_t>(ga.nbytes().value)) == 0;
    if (!same) {
      ++differ;
      if (report) ADD_FAILURE() << ctx << ": " << a.states[0].entries[e].key << " differs";
    }
  }
  return differ;
}

bool same_metrics(const Capture& a, const Capture& b) {
  if (a.metrics.size() != b.metrics.size()) return false;
  for (size_t i = 0; i < a.metrics.size(); ++i) {
    if (a.metrics[i].loss != b.metrics[i].loss || a.metrics[i].grad_norm != b.metrics[i].grad_norm)
      return false;
  }
  return true;
}

class ResumeTest : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            fmt::format("meshproof_resume_{}_{}", ::getpid(),
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  fs::path root_;
};

constexpr int64_t kHalf = 4;

// FP8 checkpoint state keys follow the parameter names (issue #17.15): every "fp8/<linear>/<role>/
// <field>" names a parameter "<linear>.weight" and every "fp8/params/<name>/<field>" a parameter
// "<name>", for GELU and SwiGLU (fc1 split into mlp.fc1_gate and mlp.fc1_up), on a TP x FSDP mesh
// with delayed scaling and FP8 primary weights.
TEST(Fp8StateKeys, NameExistingParameters) {
  for (Activation act : {Activation::kGelu, Activation::kSwiGlu}) {
    RunOptions o;
    o.config = small(RecipeKind::kDelayed);
    o.config.model.activation = act;
    o.mesh = {1, 2, 2};
    o.fsdp.fp8_params = true;
    std::set<std::string> params;
    for (const ParamSpec& s : param_specs(o.config.model)) params.insert(s.name);
    std::vector<std::string> keys;
    mesh::LocalWorld world(o.mesh.device_mesh());
    world.run([&](mesh::RankComms& comms) {
      TrainingSession s(o, comms);
      s.step();
      if (comms.rank() != 0) return;
      for (const StateEntry& e : s.state().entries)
        if (e.key.starts_with("fp8/")) keys.push_back(e.key);
    });
    const std::string ctx(activation_name(act));
    size_t fields = 0, weights = 0;
    for (const std::string& key : keys) {
      const std::string rest = key.substr(4);
      std::string name;
      if (rest.starts_with("params/")) {
        name = rest.substr(7, rest.rfind('/') - 7);  // fp8/params/<name>/<field>
        ++weights;
      } else {
        const std::string linear_role = rest.substr(0, rest.rfind('/'));   // drop the field
        name = linear_role.substr(0, linear_role.rfind('/')) + ".weight";  // drop the role
        ++fields;
      }
      EXPECT_EQ(params.count(name), 1u) << ctx << ": " << key << " names no parameter " << name;
    }
    // 4 linears (5 under SwiGLU) x 3 roles x {scale, amax_history}, and FP8 weights of each.
    const size_t linears = act == Activation::kSwiGlu ? 5 : 4;
    EXPECT_EQ(fields, linears * 3 * 2) << ctx;
    EXPECT_GT(weights, 0u) << ctx;
  }
}

TEST_F(ResumeTest, BitwiseParityPerRecipe) {
  struct Case {
    RecipeKind recipe;
    MeshSpec mesh;
    bool fp8_params = false;     // FP8 primary weights: the resumed run computes with loaded FP8
    bool dropout_micro = false;  // dropout 0.1 (Philox masks keyed by step) and 2 micro-batches
  };
  const std::vector<Case> cases = {
      {RecipeKind::kFp32, {1, 2, 2}},
      {RecipeKind::kBf16, {2, 2, 1}},
      {RecipeKind::kDelayed, {1, 2, 1}},
      {RecipeKind::kDelayed, {1, 1, 2}},
      {RecipeKind::kCurrent, {1, 2, 1}},
      {RecipeKind::kMxfp8, {1, 2, 1}},
      {RecipeKind::kCurrent, {1, 2, 2}, true},
      {RecipeKind::kDelayed, {2, 2, 1}, true},
      {RecipeKind::kMxfp8, {1, 1, 1}, true},
      {RecipeKind::kBlock, {1, 2, 1}},
      {RecipeKind::kBlock, {1, 1, 2}},
      {RecipeKind::kDelayed, {1, 2, 2}, false, true},
      // NVFP4 keeps no recipe state: its stochastic rounding is keyed by the step and the global
      // batch position, which the resumed run restores, so resume is bitwise with it too.
      {RecipeKind::kNvfp4, {1, 2, 2}},
      {RecipeKind::kNvfp4, {1, 2, 1}, false, true},
  };
  for (const Case& c : cases) {
    RunOptions o;
    o.config = small(c.recipe);
    o.mesh = c.mesh;
    o.fsdp.fp8_params = c.fp8_params;
    if (c.dropout_micro) {
      o.config.model.dropout = 0.1;
      o.config.training.micro_batches = 2;
    }
    const std::string ctx =
        fmt::format("{} on {}{}{}", recipe_name(c.recipe), c.mesh.device_mesh().str(),
                    c.fp8_params ? " fp8_params" : "", c.dropout_micro ? " dropout+micro" : "");
    const Capture a = straight(o, 2 * kHalf);
    const Capture b = resumed(o, kHalf, root_ / ctx, {}, {});
    ASSERT_EQ(a.metrics.size(), static_cast<size_t>(2 * kHalf)) << ctx;
    for (size_t i = 0; i < a.metrics.size(); ++i) {
      EXPECT_EQ(a.metrics[i].loss, b.metrics[i].loss) << ctx << " step " << i;
      EXPECT_EQ(a.metrics[i].grad_norm, b.metrics[i].grad_norm) << ctx << " step " << i;
      EXPECT_EQ(a.metrics[i].lr, b.metrics[i].lr) << ctx << " step " << i;
    }
    EXPECT_EQ(differing_tensors(a, b, ctx, true), 0) << ctx;
    EXPECT_EQ(a.states[0].scalars, b.states[0].scalars) << ctx;
    if (c.recipe == RecipeKind::kDelayed) {
      // The FP8 state is really in the checkpoint (and so really part of the parity above).
      const CheckpointIndex idx = read_checkpoint_index(root_ / ctx / checkpoint_dir_name(kHalf));
      EXPECT_EQ(idx.keys.count("fp8/layers.0.attn.qkv/input/amax_history"), 1u) << ctx;
    }
    if (c.fp8_params) {
      const CheckpointIndex idx = read_checkpoint_index(root_ / ctx / checkpoint_dir_name(kHalf));
      EXPECT_EQ(idx.keys.count("fp8/params/layers.0.mlp.fc2.weight/rowwise_data"), 1u) << ctx;
    }
  }
}

// Global tensors of every entry (rank order of `states`), keyed by checkpoint key.
std::map<std::string, Tensor> globals(const std::vector<ShardedState>& states) {
  std::map<std::string, Tensor> out;
  for (size_t e = 0; e < states[0].entries.size(); ++e) {
    std::vector<Tensor> locals;
    for (const auto& s : states) locals.push_back(s.entries[e].local);
    out[states[0].entries[e].key] = mesh::unshard(locals, states[0].entries[e].layout);
  }
  return out;
}

TEST_F(ResumeTest, EngineStateLoadsOntoAnotherMeshBitwise) {
  // The real engine's layouts (FSDP Shard(0), StridedShard(0, sf=tp) + TP Shard(0)/Shard(1),
  // HSDP Replicate) on both sides: the state saved after k steps on one mesh, loaded into a fresh
  // session on another, reassembles to the same global tensors and scalars.
  RunOptions a;
  a.config = small(RecipeKind::kDelayed);
  a.mesh = {1, 2, 2};
  a.fsdp.fp8_params = true;  // the FP8 weight shards (e4m3 bytes) reshard like their masters
  const Capture saved = straight(a, kHalf);
  const fs::path dir = [&] {
    fs::path d;
    mesh::LocalWorld world(a.mesh.device_mesh());
    world.run([&](mesh::RankComms& comms) {
      TrainingSession s(a, comms);
      for (int64_t i = 0; i < kHalf; ++i) s.step();
      fs::path p = save_checkpoint(root_, kHalf, s.state(), comms);
      if (comms.rank() == 0) d = p;
    });
    return d;
  }();
  const auto want = globals(saved.states);
  for (const MeshSpec& m : std::vector<MeshSpec>{{2, 2, 1}, {1, 1, 2}, {1, 1, 1}, {2, 2, 2}}) {
    RunOptions b = a;
    b.mesh = m;
    std::vector<ShardedState> states(static_cast<size_t>(m.world_size()));
    mesh::LocalWorld world(m.device_mesh());
    world.run([&](mesh::RankComms& comms) {
      TrainingSession s(b, comms);
      load_checkpoint(dir, s.state(), comms);
      s.load_scalars();
      states[static_cast<size_t>(comms.rank())] = s.state();
    });
    detach(states);
    const auto got = globals(states);
    ASSERT_EQ(got.size(), want.size()) << m.device_mesh().str();
    for (const auto& [key, t] : want) {
      const Tensor& g = got.at(key);
      EXPECT_EQ(std::memcmp(g.raw_data(), t.raw_data(), static_cast<size_t>(t.nbytes().value)), 0)
          << key << " on " << m.device_mesh().str();
    }
    EXPECT_EQ(states[0].scalars, saved.states[0].scalars) << m.device_mesh().str();
  }
}

TEST_F(ResumeTest, CrossMeshMatrixContinuesTraining) {
  // The six meshes: save after k fp32 steps on each, load into a fresh session on each
  // (itself included), train k more steps. Continued losses stay within the docs/design.md section
  // 8 cross-mesh bound of the straight 2k-step run on the saving mesh, rel 1e-5 (fp32 reductions
  // reordered by the mesh; the bound is the design's, the measured worst is printed), and
  // are bitwise equal when the mesh does not change. Measured worst: 2.3e-9 (fp32 losses of the
  // tiny model below). A tiny model keeps the 36 pairs fast.
  constexpr int64_t k = 2;
  constexpr double kRtol = 1e-5;
  const std::vector<MeshSpec> meshes = {{1, 1, 1}, {1, 4, 1}, {2, 2, 1},
                                        {1, 1, 2}, {1, 2, 2}, {2, 2, 2}};
  RunOptions base;
  base.config = testing::make_config({.seed = 5});
  base.config.training.steps = 2 * k;
  double worst = 0.0;
  for_each_resumed_step(base, meshes, meshes, k, root_, [&](const ResumedStep& r) {
    if (r.same_mesh) {
      EXPECT_EQ(r.got.loss, r.want.loss) << r.ctx;
    }
    const double rel = std::abs(r.got.loss - r.want.loss) / std::abs(r.want.loss);
    worst = std::max(worst, rel);
    EXPECT_LE(rel, kRtol) << r.ctx << ": " << r.got.loss << " vs " << r.want.loss;
  });
  std::printf("cross-mesh resume: worst relative loss deviation %.3g over 36 mesh pairs\n", worst);
}

TEST_F(ResumeTest, Nvfp4CrossMeshResumeWithinMeasuredBound) {
  // NVFP4 saved after kHalf steps on three meshes (FSDP 2, FSDP 2 x TP 2, HSDP 2 x 2 x TP 2) and
  // resumed on six (itself included) for kHalf more steps, against the straight run on the saving
  // mesh: bitwise on the same mesh (NVFP4 keeps no recipe state), within kRtol elsewhere. The
  // resumed steps reduce in another order (TP splits of the GEMMs, data-parallel sums), and the
  // decoded NVFP4 operands carry the fp32 global decode scale, so reordered sums move values
  // across E2M1 boundaries. The bounds are measured, not designed (this test's printout, CPU,
  // 2026-11-24, 18 pairs x 4 resumed steps): worst relative loss deviation 1.1e-3, worst grad_norm
  // deviation 1.02e-2 (FSDP 2 resumed on any tp 2 mesh, last step). Bounds: the FP8 recipes'
  // 1e-2 for the loss (9x the worst), 3e-2 for the grad norm (2.9x the worst; the FP8 recipes'
  // scenario bound leaves 2.5x).
  constexpr double kLossRtol = 1e-2;
  constexpr double kNormRtol = 3e-2;
  const std::vector<MeshSpec> sources = {{1, 2, 1}, {1, 2, 2}, {2, 2, 2}};
  const std::vector<MeshSpec> meshes = {{1, 1, 1}, {1, 4, 1}, {2, 2, 1},
                                        {1, 1, 2}, {1, 2, 2}, {2, 2, 2}};
  RunOptions base;
  base.config = small(RecipeKind::kNvfp4);
  double worst_loss = 0, worst_norm = 0;
  for_each_resumed_step(base, sources, meshes, kHalf, root_, [&](const ResumedStep& r) {
    if (r.same_mesh) {
      EXPECT_EQ(r.got.loss, r.want.loss) << r.ctx;
      EXPECT_EQ(r.got.grad_norm, r.want.grad_norm) << r.ctx;
    }
    const double rl = std::abs(r.got.loss - r.want.loss) / std::abs(r.want.loss);
    const double rn = std::abs(r.got.grad_norm - r.want.grad_norm) / std::abs(r.want.grad_norm);
    worst_loss = std::max(worst_loss, rl);
    worst_norm = std::max(worst_norm, rn);
    EXPECT_LE(rl, kLossRtol) << r.ctx << " loss " << r.got.loss << " vs " << r.want.loss;
    EXPECT_LE(rn, kNormRtol) << r.ctx << " grad_norm " << r.got.grad_norm << " vs "
                             << r.want.grad_norm;
  });
  std::printf("nvfp4 cross-mesh resume: worst relative deviation loss %.3g, grad_norm %.3g\n",
              worst_loss, worst_norm);
  RecordProperty("worst_rel_loss", std::to_string(worst_loss));
  RecordProperty("worst_rel_grad_norm", std::to_string(worst_norm));
}

TEST_F(ResumeTest, CheckpointFaultsBreakParity) {
  RunOptions o;
  o.config = small(RecipeKind::kDelayed);
  o.mesh = {1, 2, 1};
  const Capture a = straight(o, 2 * kHalf);
  struct Fault {
    std::string name;
    CheckpointOptions save, load;
  };
  std::vector<Fault> faults(4);
  faults[0].name = "fp8_state_dropped_from_checkpoint";
  faults[0].save.faults.fp8_state_dropped_from_checkpoint = true;
  faults[0].load.faults.fp8_state_dropped_from_checkpoint = true;
  faults[1].name = "scale_inv_saved_bf16";
  faults[1].save.faults.scale_inv_saved_bf16 = true;
  faults[2].name = "data_cursor_not_restored";
  faults[2].load.faults.data_cursor_not_restored = true;
  faults[3].name = "optimizer_state_not_restored";
  faults[3].load.faults.optimizer_state_not_restored = true;
  for (const Fault& f : faults) {
    const Capture b = resumed(o, kHalf, root_ / f.name, f.save, f.load);
    const bool caught = !same_metrics(a, b) || differing_tensors(a, b, f.name, false) > 0;
    EXPECT_TRUE(caught) << f.name << " left the resumed run bitwise equal";
  }
}

TEST_F(ResumeTest, Fp8ParamsScaleInvThroughBf16BreaksParity) {
  // Current scaling with FP8 primary weights: the only fp32 scale in the state is each FP8
  // weight's scale_inv, so the fault reaches exactly the loaded weights (TE's Float8Tensor
  // parameters saved with a bf16 scale_inv decode to different values after the load).
  RunOptions o;
  o.config = small(RecipeKind::kCurrent);
  o.mesh = {1, 2, 1};
  o.fsdp.fp8_params = true;
  const Capture a = straight(o, 2 * kHalf);
  CheckpointOptions save;
  save.faults.scale_inv_saved_bf16 = true;
  const Capture b = resumed(o, kHalf, root_ / "bf16", save, {});
  // Steps before the checkpoint are the same run; the first resumed step already differs.
  for (size_t i = 0; i < static_cast<size_t>(kHalf); ++i)
    EXPECT_EQ(a.metrics[i].loss, b.metrics[i].loss) << i;
  EXPECT_NE(a.metrics[kHalf].loss, b.metrics[kHalf].loss);
}

}  // namespace
}  // namespace meshproof::engine
