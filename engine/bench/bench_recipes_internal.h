// Internal to the recipe bench (engine/bench/bench_recipes.cc and the bench_*.cc files beside it
// that measure): what the measurements share. The timing (median of timed repetitions after
// untimed ones), the rotation pools that keep inputs beyond the cache, the bench values and the
// recipe and operand descriptions every measurement quantizes with, and the measurements that
// run_recipe_bench (bench_recipes.cc) calls: the GEMMs and quantizations of one linear
// (bench_gemms.cc), the grouped expert GEMMs (bench_grouped.cc) and one layer's step and the
// training runs (bench_steps.cc). Only those files include it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/bench/bench_recipes.h"
#include "engine/config/config.h"
#include "engine/model/recipe.h"
#include "kernels/core/bench_timer.h"
#include "kernels/core/error.h"
#include "kernels/core/runtime.h"
#include "kernels/core/tensor.h"
#include "kernels/gemm/gemm.h"
#include "kernels/ops/cast.h"
#include "kernels/quantize/quantized_tensor.h"

namespace meshproof::engine::bench_detail {

using kernels::Device;
using kernels::DType;
using kernels::GemmRole;
using kernels::QuantizedTensor;
using kernels::Tensor;

inline double median_of(std::vector<double> v) {
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
inline int rotation_count(int64_t bytes_per_set, int64_t cache_bytes) {
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
inline Tensor random_tensor(int64_t rows, int64_t cols, DType dtype, Device device, uint32_t seed) {
  Tensor t = Tensor::from_vector<float>({rows, cols}, bench_values(rows * cols, seed));
  if (dtype != DType::kFloat32) t = kernels::cast_to(t, dtype);
  return t.on(device);
}

inline int64_t quantized_bytes(const QuantizedTensor& q) {
  int64_t b = 0;
  for (const Tensor* t : {&q.rowwise_data, &q.rowwise_scale_inv, &q.columnwise_data,
                          &q.columnwise_scale_inv, &q.amax, &q.scale}) {
    if (t->defined()) b += t->nbytes().value;
  }
  return b;
}

inline RecipeConfig recipe_config(RecipeKind r) {
  RecipeConfig c;
  c.kind = r;
  c.amax_history_len = 16;  // the history length does not change a quantization's cost
  return c;
}

inline const Fp8Recipe::AmaxHook kSingleRank = [](const std::string&, Fp8Role, float*, int64_t) {
};  // one rank: no reduction

// Operand of a linear's GEMMs: x [tokens, in], w [out, in], dy [tokens, out].
struct OperandSpec {
  const char* name;
  Fp8Role role;
};
inline constexpr OperandSpec kX{"x", Fp8Role::kInput};
inline constexpr OperandSpec kW{"w", Fp8Role::kWeight};
inline constexpr OperandSpec kDy{"dy", Fp8Role::kGradOutput};

inline const std::vector<GemmRole> kAllRoles = {GemmRole::kFprop, GemmRole::kDgrad,
                                                GemmRole::kWgrad};

// ---- the measurements run_recipe_bench calls

// --- bench_gemms.cc: one linear's quantizations and GEMMs
// Quantizing one operand of linear shape s into one copy, from bf16, timed over a rotation pool.
QuantizeFigure measure_quantize(RecipeKind r, const GemmShape& s, const OperandSpec& op,
                                bool columnwise, const RecipeBenchOptions& o, int64_t cache);
// The recipe's GEMM in each of `roles` at linear shape s.
std::vector<Measurement> measure_gemms(RecipeKind r, const GemmShape& s,
                                       const std::vector<GemmRole>& roles,
                                       const RecipeBenchOptions& o, int64_t cache);

// --- bench_grouped.cc: the grouped expert GEMMs of a split and their quantizations
// The recipe's grouped GEMM in each of the three roles over split g at linear (out n, in k): one
// GEMM per expert block in expert order on row views, as GptModel::moe_forward / moe_backward run
// it.
std::vector<Measurement> measure_grouped_gemms(RecipeKind r, const GroupedSplit& g, int64_t n,
                                               int64_t k, const RecipeBenchOptions& o,
                                               int64_t cache);
// Quantizing one grouped operand (x [P, K], w: E x [N, K], dy [P, N]) into one copy: every
// expert's block in expert order per repetition, from bf16.
QuantizeFigure measure_grouped_quantize(RecipeKind r, const GroupedSplit& g, int64_t n, int64_t k,
                                        const OperandSpec& op, bool columnwise,
                                        const RecipeBenchOptions& o, int64_t cache);

// --- bench_steps.cc: the figures that run the engine's model
// Forward + backward of one micro-batch of a one-layer GptModel with the recipe's linears, timed,
// with the step's peak device memory.
LayerFigure measure_layer(RecipeKind r, const RecipeBenchOptions& o);
// The losses of o.steps training steps of recipe r (engine::run_training on o.device).
ConvergenceCurve train_curve(RecipeKind r, const RecipeBenchOptions& o);

}  // namespace meshproof::engine::bench_detail
