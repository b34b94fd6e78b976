#include "engine/bench_recipes.h"

#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <random>

#include "engine/model.h"
#include "engine/params.h"
#include "engine/recipe.h"
#include "kernels/bench_timer.h"
#include "kernels/cast.h"
#include "kernels/device.h"
#include "kernels/error.h"
#include "kernels/quantize.h"

namespace meshproof::engine {

using kernels::Device;
using kernels::DType;
using kernels::GemmRole;
using kernels::QuantizedTensor;
using kernels::Tensor;

namespace {

// Splits "a<sep>b<sep>c" into positive integers; input error naming `what` and the item.
std::vector<int64_t> parse_ints(std::string_view spec, char sep, std::string_view what) {
  std::vector<int64_t> out;
  size_t pos = 0;
  while (true) {
    const size_t end = spec.find(sep, pos);
    const std::string_view item =
        spec.substr(pos, end == std::string_view::npos ? std::string_view::npos : end - pos);
    int64_t v = 0;
    const auto [p, ec] = std::from_chars(item.data(), item.data() + item.size(), v);
    MP_CHECK_INPUT(!item.empty() && ec == std::errc() && p == item.data() + item.size() && v > 0,
                   "{} '{}': '{}' is not a positive integer", what, spec, item);
    out.push_back(v);
    if (end == std::string_view::npos) break;
    pos = end + 1;
  }
  return out;
}

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
  m.seconds = median_of(std::move(samples));
}

// Buffers to rotate over so that one pass over the pool is at least twice the cache: the cache
// then holds at most half of what the next iteration reads. Capped at 64 (small shapes on big
// caches: the cap keeps memory and setup bounded; those figures stay partly cache-resident).
int rotation_count(int64_t bytes_per_set, int64_t cache_bytes) {
  const int64_t per = std::max<int64_t>(bytes_per_set, 1);
  return static_cast<int>(std::clamp<int64_t>((2 * cache_bytes + per - 1) / per, 1, 64));
}

// N(0, 1) values of `dtype` (float32 or bfloat16, RNE) on `device`, deterministic per seed.
Tensor random_tensor(int64_t rows, int64_t cols, DType dtype, Device device, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(rows * cols));
  for (float& x : v) x = dist(rng);
  Tensor t = Tensor::from_vector<float>({rows, cols}, v);
  if (dtype != DType::kFloat32) t = kernels::cast_to(t, dtype);
  return device.is_cpu() ? t : t.to(device);
}

int64_t quantized_bytes(const QuantizedTensor& q) {
  int64_t b = 0;
  for (const Tensor* t : {&q.rowwise_data, &q.rowwise_scale_inv, &q.columnwise_data,
                          &q.columnwise_scale_inv, &q.amax, &q.scale}) {
    if (t->defined()) b += t->nbytes().value;
  }
  return b;
}

bool per_tensor(RecipeKind r) { return r == RecipeKind::kDelayed || r == RecipeKind::kCurrent; }

std::string gemm_dtype(RecipeKind r, Device device) {
  if (device.is_cpu()) return recipe_gemm_dtype(r, 0);
  int cc = 0;
  for (const kernels::GpuInfo& g : kernels::cuda_status().gpus) {
    if (g.index == device.index) cc = g.cc_major * 10 + g.cc_minor;
  }
  return recipe_gemm_dtype(r, cc);
}

RecipeConfig recipe_config(RecipeKind r) {
  RecipeConfig c;
  c.kind = r;
  c.amax_history_len = 16;  // the history length does not change a quantization's cost
  return c;
}

const Fp8Recipe::AmaxHook kSingleRank = [](const std::string&, Fp8Role, float*, int64_t) {
};  // one rank: no reduction

