// The resolved scenario configuration (docs/design.md section 7): plain data, every field filled in
// (defaults applied, matrix expanded, --set overrides applied, validated). The loader that builds
// it is harness/scenario_loader.h; docs/scenarios.md documents every key, type and default.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/config.h"

namespace meshproof::harness {

// The engine's own enums where the scenario names the same thing (one definition, no mapping).
using Norm = engine::NormKind;
using Activation = engine::Activation;

// The GPT-style decoder of docs/design.md section 3.
struct ModelConfig {
  int64_t vocab = 256;           // V: vocabulary size, >= 2
  int64_t hidden = 64;           // H: model width, divisible by heads
  int64_t heads = 4;             // A: attention heads, divisible by mesh.tp
  int64_t layers = 2;            // L: transformer layers, >= 1
  int64_t ffn = 256;             // F: MLP width (per branch for SwiGLU), divisible by mesh.tp
  int64_t seq_len = 32;          // S: tokens per sequence, >= 1
  Norm norm = Norm::kLayerNorm;  // layernorm (with bias) or rmsnorm (no bias); eps 1e-5
  Activation activation = Activation::kGelu;  // gelu (tanh approximation), relu or swiglu
  bool tied_embeddings = false;               // lm_head reuses embed.tok
  double dropout = 0.0;                       // dropout probability in [0, 1)
};

// Mesh dims in docs/design.md section 5 order; tp varies fastest in the rank numbering.
struct MeshConfig {
  int64_t dp_replicate = 1;        // HSDP replicas (all-reduce of gradients)
  int64_t dp_shard = 1;            // FSDP shards (all-gather weights, reduce-scatter gradients)
  int64_t tp = 1;                  // tensor-parallel ranks
  bool sequence_parallel = false;  // norms on sequence shards; needs seq_len % tp == 0

  int64_t world_size() const { return dp_replicate * dp_shard * tp; }
  int64_t dp() const { return dp_replicate * dp_shard; }
  bool operator==(const MeshConfig&) const = default;
};

using RecipeKind = engine::RecipeKind;
using Fp8Format = engine::Fp8Format;  // hybrid: e4m3 forward, e5m2 gradients; e4m3: all e4m3
enum class AmaxAlgo { kMax, kMostRecent };

// docs/design.md section 4. Options that a recipe does not use are kept (and hashed) but ignored.
struct RecipeConfig {
  RecipeKind name = RecipeKind::kBf16;
  Fp8Format fp8_format = Fp8Format::kHybrid;    // default e4m3 for mxfp8/block, else hybrid
  int64_t margin = 0;                           // delayed: scale = (fp8_max/amax) / 2^margin
  int64_t amax_history_len = 1024;              // delayed: amax history window length
  AmaxAlgo amax_compute_algo = AmaxAlgo::kMax;  // delayed: max of history or newest entry
  double eps = 0.0;                             // current/block: fp8_max / max(amax, eps)
  bool power_2_scale = false;                   // current/block: round scales to powers of 2
                                                // (default true for block, false otherwise)

  // True for the recipes that quantize GEMM inputs (delayed, current, mxfp8, block).
  bool is_fp8() const { return name != RecipeKind::kFp32 && name != RecipeKind::kBf16; }
  bool operator==(const RecipeConfig&) const = default;
};

struct FsdpConfig {
  bool reshard_after_forward = true;   // free gathered weights after forward, gather again
  bool fp8_all_gather = false;         // gather quantized shards (FP8 recipes only)
  bool fp8_params = false;             // FP8 primary weights (FP8 recipes only)
  bool sync_each_micro_batch = false;  // reduce gradients after every micro-batch (not deferred)
};

using Schedule = engine::LrSchedule;

struct TrainConfig {
  int64_t steps = 8;          // optimizer steps, >= 1
  int64_t global_batch = 8;   // sequences per step over all dp ranks
  int64_t micro_batches = 1;  // gradient-accumulation micro-batches per step
  double lr = 1e-3;           // peak learning rate, > 0
  Schedule schedule = Schedule::kConstant;
  int64_t warmup_steps = 0;   // warmup_cosine: linear warmup length, <= steps
  double min_lr = 0.0;        // warmup_cosine: final learning rate, <= lr
  double weight_decay = 0.0;  // AdamW decoupled decay on tensors with ndim >= 2
  double beta1 = 0.9;         // AdamW betas, in [0, 1)
  double beta2 = 0.999;
  double adam_eps = 1e-8;      // > 0
  double max_grad_norm = 1.0;  // global-norm clipping; 0 disables clipping
  bool recompute = false;      // activation recompute in backward
  uint64_t seed = 1234;        // Philox key for init and dropout

