// `bench recipes` (docs/design.md section 26): per recipe, the GEMMs of a layer in their three
// roles against BF16, the quantize time, the grouped expert GEMMs, one layer's step and the
// convergence curve.
// Over 600 lines on purpose: one file per op family (the recipe benchmark); the recipe table, the
// per-role operand construction, the grouped expert sets and the layer runs share the timing,
// L2-rotation and quantization helpers defined here.
#include "engine/bench/bench_recipes.h"

#include <fmt/format.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <random>

#include "engine/model/model.h"
#include "engine/model/params.h"
#include "engine/model/recipe.h"
#include "engine/moe/moe.h"
#include "engine/session/session.h"
#include "kernels/core/bench_timer.h"
#include "kernels/core/device.h"
#include "kernels/core/error.h"
#include "kernels/gemm/cublaslt_plan.h"
#include "kernels/gemm/cublaslt_resources.h"
#include "kernels/ops/cast.h"
#include "kernels/quantize/quantize.h"

namespace meshproof::engine {

using kernels::Device;
using kernels::DType;
using kernels::GemmRole;
using kernels::QuantizedTensor;
using kernels::ScalingMode;
using kernels::Tensor;

namespace {

double median_of(std::vector<double> v) {
  MP_CHECK(!v.empty(), "median of no samples");
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 == 1 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

// Seconds of body(i) over `iters` timed calls after `warmup` untimed ones: the median, with the
// fastest and slowest call (the noise of the figure). i counts all calls, so bodies that index a
// rotation pool by i never reuse the previous call's buffers. Fills m's times (not bytes/flops).
template <typename F>
void time_into(Measurement& m, Device device, int warmup, int iters, F&& body) {
  kernels::DeviceTimer timer(device);
  for (int i = 0; i < warmup; ++i) body(i);
  kernels::synchronize_current();
  std::vector<double> samples;
  samples.reserve(static_cast<size_t>(iters));
  for (int i = 0; i < iters; ++i) {
    timer.start();
    body(warmup + i);
    samples.push_back(timer.stop());
  }
  MP_CHECK(!samples.empty(), "timing of no samples");
  const auto [lo, hi] = std::minmax_element(samples.begin(), samples.end());
  m.min_seconds = *lo;
  m.max_seconds = *hi;
  m.samples = samples;
  m.seconds = median_of(std::move(samples));
}

// Buffers to rotate over so that one pass over the pool is at least twice the cache: the cache
// then holds at most half of what the next iteration reads. Capped at 64 (small shapes on big
// caches: the cap keeps memory and setup bounded; those figures stay partly cache-resident).
int rotation_count(int64_t bytes_per_set, int64_t cache_bytes) {
  const int64_t per = std::max<int64_t>(bytes_per_set, 1);
  return static_cast<int>(std::clamp<int64_t>((2 * cache_bytes + per - 1) / per, 1, 64));
}

// Unit-variance bench values, deterministic per seed: each is the sum of four 16-bit uniforms of
// one splitmix64 output (Steele, Lea, Flood 2014; Irwin-Hall, centred and scaled: bell-shaped,
// bounded at +-2*sqrt(3)). The benchmark times kernels whose cost does not depend on the values;
// it needs many large, distinct, finite inputs quickly. The mt19937 + std::normal_distribution
// this replaced took 75% of a one-repetition run (`bench recipes --model llama3_debug --iters 1`
// on the CPU, 2026-11-29): the inputs rotated beyond the last-level cache are hundreds of MiB at
// a real model's shapes.
class BenchValues {
 public:
  explicit BenchValues(uint32_t seed) : state_(0x9E3779B97F4A7C15ull * (uint64_t{seed} + 1)) {}
  float next() {
    state_ += 0x9E3779B97F4A7C15ull;
    uint64_t z = state_;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    const int64_t sum = static_cast<int64_t>((z & 0xFFFF) + ((z >> 16) & 0xFFFF) +
                                             ((z >> 32) & 0xFFFF) + (z >> 48));
    return static_cast<float>(sum - 2 * 65535) * kScale;
  }

 private:
  // The centred sum has variance 4 * (65536^2 - 1) / 12: this scale makes it 1 (to 1e-10).
  static constexpr float kScale = 1.7320508075688772f / 65536.0f;
  uint64_t state_;
};

// Bench values of `dtype` (float32 or bfloat16, RNE) on `device`.
Tensor random_tensor(int64_t rows, int64_t cols, DType dtype, Device device, uint32_t seed) {
  Tensor t = Tensor::from_vector<float>({rows, cols}, bench_values(rows * cols, seed));
  if (dtype != DType::kFloat32) t = kernels::cast_to(t, dtype);
  return t.on(device);
}

int64_t quantized_bytes(const QuantizedTensor& q) {
  int64_t b = 0;
  for (const Tensor* t : {&q.rowwise_data, &q.rowwise_scale_inv, &q.columnwise_data,
                          &q.columnwise_scale_inv, &q.amax, &q.scale}) {
    if (t->defined()) b += t->nbytes().value;
  }
  return b;
}

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

RecipeConfig recipe_config(RecipeKind r) {
  RecipeConfig c;
  c.kind = r;
  c.amax_history_len = 16;  // the history length does not change a quantization's cost
  return c;
}

const Fp8Recipe::AmaxHook kSingleRank = [](const std::string&, Fp8Role, float*, int64_t) {
};  // one rank: no reduction

// Operand of a linear's GEMMs: x [tokens, in], w [out, in], dy [tokens, out].
struct OperandSpec {
  const char* name;
  Fp8Role role;
};
constexpr OperandSpec kX{"x", Fp8Role::kInput};
constexpr OperandSpec kW{"w", Fp8Role::kWeight};
constexpr OperandSpec kDy{"dy", Fp8Role::kGradOutput};

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

// One rotation set of a linear's GEMM operands in the recipe's form.
struct GemmSet {
  Tensor x, w, dy;              // compute dtype [M,K], [N,K], [M,N]
  QuantizedTensor qx, qw, qdy;  // both copies each (FP8 recipes only)
  Tensor y, dx, dw;             // outputs [M,N] and [M,K] in the compute dtype, [N,K] fp32
};

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

const std::vector<GemmRole> kAllRoles = {GemmRole::kFprop, GemmRole::kDgrad, GemmRole::kWgrad};

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

LayerFigure measure_layer(RecipeKind r, const RecipeBenchOptions& o) {
  Config c;
  c.model = o.model.model_config(1);
  c.model.vocab = 32;
  c.training.seq_len = o.model.seq;
  c.training.batch = o.model.micro_batch;
  c.recipe = recipe_config(r);
  validate(c);
  const GptModel model(c);
  // The model computes on the rank context's device: install o.device and a memory tracker for
  // this measurement (its peak is the step's memory: weights, gradients, activations).
  kernels::MemoryTracker tracker;
  kernels::RankContext ctx = kernels::current_context();
  ctx.device = o.device;
  ctx.memory = &tracker;
  const kernels::ScopedRankContext scope(ctx);
  LayerFigure f;
  {
    const TensorMap params = init_params(c.model, c.seed);
    TensorMap weights, grads;
    // bf16 compute copies of the fp32 masters for every recipe but fp32, as the trainer does.
    for (const std::string& n : params.names()) {
      Tensor w =
          r == RecipeKind::kFp32 ? params.at(n) : kernels::cast_to(params.at(n), DType::kBFloat16);
      weights.insert(n, w.on(o.device));
      grads.insert(n, Tensor::zeros(params.at(n).shape(), DType::kFloat32, o.device));
    }
    Fp8Recipe recipe(c.recipe, kSingleRank);
    std::mt19937 rng(7);
    std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(c.model.vocab - 1));
    std::vector<int32_t> ids(static_cast<size_t>(o.model.micro_batch * (o.model.seq + 1)));
    for (int32_t& t : ids) t = tok(rng);
    const Tensor tokens = Tensor::from_vector<int32_t>({o.model.micro_batch, o.model.seq + 1}, ids);
    f.tokens = o.model.tokens();
    f.vocab = c.model.vocab;
    const double grad_scale = 1.0 / static_cast<double>(f.tokens);
    // Gradients accumulate across repetitions (zeroing them is the optimizer step's business,
    // not the layer's); their values do not change the work done.
    time_into(f.m, o.device, o.warmup, o.iters, [&](int i) {
      model.forward_backward(weights, tokens, {i, 0}, grad_scale, grads, &recipe);
    });
  }
  f.peak_bytes = tracker.peak(o.device.type).value;
  return f;
}

ConvergenceCurve train_curve(RecipeKind r, const RecipeBenchOptions& o) {
  RunOptions ro;
  ro.config.model = o.model.model_config(o.train_layers);
  ro.config.training.seq_len = o.model.seq;
  ro.config.training.batch = o.model.micro_batch;
  ro.config.training.steps = o.steps;
  ro.config.recipe = recipe_config(r);
  ro.backend = o.device;
  ro.steps = o.steps;
  const RunResult res = run_training(ro);
  ConvergenceCurve c;
  for (const StepMetrics& m : res.metrics) c.loss.push_back(m.loss);
  return c;
}

}  // namespace

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

Measurement measure_bf16_gemm(const RecipeBenchOptions& o, const GemmShape& s, GemmRole role) {
  MP_CHECK_INPUT(o.iters >= 1 && o.warmup >= 0, "bf16 GEMM timing needs iters >= 1, warmup >= 0");
  return measure_gemms(RecipeKind::kBf16, s, {role}, o,
                       kernels::last_level_cache_bytes(o.device).value)[0];
}

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
