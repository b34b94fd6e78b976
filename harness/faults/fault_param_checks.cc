// The parameter checks of the fault table's generic and collective rows
// (harness/faults/scenario_faults.h, FaultParam::check and FaultDescriptor::check): a glob must
// name a checkpoint key, fp32 state tensor, quantized linear or parameter of the scenario's run, a
// dim list real mesh dims, a collective fault a collective the sharding plan issues; each returns
// "" or why not, which the loader reports at the parameter (exit 2). Declared in
// harness/faults/scenario_faults_internal.h.
#include <fmt/format.h>

#include <algorithm>

#include "engine/faults/fault_hooks.h"
#include "engine/parallel/collective_budget.h"
#include "harness/faults/scenario_faults.h"
#include "harness/faults/scenario_faults_internal.h"
#include "harness/run/train_run.h"
#include "harness/scenario/scenario.h"
#include "mesh/core/device_mesh.h"

namespace meshproof::harness::faults_internal {
namespace {

// The first few names of `names`, for messages.
std::string some_of(const std::vector<std::string>& names) {
  std::vector<std::string> shown(names.begin(), names.begin() + std::min<size_t>(names.size(), 4));
  return fmt::format("{}{}", fmt::join(shown, ", "), names.size() > shown.size() ? ", ..." : "");
}

std::string glob_over(const std::string& glob, const std::vector<std::string>& names,
                      std::string_view what) {
  for (const std::string& n : names)
    if (engine::match_glob(glob, n)) return "";
  return fmt::format("'{}' matches no {} of this scenario (e.g. {})", glob, what, some_of(names));
}

std::vector<std::string> key_names(const Scenario& s, bool fp32_tensors_only) {
  std::vector<std::string> out;
  for (const engine::FaultKey& k : engine::fault_key_names(s.config(), s.fsdp.fp8_params))
    if (k.fp32_tensor || !fp32_tensors_only) out.push_back(k.key);
  return out;
}

// The plan's collectives of one step of `s`, every rank's (what a collective fault can name).
std::vector<mesh::CollectiveCall> plan_collectives(const Scenario& s) {
  const engine::RunOptions o = engine_run_options(s);
  std::vector<mesh::CollectiveCall> out;
  for (int r = 0; r < o.mesh.device_mesh().world_size(); ++r)
    for (mesh::CollectiveCall& c : engine::expected_collectives(o, r, 0))
      out.push_back(std::move(c));
  return out;
}

// A collective fault's (kind, group, tensor) must name a collective the plan issues in this
// scenario, else it would change nothing.
std::string names_a_collective(const std::string& kind, const std::string& group,
                               const std::string& tensor, const Scenario& s) {
  const std::vector<mesh::CollectiveCall> plan = plan_collectives(s);
  std::vector<std::string> seen;
  for (const mesh::CollectiveCall& c : plan) {
    if (mesh::collective_name(c.kind) != kind || (!group.empty() && c.group != group)) continue;
    if (engine::match_glob(tensor, c.tensor)) return "";
    if (std::find(seen.begin(), seen.end(), c.tensor) == seen.end()) seen.push_back(c.tensor);
  }
  const std::string where = group.empty() ? "" : " over " + group;
  if (seen.empty())
    return fmt::format("this scenario issues no {}{} for a parameter (mesh {})", kind, where,
                       s.mesh.device_mesh().str());
  return fmt::format("'{}' matches no parameter this scenario's {}{} serves (e.g. {})", tensor,
                     kind, where, some_of(seen));
}

}  // namespace

// ---- the generic faults' parameter checks: a glob must name something of the scenario's run
// (its checkpoint keys and linears are known before running, engine/faults/fault_hooks.h).
std::string any_key(const Scenario& s, const std::string& glob) {
  return glob_over(glob, key_names(s, false), "checkpoint key");
}
std::string fp32_key(const Scenario& s, const std::string& glob) {
  return glob_over(glob, key_names(s, true), "fp32 state tensor (checkpoint key)");
}
std::string linear_name(const Scenario& s, const std::string& glob) {
  return glob_over(glob, engine::fault_linear_names(s.config()), "quantized linear");
}
// "none" or mesh dim names joined by '+' ("dp_shard+tp"), each at most once.
std::string dim_list(const Scenario&, const std::string& dims) {
  if (dims == "none") return "";
  unsigned seen = 0;
  size_t pos = 0;
  while (pos <= dims.size()) {
    const size_t plus = dims.find('+', pos);
    const std::string part = dims.substr(pos, plus == std::string::npos ? plus : plus - pos);
    int bit = -1;
    for (mesh::MeshDim d : mesh::kAllMeshDims)
      if (mesh::mesh_dim_name(d) == part) bit = static_cast<int>(d);
    if (bit < 0)
      return fmt::format(
          "'{}' is no mesh dim (dp_replicate, dp_shard, tp; 'none' for no "
          "reduction; join with '+')",
          part);
    if ((seen >> bit) & 1u) return fmt::format("'{}' is listed twice", part);
    seen |= 1u << bit;
    if (plus == std::string::npos) break;
    pos = plus + 1;
  }
  return "";
}

// perturb moves by ULPs or by a relative amount: exactly one of them, at a step the fault is
// active at.
std::string one_perturbation(const Scenario&, const FaultSpec& spec) {
  const bool ulp = spec.int_params.at("ulp") != 0;
  const bool rel = spec.double_params.at("rel") != 0;
  if (ulp == rel) return "give exactly one of ulp (a nonzero integer) and rel (a nonzero number)";
  if (spec.int_params.at("from_step") > spec.int_params.at("step"))
    return "from_step is after step: the perturbation would never happen";
  return "";
}

const std::string& string_param(const FaultSpec& spec, const char* name) {
  return spec.string_params.at(name);
}

std::string param_name(const Scenario& s, const std::string& glob) {
  return glob_over(glob, engine::fault_param_names(s.config()), "parameter");
}

// "dp_shard", "dp_shard+tp", ...: mesh dims, not "none".
std::string mesh_group(const Scenario& s, const std::string& dims) {
  if (dims == "none") return "'none' is no group: name the mesh dims the collective spans";
  return dim_list(s, dims);
}

std::string skip_names_a_collective(const Scenario& s, const FaultSpec& spec) {
  // A bad group or a glob that names no parameter is reported at its parameter already.
  if (!mesh_group(s, string_param(spec, "group")).empty() ||
      !param_name(s, string_param(spec, "tensor")).empty())
    return "";
  const std::string group = mesh::DimSet::parse(string_param(spec, "group")).str();
  return names_a_collective(string_param(spec, "kind"), group, string_param(spec, "tensor"), s);
}

std::string dtype_names_a_collective(const Scenario& s, const FaultSpec& spec) {
  if (!param_name(s, string_param(spec, "tensor")).empty()) return "";  // reported at `tensor`
  return names_a_collective(string_param(spec, "kind"), "", string_param(spec, "tensor"), s);
}

}  // namespace meshproof::harness::faults_internal
