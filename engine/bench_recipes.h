// Measurements behind `meshproof bench recipes` (docs/design.md section 9): for each recipe the
// quantizer throughput of an activation-like and a weight-like operand, GEMM throughput per role
// (fprop, dgrad, wgrad) on given shapes, the forward+backward step time of one transformer layer
// of GptModel, and the ceilings beside them: the device's copy bandwidth (host memcpy or
// cudaMemcpy device to device) and a bf16 GEMM.
//
// Method: every figure is the median over `iters` timed iterations after `warmup` untimed ones.
// CUDA: each iteration is timed with cudaEvents on the rank's stream; CPU: steady_clock. Inputs
// rotate over enough buffers that one pass over them is at least twice the last-level cache
// (GPU L2, host L3), so a timed iteration does not read what the previous one left in the cache.
// The layer step is the exception: it runs on one set of weights and one batch, like consecutive
// steps of training do (its activations are produced inside the step).
// Plain data out: the harness turns it into a report (reports/ is not a dependency of engine/).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/config.h"
#include "kernels/gemm.h"
#include "kernels/runtime.h"

namespace meshproof::engine {

// One GEMM problem Y[M,N] = X[M,K]·W[N,K]ᵀ of a linear layer (dgrad/wgrad use the same M, N, K).
struct GemmShape {
  int64_t m = 0;
  int64_t n = 0;
  int64_t k = 0;
  std::string str() const;  // "256x512x128"
};

// "256x256x256,1024x4096x1024" -> shapes. Input error (naming the item) unless every item is
// MxNxK with positive dims that are multiples of 32 (MXFP8 blocks; per-tensor FP8 GEMMs need
// multiples of 16), and the list is non-empty.
std::vector<GemmShape> parse_gemm_shapes(std::string_view spec);

// The layer whose step is timed: one decoder layer of GptModel (docs/design.md section 3).
struct LayerShape {
  int64_t hidden = 256;  // H
  int64_t ffn = 1024;    // F
  int64_t heads = 4;     // A
  int64_t seq = 128;     // S
  int64_t batch = 4;     // B
};

// "hidden,ffn,heads,seq,batch", e.g. "256,1024,4,128,4". Input error unless five positive
// integers with heads dividing hidden, hidden and ffn multiples of 32 and batch*seq a multiple
// of 32 (so that every recipe can quantize every linear of the layer).
LayerShape parse_layer_shape(std::string_view spec);

struct RecipeBenchOptions {
  kernels::Device device = kernels::Device::cpu();
  std::vector<GemmShape> shapes = {{256, 256, 256}};
  LayerShape layer;
  int iters = 20;  // timed iterations per figure (>= 1)
  int warmup = 3;  // untimed iterations before them (>= 0)
  std::vector<RecipeKind> recipes = {RecipeKind::kFp32,    RecipeKind::kBf16,  RecipeKind::kDelayed,
                                     RecipeKind::kCurrent, RecipeKind::kMxfp8, RecipeKind::kBlock,
                                     RecipeKind::kNvfp4};
};

// Median seconds of one measured operation and the work it does.
struct Measurement {
  double seconds = 0;  // median over the timed iterations
  double bytes = 0;    // bytes read + written per iteration (bandwidth figures), else 0
  double flops = 0;    // floating-point operations per iteration (GEMM figures), else 0
  // Fastest and slowest timed iteration: the measured noise that `report compare` flags changes
  // against (0: not measured).
  double min_seconds = 0;
  double max_seconds = 0;
};

// Quantizing one operand [rows, cols] from bf16 with both copies (rowwise and columnwise), as the
// engine's Fp8Recipe does for a linear's input (activation-like: 1x128 blocks for `block`) and
// weight (weight-like: 128x128 blocks for `block`). For the bf16 recipe: the fp32 -> bf16 cast of
// the operand (the compute copy of an fp32 master). bytes = passes over the input (per-tensor
// recipes read it twice: amax, then cast) + every byte of the result (data, scales, amax).
struct QuantizeFigure {
  std::string operand;  // "activation" or "weight"
  GemmShape shape;      // the GEMM shape it belongs to (activation X[M,K], weight W[N,K])
  int64_t rows = 0;
  int64_t cols = 0;
  Measurement m;
};

struct GemmFigure {
  kernels::GemmRole role = kernels::GemmRole::kFprop;
  GemmShape shape;
  Measurement m;  // flops = 2*M*N*K; operands quantized beforehand (not timed)
};

// Forward + backward of one micro-batch of a one-layer GptModel (embedding, the layer, final
// norm, logits over `vocab` tokens and the loss) with the recipe's quantized linears.
struct LayerFigure {
  Measurement m;       // seconds only: the harness counts the step's model FLOPs (perf_metrics.h)
  int64_t tokens = 0;  // B*S
  int64_t vocab = 0;   // V of the one-layer model (small: the step is dominated by the layer)
};

struct RecipeBenchResult {
  RecipeKind recipe = RecipeKind::kFp32;
  // Dtype the recipe's GEMMs execute in on this device, per kernels/gemm.h: "fp32", "bf16" or
  // "fp8" (MXFP8 is emulated with bf16 GEMMs below compute capability 10, block scaling with
  // fp32 GEMMs everywhere).
  std::string gemm_dtype;
  std::vector<QuantizeFigure> quantize;
  std::vector<GemmFigure> gemms;
  std::optional<LayerFigure> layer;  // absent where the engine's ops have no kernel (CUDA)
  std::vector<std::string> notes;
};

struct RecipeBenchReport {
  std::string device_name;  // "cpu" or the GPU's name
  int64_t cache_bytes = 0;  // last-level cache the inputs rotate beyond
  Measurement copy;  // copy of a buffer of clamp(cache, 16 MiB, 512 MiB): bytes read + written
  std::vector<GemmFigure> bf16_gemms;  // the bf16 ceiling: fprop per shape (bf16 in, fp32 acc)
  std::vector<RecipeBenchResult> recipes;
};

// The dtype a recipe's GEMMs execute in (kernels/gemm.h): "fp32", "bf16" or "fp8". Compute
// capability as major*10 + minor (90 for Hopper, 100 for Blackwell), 0 for the CPU backend, which
// dequantizes and multiplies in fp32. Per-tensor FP8 runs fp8 GEMMs from cc 8.9; MXFP8 is
// emulated with bf16 GEMMs below cc 10; block scaling uses fp32 GEMMs everywhere. The training
// runner and the recipe bench pick MFU peaks by it.
std::string recipe_gemm_dtype(RecipeKind recipe, int compute_capability);

// Runs everything on options.device (install a RankContext for CUDA first). Input errors for
// iters < 1 or warmup < 0; runtime errors from the backends propagate.
RecipeBenchReport run_recipe_bench(const RecipeBenchOptions& options);

}  // namespace meshproof::engine
