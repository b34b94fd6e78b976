// The key table is long by nature (one entry per documented key, about 80); everything else about
// keys (reading, defaults, canonical form, docs list) is the few generic functions at the end.
#include "harness/scenario/scenario_keys.h"

#include <fmt/format.h>

#include <cstdint>
#include <iterator>
#include <limits>
#include <type_traits>

#include "kernels/core/error.h"

namespace meshproof::harness {

namespace {

using engine::MeshSpec;
using engine::RecipeConfig;

constexpr int64_t kMaxDim = int64_t{1} << 20;
constexpr int64_t kMaxInt = std::numeric_limits<int64_t>::max();

// A recipe of `kind` with every option at its default (what the resolved defaults derive from).
RecipeConfig defaults_of(engine::RecipeKind kind) {
  RecipeConfig r;
  r.kind = kind;
  return r;
}

// The names of enum E from its one name table: `name(E(i))` for i in [0, count).
template <class E, class F>
std::vector<std::string> names_of(F name, size_t count) {
  std::vector<std::string> out;
  for (size_t i = 0; i < count; ++i) out.emplace_back(name(static_cast<E>(i)));
  return out;
}
template <class E, size_t N>
std::vector<std::string> names_of(const std::string_view (&table)[N]) {
  return {std::begin(table), std::end(table)};
}

// Key factories: `field(t)` is a reference to the field the key sets in T.
template <class T, class F>
Key<T> int_key(std::string path, int64_t def, int64_t min, int64_t max, F field, std::string doc) {
  Key<T> k;
  k.path = std::move(path);
  k.type = KeyType::kInt;
  k.def = def;
  k.imin = min;
  k.imax = max;
  k.doc = std::move(doc);
  k.get = [field](const T& t) { return KeyValue{static_cast<int64_t>(field(const_cast<T&>(t)))}; };
  k.set = [field](T& t, const KeyValue& v) {
    field(t) = static_cast<std::decay_t<decltype(field(t))>>(std::get<int64_t>(v));
  };
  return k;
}

template <class T, class F>
Key<T> number_key(std::string path, double def, double min, double max, bool min_open,
                  bool max_open, F field, std::string doc) {
  Key<T> k;
  k.path = std::move(path);
  k.type = KeyType::kNumber;
  k.def = def;
  k.dmin = min;
  k.dmax = max;
  k.min_open = min_open;
  k.max_open = max_open;
  k.doc = std::move(doc);
  k.get = [field](const T& t) { return KeyValue{field(const_cast<T&>(t))}; };
  k.set = [field](T& t, const KeyValue& v) { field(t) = std::get<double>(v); };
  return k;
}

template <class T, class F>
Key<T> bool_key(std::string path, bool def, F field, std::string doc) {
  Key<T> k;
  k.path = std::move(path);
  k.type = KeyType::kBool;
  k.def = def;
  k.doc = std::move(doc);
  k.get = [field](const T& t) { return KeyValue{static_cast<bool>(field(const_cast<T&>(t)))}; };
  k.set = [field](T& t, const KeyValue& v) { field(t) = std::get<bool>(v); };
  return k;
}

// An enum whose values are 0..n-1 in the order of `names`.
template <class T, class E, class F>
Key<T> enum_key(std::string path, E def, std::vector<std::string> names, F field, std::string doc) {
  Key<T> k;
  k.path = std::move(path);
  k.type = KeyType::kEnum;
  k.def = names.at(static_cast<size_t>(def));
  k.choices = names;
  k.doc = std::move(doc);
  k.get = [field, names](const T& t) {
    return KeyValue{names.at(static_cast<size_t>(field(const_cast<T&>(t))))};
  };
  k.set = [field, names](T& t, const KeyValue& v) {
    const std::string& s = std::get<std::string>(v);
    for (size_t i = 0; i < names.size(); ++i) {
      if (names[i] == s) {
        using Stored = std::decay_t<decltype(field(t))>;
        field(t) = static_cast<Stored>(i);
        return;
      }
    }
    MP_FAIL("enum key: '{}' is none of {}", s, fmt::join(names, ", "));
  };
  return k;
}

template <class T, class F>
Key<T> string_key(std::string path, std::string def, F field, std::string doc) {
  Key<T> k;
  k.path = std::move(path);
  k.type = KeyType::kString;
  k.def = std::move(def);
  k.doc = std::move(doc);
  k.get = [field](const T& t) { return KeyValue{field(const_cast<T&>(t))}; };
  k.set = [field](T& t, const KeyValue& v) { field(t) = std::get<std::string>(v); };
  return k;
}

// A key the loader reads with its own code (a section, a list, a check, a tolerance).
template <class T>
Key<T> own_key(std::string path, KeyType type, std::string default_text, std::string doc) {
  Key<T> k;
  k.path = std::move(path);
  k.type = type;
  k.default_text = std::move(default_text);
  k.doc = std::move(doc);
  k.hashed = false;  // its canonical form is written by to_canonical_json
  return k;
}

template <class T>
Key<T> with_text(Key<T> k, std::string default_text) {
  k.default_text = std::move(default_text);
  return k;
}

// The values of the llama3_debug preset (docs/design.md section 24), by key path; every other
// model key keeps its table default.
const std::vector<std::pair<std::string_view, KeyValue>>& llama3_debug_preset() {
  static const std::vector<std::pair<std::string_view, KeyValue>> preset = {
      {"model.vocab", int64_t{2048}},
      {"model.hidden", int64_t{256}},
      {"model.heads", int64_t{16}},
      {"model.kv_heads", int64_t{4}},
      {"model.layers", int64_t{6}},
      {"model.ffn", int64_t{768}},
      {"model.norm", std::string("rmsnorm")},
      {"model.activation", std::string("swiglu")},
      {"model.position", std::string("rope")},
      {"model.rope_theta", 500000.0},
      {"model.bias", false},
      {"model.vocab_parallel", true},
  };
  return preset;
}

// Makes the defaults of the model keys follow model.preset (read first in its section).
void apply_model_presets(std::vector<Key<Scenario>>& keys) {
  for (Key<Scenario>& k : keys) {
    for (const auto& [path, value] : llama3_debug_preset()) {
      if (k.path != path) continue;
      k.default_of = [value = value, table = k.default_of, def = k.def](const Scenario& s) {
        if (s.model_preset == ModelPreset::kLlama3Debug) return value;
        return table ? table(s) : def;
      };
    }
  }
}

std::vector<Key<Scenario>> make_scenario_keys() {
  using S = Scenario;
  std::vector<Key<S>> k;
  // Top level, in the order messages list them.
  Key<S> name = string_key<S>(
      "name", "", [](S & s) -> auto& { return s.base_name; },
      "names goldens and checkpoint folders");
  name.default_text = "the file stem";
  name.hashed = false;  // the canonical form holds the expanded name
  k.push_back(name);
  Key<S> description = string_key<S>(
      "description", "", [](S & s) -> auto& { return s.description; }, "free text, not hashed");
  description.hashed = false;
  k.push_back(description);
  k.push_back(own_key<S>("model", KeyType::kMapping, "see below", "the model"));
  k.push_back(own_key<S>("mesh", KeyType::kMapping, "1 rank", "the device mesh"));
  k.push_back(own_key<S>("recipe", KeyType::kMapping, "bf16", "a mapping, or a recipe name"));
  k.push_back(own_key<S>("fsdp", KeyType::kMapping, "see below", "FSDP options"));
  k.push_back(own_key<S>("train", KeyType::kMapping, "see below", "the training plan"));
  k.push_back(own_key<S>("data", KeyType::kMapping, "see below", "the data source"));
  k.push_back(enum_key<S>(
      "backend", Backend::kAuto, names_of<Backend>(kBackendNames),
      [](S & s) -> auto& { return s.backend; }, "auto: CUDA when usable, else CPU"));
  k.push_back(enum_key<S>(
      "launcher", Launcher::kLocal, names_of<Launcher>(kLauncherNames),
      [](S & s) -> auto& { return s.launcher; },
      "local: ranks as threads; mpi: one process per rank"));
  k.push_back(bool_key<S>(
      "requires_gpu", false, [](S & s) -> auto& { return s.requires_gpu; },
      "skipped with the reason without a usable GPU"));
  k.push_back(own_key<S>("checkpoint", KeyType::kMapping, "see below", "periodic checkpoints"));
  k.push_back(own_key<S>("checks", KeyType::kMapping, "no checks", "the checks to run"));
  k.push_back(own_key<S>("faults", KeyType::kList, "[]", "injected faults"));
  k.push_back(enum_key<S>(
      "expect", Expect::kPass, names_of<Expect>(kExpectNames),
      [](S & s) -> auto& { return s.expect; }, "caught needs faults; faults need caught"));
  k.push_back(own_key<S>("matrix", KeyType::kMapping, "none", "lists of values to expand"));

  // model
  Key<S> preset = enum_key<S>(
      "model.preset", ModelPreset::kGptSmall, names_of<ModelPreset>(kModelPresetNames),
      [](S & s) -> auto& { return s.model_preset; },
      "the defaults of the model keys below (llama3_debug: see docs/design.md section 24)");
  preset.hashed = false;  // what it sets is hashed key by key
  k.push_back(preset);
  k.push_back(int_key<S>(
      "model.vocab", 256, 2, kMaxDim, [](S & s) -> auto& { return s.model.vocab; },
      "vocabulary size V"));
  k.push_back(int_key<S>(
      "model.hidden", 64, 1, kMaxDim, [](S & s) -> auto& { return s.model.hidden; },
      "model width H; divisible by heads"));
  k.push_back(int_key<S>(
      "model.heads", 4, 1, 4096, [](S & s) -> auto& { return s.model.heads; },
      "attention heads A; divisible by mesh.tp"));
  k.push_back(int_key<S>(
      "model.layers", 2, 1, 1024, [](S & s) -> auto& { return s.model.layers; },
      "transformer layers L"));
  Key<S> ffn = int_key<S>(
      "model.ffn", 256, 1, kMaxDim, [](S & s) -> auto& { return s.model.ffn; },
      "MLP width F (per branch for SwiGLU); divisible by mesh.tp");
  ffn.default_text = "4 x hidden";
  ffn.default_of = [](const S& s) { return KeyValue{4 * s.model.hidden}; };
  k.push_back(ffn);
  // One value, two engine fields: the sequence length and the rows of embed.pos.
  Key<S> seq = int_key<S>(
      "model.seq_len", 32, 1, int64_t{1} << 16, [](S & s) -> auto& { return s.train.seq_len; },
      "tokens per sequence S; divisible by tp with sequence_parallel");
  seq.set = [](S& s, const KeyValue& v) {
    s.train.seq_len = std::get<int64_t>(v);
    s.model.max_positions = s.train.seq_len;
  };
  k.push_back(seq);
  k.push_back(enum_key<S>(
      "model.norm", Norm::kLayerNorm, names_of<Norm>(engine::norm_name, 2),
      [](S & s) -> auto& { return s.model.norm; }, "layernorm (with bias) or rmsnorm; eps 1e-5"));
  k.push_back(enum_key<S>(
      "model.activation", Activation::kGelu, names_of<Activation>(engine::activation_name, 3),
      [](S & s) -> auto& { return s.model.activation; }, "GELU is the tanh approximation"));
  k.push_back(bool_key<S>(
      "model.tied_embeddings", false, [](S & s) -> auto& { return s.model.tied_embeddings; },
      "lm_head reuses embed.tok"));
  k.push_back(number_key<S>(
      "model.dropout", 0.0, 0.0, 1.0, false, true, [](S & s) -> auto& { return s.model.dropout; },
      "hidden dropout probability"));
  // Llama-style options (docs/design.md section 24). Each is hashed only where it differs from
  // the GPT-2-like model, so the hashes of scenarios that never set them stay what they were.
  Key<S> kv = int_key<S>(
      "model.kv_heads", 4, 1, 4096, [](S & s) -> auto& { return s.model.kv_heads; },
      "key/value heads KV (grouped-query attention); divides heads; divisible by mesh.tp");
  kv.default_text = "heads";
  kv.default_of = [](const S& s) { return KeyValue{s.model.heads}; };
  kv.hash_if = [](const S& s) { return engine::kv_heads_of(s.model) != s.model.heads; };
  k.push_back(kv);
  Key<S> position = enum_key<S>(
      "model.position", engine::PositionKind::kLearned,
      names_of<engine::PositionKind>(engine::position_name, 2),
      [](S & s) -> auto& { return s.model.position; },
      "learned (embed.pos) or rope (rotary q/k, no embed.pos)");
  position.hash_if = [](const S& s) { return s.model.position != engine::PositionKind::kLearned; };
  k.push_back(position);
  Key<S> theta = number_key<S>(
      "model.rope_theta", 10000.0, 1.0, 1e12, true, false,
      [](S & s) -> auto& { return s.model.rope_theta; }, "RoPE base theta");
  theta.hash_if = [](const S& s) { return s.model.rope_theta != 10000.0; };
  k.push_back(theta);
  Key<S> bias = bool_key<S>(
      "model.bias", true, [](S & s) -> auto& { return s.model.bias; },
      "biases on the linear layers (qkv, proj, fc1/fc1_gate/fc1_up, fc2)");
  bias.hash_if = [](const S& s) { return !s.model.bias; };
  k.push_back(bias);
  Key<S> vocab_parallel = bool_key<S>(
      "model.vocab_parallel", false, [](S & s) -> auto& { return s.model.vocab_parallel; },
      "embed.tok and lm_head split by vocabulary rows over tp, parallel cross-entropy");
  vocab_parallel.hash_if = [](const S& s) { return s.model.vocab_parallel; };
  k.push_back(vocab_parallel);
  // Mixture of experts (docs/design.md section 27): a mapping of its own under model. Its keys
  // enter scenario_hash only with experts > 0 (to_canonical_json), so a dense scenario's
  // canonical text is what it was.
  k.push_back(own_key<S>("model.moe", KeyType::kMapping, "none", "mixture of experts; keys below"));
  const auto moe_on = [](const S& s) { return s.model.moe.enabled(); };
  std::vector<Key<S>> moe_keys;
  moe_keys.push_back(int_key<S>(
      "model.moe.experts", 0, 0, 4096, [](S & s) -> auto& { return s.model.moe.experts; },
      "experts E per MoE layer; 0 = dense"));
  moe_keys.push_back(int_key<S>(
      "model.moe.top_k", 1, 1, 4096, [](S & s) -> auto& { return s.model.moe.top_k; },
      "experts chosen per token; <= experts"));
  moe_keys.push_back(int_key<S>(
      "model.moe.every", 1, 1, 1024, [](S & s) -> auto& { return s.model.moe.every; },
      "layer i is an MoE layer when i % every == 0"));
  moe_keys.push_back(enum_key<S>(
      "model.moe.router", engine::MoeRouter::kSoftmax,
      names_of<engine::MoeRouter>(engine::moe_router_name, 2),
      [](S & s) -> auto& { return s.model.moe.router; },
      "router probabilities from the fp32 logits"));
  moe_keys.push_back(bool_key<S>(
      "model.moe.shared_expert", false, [](S & s) -> auto& { return s.model.moe.shared_expert; },
      "one more expert applied to every token"));
  moe_keys.push_back(number_key<S>(
      "model.moe.aux_loss_coef", 0.0, 0.0, 1000.0, false, false,
      [](S & s) -> auto& { return s.model.moe.aux_loss_coef; },
      "c of the Switch load-balancing loss c * E * sum_e f_e * P_e"));
  for (Key<S>& key : moe_keys) {
    key.hash_if = moe_on;
    k.push_back(std::move(key));
  }
  apply_model_presets(k);

  // fsdp
  k.push_back(bool_key<S>(
      "fsdp.reshard_after_forward", true,
      [](S & s) -> auto& { return s.fsdp.reshard_after_forward; },
      "free gathered weights after the forward, gather again"));
  k.push_back(bool_key<S>(
      "fsdp.fp8_all_gather", false, [](S & s) -> auto& { return s.fsdp.fp8_all_gather; },
      "gather quantized shards (FP8 recipes only)"));
  k.push_back(bool_key<S>(
      "fsdp.fp8_params", false, [](S & s) -> auto& { return s.fsdp.fp8_params; },
      "FP8 primary weights"));
  Key<S> sync = bool_key<S>(
      "fsdp.sync_each_micro_batch", false,
      [](S & s) -> auto& { return s.fsdp.sync_each_micro_batch; },
      "reduce gradients after every micro-batch");
  // Hashed only when set, so that the hashes of scenarios that leave it at its default (every
  // golden and checkpoint made before the key existed) stay what they were.
  sync.hash_if = [](const S& s) { return s.fsdp.sync_each_micro_batch; };
  k.push_back(sync);

  // train
  k.push_back(int_key<S>(
      "train.steps", 8, 1, 1000000, [](S & s) -> auto& { return s.train.steps; },
      "optimizer steps"));
  k.push_back(int_key<S>(
      "train.global_batch", 8, 1, kMaxDim, [](S & s) -> auto& { return s.train.batch; },
      "sequences per step over all dp ranks"));
  k.push_back(int_key<S>(
      "train.micro_batches", 1, 1, 4096, [](S & s) -> auto& { return s.train.micro_batches; },
      "gradient-accumulation micro-batches per step"));
  k.push_back(number_key<S>(
      "train.lr", 1e-3, 0.0, 10.0, true, false, [](S & s) -> auto& { return s.train.lr; },
      "peak learning rate"));
  k.push_back(enum_key<S>(
      "train.schedule", Schedule::kConstant, names_of<Schedule>(engine::schedule_name, 2),
      [](S & s) -> auto& { return s.train.schedule; }, "learning-rate schedule"));
  // warmup_cosine: the peak step W and at least one cosine step to min_lr (CosineAnnealingLR's
  // T_max = steps - 1 - W >= 1; engine/optim/optimizer.h).
  Key<S> warmup = int_key<S>(
      "train.warmup_steps", 0, 0, 0, [](S & s) -> auto& { return s.train.warmup_steps; },
      "warmup_cosine: linear warmup length");
  warmup.imax_of = [](const S& s) {
    return s.train.schedule == Schedule::kWarmupCosine ? s.train.steps - 2 : s.train.steps;
  };
  k.push_back(warmup);
  Key<S> min_lr = number_key<S>(
      "train.min_lr", 0.0, 0.0, 0.0, false, false, [](S & s) -> auto& { return s.train.min_lr; },
      "warmup_cosine: final learning rate");
  min_lr.dmax_of = [](const S& s) { return s.train.lr; };
  k.push_back(min_lr);
  k.push_back(number_key<S>(
      "train.weight_decay", 0.0, 0.0, 10.0, false, false,
      [](S & s) -> auto& { return s.train.weight_decay; },
      "AdamW decoupled decay on tensors with ndim >= 2"));
  k.push_back(number_key<S>(
      "train.beta1", 0.9, 0.0, 1.0, false, true, [](S & s) -> auto& { return s.train.beta1; },
      "AdamW beta1"));
  k.push_back(number_key<S>(
      "train.beta2", 0.999, 0.0, 1.0, false, true, [](S & s) -> auto& { return s.train.beta2; },
      "AdamW beta2"));
  k.push_back(number_key<S>(
      "train.adam_eps", 1e-8, 0.0, 1.0, true, false,
      [](S & s) -> auto& { return s.train.adam_eps; }, "AdamW epsilon"));
  k.push_back(number_key<S>(
      "train.max_grad_norm", 1.0, 0.0, 1e9, false, false,
      [](S & s) -> auto& { return s.train.max_grad_norm; },
      "global-norm clipping; 0 disables clipping"));
  k.push_back(bool_key<S>(
      "train.recompute", false, [](S & s) -> auto& { return s.train.recompute; },
      "activation recompute in backward"));
  k.push_back(int_key<S>(
      "train.seed", 1234, 0, kMaxInt, [](S & s) -> auto& { return s.seed; },
      "Philox key for init and dropout"));

  // data
  Key<S> kind = own_key<S>("data.kind", KeyType::kEnum, "", "seeded order-k Markov chain");
  // The one data source there is: validated, and written into the canonical form.
  kind.def = std::string("markov");
  kind.choices = {"markov"};
  kind.hashed = true;
  kind.get = [](const S&) { return KeyValue{std::string("markov")}; };
  kind.set = [](S&, const KeyValue&) {};  // read (and so validated) by read_keys; nothing to store
  k.push_back(kind);
  k.push_back(int_key<S>(
      "data.order", 1, 1, 4, [](S & s) -> auto& { return s.data.markov_order; },
      "k: each token depends on the previous k"));
  k.push_back(int_key<S>(
      "data.seed", 42, 0, kMaxInt, [](S & s) -> auto& { return s.data.seed; },
      "Philox key of the data stream"));

  // checkpoint
  k.push_back(string_key<S>(
      "checkpoint.dir", "", [](S & s) -> auto& { return s.checkpoint.dir; },
      "empty: <out>/<scenario>/checkpoints"));
  Key<S> every = int_key<S>(
      "checkpoint.every", 0, 0, 0, [](S & s) -> auto& { return s.checkpoint.every; },
      "save every N steps; 0: no periodic checkpoints");
  every.imax_of = [](const S& s) { return s.train.steps; };
  k.push_back(every);
  k.push_back(int_key<S>(
      "checkpoint.keep_last", 2, 1, 1000000, [](S & s) -> auto& { return s.checkpoint.keep_last; },
      "periodic checkpoints kept"));

  // checks (their canonical form is written by to_canonical_json: only the enabled ones)
  for (const char* c : {"golden", "resume", "reference"}) {
    k.push_back(own_key<S>(fmt::format("checks.{}", c), KeyType::kCheck, "false",
                           "true, false or a mapping (a mapping enables it)"));
  }
  Key<S> parity = bool_key<S>(
      "checks.allgather_parity", false, [](S & s) -> auto& { return s.checks.allgather_parity; },
      "needs fsdp.fp8_all_gather");
  parity.hashed = false;
  k.push_back(parity);
  Key<S> determinism = bool_key<S>(
      "checks.determinism", false, [](S & s) -> auto& { return s.checks.determinism; },
      "run twice, compare bitwise");
  determinism.hashed = false;
  k.push_back(determinism);
  Key<S> collectives = bool_key<S>(
      "checks.collectives", false, [](S & s) -> auto& { return s.checks.collectives; },
      "each step's parameter collectives equal the sharding plan's");
  collectives.hashed = false;  // written by to_canonical_json, only when enabled
  k.push_back(collectives);
  Key<S> mode = enum_key<S>(
      "checks.golden.mode", GoldenMode::kExact, names_of<GoldenMode>(kGoldenModeNames),
      [](S & s) -> auto& { return s.checks.golden.mode; }, "exact is bitwise");
  mode.hashed = false;
  k.push_back(mode);
  k.push_back(own_key<S>("checks.golden.metrics", KeyType::kList, "[loss, grad_norm]",
                         "non-empty, no repeats"));
  k.push_back(
      own_key<S>("checks.golden.rtol", KeyType::kRtol, "see tolerances", "tolerance mode only"));
  Key<S> atol = number_key<S>(
      "checks.golden.atol", 0.0, 0.0, 1e9, false, false,
      [](S & s) -> auto& { return s.checks.golden.atol; }, "tolerance mode only");
  atol.hashed = false;
  k.push_back(atol);
  Key<S> failing = int_key<S>(
      "checks.golden.allowed_failing_steps", 0, 0, 0,
      [](S & s) -> auto& { return s.checks.golden.allowed_failing_steps; }, "tolerance mode only");
  failing.imax_of = [](const S& s) { return s.train.steps - 1; };
  failing.hashed = false;
  k.push_back(failing);
  k.push_back(own_key<S>("checks.resume.at_step", KeyType::kInt, "steps / 2",
                         "in [1, steps - 1]; needs steps >= 2"));
  k.push_back(
      own_key<S>("checks.resume.mesh", KeyType::kMapping, "none", "resume on this mesh instead"));
  k.push_back(own_key<S>("checks.resume.rtol", KeyType::kRtol, "see tolerances",
                         "only with mesh (a same-mesh resume is bitwise)"));
  k.push_back(own_key<S>("checks.reference.mesh", KeyType::kMapping, "the scenario's",
                         "at least one of mesh/recipe/fsdp/train"));
  k.push_back(own_key<S>("checks.reference.recipe", KeyType::kMapping, "the scenario's",
                         "differs from the scenario's own mesh+recipe"));
  k.push_back(own_key<S>("checks.reference.rtol", KeyType::kRtol, "loss: see tolerances",
                         "a number (loss) or a mapping {loss, grad_norm}"));
  // The reference's later overrides (docs/design.md section 22).
  k.push_back(own_key<S>("checks.reference.fsdp", KeyType::kMapping, "the scenario's",
                         "fsdp keys replaced in the reference run"));
  k.push_back(own_key<S>("checks.reference.train", KeyType::kMapping, "the scenario's",
                         "{micro_batches: N} in the reference run"));
  k.push_back(own_key<S>("checks.reference.checkpoint", KeyType::kMapping, "the scenario's",
                         "{every: N, keep_last: K}: periodic checkpoints of the reference run"));
  // The state check (docs/design.md section 22).
  k.push_back(own_key<S>("checks.state", KeyType::kCheck, "false",
                         "true, false or a mapping (a mapping enables it)"));
  k.push_back(own_key<S>("checks.state.at_step", KeyType::kInt, "steps / 2", "in [1, steps]"));
  k.push_back(own_key<S>("checks.state.mesh", KeyType::kMapping, "the scenario's",
                         "load and save again on this mesh"));
  // Pipeline stages (docs/design.md section 33): the order of each stage's passes. Hashed only
  // where it differs from gpipe, so the hashes of every scenario without it stay what they were.
  Key<S> pp_schedule = enum_key<S>(
      "train.pp_schedule", engine::PpSchedule::kGpipe,
      names_of<engine::PpSchedule>(engine::kPpScheduleNames),
      [](S & s) -> auto& { return s.train.pp_schedule; },
      "pipeline schedule with mesh.pp > 1: gpipe (all forwards, then all backwards) or 1f1b");
  pp_schedule.hash_if = [](const S& s) {
    return s.train.pp_schedule != engine::PpSchedule::kGpipe;
  };
  k.push_back(pp_schedule);
  // An explicit split of the layers over the pipeline stages (docs/design.md section 33): a list
  // read by the resolver, written into the canonical form (and so the hash) only when set.
  k.push_back(own_key<S>("model.pp_layers", KeyType::kList, "the even split",
                         "layers per pipeline stage: mesh.pp entries, each >= 1, summing to "
                         "model.layers"));
  return k;
}

std::vector<Key<MeshSpec>> make_mesh_keys() {
  using M = MeshSpec;
  std::vector<Key<M>> k;
  k.push_back(int_key<M>(
      "dp_replicate", 1, 1, 4096, [](M & m) -> auto& { return m.dp_replicate; }, "HSDP replicas"));
  k.push_back(int_key<M>(
      "dp_shard", 1, 1, 4096, [](M & m) -> auto& { return m.dp_shard; }, "FSDP shards"));
  k.push_back(int_key<M>(
      "tp", 1, 1, 4096, [](M & m) -> auto& { return m.tp; }, "tensor-parallel ranks"));
  k.push_back(bool_key<M>(
      "sequence_parallel", false, [](M & m) -> auto& { return m.sequence_parallel; },
      "norms on sequence shards"));
  // Compared with the product, never stored.
  Key<M> world = own_key<M>("world_size", KeyType::kInt, "the product",
                            "optional cross-check: pp x dp_replicate x dp_shard x tp");
  world.imin = 1;
  world.imax = int64_t{1} << 24;
  world.def = int64_t{1};
  k.push_back(world);
  // Expert parallelism (docs/design.md "Expert parallelism"): hashed only when > 1, so the hashes
  // of every scenario without it stay what they were.
  Key<M> ep = int_key<M>(
      "ep", 1, 1, 4096, [](M & m) -> auto& { return m.ep; },
      "expert-parallel ranks (model.moe): borrowed from dp_shard, which it divides; divides "
      "model.moe.experts");
  ep.hash_if = [](const M& m) { return m.ep != 1; };
  k.push_back(ep);
  // Pipeline stages (docs/design.md section 33), the outermost mesh dim: hashed only when > 1,
  // so the hashes of every scenario without stages stay what they were.
  Key<M> pp = int_key<M>(
      "pp", 1, 1, 4096, [](M & m) -> auto& { return m.pp; },
      "pipeline stages (outermost dim): each runs a contiguous share of model.layers "
      "(model.pp_layers, else as even as possible, earlier stages taking the extra layers); at "
      "most model.layers");
  pp.hash_if = [](const M& m) { return m.pp != 1; };
  k.push_back(pp);
  return k;
}

std::vector<Key<RecipeConfig>> make_recipe_keys() {
  using R = RecipeConfig;
  std::vector<std::string> names;
  for (const engine::RecipeName& r : engine::kRecipeNames) names.emplace_back(r.name);
  std::vector<Key<R>> k;
  k.push_back(enum_key<R>(
      "name", RecipeKind::kBf16, names, [](R & r) -> auto& { return r.kind; }, "the recipe"));
  // TE: MXFP8BlockScaling and Float8BlockScaling default to E4M3 for all tensors, the
  // per-tensor recipes to HYBRID (engine::fp8_format_of).
  Key<R> format = enum_key<R>(
      "fp8_format", Fp8Format::kHybrid, names_of<Fp8Format>(engine::fp8_format_name, 2),
      [](R & r) -> auto& { return *r.fp8_format; },
      "delayed, current, block; mxfp8 allows only e4m3");
  // The engine holds an optional (unset: the recipe's default); the scenario always sets it, and
  // reads the resolved value.
  format.get = [](const R& r) {
    return KeyValue{std::string(engine::fp8_format_name(engine::fp8_format_of(r)))};
  };
  format.set = [](R& r, const KeyValue& v) {
    r.fp8_format = std::get<std::string>(v) == "e4m3" ? Fp8Format::kE4M3 : Fp8Format::kHybrid;
  };
  format.default_text = "e4m3 for mxfp8 and block, else hybrid";
  format.default_of = [](const R& r) {
    return KeyValue{
        std::string(engine::fp8_format_name(engine::fp8_format_of(defaults_of(r.kind))))};
  };
  k.push_back(format);
  k.push_back(int_key<R>(
      "margin", 0, 0, 64, [](R & r) -> auto& { return r.margin; },
      "delayed: scale = (fp8_max / amax) / 2^margin"));
  k.push_back(int_key<R>(
      "amax_history_len", 1024, 1, 1 << 16, [](R & r) -> auto& { return r.amax_history_len; },
      "delayed: amax history window length"));
  k.push_back(enum_key<R>(
      "amax_compute_algo", kernels::AmaxAlgo::kMax,
      names_of<kernels::AmaxAlgo>(kernels::amax_algo_name, 2),
      [](R & r) -> auto& { return r.amax_compute_algo; },
      "delayed: max of the history or its newest entry"));
  // TE's amax_epsilon (docs/design.md section 15).
  k.push_back(number_key<R>(
      "eps", 0.0, 0.0, 1.0, false, false, [](R & r) -> auto& { return r.eps; },
      "current, block: amax clamped below by eps"));
  // Float8BlockScaling uses power-of-2 scales (docs/design.md section 4); current scaling does not.
  Key<R> pow2 = bool_key<R>(
      "power_2_scale", false, [](R & r) -> auto& { return *r.power_2_scale; },
      "current, block: scales rounded down to a power of two");
  pow2.get = [](const R& r) { return KeyValue{engine::power_2_scale_of(r)}; };  // as fp8_format
  pow2.set = [](R& r, const KeyValue& v) { r.power_2_scale = std::get<bool>(v); };
  pow2.default_text = "true for block, else false";
  pow2.default_of = [](const R& r) {
    return KeyValue{engine::power_2_scale_of(defaults_of(r.kind))};
  };
  k.push_back(pow2);
  return k;
}

std::string text_of(const KeyValue& v) {
  return std::visit(
      [](const auto& x) -> std::string {
        using X = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<X, bool>) {
          return x ? "true" : "false";
        } else if constexpr (std::is_same_v<X, std::string>) {
          return x.empty() ? "\"\"" : x;
        } else {
          return fmt::format("{}", x);
        }
      },
      v);
}

template <class T>
void add_docs(std::vector<KeyDoc>& out, const std::vector<Key<T>>& keys,
              const std::string& prefix) {
  for (const Key<T>& k : keys) {
    out.push_back(
        {prefix + k.path, k.type, k.default_text.empty() ? text_of(k.def) : k.default_text});
  }
}

}  // namespace

