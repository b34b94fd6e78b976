// The scenario key table (docs/design.md section 18): every key a scenario file may write at the
// top level and in the model (with model.moe and the llama3_debug preset's defaults), fsdp, train,
// data, checkpoint and checks sections, in the order messages and docs/scenarios.md list them,
// each with its type, default, range, documentation and the Scenario field it sets; and
// scenario_keys(), the table built once. Long by nature: one entry per documented key, about 80.
// The mesh and recipe keys are mesh_recipe_keys.cc's; reading, defaults, canonical form and the
// docs list are scenario_keys.cc's.
#include <fmt/format.h>

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/config/config.h"
#include "harness/scenario/scenario.h"
#include "harness/scenario/scenario_keys.h"
#include "harness/scenario/scenario_keys_internal.h"

namespace meshproof::harness {

namespace {

using keys_internal::bool_key;
using keys_internal::enum_key;
using keys_internal::int_key;
using keys_internal::names_of;
using keys_internal::number_key;
using keys_internal::own_key;
using keys_internal::string_key;

constexpr int64_t kMaxDim = int64_t{1} << 20;
constexpr int64_t kMaxInt = std::numeric_limits<int64_t>::max();

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

}  // namespace

const std::vector<Key<Scenario>>& scenario_keys() {
  static const std::vector<Key<Scenario>> keys = make_scenario_keys();
  return keys;
}

}  // namespace meshproof::harness
