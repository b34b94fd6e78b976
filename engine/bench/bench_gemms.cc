// The recipe bench's figures of one linear (docs/design.md section 26): the recipe's GEMM in each
// role at a linear shape over a rotation pool of operand sets, quantized beforehand, and the time
// of each quantization a GEMM needs (one operand into one copy, from bf16); measure_bf16_gemm, the
// BF16 baseline the training runner calibrates its MFU with, is the same measurement. Apart from
// the grouped expert GEMMs (bench_grouped.cc) and the driver (bench_recipes.cc): the dense per-GEMM
// timing in one place.
#include <algorithm>
#include <cstdint>
#include <vector>

#include "engine/bench/bench_recipes.h"
#include "engine/bench/bench_recipes_internal.h"
#include "engine/model/recipe.h"
#include "kernels/core/bench_timer.h"
#include "kernels/core/error.h"
#include "kernels/core/tensor.h"
#include "kernels/gemm/gemm.h"
#include "kernels/quantize/quantized_tensor.h"

namespace meshproof::engine {

using kernels::DType;
using kernels::GemmRole;
using kernels::QuantizedTensor;
using kernels::Tensor;
using namespace bench_detail;  // NOLINT(google-build-using-namespace): the recipe bench's helpers

namespace {

// One rotation set of a linear's GEMM operands in the recipe's form.
struct GemmSet {
  Tensor x, w, dy;              // compute dtype [M,K], [N,K], [M,N]
  QuantizedTensor qx, qw, qdy;  // both copies each (FP8 recipes only)
  Tensor y, dx, dw;             // outputs [M,N] and [M,K] in the compute dtype, [N,K] fp32
};

}  // namespace

namespace bench_detail {

// Quantizing one operand of linear shape s into one copy, from bf16, timed over a rotation pool.
QuantizeFigure measure_quantize(RecipeKind r, const GemmShape& s, const OperandSpec& op,
                                bool columnwise, const RecipeBenchOptions& o, int64_t cache) {
  QuantizeFigure f;
  f.operand = op.name;
  f.columnwise = columnwise;
  f.rows = op.role == Fp8Role::kWeight ? s.n : s.m;
  f.cols = op.role == Fp8Role::kGradOutput ? s.n : s.k;
  const int64_t n = f.rows * f.cols;
  const int64_t in_bytes = n * 2;
  // Output size estimate for the rotation count only: one 1-byte copy.
  const int pool = rotation_count(in_bytes + n, cache);
  std::vector<Tensor> inputs;
  for (int i = 0; i < pool; ++i) {
    inputs.push_back(random_tensor(f.rows, f.cols, DType::kBFloat16, o.device, 100 + i));
  }
  Fp8Recipe recipe(recipe_config(r), kSingleRank);
  int64_t out_bytes = 0;
  time_into(f.m, o.device, o.warmup, o.iters, [&](int i) {
    QuantizedTensor q = recipe.quantize("bench", op.role, inputs[static_cast<size_t>(i % pool)],
                                        {!columnwise, columnwise});
    out_bytes = quantized_bytes(q);
  });
  // Per-tensor recipes pass over the input twice (amax, then the cast); block recipes once.
  const bool per_tensor = r == RecipeKind::kDelayed || r == RecipeKind::kCurrent;
  f.m.bytes = static_cast<double>((per_tensor ? 2 : 1) * in_bytes + out_bytes);
  return f;
}

// The recipe's GEMM in each of `roles` at linear shape s.
std::vector<Measurement> measure_gemms(RecipeKind r, const GemmShape& s,
                                       const std::vector<GemmRole>& roles,
                                       const RecipeBenchOptions& o, int64_t cache) {
  const DType dt = r == RecipeKind::kFp32 ? DType::kFloat32 : DType::kBFloat16;
  const int64_t es = r == RecipeKind::kFp32 ? 4 : 2;
  const int64_t set_bytes = es * (s.m * s.k + s.n * s.k + s.m * s.n) * 2 + 4 * s.n * s.k;
  const int pool = rotation_count(set_bytes, cache);
  Fp8Recipe recipe(recipe_config(r), kSingleRank);
  std::vector<GemmSet> sets(static_cast<size_t>(pool));
  // Columnwise copies only when a dgrad or wgrad reads them: an fprop-only set (the M sweep)
  // quantizes rowwise copies only, as columnwise MXFP8 blocks need M % 32 == 0, which a small M
  // of the sweep may not meet.
  const bool need_col = std::any_of(roles.begin(), roles.end(),
                                    [](GemmRole role) { return role != GemmRole::kFprop; });
  for (int i = 0; i < pool; ++i) {
    GemmSet& g = sets[static_cast<size_t>(i)];
    g.x = random_tensor(s.m, s.k, dt, o.device, 1000 + 3 * i);
    g.w = random_tensor(s.n, s.k, dt, o.device, 1001 + 3 * i);
    g.dy = random_tensor(s.m, s.n, dt, o.device, 1002 + 3 * i);
    if (recipe.enabled()) {
      g.qx = recipe.quantize("bench", Fp8Role::kInput, g.x, {true, need_col});
      g.qw = recipe.quantize("bench", Fp8Role::kWeight, g.w, {true, need_col});
      g.qdy = recipe.quantize("bench", Fp8Role::kGradOutput, g.dy, {true, need_col});
    }
    g.y = Tensor::empty({s.m, s.n}, dt, o.device);
    g.dx = Tensor::empty({s.m, s.k}, dt, o.device);
    g.dw = Tensor::empty({s.n, s.k}, DType::kFloat32, o.device);
  }
  auto operand = [&](const Tensor& t, const QuantizedTensor& q) -> kernels::GemmOperand {
    if (recipe.enabled()) return &q;
    return &t;
  };
  std::vector<Measurement> out;
  for (GemmRole role : roles) {
    Measurement m;
    m.flops = 2.0 * static_cast<double>(s.m) * static_cast<double>(s.n) * static_cast<double>(s.k);
    const kernels::GemmOptions opts = recipe.options(role);
    time_into(m, o.device, o.warmup, o.iters, [&](int i) {
      GemmSet& g = sets[static_cast<size_t>(i % pool)];
      switch (role) {
        case GemmRole::kFprop:
          kernels::gemm_fprop(operand(g.x, g.qx), operand(g.w, g.qw), g.y, opts);
          break;
        case GemmRole::kDgrad:
          kernels::gemm_dgrad(operand(g.dy, g.qdy), operand(g.w, g.qw), g.dx, opts);
          break;
        case GemmRole::kWgrad:
          kernels::gemm_wgrad(operand(g.dy, g.qdy), operand(g.x, g.qx), g.dw, opts);
          break;
      }
    });
    out.push_back(std::move(m));
  }
  return out;
}

}  // namespace bench_detail

Measurement measure_bf16_gemm(const RecipeBenchOptions& o, const GemmShape& s, GemmRole role) {
  MP_CHECK_INPUT(o.iters >= 1 && o.warmup >= 0, "bf16 GEMM timing needs iters >= 1, warmup >= 0");
  return measure_gemms(RecipeKind::kBf16, s, {role}, o,
                       kernels::last_level_cache_bytes(o.device).value)[0];
}

}  // namespace meshproof::engine
