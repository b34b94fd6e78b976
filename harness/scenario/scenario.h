// The resolved scenario configuration (docs/design.md sections 7 and 18): plain data, every field
// filled in (defaults applied, matrix expanded, --set overrides applied, validated). The loader
// that builds it is harness/scenario/scenario_loader.h; harness/scenario/scenario_keys.h is the
// table of its keys (type, default, range), which docs/scenarios.md lists (a test keeps the two
// equal).
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/config/config.h"
#include "engine/config/mesh_spec.h"
#include "engine/session/session.h"
#include "kernels/quantize/quantize.h"

namespace meshproof::harness {

// The engine's own enums and configuration types where the scenario names the same thing (one
// definition, no mapping; docs/design.md section 18).
using Norm = engine::NormKind;
using Activation = engine::Activation;
using RecipeKind = engine::RecipeKind;
using Fp8Format = engine::Fp8Format;  // hybrid: e4m3 forward, e5m2 gradients; e4m3: all e4m3
using Schedule = engine::LrSchedule;

// The harness's own enums; each name table is the one the loader, to_string and reports use.
enum class Backend : uint8_t { kCpu, kCuda, kAuto };
inline constexpr std::string_view kBackendNames[] = {"cpu", "cuda", "auto"};
enum class Launcher : uint8_t { kLocal, kMpi };
inline constexpr std::string_view kLauncherNames[] = {"local", "mpi"};
// model.preset (docs/design.md section 24): the defaults of the model keys. gpt_small is the
// GPT-2-like model of the key table; llama3_debug the size of torchtitan's llama3 debug model.
enum class ModelPreset : uint8_t { kGptSmall, kLlama3Debug };
inline constexpr std::string_view kModelPresetNames[] = {"gpt_small", "llama3_debug"};

struct CheckpointConfig {
  std::string dir;        // empty: <out>/<scenario>/checkpoints
  int64_t every = 0;      // save every N steps; 0: only where a check needs a checkpoint
  int64_t keep_last = 2;  // checkpoints kept on disk, >= 1
};

enum class GoldenMode : uint8_t { kExact, kTolerance };
inline constexpr std::string_view kGoldenModeNames[] = {"exact", "tolerance"};
enum class Metric : uint8_t { kLoss, kGradNorm };
inline constexpr std::string_view kMetricNames[] = {"loss", "grad_norm"};

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
  int64_t at_step = 0;  // save after this step; in [1, steps - 1]; default steps / 2
  std::optional<engine::MeshSpec> mesh;  // resume on another mesh (within rtol); else bitwise
  double rtol = 0.0;                     // cross-mesh only; 0 when resuming on the same mesh
};

struct ReferenceCheck {
  bool enabled = false;
  // At least one override is set when enabled, and together they differ from the scenario.
  std::optional<engine::MeshSpec> mesh;
  std::optional<engine::RecipeConfig> recipe;
  // The scenario's fsdp options with the keys checks.reference.fsdp names replaced.
  std::optional<engine::FsdpOptions> fsdp;
  std::optional<int64_t> micro_batches;  // checks.reference.train.micro_batches
  // checks.reference.checkpoint: the reference run writes periodic checkpoints every `every`
  // steps (keeping keep_last) into a folder of its own (docs/design.md section 29).
  std::optional<CheckpointConfig> checkpoint;
  std::map<Metric, double> rtol;  // per metric; loss always present when enabled
};

// checks.state (docs/design.md section 22): save after at_step on the scenario's mesh, load into
// a fresh engine on `mesh` (the scenario's by default), save again at once; both checkpoints
// reassembled to global tensors must be bitwise equal key by key.
struct StateCheck {
  bool enabled = false;
  int64_t at_step = 0;                   // save after this step; in [1, steps]; default steps / 2
  std::optional<engine::MeshSpec> mesh;  // load on this mesh; unset: the scenario's
};

