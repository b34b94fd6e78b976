#include "harness/scenario/scenario.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <xxhash.h>

#include "harness/checks/check_table.h"
#include "harness/scenario/scenario_keys.h"
#include "kernels/core/error.h"

namespace meshproof::harness {

const char* to_string(Norm v) { return engine::norm_name(v).data(); }
const char* to_string(Activation v) { return engine::activation_name(v).data(); }
const char* to_string(RecipeKind v) { return engine::recipe_name(v).data(); }
const char* to_string(Fp8Format v) { return engine::fp8_format_name(v).data(); }
const char* to_string(kernels::AmaxAlgo v) { return kernels::amax_algo_name(v).data(); }
const char* to_string(Schedule v) { return engine::schedule_name(v).data(); }
const char* to_string(Backend v) { return kBackendNames[static_cast<size_t>(v)].data(); }
const char* to_string(Launcher v) { return kLauncherNames[static_cast<size_t>(v)].data(); }
const char* to_string(GoldenMode v) { return kGoldenModeNames[static_cast<size_t>(v)].data(); }
const char* to_string(Metric v) { return kMetricNames[static_cast<size_t>(v)].data(); }
const char* to_string(Expect v) { return kExpectNames[static_cast<size_t>(v)].data(); }

namespace {

using nlohmann::json;

json mesh_json(const engine::MeshSpec& m) { return keys_json(mesh_keys(), "", m); }
json recipe_json(const engine::RecipeConfig& r) { return keys_json(recipe_keys(), "", r); }

}  // namespace

json to_canonical_json(const Scenario& s) {
  // Every hashed key of the key table (harness/scenario/scenario_keys.h) with its value; the checks
  // and faults below. nlohmann::json objects are std::map-backed: keys come out sorted, so the text
  // does not depend on the order fields are inserted here or written in the YAML.
  json j = keys_json(scenario_keys(), "", s);
  j["name"] = s.name;
  for (const char* section : {"model", "fsdp", "train", "data", "checkpoint"}) {
    j[section] = keys_json(scenario_keys(), section, s);
  }
  // MoE keys only with MoE on (docs/design.md section 27): dense canonical texts are unchanged.
  if (s.model.moe.enabled()) j["model"]["moe"] = keys_json(scenario_keys(), "model.moe", s);
  // An explicit pipeline split only when set (docs/design.md section 33): every other canonical
  // text is unchanged.
  if (!s.model.pp_layers.empty()) j["model"]["pp_layers"] = s.model.pp_layers;
  j["mesh"] = mesh_json(s.mesh);
  j["recipe"] = recipe_json(s.recipe);
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
    // The later overrides appear only when set (older scenarios keep their hash).
    if (ref.fsdp) {
      Scenario with = s;
      with.fsdp = *ref.fsdp;
      checks["reference"]["fsdp"] = keys_json(scenario_keys(), "fsdp", with);
    }
    if (ref.micro_batches) checks["reference"]["train"] = {{"micro_batches", *ref.micro_batches}};
    if (ref.checkpoint)
      checks["reference"]["checkpoint"] = {{"every", ref.checkpoint->every},
                                           {"keep_last", ref.checkpoint->keep_last}};
  }
  checks["allgather_parity"] = s.checks.allgather_parity;
  checks["determinism"] = s.checks.determinism;
  // The state check (added after the library's goldens were recorded) appears only when
  // enabled, so that a scenario without it keeps its hash.
  const StateCheck& st = s.checks.state;
  if (st.enabled) {
    checks["state"] = {{"at_step", st.at_step}};
    if (st.mesh) checks["state"]["mesh"] = mesh_json(*st.mesh);
  }
  // The collectives check (added after the goldens were recorded): only when enabled.
  if (s.checks.collectives) checks["collectives"] = true;
  j["checks"] = checks;
  json faults = json::array();  // order is meaningful (injection order): kept as written
  for (const FaultSpec& f : s.faults) {
    json params = json::object();
    for (const auto& [k, v] : f.int_params) params[k] = v;
    for (const auto& [k, v] : f.string_params) params[k] = v;
    for (const auto& [k, v] : f.double_params) params[k] = v;  // none in the built-in faults
    faults.push_back({{"name", f.name}, {"params", params}});
  }
  j["faults"] = faults;
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

std::string mesh_text(const engine::MeshSpec& m) {
  return fmt::format("{}dp_replicate={} dp_shard={} tp={}{}{}",
                     m.pp > 1 ? fmt::format("pp={} ", m.pp) : "", m.dp_replicate, m.dp_shard, m.tp,
                     m.sequence_parallel ? " sp" : "", m.ep > 1 ? fmt::format(" ep={}", m.ep) : "");
}

std::string describe_mesh(const engine::MeshSpec& m) {
  return fmt::format("{} ({} rank{})", mesh_text(m), m.world_size(),
                     m.world_size() == 1 ? "" : "s");
}

Scenario on_mesh(const Scenario& s, const engine::MeshSpec& m) {
  Scenario out = s;
  out.mesh = m;
  if (m.pp != s.mesh.pp) out.model.pp_layers.clear();
  return out;
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
  std::string recipe = to_string(s.recipe.kind);
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
