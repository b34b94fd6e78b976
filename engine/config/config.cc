#include "engine/config/config.h"

#include <fmt/format.h>

#include <cmath>
#include <iterator>

#include "kernels/core/error.h"

namespace meshproof::engine {

std::string_view norm_name(NormKind k) {
  return k == NormKind::kLayerNorm ? "layernorm" : "rmsnorm";
}

std::string_view activation_name(Activation a) {
  switch (a) {
    case Activation::kGelu:
      return "gelu";
    case Activation::kRelu:
      return "relu";
    case Activation::kSwiGlu:
      return "swiglu";
  }
  return "?";
}

std::string_view position_name(PositionKind p) {
  return p == PositionKind::kLearned ? "learned" : "rope";
}

std::string_view recipe_name(RecipeKind r) {
  for (const RecipeName& n : kRecipeNames) {
    if (n.kind == r) return n.name;
  }
  return "?";
}

std::string_view schedule_name(LrSchedule s) {
  return s == LrSchedule::kConstant ? "constant" : "warmup_cosine";
}

std::string_view fp8_format_name(Fp8Format f) {
  return f == Fp8Format::kHybrid ? "hybrid" : "e4m3";
}

NormKind parse_norm(std::string_view s, std::string_view field) {
  if (s == "layernorm") return NormKind::kLayerNorm;
  if (s == "rmsnorm") return NormKind::kRmsNorm;
  MP_FAIL_INPUT("{} = '{}': expected layernorm or rmsnorm", field, s);
}

Activation parse_activation(std::string_view s, std::string_view field) {
  if (s == "gelu") return Activation::kGelu;
  if (s == "relu") return Activation::kRelu;
  if (s == "swiglu") return Activation::kSwiGlu;
  MP_FAIL_INPUT("{} = '{}': expected gelu, relu or swiglu", field, s);
}

PositionKind parse_position(std::string_view s, std::string_view field) {
  if (s == "learned") return PositionKind::kLearned;
  if (s == "rope") return PositionKind::kRope;
  MP_FAIL_INPUT("{} = '{}': expected learned or rope", field, s);
}

RecipeKind parse_recipe(std::string_view s, std::string_view field) {
  std::string names;  // "fp32, bf16, ... or block"
  const size_t count = std::size(kRecipeNames);
  for (size_t i = 0; i < count; ++i) {
    if (s == kRecipeNames[i].name) return kRecipeNames[i].kind;
    names += fmt::format("{}{}",
                         i == 0           ? ""
                         : i + 1 == count ? " or "
                                          : ", ",
                         kRecipeNames[i].name);
  }
  MP_FAIL_INPUT("{} = '{}': expected {}", field, s, names);
}

LrSchedule parse_schedule(std::string_view s, std::string_view field) {
  if (s == "constant") return LrSchedule::kConstant;
  if (s == "warmup_cosine") return LrSchedule::kWarmupCosine;
  MP_FAIL_INPUT("{} = '{}': expected constant or warmup_cosine", field, s);
}

std::string_view moe_router_name(MoeRouter r) {
  return r == MoeRouter::kSoftmax ? "softmax" : "sigmoid";
}

MoeRouter parse_moe_router(std::string_view s, std::string_view field) {
  if (s == "softmax") return MoeRouter::kSoftmax;
  if (s == "sigmoid") return MoeRouter::kSigmoid;
  MP_FAIL_INPUT("{} = '{}': expected softmax or sigmoid", field, s);
}

Fp8Format fp8_format_of(const RecipeConfig& r) {
  if (r.fp8_format) return *r.fp8_format;
  // TE: DelayedScaling and Float8CurrentScaling default to HYBRID, MXFP8BlockScaling and
  // Float8BlockScaling to E4M3.
  return r.kind == RecipeKind::kMxfp8 || r.kind == RecipeKind::kBlock ? Fp8Format::kE4M3
                                                                      : Fp8Format::kHybrid;
}

bool power_2_scale_of(const RecipeConfig& r) {
  if (r.power_2_scale) return *r.power_2_scale;
  // TE: Float8BlockScaling's QParams use power-of-2 scales, Float8CurrentScaling's do not.
  return r.kind == RecipeKind::kBlock;
}

std::vector<ConfigIssue> check_config(const Config& c) {
  std::vector<ConfigIssue> issues;
  // needf(key, cond, message): records the issue when `cond` does not hold.
  const auto needf = [&issues](const char* key, bool cond, std::string text) {
    if (!cond) issues.push_back({key, std::move(text)});
  };
  const ModelConfig& m = c.model;
  const TrainingConfig& t = c.training;
  needf("model.vocab", m.vocab >= 2, fmt::format("model.vocab = {} must be >= 2", m.vocab));
  needf("model.vocab", m.vocab <= (int64_t{1} << 30),
        fmt::format("model.vocab = {} too large for int32 token ids", m.vocab));
  needf("model.hidden", m.hidden >= 1, fmt::format("model.hidden = {} must be >= 1", m.hidden));
  needf("model.heads", m.heads >= 1, fmt::format("model.heads = {} must be >= 1", m.heads));
  needf("model.heads", m.heads < 1 || m.hidden % m.heads == 0,
        fmt::format("model.heads = {} does not divide model.hidden = {}", m.heads, m.hidden));
  needf("model.layers", m.layers >= 1, fmt::format("model.layers = {} must be >= 1", m.layers));
  needf("model.ffn", m.ffn >= 1, fmt::format("model.ffn = {} must be >= 1", m.ffn));
  needf("model.max_positions", m.max_positions >= 1,
        fmt::format("model.max_positions = {} must be >= 1", m.max_positions));
  needf("model.dropout", m.dropout >= 0.0 && m.dropout < 1.0,
        fmt::format("model.dropout = {} must be in [0, 1)", m.dropout));
  needf("model.norm_eps", m.norm_eps > 0.0,
        fmt::format("model.norm_eps = {} must be > 0", m.norm_eps));
  needf("model.kv_heads", m.kv_heads >= 0,
        fmt::format("model.kv_heads = {} must be >= 1 (or 0: model.heads)", m.kv_heads));
  needf("model.kv_heads", m.kv_heads <= 0 || m.heads < 1 || m.heads % m.kv_heads == 0,
        fmt::format("model.kv_heads = {} does not divide model.heads = {}", m.kv_heads, m.heads));
  // RoPE rotates pairs (2i, 2i+1) of each head: the head dim must be even.
  needf("model.position",
        m.position != PositionKind::kRope || m.heads < 1 || m.hidden % m.heads != 0 ||
            (m.hidden / m.heads) % 2 == 0,
        fmt::format("model.position = rope needs an even head dim, got model.hidden / model.heads "
                    "= {} / {}",
                    m.hidden, m.heads));
  needf("model.rope_theta", std::isfinite(m.rope_theta) && m.rope_theta > 1.0,
        fmt::format("model.rope_theta = {} must be finite and > 1", m.rope_theta));

  needf("training.batch", t.batch >= 1, fmt::format("training.batch = {} must be >= 1", t.batch));
  needf("training.seq_len", t.seq_len >= 1,
        fmt::format("training.seq_len = {} must be >= 1", t.seq_len));
  needf("training.seq_len", t.seq_len <= m.max_positions,
        fmt::format("training.seq_len = {} exceeds model.max_positions = {}", t.seq_len,
                    m.max_positions));
  needf("training.steps", t.steps >= 1, fmt::format("training.steps = {} must be >= 1", t.steps));
  needf("training.micro_batches", t.micro_batches >= 1 && t.batch % t.micro_batches == 0,
        fmt::format("training.micro_batches = {} must be >= 1 and divide training.batch = {}",
                    t.micro_batches, t.batch));
  needf("training.lr", std::isfinite(t.lr) && t.lr >= 0.0,
        fmt::format("training.lr = {} must be finite and >= 0", t.lr));
  needf("training.min_lr", t.min_lr >= 0.0 && t.min_lr <= t.lr,
        fmt::format("training.min_lr = {} must be in [0, lr = {}]", t.min_lr, t.lr));
  needf("training.warmup_steps", t.warmup_steps >= 0,
        fmt::format("training.warmup_steps = {} must be >= 0", t.warmup_steps));
  needf("training.beta1", t.beta1 >= 0.0 && t.beta1 < 1.0,
        fmt::format("training.beta1 = {} must be in [0, 1)", t.beta1));
  needf("training.beta2", t.beta2 >= 0.0 && t.beta2 < 1.0,
        fmt::format("training.beta2 = {} must be in [0, 1)", t.beta2));
  needf("training.adam_eps", t.adam_eps > 0.0,
        fmt::format("training.adam_eps = {} must be > 0", t.adam_eps));
  needf("training.weight_decay", t.weight_decay >= 0.0,
        fmt::format("training.weight_decay = {} must be >= 0", t.weight_decay));
  // warmup_cosine: the cosine phase (CosineAnnealingLR, T_max = steps - 1 - warmup_steps) needs
  // T_max >= 1 to start at lr and end at min_lr on the last step.
  needf(
      "training.warmup_steps",
      t.schedule != LrSchedule::kWarmupCosine || t.warmup_steps <= t.steps - 2,
      fmt::format("training.warmup_steps = {} with training.schedule = warmup_cosine must be <= "
                  "training.steps - 2 = {} (the peak step and at least one cosine step to min_lr)",
                  t.warmup_steps, t.steps - 2));

  // Mixture of experts (docs/design.md section 27).
  const MoeConfig& moe = m.moe;
  needf("model.moe.experts", moe.experts >= 0,
        fmt::format("model.moe.experts = {} must be >= 0 (0: no MoE)", moe.experts));
  needf("model.moe.experts", moe.enabled() || moe == MoeConfig{},
        "model.moe.experts = 0 (the dense model) but other model.moe settings differ from their "
        "defaults; set experts >= 1 or leave model.moe out");
  if (moe.enabled()) {
    needf("model.moe.top_k", moe.top_k >= 1 && moe.top_k <= moe.experts,
          fmt::format("model.moe.top_k = {} must be in [1, model.moe.experts = {}]", moe.top_k,
                      moe.experts));
    needf(
        "model.moe.every", moe.every >= 1 && moe.every <= m.layers,
        fmt::format("model.moe.every = {} must be in [1, model.layers = {}]", moe.every, m.layers));
    needf("model.moe.aux_loss_coef", std::isfinite(moe.aux_loss_coef) && moe.aux_loss_coef >= 0.0,
          fmt::format("model.moe.aux_loss_coef = {} must be finite and >= 0", moe.aux_loss_coef));
  }

  const DataConfig& d = c.data;
  needf("data.markov_order", d.markov_order >= 1 && d.markov_order <= 4,
        fmt::format("data.markov_order = {} must be in [1, 4]", d.markov_order));
  // The transition table holds V^k contexts x V int32 tokens: capped at 2^24 entries (64 MiB),
  // the bound docs/scenarios.md states for data.order.
  needf("data.markov_order",
        std::pow(static_cast<double>(m.vocab), static_cast<double>(d.markov_order)) *
                static_cast<double>(m.vocab) <=
            static_cast<double>(int64_t{1} << 24),
        fmt::format("data.markov_order = {} with model.vocab = {}: the transition table "
                    "(vocab^(order+1) = {}^{} entries) exceeds 2^24",
                    d.markov_order, m.vocab, m.vocab, d.markov_order + 1));
  needf("data.decay", d.decay > 0.0 && d.decay <= 1.0,
        fmt::format("data.decay = {} must be in (0, 1]", d.decay));

  const RecipeConfig& r = c.recipe;
  if (r.kind == RecipeKind::kMxfp8) {
    // MXFP8 blocks of 32 run along K (rowwise) and along M (columnwise) of every GEMM operand of
    // qkv/proj/fc1/fc2: K in {H, F}, N in {3H, H, F}, M = micro-batch rows * seq_len.
    needf("model.hidden", m.hidden % 32 == 0,
          fmt::format("recipe = mxfp8 needs model.hidden % 32 == 0, got {}", m.hidden));
    needf("model.ffn", m.ffn % 32 == 0,
          fmt::format("recipe = mxfp8 needs model.ffn % 32 == 0, got {}", m.ffn));
    const int64_t rows = t.batch / std::max<int64_t>(t.micro_batches, 1) * t.seq_len;
    needf("training.batch", rows % 32 == 0,
          fmt::format("recipe = mxfp8 needs (training.batch / training.micro_batches) * "
                      "training.seq_len % 32 == 0, got {}",
                      rows));
  }
  if (r.kind == RecipeKind::kNvfp4) {
    // NVFP4 1x16 blocks / 16x16 tiles / 16-element RHT groups run along both dims of every GEMM
    // operand of qkv/proj/fc1/fc2 (docs/design.md section 25).
    needf("model.hidden", m.hidden % 16 == 0,
          fmt::format("recipe = nvfp4 needs model.hidden % 16 == 0, got {}", m.hidden));
    needf("model.ffn", m.ffn % 16 == 0,
          fmt::format("recipe = nvfp4 needs model.ffn % 16 == 0, got {}", m.ffn));
    const int64_t rows = t.batch / std::max<int64_t>(t.micro_batches, 1) * t.seq_len;
    needf("training.batch", rows % 16 == 0,
          fmt::format("recipe = nvfp4 needs (training.batch / training.micro_batches) * "
                      "training.seq_len % 16 == 0, got {}",
                      rows));
  }
  needf("recipe.amax_history_len", r.amax_history_len >= 1,
        fmt::format("recipe.amax_history_len = {} must be >= 1", r.amax_history_len));
  needf("recipe.fp8_format", r.kind != RecipeKind::kMxfp8 || fp8_format_of(r) == Fp8Format::kE4M3,
        "recipe.fp8_format = hybrid: recipe mxfp8 supports only e4m3");
  needf("recipe.eps", std::isfinite(r.eps) && r.eps >= 0.0 && r.eps <= 1.0,
        fmt::format("recipe.eps = {} must be in [0, 1]", r.eps));
  return issues;
}

void validate(const Config& c) {
  const std::vector<ConfigIssue> issues = check_config(c);
  if (!issues.empty()) MP_FAIL_INPUT("{}", issues.front().message);
}

std::vector<std::pair<std::string, std::string>> config_items(const Config& c) {
  std::vector<std::pair<std::string, std::string>> kv;
  auto add = [&kv](std::string k, auto v) { kv.emplace_back(std::move(k), fmt::format("{}", v)); };
  add("model.vocab", c.model.vocab);
  add("model.hidden", c.model.hidden);
  add("model.heads", c.model.heads);
  add("model.layers", c.model.layers);
  add("model.ffn", c.model.ffn);
  add("model.max_positions", c.model.max_positions);
  add("model.norm", norm_name(c.model.norm));
  add("model.activation", activation_name(c.model.activation));
  add("model.tied_embeddings", c.model.tied_embeddings ? 1 : 0);
  add("model.dropout", c.model.dropout);
  add("model.norm_eps", c.model.norm_eps);
  add("model.kv_heads", kv_heads_of(c.model));
  add("model.position", position_name(c.model.position));
  add("model.rope_theta", c.model.rope_theta);
  add("model.bias", c.model.bias ? 1 : 0);
  add("model.vocab_parallel", c.model.vocab_parallel ? 1 : 0);
  if (c.model.moe.enabled()) {  // only with MoE: the dense model's items stay what they were
    add("model.moe.experts", c.model.moe.experts);
    add("model.moe.top_k", c.model.moe.top_k);
    add("model.moe.every", c.model.moe.every);
    add("model.moe.router", moe_router_name(c.model.moe.router));
    add("model.moe.shared_expert", c.model.moe.shared_expert ? 1 : 0);
    add("model.moe.aux_loss_coef", c.model.moe.aux_loss_coef);
  }
  add("recipe.name", recipe_name(c.recipe.kind));
  add("recipe.amax_history_len", c.recipe.amax_history_len);
  add("recipe.amax_compute_algo", kernels::amax_algo_name(c.recipe.amax_compute_algo));
  add("recipe.margin", c.recipe.margin);
  add("recipe.fp8_format", fp8_format_name(fp8_format_of(c.recipe)));
  add("recipe.power_2_scale", power_2_scale_of(c.recipe) ? 1 : 0);
  add("recipe.eps", c.recipe.eps);
  add("training.batch", c.training.batch);
  add("training.seq_len", c.training.seq_len);
  add("training.steps", c.training.steps);
  add("training.micro_batches", c.training.micro_batches);
  add("training.lr", c.training.lr);
  add("training.min_lr", c.training.min_lr);
  add("training.warmup_steps", c.training.warmup_steps);
  add("training.schedule", schedule_name(c.training.schedule));
  add("training.beta1", c.training.beta1);
  add("training.beta2", c.training.beta2);
  add("training.adam_eps", c.training.adam_eps);
  add("training.weight_decay", c.training.weight_decay);
  add("training.max_grad_norm", c.training.max_grad_norm);
  add("training.recompute", c.training.recompute ? 1 : 0);
  add("data.markov_order", c.data.markov_order);
  add("data.decay", c.data.decay);
  add("data.seed", c.data.seed);
  add("seed", c.seed);
  return kv;
}

}  // namespace meshproof::engine
