// Tensor-parallel experts (docs/design.md "Tensor-parallel experts"): MoE training with tp 2, with
// and without expert parallelism and sequence parallelism, against one rank (loss, grad_norm and
// the final weights) for fp32 and the FP8 recipes, the placements of the expert parameters as
// data on their specs, the run rules, and the FP8 all-gather / FP8 primary weights of expert
// weights.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <map>

#include "engine/config/run_rules.h"
#include "engine/model/params.h"
#include "engine/model/trainer.h"
#include "engine/session/session.h"
#include "tests/engine/test_config.h"

namespace meshproof::engine {
namespace {

using kernels::Tensor;

MeshSpec mesh(int replicate, int shard, int tp, int ep, bool sp = false) {
  MeshSpec m{replicate, shard, tp};
  m.ep = ep;
  m.sequence_parallel = sp;
  return m;
}

std::string mesh_name(const MeshSpec& m) {
  return fmt::format("{} ep {}{}", m.device_mesh().str(), m.ep, m.sequence_parallel ? " sp" : "");
}

// ||got - want|| / ||want|| of one final weight, in double, without attn.qkv.bias's key entries
// (testing::drop_key_bias says why).
// Returns {||got - want||², ||want||²}.
std::pair<double, double> sq_norms(const Config& c, const std::string& name, const Tensor& got_t,
                                   const Tensor& want_t, int steps) {
  std::vector<float> got = got_t.to_vector<float>(), want = want_t.to_vector<float>();
  EXPECT_EQ(got.size(), want.size()) << name;
  if (got.size() != want.size()) return {1.0, 0.0};
  testing::drop_key_bias(c, name, got, want, steps);
  double diff = 0, norm = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    diff += (double{got[i]} - want[i]) * (double{got[i]} - want[i]);
    norm += double{want[i]} * want[i];
  }
  return {diff, norm};
}

// Relative deviations: loss and grad_norm (worst step), the final weights as one vector
// (||got - want|| / ||want|| over every parameter) and per tensor (the worst; not checked when
// `tensor` is 0: under the FP8 recipes a small tensor such as a norm bias, which moves by about
// lr per step from 0, differs by O(1) relative when its tiny gradients round differently).
struct Bounds {
  double loss = 0, grad_norm = 0, params = 0, tensor = 0;
};

// `steps` steps of `c` on `m` against the single-rank Trainer `t` (run for `ref`): the worst
// deviations, recorded as a test property (the measured numbers of docs/design.md).
Bounds measure(const Config& c, const Trainer& t, const std::vector<StepMetrics>& ref,
               const MeshSpec& m, const std::string& tag) {
  const int steps = static_cast<int>(ref.size());
  const RunResult run = run_training(testing::run_options(c, m, steps));
  const std::string where = mesh_name(m);
  EXPECT_EQ(run.metrics.size(), ref.size()) << where;
  Bounds got;
  for (size_t s = 0; s < std::min(ref.size(), run.metrics.size()); ++s) {
    const StepMetrics& want = ref[s];
    const StepMetrics& have = run.metrics[s];
    got.loss = std::max(got.loss, std::abs(have.loss - want.loss) / want.loss);
    got.grad_norm =
        std::max(got.grad_norm, std::abs(have.grad_norm - want.grad_norm) / want.grad_norm);
  }
  std::string worst_param;
  double diff = 0, norm = 0;
  for (const std::string& name : t.params().names()) {
    EXPECT_TRUE(run.final_params.count(name)) << where << ": no final " << name;
    if (!run.final_params.count(name)) continue;
    const auto [d, n] = sq_norms(c, name, run.final_params.at(name), t.params().at(name), steps);
    diff += d;
    norm += n;
    const double r = n == 0 ? std::sqrt(d) : std::sqrt(d / n);
    if (r >= got.tensor) {
      got.tensor = r;
      worst_param = name;
    }
  }
  got.params = std::sqrt(diff / norm);
  ::testing::Test::RecordProperty(
      fmt::format("rel_{}_{}", tag, where),
      fmt::format("loss {:.3e} grad_norm {:.3e} params {:.3e} worst tensor {:.3e} ({})", got.loss,
                  got.grad_norm, got.params, got.tensor, worst_param));
  return got;
}

std::vector<StepMetrics> reference(Trainer& t, int steps) {
  std::vector<StepMetrics> ref;
  for (int s = 0; s < steps; ++s) ref.push_back(t.step());
  return ref;
}

// Every mesh against one rank within `b` (b.tensor 0: the per-tensor deviation not checked).
void expect_tp_matches(const Config& c, const Bounds& b, const std::string& tag,
                       const std::vector<MeshSpec>& meshes, int steps = 3) {
  Trainer t(c);
  const std::vector<StepMetrics> ref = reference(t, steps);
  for (const MeshSpec& m : meshes) {
    const Bounds got = measure(c, t, ref, m, tag);
    const std::string where = tag + " " + mesh_name(m);
    EXPECT_LE(got.loss, b.loss) << where;
    EXPECT_LE(got.grad_norm, b.grad_norm) << where;
    EXPECT_LE(got.params, b.params) << where;
    if (b.tensor > 0) {
      EXPECT_LE(got.tensor, b.tensor) << where;
    }
  }
}

// The expert placements are data on the parameter specs, the dense MLP's: fc1 (gate, up)
// column-parallel, fc2 row-parallel with its bias replicated, the router replicated and fp32.
TEST(MoeTpPlan, ExpertSpecsCarryTheDenseMlpTpStyles) {
  Config c = testing::tiny_moe_config();
  c.model.activation = Activation::kSwiGlu;
  c.model.moe.shared_expert = true;
  int experts_seen = 0;
  for (const ParamSpec& s : param_specs(c.model)) {
    if (s.name.find(".moe.") == std::string::npos) continue;
    const bool weight = s.name.ends_with(".weight");
    if (s.name.ends_with("router.weight")) {
      EXPECT_EQ(s.tp, TpStyle::kReplicated) << s.name;
      EXPECT_TRUE(s.fp32_compute) << s.name;
      EXPECT_FALSE(s.quantized()) << s.name;
      continue;
    }
    ++experts_seen;
    const bool fc2 = s.name.find(".fc2.") != std::string::npos;
    const TpStyle want = fc2 ? (weight ? TpStyle::kRow : TpStyle::kReplicated) : TpStyle::kColumn;
    EXPECT_EQ(s.tp, want) << s.name;
    if (weight) {
      EXPECT_EQ(s.linear_kind, fc2 ? LinearKind::kRowParallel : LinearKind::kColumnParallel)
          << s.name;
    }
  }
  // 2 layers x (4 experts + shared) x 3 linears x (weight, bias).
  EXPECT_EQ(experts_seen, 2 * 5 * 3 * 2);
}

// fp32: tp 2 alone, with ep 2 over FSDP 2 and over HSDP 2 x FSDP 2 (8 ranks), and with sequence
// parallelism (which adds the router and expert fc2 bias gradients on tp rank 0 only). Bounds:
// the fp32 mesh bound 1e-5 of docs/design.md section 8 for loss, grad_norm and all final weights
// as one vector; 1e-4 for the worst single tensor (AdamW's normalised update moves a weight by
// about lr whatever its gradient's size, so a summation-order difference in a tiny gradient
// element shows most in a small tensor such as a bias). Measured 2026-11-24: loss 2.8e-8,
// grad_norm 4.2e-7, weights 1.5e-6, worst tensor 2.7e-5 (recorded as properties).
TEST(MoeTpMeshes, Fp32TpTwoWithAndWithoutEpMatchesOneRank) {
  Config c = testing::tiny_moe_config();
  c.model.moe.shared_expert = true;
  c.model.moe.aux_loss_coef = 0.01;
  c.model.bias = true;
  expect_tp_matches(c, {1e-5, 1e-5, 1e-5, 1e-4}, "fp32_softmax_shared",
                    {mesh(1, 1, 2, 1), mesh(1, 2, 2, 2), mesh(2, 2, 2, 2), mesh(1, 2, 2, 2, true),
                     mesh(1, 1, 2, 1, true)});
  Config g = testing::tiny_moe_config();
  g.model.activation = Activation::kSwiGlu;
  g.model.moe.router = MoeRouter::kSigmoid;
  g.model.moe.experts = 8;
  g.training.micro_batches = 2;
  expect_tp_matches(g, {1e-5, 1e-5, 1e-5, 1e-4}, "fp32_sigmoid_swiglu_mb2",
                    {mesh(1, 2, 2, 2), mesh(1, 4, 2, 4), mesh(1, 2, 2, 2, true)});
}

// bf16 and the FP8 recipes on tp 2 x ep 2 x FSDP 2 and tp 2 x ep 2 x FSDP 4 with sequence
// parallelism against one rank, 3 steps: loss and grad_norm within the dense FP8 mesh bounds of
// the MoE tests (loss 1e-2, grad_norm 1e-1: tests/engine/moe/moe_test.cc, docs/design.md section 8
// (1e-2 for bf16) and tests/engine/parallel/shard_test.cc). The final weights are compared with the
// dense model's deviation on the same mesh and recipe (experts 0, ep 1), measured here: after 3
// AdamW steps at lr 1e-2 a weight moves by about lr per step whatever its gradient's size, so FP8
// gradients that round differently move the dense model's weights by 2-10% (norm-relative) already;
// the MoE model must stay within 3x that (measured ratio up to 2.7, block, on 2026-11-24: a token
// whose top-k choice flips adds to the rounding differences). Under bf16 the same comparison
// gives 5.4e-2 against the dense model's 9.3e-3 (ratio 5.8; the fp32 runs of the same meshes and
// model agree within 1.7e-7, so it is rounding amplified by routing flips, not a tp error):
// bf16's weights are recorded, not bounded by the ratio. MXFP8 runs the model with hidden 64
// (hidden / tp = 32: whole 1x32 blocks of attn.proj's K), the others hidden 32.
TEST(MoeTpMeshes, Bf16AndFp8RecipesOnTpTwoEpTwoMatchOneRankWithinMeasuredBounds) {
  for (RecipeKind r : {RecipeKind::kBf16, RecipeKind::kCurrent, RecipeKind::kMxfp8,
                       RecipeKind::kDelayed, RecipeKind::kBlock, RecipeKind::kNvfp4}) {
    Config c = testing::moe_mesh_config(r);
    if (r == RecipeKind::kMxfp8) {
      c.model.hidden = 64;
      c.model.ffn = 128;
    }
    Config dense = c;
    dense.model.moe = MoeConfig{};
    constexpr int kSteps = 3;
    Trainer t(c), td(dense);
    const std::vector<StepMetrics> ref = reference(t, kSteps), ref_d = reference(td, kSteps);
    for (const MeshSpec& m : {mesh(1, 2, 2, 2), mesh(1, 4, 2, 2, true)}) {
      MeshSpec md = m;
      md.ep = 1;
      const std::string where = fmt::format("{} {}", recipe_name(r), mesh_name(m));
      const Bounds got = measure(c, t, ref, m, std::string(recipe_name(r)));
      const Bounds base = measure(dense, td, ref_d, md, fmt::format("{}_dense", recipe_name(r)));
      EXPECT_LE(got.loss, 1e-2) << where;
      EXPECT_LE(got.grad_norm, 1e-1) << where;
      if (r != RecipeKind::kBf16) {
        EXPECT_LE(got.params, 3 * base.params) << where << " (dense " << base.params << ")";
      }
    }
  }
}

// mesh.tp > 1 with model.moe is accepted, also with the FP8 weight gathers.
TEST(MoeTpRules, TpWithMoeAndFp8GathersAccepted) {
  const auto issue = [](const RunOptions& o) {
    const std::vector<ConfigIssue> is = check_run(o, HostLimits{});
    return is.empty() ? std::string() : is.front().key_path + ": " + is.front().message;
  };
  const Config moe = testing::tiny_moe_config();
  EXPECT_EQ(issue(testing::run_options(moe, mesh(1, 2, 2, 2), 1)), "");
  EXPECT_EQ(issue(testing::run_options(moe, mesh(2, 2, 2, 2, true), 1)), "");
  RunOptions fp8 =
      testing::run_options(testing::moe_mesh_config(RecipeKind::kCurrent), mesh(1, 2, 2, 2), 1);
  fp8.fsdp.fp8_all_gather = true;
  EXPECT_EQ(issue(fp8), "");
  fp8.fsdp.fp8_params = true;
  EXPECT_EQ(issue(fp8), "");
}

// The model of the FP8 gather tests: hidden 64, ffn 128 (expert fc1 [128, 64] and fc2 [64, 128]:
// whole 32-row MXFP8 blocks per dp_shard 2 shard), 4 experts, top 2, aux loss.
Config gather_config(RecipeKind r) {
  Config c = testing::moe_mesh_config(r);
  c.model.hidden = 64;
  c.model.ffn = 128;
  return c;
}

// fsdp.fp8_all_gather with MoE: every expert weight's shard is quantized and all-gathered as FP8
// (per-tensor scales from the amax MAX-reduced over the weight's group, MXFP8 / NVFP4 blocks
// whole per shard), which is bitwise quantize(gather(shard)): the run equals the high-precision
// gather run bit for bit (loss, grad_norm, final weights), and allgather_parity finds every
// gathered expert weight of every step byte-identical to the single-rank quantization.
TEST(MoeFp8Gather, ExpertWeightsGatheredAsFp8BitwiseEqualToHighPrecisionGather) {
  const std::vector<std::pair<RecipeKind, MeshSpec>> cases = {
      {RecipeKind::kCurrent, mesh(1, 2, 1, 2)}, {RecipeKind::kCurrent, mesh(1, 2, 2, 2)},
      {RecipeKind::kDelayed, mesh(1, 2, 1, 2)}, {RecipeKind::kDelayed, mesh(2, 2, 2, 2)},
      {RecipeKind::kMxfp8, mesh(1, 2, 1, 2)},   {RecipeKind::kNvfp4, mesh(1, 2, 2, 2)}};
  for (const auto& [r, m] : cases) {
    const Config c = gather_config(r);
    const std::string where = fmt::format("{} {}", recipe_name(r), mesh_name(m));
    RunOptions hp = testing::run_options(c, m, 3), f8 = hp;
    f8.fsdp.fp8_all_gather = true;
    f8.allgather_parity = true;
    const RunResult a = run_training(hp), b = run_training(f8);
    testing::expect_same_run(a, b, where);
    std::map<std::string, int> checked;
    for (const AllGatherParity& p : b.parity) {
      if (p.tensor.find(".moe.experts.") == std::string::npos) continue;
      EXPECT_GT(p.bytes, 0) << where << " " << p.tensor;
      EXPECT_EQ(p.mismatched_bytes, 0) << where << " " << p.tensor << " step " << p.step;
      ++checked[p.tensor];
    }
    // Every expert weight (2 layers x 4 experts x fc1, fc2), every step.
    EXPECT_EQ(checked.size(), 2u * 4u * 2u) << where;
    for (const auto& [name, n] : checked) EXPECT_GE(n, 3) << where << " " << name;
  }
}

// fsdp.fp8_params with MoE: each expert weight is held as an FP8 primary weight (quantize of its
// fp32 master with the whole weight's scale, re-quantized after each step). With current and
// mxfp8 scaling those weights are the same on every data-parallel mesh; ep only changes the
// summation order of the expert weight gradients (docs/design.md "Expert parallelism"), so
// FSDP 2 x ep 2 matches one rank with fp8_params within the fp32 mesh bound 1e-5 (section 8;
// measured 4.5e-12). tp 2 changes the GEMM reduction lengths, and delayed scaling drifts on a
// mesh as it does without fp8_params: bound 1e-2, the FP8 mesh bound (measured 5.7e-4 current
// tp 2, 2.3e-4 delayed). Against the fp8_all_gather run (the bf16 compute copy quantized
// instead of the fp32 master) within 1e-2 as well (measured 6.7e-4). Measured 2026-11-24
// (properties).
TEST(MoeFp8Gather, Fp8ParamsWithExpertsMatchOneRank) {
  const std::vector<std::pair<RecipeKind, MeshSpec>> cases = {
      {RecipeKind::kCurrent, mesh(1, 2, 1, 2)},
      {RecipeKind::kCurrent, mesh(1, 2, 2, 2)},
      {RecipeKind::kMxfp8, mesh(1, 2, 1, 2)},
      {RecipeKind::kDelayed, mesh(1, 2, 1, 2)}};
  for (const auto& [r, m] : cases) {
    Config c = gather_config(r);
    c.training.lr = 1e-3;
    const std::string where = fmt::format("{} {}", recipe_name(r), mesh_name(m));
    RunOptions one = testing::run_options(c, mesh(1, 1, 1, 1), 4);
    one.fsdp.fp8_params = true;
    RunOptions run = one;
    run.mesh = m;
    RunOptions ag = run;
    ag.fsdp.fp8_params = false;
    ag.fsdp.fp8_all_gather = true;
    const RunResult a = run_training(one), b = run_training(run), g = run_training(ag);
    double mesh_worst = 0, ag_worst = 0;
    for (size_t s = 0; s < a.metrics.size(); ++s) {
      const double want = a.metrics[s].loss;
      mesh_worst = std::max(mesh_worst, std::abs(b.metrics[s].loss - want) / want);
      ag_worst = std::max(ag_worst, std::abs(g.metrics[s].loss - b.metrics[s].loss) / want);
    }
    EXPECT_LE(mesh_worst, r == RecipeKind::kDelayed || m.tp > 1 ? 1e-2 : 1e-5) << where;
    EXPECT_LE(ag_worst, 1e-2) << where;
    ::testing::Test::RecordProperty(
        fmt::format("rel_loss_fp8_params_{}", where),
        fmt::format("vs 1 rank {:.2e}, vs fp8_all_gather {:.2e}", mesh_worst, ag_worst));
  }
}

}  // namespace
}  // namespace meshproof::engine