template <class T>
std::string Key<T>::name() const {
  const size_t dot = path.rfind('.');
  return dot == std::string::npos ? path : path.substr(dot + 1);
}

template <class T>
std::string Key<T>::section() const {
  const size_t dot = path.rfind('.');
  return dot == std::string::npos ? std::string() : path.substr(0, dot);
}

const std::vector<Key<Scenario>>& scenario_keys() {
  static const std::vector<Key<Scenario>> keys = make_scenario_keys();
  return keys;
}

const std::vector<Key<MeshSpec>>& mesh_keys() {
  static const std::vector<Key<MeshSpec>> keys = make_mesh_keys();
  return keys;
}

const std::vector<Key<RecipeConfig>>& recipe_keys() {
  static const std::vector<Key<RecipeConfig>> keys = make_recipe_keys();
  return keys;
}

template <class T>
const Key<T>& key_at(const std::vector<Key<T>>& keys, std::string_view path) {
  for (const Key<T>& k : keys) {
    if (k.path == path) return k;
  }
  MP_FAIL("the scenario key table has no key {}", path);
}

template <class T>
std::vector<std::string> section_keys(const std::vector<Key<T>>& keys, std::string_view section) {
  std::vector<std::string> names;
  for (const Key<T>& k : keys) {
    if (k.section() == section) names.push_back(k.name());
  }
  return names;
}

