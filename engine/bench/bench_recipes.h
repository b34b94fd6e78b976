// Measurements behind `meshproof bench recipes` (docs/design.md sections 9 and 26): per recipe
// and per GEMM of a transformer block's linear layers (qkv, proj, fc1, fc2 x fprop, dgrad,
// wgrad) at shapes derived from a model, the BF16 GEMM time at the same shape, the recipe's GEMM
// time and the time of every quantization that GEMM needs; an M (tokens) sweep of the forward
// GEMMs at the model's N and K; the forward+backward step time and peak memory of one layer; and
// optionally the loss curves of N training steps per recipe (convergence against BF16 and fp32).
//
// Method: every time is the median over `iters` timed back-to-back repetitions after `warmup`
// untimed ones, with the fastest and slowest repetition and every raw repetition kept. CUDA: each
// repetition is timed with cudaEvents on the rank's stream; CPU: steady_clock. Inputs rotate over
// enough buffers that one pass over them is at least twice the last-level cache (GPU L2, host
// L3), so a timed repetition does not read what the previous one left in the cache. The layer
// step is the exception: it runs on one set of weights and one batch, like consecutive steps of
// training do (its activations are produced inside the step).
// Plain data out: the harness turns it into a report (reports/ is not a dependency of engine/).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/config/config.h"
#include "kernels/core/runtime.h"
#include "kernels/gemm/gemm.h"

