// The resolver's reading of a scenario's `faults:` list against the fault table
// (harness/faults/scenario_faults.h): each entry a name from the table (once) or a mapping with
// its parameters, each parameter typed and checked by its row, then the row's own check, its
// requirements of the scenario and an enabled check that catches it. A member of the Resolver
// (harness/scenario/scenario_resolver_internal.h).
#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <string>
#include <vector>

#include "harness/checks/check_table.h"
#include "harness/faults/scenario_faults.h"
#include "harness/scenario/scenario.h"
#include "harness/scenario/scenario_resolver_internal.h"

namespace meshproof::harness::resolver_internal {

void Resolver::read_faults(const Value* v, Scenario& sc) {
  if (v == nullptr) return;
  locs["faults"] = v->where;
  if (v->kind != Value::kSeq) {
    bad("faults", fmt::format("expected a list of faults, got {}", describe(*v)));
  }
  std::vector<std::string> names;
  for (const FaultDescriptor& f : fault_table()) names.emplace_back(f.name);
  // The scenario's enabled checks as the fault table names them (resume_cross_mesh for the
  // resume check with a mesh override).
  const std::vector<std::string> checks = enabled_claims(sc);
  for (size_t i = 0; i < v->seq.size(); ++i) {
    const Value& item = v->seq[i];
    const std::string path = fmt::format("faults[{}]", i);
    locs[path] = item.where;
    const Value* name_v = &item;
    if (item.kind == Value::kMap) {
      name_v = item.find("name");
      if (name_v == nullptr) fail(at(path), path, "a fault mapping needs a name");
    }
    if (name_v->kind != Value::kScalar) {
      fail(name_v->where, path, fmt::format("expected a fault name, got {}", describe(*name_v)));
    }
    const FaultDescriptor* info = find_fault(name_v->scalar);
    if (info == nullptr) {
      fail(name_v->where, path,
           unknown_message(fmt::format("fault '{}'", name_v->scalar), name_v->scalar, names));
    }
    for (size_t j = 0; j < sc.faults.size(); ++j) {
      if (sc.faults[j].name == info->name) {
        fail(name_v->where, path,
             fmt::format("{} is listed twice (also faults[{}])", info->name, j));
      }
    }
    FaultSpec spec;
    spec.name = info->name;
    const std::vector<const FaultParam*> params = all_params(*info);
    std::vector<std::string> keys = {"name"};
    for (const FaultParam* p : params) keys.emplace_back(p->name);
    Section ps(item.kind == Value::kMap ? &item : nullptr, path, item.where, locs, keys);
    for (const FaultParam* p : params) {
      const std::string key(p->name);
      switch (p->type) {
        case FaultParam::Type::kInt:
          spec.int_params[key] = ps.integer(key, p->default_int, p->min, p->max_for(sc));
          break;
        case FaultParam::Type::kChoice: {
          const std::vector<std::string> choices(p->choices.begin(), p->choices.end());
          // The first choice is the default (harness/faults/scenario_faults.h).
          spec.string_params[key] = choices.at(ps.choice(key, 0, choices));
          break;
        }
        case FaultParam::Type::kDouble:
          spec.double_params[key] = ps.number(key, p->default_double, p->min_double, p->max_double);
          break;
        case FaultParam::Type::kString: {
          const std::string value = ps.string(key, "");
          const std::string where = path + "." + key;
          if (value.empty() && p->required) {
            bad(ps.has(key) ? where : path,
                fmt::format("{} needs {}: {}", info->name, key, p->doc));
            break;
          }
          if (p->check != nullptr) {
            const std::string why = p->check(sc, value);
            if (!why.empty()) bad(where, fmt::format("{} {}: {}", info->name, key, why));
          }
          spec.string_params[key] = value;
          break;
        }
      }
    }
    if (info->check != nullptr) {
      const std::string why = info->check(sc, spec);
      if (!why.empty()) bad(path, fmt::format("{}: {}", info->name, why));
    }
    for (const FaultRequirement& need : info->needs) {
      if (!need.met(sc)) bad(path, fmt::format("{} needs {}", info->name, need.what));
    }
    const bool caught = std::any_of(info->caught_by.begin(), info->caught_by.end(), [&](auto c) {
      return std::find(checks.begin(), checks.end(), c) != checks.end();
    });
    if (!caught) {
      std::vector<std::string> shown;
      for (std::string_view c : info->caught_by) shown.push_back(describe_claim(c));
      bad(path, fmt::format("{} is caught only by {}; enable one of those checks", info->name,
                            fmt::join(shown, " or ")));
    }
    sc.faults.push_back(std::move(spec));
  }
}

}  // namespace meshproof::harness::resolver_internal