template <class T>
KeyValue read_key(yaml::Section& s, const Key<T>& k, const T& target) {
  const KeyValue def = k.default_of ? k.default_of(target) : k.def;
  const std::string name = k.name();
  switch (k.type) {
    case KeyType::kInt:
      return s.integer(name, std::get<int64_t>(def), k.imin,
                       k.imax_of ? k.imax_of(target) : k.imax);
    case KeyType::kNumber:
      return s.number(name, std::get<double>(def), k.dmin, k.dmax_of ? k.dmax_of(target) : k.dmax,
                      k.min_open, k.max_open);
    case KeyType::kBool:
      return s.boolean(name, std::get<bool>(def));
    case KeyType::kEnum: {
      const auto it = std::find(k.choices.begin(), k.choices.end(), std::get<std::string>(def));
      const size_t i = s.choice(name, static_cast<size_t>(it - k.choices.begin()), k.choices);
      return k.choices.at(i);
    }
    case KeyType::kString:
      return s.string(name, std::get<std::string>(def));
    default:
      break;
  }
  MP_FAIL("key {} is read by the loader's own code, not by read_key", k.path);
}

template <class T>
void read_keys(yaml::Section& s, const std::vector<Key<T>>& keys, std::string_view section,
               T& target) {
  for (const Key<T>& k : keys) {
    if (k.section() != section || !k.set) continue;
    k.set(target, read_key(s, k, target));
  }
}