namespace meshproof::engine {

// One GEMM problem in the kernels' linear-layer convention Y[M,N] = X[M,K]·W[N,K]ᵀ: M tokens, N
// out features, K in features (the dgrad and wgrad kernels take the same M, N, K; gemm_dims
// gives each role's own output rows, output columns and reduction length).
struct GemmShape {
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  std::string str() const;  // "256x512x128"
  bool operator==(const GemmShape&) const = default;
};

// "256x256x256,1024x4096x1024" -> shapes. Input error (naming the item) unless every item is
// MxNxK with positive dims that are multiples of 32 (MXFP8 blocks; per-tensor FP8 GEMMs need
// multiples of 16), and the list is non-empty.
std::vector<GemmShape> parse_gemm_shapes(std::string_view spec);

// "16,64,256" -> token counts for the M sweep. Input error unless positive multiples of 16 (the
// per-tensor FP8 GEMMs' granularity; a recipe with coarser blocks skips the M it cannot take).
std::vector<int64_t> parse_m_sweep(std::string_view spec);

// `n` bench input values for `seed` (the GEMM and quantizer operands): unit variance, mean 0,
// bounded at +-2*sqrt(3), deterministic per seed (engine/bench/bench_recipes_internal.h says how
// and why).
std::vector<float> bench_values(int64_t n, uint32_t seed);

// The model whose linear layers are benchmarked: one decoder block of GptModel (docs/design.md
// section 3) and the micro-batch that feeds it.
struct BenchModel {
  int64_t hidden = 256;  // H
  int64_t ffn = 1024;    // F
  int64_t heads = 4;     // A
  int64_t kv_heads = 4;  // KV heads (grouped-query attention: qkv is (A + 2 KV) * H / A wide)
  int64_t seq = 128;     // S
  int64_t micro_batch = 4;
  Activation activation = Activation::kGelu;  // SwiGLU: fc1 is fc1_gate + fc1_up (engine table)
  // The block's architecture beside its sizes (a model preset sets them; the explicit form
  // keeps the GPT-2-like defaults). They shape the layer step, not the GEMM list.
  NormKind norm = NormKind::kLayerNorm;
  PositionKind position = PositionKind::kLearned;
  double rope_theta = 10000.0;
  bool bias = true;
  int64_t tokens() const { return seq * micro_batch; }
  // The engine model of `layers` blocks (vocab 64, the engine's default) with these dimensions.
  ModelConfig model_config(int64_t layers) const;
};

// Input error naming `what` (the --model value) unless every dimension is positive, heads
// divides hidden, kv_heads divides heads, and hidden, ffn and micro_batch*seq are multiples of
// 32 (so that every recipe can quantize every linear).
void check_bench_model(const BenchModel& b, std::string_view what);

// The explicit "--model" form "hidden,ffn,heads,kv_heads,seq,micro_batch" (e.g.
// "256,1024,4,4,128,4"), checked by check_bench_model. Model presets by name are scenario key
// defaults (model.preset), which the harness resolves before calling this (docs/design.md
// section 26); a name here is an input error.
BenchModel parse_bench_model(std::string_view spec, Activation activation = Activation::kGelu);

// One GEMM of a linear layer of the block: the linear's shape in the kernels' convention
// (tokens, out features, in features) and the role.
struct LinearGemm {
  std::string linear;  // "qkv", "proj", "fc1", "fc1_gate", "fc1_up", "fc2" (engine table names)
  kernels::GemmRole role = kernels::GemmRole::kFprop;
  GemmShape shape;  // M = tokens, N = out features, K = in features of the linear
};

// Each role's own GEMM dimensions: output rows M, output columns N and reduction length K.
//   fprop Y = X·Wᵀ:   (tokens, out, in)
//   dgrad dX = dY·W:  (tokens, in, out)
//   wgrad dW = dYᵀ·X: (out, in, tokens)
// FLOPs 2·M·N·K are the same for the three.
GemmShape gemm_dims(const LinearGemm& g);

// The block's linears (engine/model/params.h block_linears, in forward order) x (fprop, dgrad,
// wgrad) at `tokens` tokens.
std::vector<LinearGemm> model_gemms(const BenchModel& model, int64_t tokens);

// Speedups over BF16 at the same shape (docs/design.md section 26), as TransformerEngine's GEMM
// benchmark reports them:
//   autocast     = bf16 / (gemm + quantize)  (every operand quantized on the fly)
//   prequantized = bf16 / gemm               (operands already quantized, e.g. cached weights)
// Input error unless bf16 > 0, gemm > 0 and quantize >= 0 (all seconds).
struct Speedup {
  double autocast = 0;
  double prequantized = 0;
};
Speedup gemm_speedup(double bf16_s, double gemm_s, double quantize_s);

struct RecipeBenchOptions {
  kernels::Device device = kernels::Device::cpu();
  BenchModel model;
  std::vector<GemmShape> shapes;  // extra GEMM shapes ("custom" linear), beside the model's
  std::vector<int64_t> m_sweep;   // tokens for the forward M sweep (empty: none)
  int iters = 20;                 // timed repetitions per figure (>= 1)
  int warmup = 3;                 // untimed repetitions before them (>= 0)
  int64_t steps = 0;              // convergence: training steps per recipe (0: none)
  int64_t train_layers = 2;       // blocks of the model the convergence run trains
  std::vector<RecipeKind> recipes = all_bench_recipes();

