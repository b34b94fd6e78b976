// `bench recipes` (docs/design.md section 26): per recipe, the GEMMs of a layer in their three
// roles against BF16, the quantize time, the grouped expert GEMMs, one layer's step and the
// convergence curve. This file holds the recipe bench's table of recipes (the GEMM dtype and
// emulation labels, from the path decision) and run_recipe_bench, which runs every measurement in
// order and assembles the report; the measurements themselves are bench_gemms.cc (one linear's
// GEMMs and quantizations), bench_grouped.cc (the grouped expert GEMMs) and bench_steps.cc (the
// layer step and the training runs), sharing the timing, rotation and quantization helpers of
// engine/bench/bench_recipes_internal.h.
#include "engine/bench/bench_recipes.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/bench/bench_recipes_internal.h"
#include "engine/config/config.h"
#include "engine/model/params.h"
#include "kernels/core/bench_timer.h"
#include "kernels/core/device.h"
#include "kernels/core/error.h"
#include "kernels/core/tensor.h"
#include "kernels/gemm/cublaslt_plan.h"
#include "kernels/gemm/cublaslt_resources.h"
#include "kernels/gemm/gemm.h"

namespace meshproof::engine {

using kernels::Device;
using kernels::DType;
using kernels::GemmRole;
using kernels::ScalingMode;
using kernels::Tensor;
using namespace bench_detail;  // NOLINT(google-build-using-namespace): the recipe bench's helpers

namespace {

// The recipe bench's view of each recipe: a new recipe of engine/config/config.h kRecipeNames is
// one row. Whether its GEMMs are native or emulated on a device, and why, is
// kernels::lt::choose_gemm_path's answer for its operands (recipe_paths below), the decision the
// CUDA GEMM itself runs.
struct BenchRecipeRow {
  RecipeKind kind;
  const char* native_dtype;    // GEMM dtype when cuBLASLt runs the recipe natively
  const char* emulated_dtype;  // GEMM dtype of its exact emulation (the dequantized operands)
  int64_t m_multiple;          // token multiple its quantizers and GEMMs need
};

constexpr BenchRecipeRow kBenchRecipes[] = {
    {RecipeKind::kFp32, "fp32", "fp32", 1},
    {RecipeKind::kBf16, "bf16", "bf16", 1},
    {RecipeKind::kDelayed, "fp8", "fp32", 16},
    {RecipeKind::kCurrent, "fp8", "fp32", 16},
    {RecipeKind::kMxfp8, "fp8", "bf16", 32},
    {RecipeKind::kBlock, "fp8", "fp32", 1},
    // Blocks are 16 wide along K and the 16x16 weight tiles need M % 16 == 0 for the columnwise
    // copies.
    {RecipeKind::kNvfp4, "fp4", "fp32", 16},
};

const BenchRecipeRow& bench_row(RecipeKind r) {
  for (const BenchRecipeRow& row : kBenchRecipes) {
    if (row.kind == r) return row;
  }
  MP_FAIL("recipe '{}' has no row in the recipe bench's table (engine/bench/bench_recipes.cc)",
          recipe_name(r));
}

int device_cc(Device device) {
  if (device.is_cpu()) return 0;
  for (const kernels::GpuInfo& g : kernels::cuda_status().gpus) {
    if (g.index == device.index) return g.cc_major * 10 + g.cc_minor;
  }
  return 0;
}

// The quantizations each role reads (kernels/gemm/gemm.h): operand and whether the columnwise copy.
std::vector<std::pair<OperandSpec, bool>> role_quantizations(GemmRole role) {
  switch (role) {
    case GemmRole::kFprop:
      return {{kX, false}, {kW, false}};
    case GemmRole::kDgrad:
      return {{kDy, false}, {kW, true}};
    case GemmRole::kWgrad:
      return {{kDy, true}, {kX, true}};
  }
  return {};
}

// A block linear's name without its "attn."/"mlp." prefix: "qkv", "fc1_gate".
std::string short_linear(std::string_view name) {
  const size_t dot = name.rfind('.');
  return std::string(dot == std::string_view::npos ? name : name.substr(dot + 1));
}

// Distinct linear shapes (first occurrence order) of a list of GEMMs, with their linear names.
std::vector<std::pair<std::string, GemmShape>> linear_shapes(const std::vector<LinearGemm>& gs) {
  std::vector<std::pair<std::string, GemmShape>> out;
  for (const LinearGemm& g : gs) {
    if (out.empty() || out.back().first != g.linear || !(out.back().second == g.shape))
      out.emplace_back(g.linear, g.shape);
  }
  return out;
}

}  // namespace

// The values of bench_detail::BenchValues (engine/bench/bench_recipes_internal.h says how and why).
std::vector<float> bench_values(int64_t n, uint32_t seed) {
  MP_CHECK(n >= 0, "bench_values: negative count {}", n);
  BenchValues values(seed);
  std::vector<float> v(static_cast<size_t>(n));
  for (float& x : v) x = values.next();
  return v;
}

std::vector<LinearGemm> model_gemms(const BenchModel& model, int64_t tokens) {
  const ModelConfig mc = model.model_config(1);
  std::vector<LinearGemm> out;
  for (const LinearLayer& lin : block_linears(mc.activation)) {
    const GemmShape s{tokens, lin.out_mult * model_dim(mc, lin.out_dim), model_dim(mc, lin.in_dim)};
    for (GemmRole role : kAllRoles) out.push_back({short_linear(lin.name), role, s});
  }
  return out;
}

Speedup gemm_speedup(double bf16_s, double gemm_s, double quantize_s) {
  MP_CHECK_INPUT(bf16_s > 0 && gemm_s > 0 && quantize_s >= 0,
                 "speedup needs bf16 > 0, gemm > 0 and quantize >= 0 seconds (got {}, {}, {})",
                 bf16_s, gemm_s, quantize_s);
  return {bf16_s / (gemm_s + quantize_s), bf16_s / gemm_s};
}

double RoleFigure::quantize_seconds() const {
  double s = 0;
  for (const QuantizeFigure& q : quantize) s += q.m.seconds;
  return s;
}

Speedup RoleFigure::speedup() const {
  return gemm_speedup(bf16.seconds, time.seconds, quantize_seconds());
}

std::vector<RecipeKind> RecipeBenchOptions::all_bench_recipes() {
  std::vector<RecipeKind> out;
  for (const RecipeName& n : kRecipeNames) out.push_back(n.kind);
  return out;
}

namespace {

// The operands (A, B of kernels/gemm/gemm_internal.h's canonical form) of each role of a recipe's
// linear layer, as the path decision sees them: fprop X x W, dgrad dY x W^T, wgrad dY^T x X^T
// (engine/model/recipe.cc's quantizations with the default HYBRID formats: dY in e5m2 for
// per-tensor).
std::array<std::pair<kernels::lt::PathOperand, kernels::lt::PathOperand>, 3> recipe_operands(
    RecipeKind r) {
  using kernels::lt::PathOperand;
  auto hp = [](DType d) { return PathOperand{false, ScalingMode::kCurrentTensor, d}; };
  auto q = [](ScalingMode m, DType f) { return PathOperand{true, m, f}; };
  switch (r) {
    case RecipeKind::kFp32:
      return {{{hp(DType::kFloat32), hp(DType::kFloat32)},
               {hp(DType::kFloat32), hp(DType::kFloat32)},
               {hp(DType::kFloat32), hp(DType::kFloat32)}}};
    case RecipeKind::kBf16:
      return {{{hp(DType::kBFloat16), hp(DType::kBFloat16)},
               {hp(DType::kBFloat16), hp(DType::kBFloat16)},
               {hp(DType::kBFloat16), hp(DType::kBFloat16)}}};
    case RecipeKind::kDelayed:
    case RecipeKind::kCurrent: {
      const ScalingMode m =
          r == RecipeKind::kDelayed ? ScalingMode::kDelayedTensor : ScalingMode::kCurrentTensor;
      return {{{q(m, DType::kE4M3), q(m, DType::kE4M3)},
               {q(m, DType::kE5M2), q(m, DType::kE4M3)},
               {q(m, DType::kE5M2), q(m, DType::kE4M3)}}};
    }
    case RecipeKind::kMxfp8: {
      const PathOperand mx = q(ScalingMode::kMxfp8, DType::kE4M3);
      return {{{mx, mx}, {mx, mx}, {mx, mx}}};
    }
    case RecipeKind::kBlock: {
      const PathOperand v = q(ScalingMode::kBlock1x128, DType::kE4M3);
      const PathOperand t = q(ScalingMode::kBlock128x128, DType::kE4M3);
      return {{{v, t}, {v, t}, {v, v}}};
    }
    case RecipeKind::kNvfp4: {
      const PathOperand f = q(ScalingMode::kNvfp4, DType::kE2M1);
      return {{{f, f}, {f, f}, {f, f}}};
    }
  }
  MP_FAIL("recipe '{}' has no operands in the recipe bench (engine/bench/bench_recipes.cc)",
          recipe_name(r));
}

// The first emulation reason over the recipe's three roles ("" when all are native), at shapes
// every native path takes (multiples of 128: the bench and training shapes the recipes' rules
// admit; a shape a native path refuses is an input error there, or the emulation the decision
// names, per GEMM).
std::string recipe_path_emulation(RecipeKind recipe, int compute_capability, int lt_version,
                                  const std::vector<GemmShape>& shapes = {{128, 128, 128}}) {
  const auto ops = recipe_operands(recipe);
  for (const GemmShape& s : shapes) {
    // [R, S, K] of each role at linear shape (M, N, K) (kernels/gemm/gemm_internal.h).
    const int64_t dims[3][3] = {{s.m, s.n, s.k}, {s.m, s.k, s.n}, {s.n, s.k, s.m}};
    for (size_t role = 0; role < ops.size(); ++role) {
      const kernels::lt::PathQuery q{ops[role].first, ops[role].second, compute_capability,
                                     lt_version,      dims[role][0],    dims[role][1],
                                     dims[role][2]};
      const kernels::lt::PathDecision d = kernels::lt::choose_gemm_path(q);
      if (!d.native()) return d.emulation;
    }
  }
  return "";
}

}  // namespace

int label_cublaslt_version(int compute_capability) {
  // The CPU's labels never read it, and opening cuBLASLt to ask costs a CPU run its static
  // initialisers (about 0.15 s, section 31): a CPU run must not open it.
  if (compute_capability == 0) return 0;
  const int v = kernels::cublaslt_runtime_version();
  return v != 0 ? v : kernels::lt::kLtVersionBlock;
}

std::string recipe_gemm_dtype(RecipeKind recipe, int compute_capability, int lt_version) {
  if (compute_capability == 0) return "fp32";  // the CPU backend dequantizes to fp32
  const BenchRecipeRow& row = bench_row(recipe);
  return recipe_path_emulation(recipe, compute_capability, lt_version).empty() ? row.native_dtype
                                                                               : row.emulated_dtype;
}

std::string recipe_gemm_dtype(RecipeKind recipe, int compute_capability) {
  return recipe_gemm_dtype(recipe, compute_capability, label_cublaslt_version(compute_capability));
}

std::string recipe_emulation(RecipeKind recipe, int compute_capability, int lt_version) {
  if (compute_capability == 0) return "CPU emulation";
  return recipe_path_emulation(recipe, compute_capability, lt_version);
}

std::string recipe_emulation(RecipeKind recipe, int compute_capability) {
  return recipe_emulation(recipe, compute_capability, label_cublaslt_version(compute_capability));
}

std::string recipe_emulation(RecipeKind recipe, int compute_capability, int lt_version,
                             const std::vector<GemmShape>& shapes) {
  if (compute_capability == 0) return "CPU emulation";
  return recipe_path_emulation(recipe, compute_capability, lt_version, shapes);
}

int64_t recipe_m_multiple(RecipeKind recipe) { return bench_row(recipe).m_multiple; }

RecipeBenchReport run_recipe_bench(const RecipeBenchOptions& o) {
  MP_CHECK_INPUT(o.iters >= 1, "--iters must be at least 1 (got {})", o.iters);
  MP_CHECK_INPUT(o.warmup >= 0, "--warmup must be non-negative (got {})", o.warmup);
  MP_CHECK_INPUT(o.steps >= 0, "--steps must be non-negative (got {})", o.steps);
  MP_CHECK_INPUT(!o.recipes.empty(), "no recipes to measure");
  for (RecipeKind r : o.recipes) (void)bench_row(r);
  RecipeBenchReport rep;
  rep.device_name = kernels::device_name(o.device);
  rep.compute_capability = device_cc(o.device);
  rep.cache_bytes = kernels::last_level_cache_bytes(o.device).value;

  // Copy ceiling: source and destination together twice the cache (each at least 16 MiB, at most
  // 512 MiB), so that the copy streams through memory.
  const int64_t copy_elems =
      std::clamp<int64_t>(rep.cache_bytes, int64_t{16} << 20, int64_t{512} << 20) / 4;
  const Tensor src = Tensor::zeros({copy_elems}, DType::kFloat32, o.device);
  Tensor dst = Tensor::empty({copy_elems}, DType::kFloat32, o.device);
  rep.copy.bytes = 2.0 * static_cast<double>(src.nbytes().value);
  time_into(rep.copy, o.device, o.warmup, o.iters, [&](int) { dst.copy_from(src); });

  // The GEMMs: the model's, then the --shapes ones as linear "custom".
  std::vector<LinearGemm> gemms = model_gemms(o.model, o.model.tokens());
  for (const GemmShape& s : o.shapes) {
    for (GemmRole role : kAllRoles) gemms.push_back({"custom", role, s});
  }
  const std::vector<std::pair<std::string, GemmShape>> shapes = linear_shapes(gemms);
  // The forward M sweep at each linear's N, K.
  std::vector<std::pair<std::string, GemmShape>> sweep_shapes;
  for (int64_t m : o.m_sweep) {
    for (const auto& [name, s] : linear_shapes(model_gemms(o.model, m))) {
      sweep_shapes.emplace_back(name, s);
    }
  }

  // BF16 baselines at every shape, shared by every recipe.
  std::vector<std::vector<Measurement>> bf16;  // [shape][role]
  for (const auto& [name, s] : shapes) {
    bf16.push_back(measure_gemms(RecipeKind::kBf16, s, kAllRoles, o, rep.cache_bytes));
  }
  std::vector<Measurement> bf16_sweep;
  for (const auto& [name, s] : sweep_shapes) {
    bf16_sweep.push_back(
        measure_gemms(RecipeKind::kBf16, s, {GemmRole::kFprop}, o, rep.cache_bytes)[0]);
  }

  // The grouped expert GEMM (docs/design.md section 27): the block's first MLP linear as
  // kGroupedExperts experts over the model's tokens, split unevenly; bf16 baseline once.
  const ModelConfig block = o.model.model_config(1);
  std::string grouped_linear;
  int64_t grouped_n = 0, grouped_k = 0;
  for (const LinearLayer& lin : block_linears(block.activation)) {
    if (!lin.name.starts_with("mlp.")) continue;
    grouped_linear = short_linear(lin.name);
    grouped_n = lin.out_mult * model_dim(block, lin.out_dim);
    grouped_k = model_dim(block, lin.in_dim);
    break;
  }
  MP_CHECK(grouped_n > 0, "bench recipes: the block has no MLP linear for the grouped GEMM");
  const GroupedSplit bf16_split = grouped_split(RecipeKind::kBf16, o.model.tokens());
  const std::vector<Measurement> bf16_grouped = measure_grouped_gemms(
      RecipeKind::kBf16, bf16_split, grouped_n, grouped_k, o, rep.cache_bytes);

  if (o.steps > 0) {
    rep.bf16_curve = train_curve(RecipeKind::kBf16, o);
    rep.fp32_curve = train_curve(RecipeKind::kFp32, o);
  }

  for (RecipeKind r : o.recipes) {
    RecipeBenchResult res;
    res.recipe = r;
    res.gemm_dtype = recipe_gemm_dtype(r, rep.compute_capability);
    // The label from every GEMM shape this run measures (a shape a native path does not take
    // makes the recipe's figures an emulation, with that GEMM's reason).
    res.split = grouped_split(r, o.model.tokens());
    std::vector<GemmShape> measured;
    for (const auto& [name, s] : shapes) measured.push_back(s);
    for (const auto& [name, s] : sweep_shapes) measured.push_back(s);
    // Every expert block's GEMM (an empty block runs no GEMM a path decides).
    for (int64_t rows : res.split.padded) {
      if (rows > 0) measured.push_back({rows, grouped_n, grouped_k});
    }
    res.emulation = recipe_emulation(r, rep.compute_capability,
                                     label_cublaslt_version(rep.compute_capability), measured);
    const bool quantized = is_fp8(r);
    for (size_t si = 0; si < shapes.size(); ++si) {
      // Named references, not a structured binding: the lambda below captures the shape, which
      // clang (the sanitizer build) does not allow for a binding before C++20's P1091 lands there.
      const std::string& name = shapes[si].first;
      const GemmShape& s = shapes[si].second;
      // The bf16 recipe's GEMMs are the baselines themselves (speedup 1 by definition).
      const std::vector<Measurement> times =
          r == RecipeKind::kBf16 ? bf16[si] : measure_gemms(r, s, kAllRoles, o, rep.cache_bytes);
      // Each (operand, copy) quantization once per shape, shared by the roles that read it.
      std::vector<QuantizeFigure> quants;
      auto quant = [&](const OperandSpec& op, bool col) -> const QuantizeFigure& {
        for (const QuantizeFigure& q : quants) {
          if (q.operand == op.name && q.columnwise == col) return q;
        }
        quants.push_back(measure_quantize(r, s, op, col, o, rep.cache_bytes));
        return quants.back();
      };
      for (size_t ri = 0; ri < kAllRoles.size(); ++ri) {
        RoleFigure f;
        f.gemm = {name, kAllRoles[ri], s};
        f.bf16 = bf16[si][ri];
        f.time = times[ri];
        if (quantized) {
          for (const auto& [op, col] : role_quantizations(kAllRoles[ri])) {
            f.quantize.push_back(quant(op, col));
          }
        }
        res.roles.push_back(std::move(f));
      }
    }
    const int64_t mult = bench_row(r).m_multiple;
    std::vector<int64_t> skipped;
    for (size_t si = 0; si < sweep_shapes.size(); ++si) {
      const auto& [name, s] = sweep_shapes[si];
      if (s.m % mult != 0) {
        if (std::find(skipped.begin(), skipped.end(), s.m) == skipped.end()) skipped.push_back(s.m);
        continue;
      }
      RoleFigure f;
      f.gemm = {name, GemmRole::kFprop, s};
      f.bf16 = bf16_sweep[si];
      f.time = r == RecipeKind::kBf16
                   ? bf16_sweep[si]
                   : measure_gemms(r, s, {GemmRole::kFprop}, o, rep.cache_bytes)[0];
      if (quantized) {
        for (const auto& [op, col] : role_quantizations(GemmRole::kFprop)) {
          f.quantize.push_back(measure_quantize(r, s, op, col, o, rep.cache_bytes));
        }
      }
      res.sweep.push_back(std::move(f));
    }
    for (int64_t m : skipped) {
      res.notes.push_back(fmt::format("M sweep: M = {} not measured ({} needs M % {} == 0)", m,
                                      recipe_name(r), mult));
    }
    {
      // The grouped GEMM rows: the bf16 recipe's are the baselines themselves.
      const std::vector<Measurement> times =
          r == RecipeKind::kBf16
              ? bf16_grouped
              : measure_grouped_gemms(r, res.split, grouped_n, grouped_k, o, rep.cache_bytes);
      std::vector<QuantizeFigure> quants;
      auto quant = [&](const OperandSpec& op, bool col) -> const QuantizeFigure& {
        for (const QuantizeFigure& q : quants) {
          if (q.operand == op.name && q.columnwise == col) return q;
        }
        quants.push_back(measure_grouped_quantize(r, res.split, grouped_n, grouped_k, op, col, o,
                                                  rep.cache_bytes));
        return quants.back();
      };
      std::string rows;
      for (int64_t n : res.split.rows) rows += fmt::format("{}{}", rows.empty() ? "" : "/", n);
      for (size_t ri = 0; ri < kAllRoles.size(); ++ri) {
        RoleFigure f;
        f.gemm = {fmt::format("experts {} rows {}", grouped_linear, rows),
                  kAllRoles[ri],
                  {res.split.tokens(), grouped_n, grouped_k}};
        f.bf16 = bf16_grouped[ri];
        f.time = times[ri];
        if (quantized) {
          for (const auto& [op, col] : role_quantizations(kAllRoles[ri])) {
            f.quantize.push_back(quant(op, col));
          }
        }
        res.grouped.push_back(std::move(f));
      }
    }
    res.layer = measure_layer(r, o);
    if (o.steps > 0) {
      if (r == RecipeKind::kBf16) {
        res.convergence = rep.bf16_curve;
      } else if (r == RecipeKind::kFp32) {
        res.convergence = rep.fp32_curve;
      } else {
        res.convergence = train_curve(r, o);
      }
    }
    rep.recipes.push_back(std::move(res));
  }
  return rep;
}

}  // namespace meshproof::engine