template <class T>
nlohmann::json keys_json(const std::vector<Key<T>>& keys, std::string_view section,
                         const T& target) {
  nlohmann::json j = nlohmann::json::object();
  for (const Key<T>& k : keys) {
    if (k.section() != section || !k.hashed || !k.get) continue;
    if (k.hash_if && !k.hash_if(target)) continue;
    std::visit([&](const auto& v) { j[k.name()] = v; }, k.get(target));
  }
  return j;
}

#define MESHPROOF_KEY_TEMPLATES(T)                                                              \
  template struct Key<T>;                                                                       \
  template const Key<T>& key_at(const std::vector<Key<T>>&, std::string_view);                  \
  template std::vector<std::string> section_keys(const std::vector<Key<T>>&, std::string_view); \
  template KeyValue read_key(yaml::Section&, const Key<T>&, const T&);                          \
  template void read_keys(yaml::Section&, const std::vector<Key<T>>&, std::string_view, T&);    \
  template nlohmann::json keys_json(const std::vector<Key<T>>&, std::string_view, const T&);
MESHPROOF_KEY_TEMPLATES(Scenario)
MESHPROOF_KEY_TEMPLATES(MeshSpec)
MESHPROOF_KEY_TEMPLATES(RecipeConfig)
#undef MESHPROOF_KEY_TEMPLATES

Scenario::Scenario() {
  // Every key with a field at its default, in table order (so that model.ffn = 4 x hidden sees
  // the hidden default).
  for (const Key<Scenario>& k : scenario_keys()) {
    if (k.set) k.set(*this, k.default_of ? k.default_of(*this) : k.def);
  }
  recipe = default_recipe(RecipeKind::kBf16);
}

engine::RecipeConfig default_recipe(RecipeKind name) {
  engine::RecipeConfig r;
  r.kind = name;
  for (const Key<RecipeConfig>& k : recipe_keys()) {
    if (k.path != "name" && k.set) k.set(r, k.default_of ? k.default_of(r) : k.def);
  }
  return r;
}

std::vector<KeyDoc> documented_keys() {
  std::vector<KeyDoc> out;
  add_docs(out, scenario_keys(), "");
  add_docs(out, mesh_keys(), "mesh.");
  add_docs(out, recipe_keys(), "recipe.");
  return out;
}

}  // namespace meshproof::harness