  // Sequences per data-parallel rank and micro-batch.
  int64_t micro_batch_rows(const MeshConfig& mesh) const {
    return global_batch / (mesh.dp() * micro_batches);
  }
};

enum class DataKind { kMarkov };

struct DataConfig {
  DataKind kind = DataKind::kMarkov;  // seeded order-k Markov chain over the vocabulary
  int64_t order = 1;                  // k in [0, 4]; vocab^(k+1) <= 2^24 transition entries
  uint64_t seed = 42;
};

enum class Backend { kCpu, kCuda, kAuto };
enum class Launcher { kLocal, kMpi };

struct CheckpointConfig {
  std::string dir;        // empty: <out>/<scenario>/checkpoints
  int64_t every = 0;      // save every N steps; 0: only where a check needs a checkpoint
  int64_t keep_last = 2;  // checkpoints kept on disk, >= 1
};

enum class GoldenMode { kExact, kTolerance };
enum class Metric { kLoss, kGradNorm };

struct GoldenCheck {
  bool enabled = false;
  GoldenMode mode = GoldenMode::kExact;
  std::vector<Metric> metrics = {Metric::kLoss, Metric::kGradNorm};
  double rtol = 0.0;                  // tolerance mode only; 0 in exact mode
  double atol = 0.0;                  // tolerance mode only
  int64_t allowed_failing_steps = 0;  // tolerance mode only
};

struct ResumeCheck {
  bool enabled = false;
  int64_t at_step = 0;             // save after this step; in [1, steps - 1]; default steps / 2
  std::optional<MeshConfig> mesh;  // resume on another mesh (within rtol); else bitwise
  double rtol = 0.0;               // cross-mesh only; 0 when resuming on the same mesh
};

struct ReferenceCheck {
  bool enabled = false;
  std::optional<MeshConfig> mesh;  // at least one of mesh / recipe is set when enabled
  std::optional<RecipeConfig> recipe;
  std::map<Metric, double> rtol;  // per metric; loss always present when enabled
};

struct ChecksConfig {
  GoldenCheck golden;
  ResumeCheck resume;
  ReferenceCheck reference;
  bool allgather_parity = false;  // needs fsdp.fp8_all_gather
  bool determinism = false;
  // The enabled checks in run order: harness/check_table.h enabled_checks().
};

// One injected fault, params resolved against the catalog (harness/scenario_faults.h).
struct FaultSpec {
  std::string name;
  std::map<std::string, int64_t> int_params;
  std::map<std::string, std::string> string_params;
};

enum class Expect { kPass, kCaught };

struct Scenario {
  std::string name;       // expanded name: base[key=label,...] for matrix entries
  std::string base_name;  // the `name` key as written (or the file stem)
  std::vector<std::pair<std::string, std::string>> matrix_labels;  // (matrix key, label)
  std::string source;       // the file the scenario came from (as given)
  std::string name_where;   // "FILE:LINE:COL" of the `name` value (FILE:1:1 for the file stem)
  std::string description;  // free text; not part of the canonical form
  ModelConfig model;
  MeshConfig mesh;
  RecipeConfig recipe;
  FsdpConfig fsdp;
  TrainConfig train;
  DataConfig data;
  Backend backend = Backend::kAuto;
  Launcher launcher = Launcher::kLocal;
  bool requires_gpu = false;
  CheckpointConfig checkpoint;
  ChecksConfig checks;
  std::vector<FaultSpec> faults;
  Expect expect = Expect::kPass;
};

const char* to_string(Norm v);
const char* to_string(Activation v);
const char* to_string(RecipeKind v);
const char* to_string(Fp8Format v);
const char* to_string(AmaxAlgo v);
const char* to_string(Schedule v);
const char* to_string(DataKind v);
const char* to_string(Backend v);
const char* to_string(Launcher v);
const char* to_string(GoldenMode v);
const char* to_string(Metric v);
const char* to_string(Expect v);

// Recipe defaults that depend on the recipe name (fp8_format, power_2_scale).
RecipeConfig default_recipe(RecipeKind name);

// The canonical form: every resolved field except `description` (commentary), keys sorted,
// numbers in shortest round-trip form. Equal configurations give equal text whatever the key
// order or which defaults were spelled out in the YAML.
nlohmann::json to_canonical_json(const Scenario& s);
std::string canonical_text(const Scenario& s);
// xxhash64 (seed 0) of canonical_text: the scenario's provenance hash for goldens/checkpoints.
uint64_t scenario_hash(const Scenario& s);
std::string scenario_hash_hex(const Scenario& s);  // 16 lowercase hex digits
// "mesh dp_replicate=2 dp_shard=2 tp=2 (8 ranks) | recipe mxfp8 | steps 8 | checks golden,resume"
std::string summary_line(const Scenario& s);
std::string describe_mesh(const MeshConfig& m);

// Scenario names key golden folders, checkpoint folders and reports (docs/design.md section 11): a
// name is 1 to kMaxNameBytes bytes of [A-Za-z0-9_.+-] and not "." or "..". Returns "" for a
// valid name, else what is wrong (a sentence for a loader message).
constexpr size_t kMaxNameBytes = 255;
std::string name_problem(const std::string& name);

// `root / relative` for a path derived from a scenario name (a golden file, a checkpoint or
// output folder), after checking that it stays inside `root`: `relative` is relative, and each
// of its components is a non-empty name other than "." and "..", at most kMaxNameBytes long.
// Throws kInput naming the derived path otherwise: a name that escapes its root must never
// reach the file system (golden update, run --out write and remove_all under these paths).
std::filesystem::path path_inside(const std::filesystem::path& root,
                                  const std::filesystem::path& relative);

}  // namespace meshproof::harness