// Activation-like (X[M,K], Fp8Role::kInput) or weight-like (W[N,K], kWeight) quantization.
QuantizeFigure measure_quantize(RecipeKind r, const GemmShape& s, bool weight,
                                const RecipeBenchOptions& o, int64_t cache) {
  QuantizeFigure f;
  f.operand = weight ? "weight" : "activation";
  f.shape = s;
  f.rows = weight ? s.n : s.m;
  f.cols = s.k;
  const int64_t n = f.rows * f.cols;
  const DType in_dtype = r == RecipeKind::kBf16 ? DType::kFloat32 : DType::kBFloat16;
  const int64_t in_bytes = n * (in_dtype == DType::kFloat32 ? 4 : 2);
  // Output size estimate for the rotation count only: two 1-byte copies (bf16 recipe: 2 bytes).
  const int pool = rotation_count(in_bytes + 2 * n, cache);
  std::vector<Tensor> inputs;
  for (int i = 0; i < pool; ++i) {
    inputs.push_back(random_tensor(f.rows, f.cols, in_dtype, o.device, 100 + i));
  }
  if (r == RecipeKind::kBf16) {
    f.m.bytes = static_cast<double>(in_bytes + 2 * n);
    time_into(f.m, o.device, o.warmup, o.iters, [&](int i) {
      Tensor y = kernels::cast_to(inputs[static_cast<size_t>(i % pool)], DType::kBFloat16);
      (void)y;
    });
    return f;
  }
  Fp8Recipe recipe(recipe_config(r), kSingleRank);
  const Fp8Role role = weight ? Fp8Role::kWeight : Fp8Role::kInput;
  int64_t out_bytes = 0;
  time_into(f.m, o.device, o.warmup, o.iters, [&](int i) {
    QuantizedTensor q =
        recipe.quantize("bench", role, inputs[static_cast<size_t>(i % pool)], {true, true});
    out_bytes = quantized_bytes(q);
  });
  // Per-tensor recipes pass over the input twice (amax, then the cast); block recipes once.
  f.m.bytes = static_cast<double>((per_tensor(r) ? 2 : 1) * in_bytes + out_bytes);
  return f;
}

// One rotation set of a linear's GEMM operands in the recipe's form.
struct GemmSet {
  Tensor x, w, dy;              // compute dtype [M,K], [N,K], [M,N]
  QuantizedTensor qx, qw, qdy;  // both copies each (FP8 recipes only)
  Tensor y, dx, dw;             // outputs [M,N] and [M,K] in the compute dtype, [N,K] fp32
};

