#include "harness/scenario.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <xxhash.h>

#include "harness/check_table.h"
#include "kernels/error.h"

namespace meshproof::harness {

const char* to_string(Norm v) { return v == Norm::kLayerNorm ? "layernorm" : "rmsnorm"; }
const char* to_string(Activation v) {
  switch (v) {
    case Activation::kGelu:
      return "gelu";
    case Activation::kRelu:
      return "relu";
    case Activation::kSwiGlu:
      return "swiglu";
  }
  return "?";
}
const char* to_string(RecipeKind v) {
  switch (v) {
    case RecipeKind::kFp32:
      return "fp32";
    case RecipeKind::kBf16:
      return "bf16";
    case RecipeKind::kDelayed:
      return "delayed";
    case RecipeKind::kCurrent:
      return "current";
    case RecipeKind::kMxfp8:
      return "mxfp8";
    case RecipeKind::kBlock:
      return "block";
  }
  return "?";
}
const char* to_string(Fp8Format v) { return v == Fp8Format::kHybrid ? "hybrid" : "e4m3"; }
const char* to_string(AmaxAlgo v) { return v == AmaxAlgo::kMax ? "max" : "most_recent"; }
const char* to_string(Schedule v) {
  return v == Schedule::kConstant ? "constant" : "warmup_cosine";
}
const char* to_string(DataKind) { return "markov"; }
const char* to_string(Backend v) {
  switch (v) {
    case Backend::kCpu:
      return "cpu";
    case Backend::kCuda:
      return "cuda";
    case Backend::kAuto:
      return "auto";
  }
  return "?";
}
const char* to_string(Launcher v) { return v == Launcher::kLocal ? "local" : "mpi"; }
const char* to_string(GoldenMode v) { return v == GoldenMode::kExact ? "exact" : "tolerance"; }
const char* to_string(Metric v) { return v == Metric::kLoss ? "loss" : "grad_norm"; }
const char* to_string(Expect v) { return v == Expect::kPass ? "pass" : "caught"; }

RecipeConfig default_recipe(RecipeKind name) {
  RecipeConfig r;
  r.name = name;
  // TE: MXFP8BlockScaling and Float8BlockScaling default to E4M3 for all tensors, the per-tensor
  // recipes to HYBRID (engine::fp8_format_of).
  r.fp8_format = name == RecipeKind::kMxfp8 || name == RecipeKind::kBlock ? Fp8Format::kE4M3
                                                                          : Fp8Format::kHybrid;
  // Float8BlockScaling uses power-of-2 scales (docs/design.md section 4); current scaling does not.
  r.power_2_scale = name == RecipeKind::kBlock;
  return r;
}

namespace {

using nlohmann::json;

json mesh_json(const MeshConfig& m) {
  return {{"dp_replicate", m.dp_replicate},
          {"dp_shard", m.dp_shard},
          {"tp", m.tp},
          {"sequence_parallel", m.sequence_parallel}};
}

json recipe_json(const RecipeConfig& r) {
  return {{"name", to_string(r.name)},
          {"fp8_format", to_string(r.fp8_format)},
          {"margin", r.margin},
          {"amax_history_len", r.amax_history_len},
          {"amax_compute_algo", to_string(r.amax_compute_algo)},
          {"eps", r.eps},
          {"power_2_scale", r.power_2_scale}};
}

}  // namespace

json to_canonical_json(const Scenario& s) {
  // nlohmann::json objects are std::map-backed: keys come out sorted, so the text does not
  // depend on the order fields are inserted here or written in the YAML.
  json j;
  j["name"] = s.name;
  j["model"] = {{"vocab", s.model.vocab},
                {"hidden", s.model.hidden},
                {"heads", s.model.heads},
                {"layers", s.model.layers},
                {"ffn", s.model.ffn},
                {"seq_len", s.model.seq_len},
                {"norm", to_string(s.model.norm)},
                {"activation", to_string(s.model.activation)},
                {"tied_embeddings", s.model.tied_embeddings},
                {"dropout", s.model.dropout}};
  j["mesh"] = mesh_json(s.mesh);
  j["recipe"] = recipe_json(s.recipe);
  j["fsdp"] = {{"reshard_after_forward", s.fsdp.reshard_after_forward},
               {"fp8_all_gather", s.fsdp.fp8_all_gather},
               {"fp8_params", s.fsdp.fp8_params}};
  // Written only when set, so that the hashes of scenarios that leave it at its default (every
  // golden and checkpoint made before the key existed) stay what they were.
  if (s.fsdp.sync_each_micro_batch) j["fsdp"]["sync_each_micro_batch"] = true;
  const TrainConfig& t = s.train;
  j["train"] = {{"steps", t.steps},
                {"global_batch", t.global_batch},
                {"micro_batches", t.micro_batches},
                {"lr", t.lr},
                {"schedule", to_string(t.schedule)},
                {"warmup_steps", t.warmup_steps},
                {"min_lr", t.min_lr},
                {"weight_decay", t.weight_decay},
                {"beta1", t.beta1},
                {"beta2", t.beta2},
                {"adam_eps", t.adam_eps},
                {"max_grad_norm", t.max_grad_norm},
                {"recompute", t.recompute},
                {"seed", t.seed}};
  j["data"] = {{"kind", to_string(s.data.kind)}, {"order", s.data.order}, {"seed", s.data.seed}};
  j["backend"] = to_string(s.backend);
  j["launcher"] = to_string(s.launcher);
  j["requires_gpu"] = s.requires_gpu;
  j["checkpoint"] = {{"dir", s.checkpoint.dir},
                     {"every", s.checkpoint.every},
                     {"keep_last", s.checkpoint.keep_last}};
  json checks = json::object();
  const GoldenCheck& g = s.checks.golden;
  if (g.enabled) {
    json metrics = json::array();
    for (Metric m : g.metrics) metrics.push_back(to_string(m));
    checks["golden"] = {{"mode", to_string(g.mode)},
                        {"metrics", metrics},
                        {"rtol", g.rtol},
                        {"atol", g.atol},
                        {"allowed_failing_steps", g.allowed_failing_steps}};
  }
  const ResumeCheck& r = s.checks.resume;
  if (r.enabled) {
    checks["resume"] = {{"at_step", r.at_step}, {"rtol", r.rtol}};
    if (r.mesh) checks["resume"]["mesh"] = mesh_json(*r.mesh);
  }
  const ReferenceCheck& ref = s.checks.reference;
  if (ref.enabled) {
    json rtol = json::object();
    for (const auto& [metric, value] : ref.rtol) rtol[to_string(metric)] = value;
    checks["reference"] = {{"rtol", rtol}};
    if (ref.mesh) checks["reference"]["mesh"] = mesh_json(*ref.mesh);
    if (ref.recipe) checks["reference"]["recipe"] = recipe_json(*ref.recipe);
  }
  checks["allgather_parity"] = s.checks.allgather_parity;
  checks["determinism"] = s.checks.determinism;
  j["checks"] = checks;
  json faults = json::array();  // order is meaningful (injection order): kept as written
  for (const FaultSpec& f : s.faults) {
    json params = json::object();
    for (const auto& [k, v] : f.int_params) params[k] = v;
    for (const auto& [k, v] : f.string_params) params[k] = v;
    faults.push_back({{"name", f.name}, {"params", params}});
  }
  j["faults"] = faults;
  j["expect"] = to_string(s.expect);
  return j;
}

std::string canonical_text(const Scenario& s) { return to_canonical_json(s).dump(); }

uint64_t scenario_hash(const Scenario& s) {
  const std::string text = canonical_text(s);
  return XXH64(text.data(), text.size(), 0);
}

std::string scenario_hash_hex(const Scenario& s) {
  return fmt::format("{:016x}", scenario_hash(s));
}

std::string describe_mesh(const MeshConfig& m) {
  return fmt::format("dp_replicate={} dp_shard={} tp={}{} ({} rank{})", m.dp_replicate, m.dp_shard,
                     m.tp, m.sequence_parallel ? " sp" : "", m.world_size(),
                     m.world_size() == 1 ? "" : "s");
}

std::string name_problem(const std::string& name) {
  if (name.empty()) {
    return "'' must be non-empty and use only letters, digits, '_', '.', '+' and '-' (it names "
           "golden files)";
  }
  if (name.size() > kMaxNameBytes) {
    return fmt::format("is {} bytes long, more than {} (it names golden and checkpoint folders)",
                       name.size(), kMaxNameBytes);
  }
  for (char c : name) {
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') ||
                    c == '_' || c == '.' || c == '+' || c == '-';
    if (!ok) {
      return fmt::format(
          "'{}' must be non-empty and use only letters, digits, '_', '.', '+' and '-' (it names "
          "golden files)",
          name);
    }
  }
  if (name == "." || name == "..") {
    return fmt::format(
        "'{}' names a folder's self or parent; golden and checkpoint folders are "
        "named after the scenario",
        name);
  }
  return "";
}

std::filesystem::path path_inside(const std::filesystem::path& root,
                                  const std::filesystem::path& relative) {
  MP_CHECK_INPUT(!relative.empty() && relative.is_relative() && !relative.has_root_name() &&
                     !relative.has_root_directory(),
                 "the path '{}' derived from a scenario name is not relative to {}",
                 relative.string(), root.string());
  for (const std::filesystem::path& part : relative) {
    const std::string p = part.string();
    MP_CHECK_INPUT(!p.empty() && p != "." && p != ".." && p.size() <= kMaxNameBytes,
                   "the path '{}' derived from a scenario name leaves {} or has an unusable "
                   "component '{}' (empty, '.', '..' or over {} bytes)",
                   relative.string(), root.string(), p, kMaxNameBytes);
  }
  return root / relative;
}

std::string summary_line(const Scenario& s) {
  std::string recipe = to_string(s.recipe.name);
  if (s.fsdp.fp8_all_gather) recipe += " +fp8_all_gather";
  if (s.fsdp.fp8_params) recipe += " +fp8_params";
  if (s.fsdp.sync_each_micro_batch) recipe += " +sync_each_micro_batch";
  const std::vector<std::string> checks = enabled_checks(s);
  std::string line = fmt::format(
      "mesh {} | recipe {} | steps {} | checks {}", describe_mesh(s.mesh), recipe, s.train.steps,
      checks.empty() ? std::string("none") : fmt::format("{}", fmt::join(checks, ",")));
  if (!s.faults.empty()) {
    std::vector<std::string> names;
    for (const FaultSpec& f : s.faults) names.push_back(f.name);
    line += fmt::format(" | faults {} | expect {}", fmt::join(names, ","), to_string(s.expect));
  }
  return line;
}

}  // namespace meshproof::harness
