// Everything a training run is made of, as plain data (docs/design.md sections 3 and 4): model
// dims, norm, activation, tying, dropout, recipe and its options, training plan, data source and
// seed. validate() checks it all up front so that bad configuration is a kInput error naming the
// field before any tensor is allocated.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kernels/quantize/quantize.h"

namespace meshproof::engine {

enum class NormKind : uint8_t { kLayerNorm, kRmsNorm };
enum class Activation : uint8_t { kGelu, kRelu, kSwiGlu };
// How token positions enter the model (docs/design.md section 24): a learned table embed.pos added
// to the token embedding, or rotary embeddings applied to q and k in every attention layer.
enum class PositionKind : uint8_t { kLearned, kRope };
enum class RecipeKind : uint8_t { kFp32, kBf16, kDelayed, kCurrent, kMxfp8, kBlock, kNvfp4 };
enum class LrSchedule : uint8_t { kConstant, kWarmupCosine };
// How a mixture-of-experts router turns its fp32 logits into probabilities (docs/design.md
// section 27): softmax over the experts, or an independent sigmoid per expert.
enum class MoeRouter : uint8_t { kSoftmax, kSigmoid };
// TransformerEngine's recipe.Format: HYBRID quantizes forward tensors (inputs, weights) in E4M3
// and gradients in E5M2; E4M3 quantizes every tensor in E4M3.
enum class Fp8Format : uint8_t { kHybrid, kE4M3 };

// The one table of recipe names (scenario keys, CLI flags, reports, to_string): every RecipeKind
// in declaration order with its name.
struct RecipeName {
  RecipeKind kind;
  std::string_view name;
};
inline constexpr RecipeName kRecipeNames[] = {
    {RecipeKind::kFp32, "fp32"},       {RecipeKind::kBf16, "bf16"},
    {RecipeKind::kDelayed, "delayed"}, {RecipeKind::kCurrent, "current"},
    {RecipeKind::kMxfp8, "mxfp8"},     {RecipeKind::kBlock, "block"},
    {RecipeKind::kNvfp4, "nvfp4"}};
// True for the recipes that quantize GEMM inputs (delayed, current, mxfp8, block, nvfp4: the
// "fp8" of the engine's names covers NVFP4's E2M1 elements too).
constexpr bool is_fp8(RecipeKind r) { return r != RecipeKind::kFp32 && r != RecipeKind::kBf16; }

std::string_view norm_name(NormKind k);
std::string_view activation_name(Activation a);
std::string_view position_name(PositionKind p);
std::string_view recipe_name(RecipeKind r);
std::string_view schedule_name(LrSchedule s);
std::string_view fp8_format_name(Fp8Format f);
std::string_view moe_router_name(MoeRouter r);
// Parsers throw a kInput error naming `field` and the accepted values.
NormKind parse_norm(std::string_view s, std::string_view field);
Activation parse_activation(std::string_view s, std::string_view field);
PositionKind parse_position(std::string_view s, std::string_view field);
RecipeKind parse_recipe(std::string_view s, std::string_view field);
LrSchedule parse_schedule(std::string_view s, std::string_view field);
MoeRouter parse_moe_router(std::string_view s, std::string_view field);

// Mixture of experts (docs/design.md section 27): every `every`-th layer (layers i with
// i % every == 0) replaces its MLP by `experts` MLPs of the model's activation and ffn width, an
// fp32 router [E, H] choosing top_k of them per token, and optionally one shared expert applied to
// every token. experts = 0: no MoE (the dense model, unchanged).
struct MoeConfig {
  int64_t experts = 0;  // E; 0 = dense
  int64_t top_k = 1;    // k in [1, E]
  int64_t every = 1;    // layer i is an MoE layer when i % every == 0
  MoeRouter router = MoeRouter::kSoftmax;
  bool shared_expert = false;
  double aux_loss_coef = 0.0;  // c of the Switch load-balancing loss c * E * sum_e f_e * P_e
  bool enabled() const { return experts > 0; }
  bool operator==(const MoeConfig&) const = default;
};

struct ModelConfig {
  int64_t vocab = 64;          // V
  int64_t hidden = 32;         // H
  int64_t heads = 4;           // A (head dim d = H / A)
  int64_t layers = 2;          // L
  int64_t ffn = 128;           // F
  int64_t max_positions = 16;  // rows of embed.pos (>= seq_len)
  NormKind norm = NormKind::kLayerNorm;
  Activation activation = Activation::kGelu;
  bool tied_embeddings = false;  // lm_head uses embed.tok when set
  double dropout = 0.0;          // hidden dropout after attn.proj and mlp.fc2
  double norm_eps = 1e-5;
  // Llama-style options (docs/design.md section 24); the defaults are the GPT-2-like model.
  int64_t kv_heads = 0;  // KV key/value heads (grouped-query attention); 0 means A (MHA)
  PositionKind position = PositionKind::kLearned;
  double rope_theta = 10000.0;  // RoPE base: angle p * theta^(-2i/d)
  bool bias = true;             // false: no bias on any linear layer
  // embed.tok and lm_head.weight split by rows (vocabulary) over tp, with the masked lookup and
  // the parallel cross-entropy; no effect with tp = 1.
  bool vocab_parallel = false;
  MoeConfig moe;  // mixture of experts (docs/design.md section 27); off by default
  // The layers of each pipeline stage (docs/design.md section 33), one entry per stage of
  // mesh.pp, each >= 1, summing to `layers` (engine/config/run_rules.cc); empty: the even split of
  // engine/pipeline/pipeline.h stage_layer_counts. A split of the work, not of the model: a
  // checkpoint saved with one split loads with any other.
  std::vector<int64_t> pp_layers;
};

// True when layer i of `m` is a mixture-of-experts layer.
inline bool is_moe_layer(const ModelConfig& m, int64_t i) {
  return m.moe.enabled() && i % m.moe.every == 0;
}

// The number of key/value heads: model.kv_heads, or A when it is 0.
inline int64_t kv_heads_of(const ModelConfig& m) { return m.kv_heads > 0 ? m.kv_heads : m.heads; }

// Recipe options (docs/design.md section 4, docs/design.md section 15). Only the fields of the
// chosen recipe are used. Unset optionals take the recipe's TransformerEngine default (resolved by
// fp8_format_of / power_2_scale_of).
struct RecipeConfig {
  RecipeKind kind = RecipeKind::kFp32;
  int64_t amax_history_len = 1024;                                // delayed
  kernels::AmaxAlgo amax_compute_algo = kernels::AmaxAlgo::kMax;  // delayed
  int64_t margin = 0;                                             // delayed
  // delayed, current, block: default HYBRID (delayed, current) or E4M3 (mxfp8, block); mxfp8
  // accepts only E4M3.
  std::optional<Fp8Format> fp8_format;
  // current, block: scales rounded down to powers of two; default false (current), true (block).
  std::optional<bool> power_2_scale;
  // current, block: amax clamped below by eps before scale = fp8_max / amax (TE's amax_epsilon);
  // [0, 1], 0 disables the clamp.
  double eps = 0.0;
  bool operator==(const RecipeConfig&) const = default;
};

// The resolved options of a recipe (the explicit value, else the recipe's default).
Fp8Format fp8_format_of(const RecipeConfig& r);
bool power_2_scale_of(const RecipeConfig& r);

// Pipeline schedules (docs/design.md section 33, engine/pipeline/pipeline.h): GPipe runs every
// micro-batch's forward, then every backward; 1F1B (PipeDream-flush) runs (stages - stage - 1)
// warm-up forwards, then alternates one forward and one backward, then drains the backwards.
// Both run the backwards in micro-batch order, so every parameter's gradient accumulates
// micro-batch 0 first, as with one stage.
enum class PpSchedule : uint8_t { kGpipe, kOneFOneB };
inline constexpr std::string_view kPpScheduleNames[] = {"gpipe", "1f1b"};

struct TrainingConfig {
  int64_t batch = 4;     // B: global batch (sequences per step)
  int64_t seq_len = 16;  // S
  int64_t steps = 20;
  int64_t micro_batches = 1;  // gradient accumulation: B is split into this many micro-batches
  double lr = 1e-3;
  double min_lr = 0.0;  // cosine floor
  int64_t warmup_steps = 0;
  LrSchedule schedule = LrSchedule::kConstant;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double adam_eps = 1e-8;
  double weight_decay = 0.0;
  double max_grad_norm = 1.0;  // <= 0 disables clipping
  bool recompute = false;      // activation recompute per layer
  // The order of each pipeline stage's passes (mesh pp > 1; no effect with one stage).
  PpSchedule pp_schedule = PpSchedule::kGpipe;
};

struct DataConfig {
  int64_t markov_order = 1;  // k: each token depends on the previous k
  double decay = 0.5;        // next-token probabilities proportional to decay^rank
  uint64_t seed = 42;        // Philox key of the data stream (transition table and tokens)
};

struct Config {
  ModelConfig model;
  RecipeConfig recipe;
  TrainingConfig training;
  DataConfig data;
  uint64_t seed = 1234;  // Philox key of parameter init and dropout (data: data.seed)
};

// One broken input rule: the key it is about (engine names, e.g. "model.heads",
// "training.batch", "mesh.sequence_parallel") and a sentence that says what is wrong.
struct ConfigIssue {
  std::string key_path;
  std::string message;
};

// Every rule of a single-rank configuration that `config` breaks, in a fixed order (empty: valid).
// The mesh-level rules are engine::check_run's (engine/config/run_rules.h).
std::vector<ConfigIssue> check_config(const Config& config);

// Throws kernels::Error (kInput) with the first issue of check_config, e.g.
// "model.heads = 3 does not divide model.hidden = 32".
void validate(const Config& config);

// (key, value) pairs of every setting, for /config attributes and reports.
std::vector<std::pair<std::string, std::string>> config_items(const Config& config);

}  // namespace meshproof::engine