std::vector<GemmFigure> measure_gemms(RecipeKind r, const GemmShape& s,
                                      const std::vector<GemmRole>& roles,
                                      const RecipeBenchOptions& o, int64_t cache) {
  const DType dt = r == RecipeKind::kFp32 ? DType::kFloat32 : DType::kBFloat16;
  const int64_t es = r == RecipeKind::kFp32 ? 4 : 2;
  const int64_t set_bytes = es * (s.m * s.k + s.n * s.k + s.m * s.n) * 2 + 4 * s.n * s.k;
  const int pool = rotation_count(set_bytes, cache);
  Fp8Recipe recipe(recipe_config(r), kSingleRank);
  std::vector<GemmSet> sets(static_cast<size_t>(pool));
  for (int i = 0; i < pool; ++i) {
    GemmSet& g = sets[static_cast<size_t>(i)];
    g.x = random_tensor(s.m, s.k, dt, o.device, 1000 + 3 * i);
    g.w = random_tensor(s.n, s.k, dt, o.device, 1001 + 3 * i);
    g.dy = random_tensor(s.m, s.n, dt, o.device, 1002 + 3 * i);
    if (recipe.enabled()) {
      g.qx = recipe.quantize("bench", Fp8Role::kInput, g.x, {true, true});
      g.qw = recipe.quantize("bench", Fp8Role::kWeight, g.w, {true, true});
      g.qdy = recipe.quantize("bench", Fp8Role::kGradOutput, g.dy, {true, true});
    }
    g.y = Tensor::empty({s.m, s.n}, dt, o.device);
    g.dx = Tensor::empty({s.m, s.k}, dt, o.device);
    g.dw = Tensor::empty({s.n, s.k}, DType::kFloat32, o.device);
  }
  auto operand = [&](const Tensor& t, const QuantizedTensor& q) -> kernels::GemmOperand {
    if (recipe.enabled()) return &q;
    return &t;
  };
  std::vector<GemmFigure> out;
  for (GemmRole role : roles) {
    GemmFigure f;
    f.role = role;
    f.shape = s;
    f.m.flops =
        2.0 * static_cast<double>(s.m) * static_cast<double>(s.n) * static_cast<double>(s.k);
    const kernels::GemmOptions opts = recipe.options(role);
    time_into(f.m, o.device, o.warmup, o.iters, [&](int i) {
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
    out.push_back(f);
  }
  return out;
}

LayerFigure measure_layer(RecipeKind r, const RecipeBenchOptions& o) {
  const LayerShape& l = o.layer;
  Config c;
  c.model.vocab = 32;
  c.model.hidden = l.hidden;
  c.model.heads = l.heads;
  c.model.layers = 1;
  c.model.ffn = l.ffn;
  c.model.max_positions = l.seq;
  c.training.seq_len = l.seq;
  c.training.batch = l.batch;
  c.recipe = recipe_config(r);
  validate(c);
  const GptModel model(c);
  // The model computes on the rank context's device: install o.device for this measurement.
  kernels::RankContext ctx = kernels::current_context();
  ctx.device = o.device;
  const kernels::ScopedRankContext scope(ctx);
  const TensorMap params = init_params(c.model, c.seed);
  TensorMap weights, grads;
  // bf16 compute copies of the fp32 masters for every recipe but fp32, as the trainer does.
  for (const std::string& n : params.names()) {
    Tensor w =
        r == RecipeKind::kFp32 ? params.at(n) : kernels::cast_to(params.at(n), DType::kBFloat16);
    weights.insert(n, o.device.is_cpu() ? w : w.to(o.device));
    grads.insert(n, Tensor::zeros(params.at(n).shape(), DType::kFloat32, o.device));
  }
  Fp8Recipe recipe(c.recipe, kSingleRank);
  std::mt19937 rng(7);
  std::uniform_int_distribution<int32_t> tok(0, static_cast<int32_t>(c.model.vocab - 1));
  std::vector<int32_t> ids(static_cast<size_t>(l.batch * (l.seq + 1)));
  for (int32_t& t : ids) t = tok(rng);
  const Tensor tokens = Tensor::from_vector<int32_t>({l.batch, l.seq + 1}, ids);
  LayerFigure f;
  f.tokens = l.batch * l.seq;
  f.vocab = c.model.vocab;
  const double grad_scale = 1.0 / static_cast<double>(f.tokens);
  // Gradients accumulate across iterations (zeroing them is the optimizer step's business, not
  // the layer's); their values do not change the work done.
  time_into(f.m, o.device, o.warmup, o.iters, [&](int i) {
    model.forward_backward(weights, tokens, {i, 0}, grad_scale, grads, &recipe);
  });
  return f;
}

}  // namespace

std::string GemmShape::str() const { return fmt::format("{}x{}x{}", m, n, k); }

std::vector<GemmShape> parse_gemm_shapes(std::string_view spec) {
  MP_CHECK_INPUT(!spec.empty(), "--shapes is empty (expected e.g. 256x256x256,1024x4096x1024)");
  std::vector<GemmShape> out;
  size_t pos = 0;
  while (true) {
    const size_t end = spec.find(',', pos);
    const std::string_view item =
        spec.substr(pos, end == std::string_view::npos ? std::string_view::npos : end - pos);
    const std::vector<int64_t> d = parse_ints(item, 'x', "--shapes item");
    MP_CHECK_INPUT(d.size() == 3, "--shapes '{}': '{}' is not MxNxK", spec, item);
    for (int64_t v : d) {
      MP_CHECK_INPUT(
          v % 32 == 0,
          "--shapes '{}': {} in '{}' is not a multiple of 32 (MXFP8 quantizes 32-element "
          "blocks along M, N and K)",
          spec, v, item);
    }
    out.push_back({d[0], d[1], d[2]});
    if (end == std::string_view::npos) break;
    pos = end + 1;
  }
  return out;
}

LayerShape parse_layer_shape(std::string_view spec) {
  const std::vector<int64_t> d = parse_ints(spec, ',', "--layer");
  MP_CHECK_INPUT(d.size() == 5, "--layer '{}': expected hidden,ffn,heads,seq,batch (5 integers)",
                 spec);
  LayerShape l{d[0], d[1], d[2], d[3], d[4]};
  MP_CHECK_INPUT(l.hidden % l.heads == 0, "--layer '{}': heads {} does not divide hidden {}", spec,
                 l.heads, l.hidden);
  MP_CHECK_INPUT(l.hidden % 32 == 0 && l.ffn % 32 == 0 && (l.batch * l.seq) % 32 == 0,
                 "--layer '{}': hidden ({}), ffn ({}) and batch*seq ({}) must be multiples of 32 "
                 "(MXFP8 blocks)",
                 spec, l.hidden, l.ffn, l.batch * l.seq);
  return l;
}

std::string recipe_gemm_dtype(RecipeKind recipe, int compute_capability) {
  if (compute_capability == 0) return "fp32";  // the CPU backend dequantizes to fp32
  switch (recipe) {
    case RecipeKind::kFp32:
      return "fp32";
    case RecipeKind::kBf16:
      return "bf16";
    case RecipeKind::kDelayed:
    case RecipeKind::kCurrent:
      return compute_capability >= 89 ? "fp8" : "fp32";
    case RecipeKind::kMxfp8:
      return compute_capability >= 100 ? "fp8" : "bf16";
    case RecipeKind::kBlock:
    case RecipeKind::kNvfp4:  // exact fp32 emulation on every device (kernels/gemm_cublaslt.cc)
      return "fp32";
  }
  return "fp32";
}

RecipeBenchReport run_recipe_bench(const RecipeBenchOptions& o) {
  MP_CHECK_INPUT(o.iters >= 1, "--iters must be at least 1 (got {})", o.iters);
  MP_CHECK_INPUT(o.warmup >= 0, "--warmup must be non-negative (got {})", o.warmup);
  MP_CHECK_INPUT(!o.shapes.empty(), "no GEMM shapes to measure");
  RecipeBenchReport rep;
  rep.device_name = kernels::device_name(o.device);
  rep.cache_bytes = kernels::last_level_cache_bytes(o.device).value;

  // Copy ceiling: source and destination together twice the cache (each at least 16 MiB, at most
  // 512 MiB), so that the copy streams through memory.
  const int64_t copy_elems =
      std::clamp<int64_t>(rep.cache_bytes, int64_t{16} << 20, int64_t{512} << 20) / 4;
  const Tensor src = Tensor::zeros({copy_elems}, DType::kFloat32, o.device);
  Tensor dst = Tensor::empty({copy_elems}, DType::kFloat32, o.device);
  rep.copy.bytes = 2.0 * static_cast<double>(src.nbytes().value);
  time_into(rep.copy, o.device, o.warmup, o.iters, [&](int) { dst.copy_from(src); });

  for (const GemmShape& s : o.shapes) {
    for (GemmFigure& f :
         measure_gemms(RecipeKind::kBf16, s, {GemmRole::kFprop}, o, rep.cache_bytes)) {
      rep.bf16_gemms.push_back(f);
    }
  }

  for (RecipeKind r : o.recipes) {
    RecipeBenchResult res;
    res.recipe = r;
    res.gemm_dtype = gemm_dtype(r, o.device);
    if (r == RecipeKind::kFp32) {
      res.notes.push_back("fp32 is the reference: no quantization");
    } else if (r == RecipeKind::kBf16 && o.device.is_cuda()) {
      res.notes.push_back(
          "bf16 cast (fp32 -> bf16) not measured: kernels/cast has no CUDA kernel yet");
    } else {
      for (const GemmShape& s : o.shapes) {
        res.quantize.push_back(measure_quantize(r, s, false, o, rep.cache_bytes));
        res.quantize.push_back(measure_quantize(r, s, true, o, rep.cache_bytes));
      }
    }
    for (const GemmShape& s : o.shapes) {
      for (GemmFigure& f : measure_gemms(
               r, s, {GemmRole::kFprop, GemmRole::kDgrad, GemmRole::kWgrad}, o, rep.cache_bytes)) {
        res.gemms.push_back(f);
      }
    }
    res.layer = measure_layer(r, o);
    rep.recipes.push_back(std::move(res));
  }
  return rep;
}

}  // namespace meshproof::engine