  // Every recipe of the engine's recipe table (engine/config/config.h kRecipeNames), in its order.
  static std::vector<RecipeKind> all_bench_recipes();
};

// Median seconds of one measured operation, its range and every repetition.
struct Measurement {
  double seconds = 0;  // median over the timed repetitions
  double bytes = 0;    // bytes read + written per repetition (bandwidth figures), else 0
  double flops = 0;    // floating-point operations per repetition (GEMM figures), else 0
  // Fastest and slowest timed repetition: the measured noise that `report compare` flags changes
  // against (0: not measured).
  double min_seconds = 0;
  double max_seconds = 0;
  std::vector<double> samples;  // every timed repetition, seconds, in order
};

// One quantization a GEMM needs: operand x [tokens, in], w [out, in] or dy [tokens, out] into the
// rowwise or the columnwise copy, from bf16, amax included (per-tensor recipes: amax pass, scale,
// cast; delayed: the amax history update too).
struct QuantizeFigure {
  std::string operand;  // "x", "w" or "dy"
  bool columnwise = false;
  int64_t rows = 0;
  int64_t cols = 0;
  Measurement m;  // bytes: input passes + every byte of the result
};

// One GEMM of one recipe with its BF16 baseline at the same shape and the quantizations it needs:
// fprop x rowwise + w rowwise; dgrad dy rowwise + w columnwise; wgrad dy columnwise + x
// columnwise (kernels/gemm/gemm.h). Unquantized recipes (fp32, bf16) need none.
struct RoleFigure {
  LinearGemm gemm;
  Measurement bf16;  // bf16 GEMM at the same shape and role (bf16 in, fp32 accumulate)
  Measurement time;  // the recipe's GEMM, operands quantized beforehand (not timed)
  std::vector<QuantizeFigure> quantize;
  double quantize_seconds() const;  // sum of the quantizations' medians
  Speedup speedup() const;          // gemm_speedup(bf16, time, quantize_seconds())
};

// Forward + backward of one micro-batch of a one-layer GptModel (embedding, the layer, final
// norm, logits over `vocab` tokens and the loss) with the recipe's quantized linears.
struct LayerFigure {
  Measurement m;       // seconds only: the harness counts the step's model FLOPs (perf_metrics.h)
  int64_t tokens = 0;  // B*S
  int64_t vocab = 0;   // V of the one-layer model (small: the step is dominated by the layer)
  int64_t peak_bytes = 0;  // high-water mark of the device memory the step's tensors took
};

// Losses of `steps` optimizer steps of engine::run_training on one device from the same init
// (config seed) and data (data seed) for every recipe.
struct ConvergenceCurve {
  std::vector<double> loss;  // per step, nats (mean cross-entropy)
};

// The grouped expert GEMM's uneven split (docs/design.md sections 26 and 27): the block's first
// MLP linear (fc1, or fc1_gate under SwiGLU) as kGroupedExperts experts, each with its own
// [out, in] weight, over the bench's T tokens routed top-1 as T/2, 3T/8, 0 and T/8 rows (one
// expert with none). Each expert's rows are padded with zero rows to the recipe's alignment
// (moe::row_alignment; quantized recipes give the empty expert one block of zero rows, as the
// engine's dispatch does), so the GEMMs and quantizations run on exactly the blocks training runs.
inline constexpr int64_t kGroupedExperts = 4;
struct GroupedSplit {
  std::vector<int64_t> rows;    // [E] routed rows per expert
  int64_t alignment = 1;        // the recipe's expert row alignment
  std::vector<int64_t> padded;  // [E] rows of each expert's block after padding
  int64_t tokens() const;       // sum of rows (the useful rows the FLOPs count)
  int64_t padded_rows() const;  // sum of padded
};
// Input error unless tokens is a positive multiple of 8.
GroupedSplit grouped_split(RecipeKind recipe, int64_t tokens);

struct RecipeBenchResult {
  RecipeKind recipe = RecipeKind::kFp32;
  // Dtype the recipe's GEMMs execute in on this device (recipe_gemm_dtype).
  std::string gemm_dtype;
  // Empty when the recipe runs natively on this device, else why its figures are an emulation
  // (recipe_emulation).
  std::string emulation;
  std::vector<RoleFigure> roles;  // the model's GEMMs, then the --shapes ones ("custom")
  std::vector<RoleFigure> sweep;  // fprop per linear per M of the sweep the recipe can take
  // The grouped expert GEMM per role over `split` (engine::grouped_split): gemm.linear
  // "experts fc1 rows A/B/C/D", gemm.shape (T, out, in) with T the routed rows (FLOPs count them,
  // not the padding); time: one GEMM per expert block in expert order (the engine's grouped GEMM),
  // operands quantized per expert beforehand; bf16: the same loop in bf16 over the unpadded
  // blocks; quantize: every expert's block of each operand copy, summed.
  std::vector<RoleFigure> grouped;
  GroupedSplit split;
  std::optional<LayerFigure> layer;  // absent where the engine's ops have no kernel (CUDA)
  std::optional<ConvergenceCurve> convergence;
  std::vector<std::string> notes;
};

struct RecipeBenchReport {
  std::string device_name;     // "cpu" or the GPU's name
  int compute_capability = 0;  // major*10 + minor; 0 on the CPU
  int64_t cache_bytes = 0;     // last-level cache the inputs rotate beyond
  Measurement copy;  // copy of a buffer of clamp(cache, 16 MiB, 512 MiB): bytes read + written
  std::vector<RecipeBenchResult> recipes;
  // Reference curves for the loss differences (trained even when not in options.recipes).
  std::optional<ConvergenceCurve> bf16_curve;
  std::optional<ConvergenceCurve> fp32_curve;
};

// The dtype a recipe's GEMMs execute in (kernels/gemm/gemm.h): "fp32", "bf16", "fp8" or "fp4".
// Compute capability as major*10 + minor (90 for Hopper, 100 for Blackwell), 0 for the CPU backend,
// which dequantizes and multiplies in fp32; lt_version: cublasLtGetVersion(). From the path
// decision (kernels::lt::choose_gemm_path): per-tensor FP8 runs fp8 GEMMs from cc 8.9; MXFP8 on
// cc 10.x, emulated with bf16 GEMMs elsewhere; block scaling runs fp8 GEMMs on cc 9.0 (cuBLASLt
// >= 12.9), fp32 GEMMs elsewhere; NVFP4 fp4 GEMMs on cc 10.x, fp32 elsewhere. The training runner
// and the recipe bench pick MFU peaks by it.
std::string recipe_gemm_dtype(RecipeKind recipe, int compute_capability, int lt_version);
// With label_cublaslt_version(compute_capability).
std::string recipe_gemm_dtype(RecipeKind recipe, int compute_capability);

// Why a recipe's figures on this device are an emulation, "" when native: every CPU figure
// ("CPU emulation") and the first emulated role's reason from kernels::lt::choose_gemm_path, the
// decision the CUDA GEMM runs (so the label and the path cannot disagree).
std::string recipe_emulation(RecipeKind recipe, int compute_capability, int lt_version);
// With label_cublaslt_version(compute_capability).
std::string recipe_emulation(RecipeKind recipe, int compute_capability);
// At the linear shapes a run measures (every role of each): the first GEMM the decision emulates
// gives the label. The overloads above assume shapes every native path takes (128x128x128).
std::string recipe_emulation(RecipeKind recipe, int compute_capability, int lt_version,
                             const std::vector<GemmShape>& shapes);

// The cuBLASLt version the labels of a device of that compute capability assume: the loaded
// library's; in a build without CUDA the newest the decision knows. 0 for the CPU (compute
// capability 0), whose labels do not depend on it: a CPU run never opens cuBLASLt.
int label_cublaslt_version(int compute_capability);

// The token-count multiple a recipe's quantizers need (MXFP8: 32-row blocks; per-tensor FP8
// GEMMs: 16; others 1).
int64_t recipe_m_multiple(RecipeKind recipe);

// The bf16 GEMM (bf16 in, fp32 accumulate) of `role` at linear shape s on options.device, with
// options' iters and warmup, inputs rotated beyond the cache: the measured calibration for GPUs
// not in the peak table (the training runner's MFU).
Measurement measure_bf16_gemm(const RecipeBenchOptions& options, const GemmShape& s,
                              kernels::GemmRole role = kernels::GemmRole::kFprop);

// Runs everything on options.device (install a RankContext for CUDA first). Input errors for
// iters < 1 or warmup < 0; runtime errors from the backends propagate.
RecipeBenchReport run_recipe_bench(const RecipeBenchOptions& options);

}  // namespace meshproof::engine
