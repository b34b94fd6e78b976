// The recipe bench's grouped expert GEMM (docs/design.md sections 26 and 27): the uneven split of
// the bench's tokens over kGroupedExperts experts padded to the recipe's alignment
// (grouped_split), the GEMMs of each role run block by block in expert order on row views as
// GptModel::moe_forward / moe_backward run them, and the per-expert quantizations of each operand.
// Apart from the dense per-GEMM timing (bench_gemms.cc): its operands are the experts' blocks,
// built and quantized per expert.
#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <string>
#include <vector>

#include "engine/bench/bench_recipes.h"
#include "engine/bench/bench_recipes_internal.h"
#include "engine/config/config.h"
#include "engine/model/recipe.h"
#include "engine/moe/moe.h"
#include "kernels/core/error.h"
#include "kernels/core/tensor.h"
#include "kernels/gemm/gemm.h"
#include "kernels/ops/cast.h"
#include "kernels/quantize/quantized_tensor.h"

namespace meshproof::engine {

using kernels::Device;
using kernels::DType;
using kernels::GemmRole;
using kernels::QuantizedTensor;
using kernels::Tensor;
using namespace bench_detail;  // NOLINT(google-build-using-namespace): the recipe bench's helpers

namespace {

// Bench-value rows of each expert's block ([padded_rows, cols] of `dtype` on `device`), zero in
// the padding rows as the engine's dispatch leaves them.
Tensor random_blocks(const GroupedSplit& g, int64_t cols, DType dtype, Device device,
                     uint32_t seed) {
  BenchValues values(seed);
  std::vector<float> v(static_cast<size_t>(g.padded_rows() * cols), 0.0f);
  int64_t row = 0;
  for (size_t e = 0; e < g.rows.size(); ++e) {
    for (int64_t i = 0; i < g.rows[e] * cols; ++i)
      v[static_cast<size_t>(row * cols + i)] = values.next();
    row += g.padded[e];
  }
  Tensor t = Tensor::from_vector<float>({g.padded_rows(), cols}, v);
  if (dtype != DType::kFloat32) t = kernels::cast_to(t, dtype);
  return t.on(device);
}

// First row of each expert's block.
std::vector<int64_t> block_offsets(const GroupedSplit& g) {
  std::vector<int64_t> off(g.padded.size() + 1, 0);
  for (size_t e = 0; e < g.padded.size(); ++e) off[e + 1] = off[e] + g.padded[e];
  return off;
}

// Quantizations of a grouped operand per expert name ("bench.expert<e>"); experts with an empty
// block (fp32 / bf16 only: quantized recipes pad an empty expert to one block) are skipped.
std::string expert_name(size_t e) { return fmt::format("bench.expert{}", e); }

// One rotation set of the grouped GEMM: X [P, K] and dY [P, N] with the experts' blocks as rows,
// one W [N, K] per expert, their per-expert quantized copies and the outputs.
struct GroupedSet {
  Tensor x, dy;
  std::vector<Tensor> w;
  std::vector<QuantizedTensor> qx, qw, qdy;  // per expert (quantized recipes)
  Tensor y, dx;                              // [P, N], [P, K]
  std::vector<Tensor> dw;                    // per expert [N, K] fp32
};

}  // namespace

namespace bench_detail {

// The recipe's grouped GEMM in each of the three roles over split g at linear (out n, in k): one
// GEMM per expert block in expert order on row views, as GptModel::moe_forward / moe_backward run
// it.
std::vector<Measurement> measure_grouped_gemms(RecipeKind r, const GroupedSplit& g, int64_t n,
                                               int64_t k, const RecipeBenchOptions& o,
                                               int64_t cache) {
  const DType dt = r == RecipeKind::kFp32 ? DType::kFloat32 : DType::kBFloat16;
  const int64_t es = r == RecipeKind::kFp32 ? 4 : 2;
  const int64_t p = g.padded_rows(), experts = static_cast<int64_t>(g.rows.size());
  const int64_t set_bytes = es * (p * k + experts * n * k + p * n) * 2 + 4 * experts * n * k;
  const int pool = rotation_count(set_bytes, cache);
  const std::vector<int64_t> off = block_offsets(g);
  Fp8Recipe recipe(recipe_config(r), kSingleRank);
  std::vector<GroupedSet> sets(static_cast<size_t>(pool));
  for (int i = 0; i < pool; ++i) {
    GroupedSet& s = sets[static_cast<size_t>(i)];
    const auto seed = static_cast<uint32_t>(5000 + 16 * i);
    s.x = random_blocks(g, k, dt, o.device, seed);
    s.dy = random_blocks(g, n, dt, o.device, seed + 1);
    for (size_t e = 0; e < g.rows.size(); ++e) {
      s.w.push_back(random_tensor(n, k, dt, o.device, seed + 2 + static_cast<uint32_t>(e)));
      s.dw.push_back(Tensor::empty({n, k}, DType::kFloat32, o.device));
      if (recipe.enabled()) {
        const kernels::Usage both{true, true};
        const std::string name = expert_name(e);
        s.qx.push_back(
            recipe.quantize(name, Fp8Role::kInput, s.x.slice_rows(off[e], off[e + 1]), both));
        s.qw.push_back(recipe.quantize(name, Fp8Role::kWeight, s.w.back(), both));
        s.qdy.push_back(
            recipe.quantize(name, Fp8Role::kGradOutput, s.dy.slice_rows(off[e], off[e + 1]), both));
      }
    }
    s.y = Tensor::empty({p, n}, dt, o.device);
    s.dx = Tensor::empty({p, k}, dt, o.device);
  }
  std::vector<Measurement> out;
  for (GemmRole role : kAllRoles) {
    Measurement m;
    m.flops =
        2.0 * static_cast<double>(g.tokens()) * static_cast<double>(n) * static_cast<double>(k);
    const kernels::GemmOptions opts = recipe.options(role);
    time_into(m, o.device, o.warmup, o.iters, [&](int i) {
      GroupedSet& s = sets[static_cast<size_t>(i % pool)];
      for (size_t e = 0; e < g.rows.size(); ++e) {
        // An empty block (fp32 / bf16: an expert with no rows) has no GEMM to run; its weight
        // gradient is zero, which is not a GEMM's work either.
        if (off[e + 1] == off[e]) continue;
        const bool q = recipe.enabled();
        const Tensor xe = s.x.slice_rows(off[e], off[e + 1]);
        const Tensor dye = s.dy.slice_rows(off[e], off[e + 1]);
        const kernels::GemmOperand x = q ? kernels::GemmOperand(&s.qx[e]) : &xe;
        const kernels::GemmOperand w = q ? kernels::GemmOperand(&s.qw[e]) : &s.w[e];
        const kernels::GemmOperand dy = q ? kernels::GemmOperand(&s.qdy[e]) : &dye;
        switch (role) {
          case GemmRole::kFprop: {
            Tensor ye = s.y.slice_rows(off[e], off[e + 1]);
            kernels::gemm_fprop(x, w, ye, opts);
            break;
          }
          case GemmRole::kDgrad: {
            Tensor dxe = s.dx.slice_rows(off[e], off[e + 1]);
            kernels::gemm_dgrad(dy, w, dxe, opts);
            break;
          }
          case GemmRole::kWgrad:
            kernels::gemm_wgrad(dy, x, s.dw[e], opts);
            break;
        }
      }
    });
    out.push_back(std::move(m));
  }
  return out;
}

// Quantizing one grouped operand (x [P, K], w: E x [N, K], dy [P, N]) into one copy: every
// expert's block in expert order per repetition, from bf16.
QuantizeFigure measure_grouped_quantize(RecipeKind r, const GroupedSplit& g, int64_t n, int64_t k,
                                        const OperandSpec& op, bool columnwise,
                                        const RecipeBenchOptions& o, int64_t cache) {
  QuantizeFigure f;
  f.operand = op.name;
  f.columnwise = columnwise;
  const bool weight = op.role == Fp8Role::kWeight;
  const int64_t experts = static_cast<int64_t>(g.rows.size());
  f.rows = weight ? experts * n : g.padded_rows();
  f.cols = op.role == Fp8Role::kGradOutput ? n : k;
  const int64_t in_bytes = f.rows * f.cols * 2;
  const int pool = rotation_count(in_bytes + f.rows * f.cols, cache);
  // Weights: E stacked [N, K] blocks; activations: the experts' padded blocks.
  GroupedSplit wsplit;
  wsplit.rows.assign(g.rows.size(), n);
  wsplit.padded = wsplit.rows;
  const GroupedSplit& blocks = weight ? wsplit : g;
  const std::vector<int64_t> off = block_offsets(blocks);
  std::vector<Tensor> inputs;
  for (int i = 0; i < pool; ++i) {
    inputs.push_back(
        random_blocks(blocks, f.cols, DType::kBFloat16, o.device, 7000 + static_cast<uint32_t>(i)));
  }
  Fp8Recipe recipe(recipe_config(r), kSingleRank);
  int64_t out_bytes = 0;
  time_into(f.m, o.device, o.warmup, o.iters, [&](int i) {
    out_bytes = 0;
    for (size_t e = 0; e < blocks.rows.size(); ++e) {
      if (off[e + 1] == off[e]) continue;
      QuantizedTensor q =
          recipe.quantize(expert_name(e), op.role,
                          inputs[static_cast<size_t>(i % pool)].slice_rows(off[e], off[e + 1]),
                          {!columnwise, columnwise});
      out_bytes += quantized_bytes(q);
    }
  });
  const bool per_tensor = r == RecipeKind::kDelayed || r == RecipeKind::kCurrent;
  f.m.bytes = static_cast<double>((per_tensor ? 2 : 1) * in_bytes + out_bytes);
  return f;
}

}  // namespace bench_detail

int64_t GroupedSplit::tokens() const {
  int64_t t = 0;
  for (int64_t r : rows) t += r;
  return t;
}

int64_t GroupedSplit::padded_rows() const {
  int64_t t = 0;
  for (int64_t r : padded) t += r;
  return t;
}

GroupedSplit grouped_split(RecipeKind recipe, int64_t tokens) {
  MP_CHECK_INPUT(tokens > 0 && tokens % 8 == 0,
                 "grouped GEMM split: {} tokens is not a positive multiple of 8", tokens);
  static_assert(kGroupedExperts == 4, "the split below names four experts");
  GroupedSplit g;
  g.rows = {tokens / 2, 3 * tokens / 8, 0, tokens / 8};
  g.alignment = moe::row_alignment(recipe);
  // The engine's dispatch rule (moe::dispatch): padded to the alignment, an empty expert one
  // block under the quantized recipes (keep_empty).
  for (int64_t r : g.rows) {
    const int64_t n = std::max<int64_t>(r, is_fp8(recipe) ? 1 : 0);
    g.padded.push_back((n + g.alignment - 1) / g.alignment * g.alignment);
  }
  return g;
}

}  // namespace meshproof::engine