struct ChecksConfig {
  GoldenCheck golden;
  ResumeCheck resume;
  ReferenceCheck reference;
  bool allgather_parity = false;  // needs fsdp.fp8_all_gather
  bool determinism = false;
  StateCheck state;
  // The communication budget (docs/design.md section 29): every step's recorded parameter
  // collectives equal the sharding plan's.
  bool collectives = false;
  // The enabled checks in run order: harness/checks/check_table.h enabled_checks().
};

// One injected fault, params resolved against the catalog (harness/faults/scenario_faults.h).
struct FaultSpec {
  std::string name;
  std::map<std::string, int64_t> int_params;
  std::map<std::string, std::string> string_params;
  std::map<std::string, double> double_params;  // kDouble parameters (generic faults)
};

enum class Expect : uint8_t { kPass, kCaught };
inline constexpr std::string_view kExpectNames[] = {"pass", "caught"};

// One scenario: the engine's own configuration objects (what engine::RunOptions holds, so that
// engine_run_options in harness/run/train_run.h assembles them without mapping a field) and the
// harness's own fields. `Scenario()` holds every key at its documented default (the key table,
// harness/scenario/scenario_keys.h), which differ from the engine's defaults (a bigger model,
// bf16).
struct Scenario {
  Scenario();

  std::string name;       // expanded name: base[key=label,...] for matrix entries
  std::string base_name;  // the `name` key as written (or the file stem)
  std::vector<std::pair<std::string, std::string>> matrix_labels;  // (matrix key, label)
  std::string source;       // the file the scenario came from (as given)
  std::string name_where;   // "FILE:LINE:COL" of the `name` value (FILE:1:1 for the file stem)
  std::string description;  // free text; not part of the canonical form
  // Scenario key -> engine field where the names differ: model.seq_len -> train.seq_len (and
  // model.max_positions, which is always seq_len), train.global_batch -> train.batch, data.order ->
  // data.markov_order, recipe.name -> recipe.kind, train.seed -> seed.
  engine::ModelConfig model;
  ModelPreset model_preset = ModelPreset::kGptSmall;  // model.preset: the model keys' defaults
  engine::MeshSpec mesh;
  engine::RecipeConfig recipe;  // fp8_format and power_2_scale always set (default_recipe)
  engine::FsdpOptions fsdp;
  engine::TrainingConfig train;
  engine::DataConfig data;
  uint64_t seed = 1234;  // train.seed: Philox key of init and dropout (engine::Config::seed)
  Backend backend = Backend::kAuto;
  Launcher launcher = Launcher::kLocal;
  bool requires_gpu = false;
  CheckpointConfig checkpoint;
  ChecksConfig checks;
  std::vector<FaultSpec> faults;
  Expect expect = Expect::kPass;

  // The engine's Config of this scenario (model, recipe, training, data, seed).
  engine::Config config() const { return {model, recipe, train, data, seed}; }
};

// Names from the one table of each enum (engine/config/config.h, kernels/quantize/quantize.h,
// above).
const char* to_string(Norm v);
const char* to_string(Activation v);
const char* to_string(RecipeKind v);
const char* to_string(Fp8Format v);
const char* to_string(kernels::AmaxAlgo v);
const char* to_string(Schedule v);
const char* to_string(Backend v);
const char* to_string(Launcher v);
const char* to_string(GoldenMode v);
const char* to_string(Metric v);
const char* to_string(Expect v);

// The recipe keys at their defaults for recipe `name`, with the defaults that depend on the name
// (fp8_format, power_2_scale) resolved (harness/scenario/scenario_keys.h).
engine::RecipeConfig default_recipe(RecipeKind name);

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
// The mesh as reports name it, "pp=2 dp_replicate=1 dp_shard=2 tp=1 sp ep=2" (pp, sp and ep
// only when used); describe_mesh adds the rank count.
std::string mesh_text(const engine::MeshSpec& m);
std::string describe_mesh(const engine::MeshSpec& m);
// The scenario run on another mesh `m` (a check's: checks.resume.mesh, checks.state.mesh,
// checks.reference.mesh). model.pp_layers splits the layers over the scenario's own mesh.pp
// stages: on a mesh with another pp the run takes the even split (docs/design.md section 33).
Scenario on_mesh(const Scenario& s, const engine::MeshSpec& m);

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
