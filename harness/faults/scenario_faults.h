// The fault table (docs/design.md sections 7 and 19): one descriptor row per injectable fault
// with the real bug class it reproduces, what a scenario must have for the fault to be
// meaningful, the checks that catch it, its parameters and how it maps onto the engine's
// engine::FaultInjection. Everything about faults reads this table: the scenario loader (unknown
// names, parameters, requirements, an enabled catching check), the runner (the engine injection,
// the intended checks of a report), `meshproof faults`, and the tests. Adding a fault is one row
// here plus its engine hook (engine/faults/faults.h) and its scenario (scenarios/faults/NAME.yaml).
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/faults/faults.h"
#include "harness/scenario/scenario.h"

namespace meshproof::harness {

// One parameter of a fault, as the scenario writes it under the fault's mapping.
struct FaultParam {
  // kString: free text (a glob or a dim list), checked by `check`; kDouble: a finite number in
  // [min_double, max_double].
  enum class Type { kInt, kChoice, kString, kDouble };
  // The upper bound of an integer parameter, when it depends on the scenario.
  enum class Max { kNone, kLastLayer /* model.layers - 1 */, kLastStep /* train.steps */ };
  std::string_view name;
  Type type = Type::kInt;
  int64_t default_int = 0;  // kInt: default and range [min, max]
  int64_t min = 0;
  Max max = Max::kNone;
  std::vector<std::string_view> choices =
      {};  // kChoice: the allowed values; the first is the default
  std::string_view doc;
  // kString: the scenario must give it (there is no default).
  bool required = false;
  // kString: "" when `value` is acceptable in `s`, else why not (the loader reports it at the
  // parameter's file:line, exit 2), e.g. a glob that matches no checkpoint key.
  std::string (*check)(const Scenario& s, const std::string& value) = nullptr;
  // kDouble: default and range.
  double default_double = 0;
  double min_double = 0;
  double max_double = 0;

  // kInt: the largest value `s` allows (INT64_MAX without a bound).
  int64_t max_for(const Scenario& s) const;
  // For people: "int in [1, train.steps], default 1" or "one of all|exp_avg|..., default all".
  std::string describe() const;
};

// Something the scenario must have for the fault to act (an FP8 recipe, a second replica, ...).
// The loader rejects a scenario that lacks it: "faults[i]: NAME needs WHAT".
struct FaultRequirement {
  std::string_view what;  // names the scenario keys, e.g. "mesh.dp_replicate >= 2"
  bool (*met)(const Scenario& s);
};

struct FaultDescriptor {
  std::string_view name;       // the `faults:` entry and scenarios/faults/NAME.yaml
  std::string_view bug_class;  // the real bug this reproduces, one sentence
  std::vector<FaultRequirement> needs;
  // The checks that catch it (check_table()'s claim names: a check's name, or
  // "resume_cross_mesh" for the resume check with a mesh override); a fault scenario must enable
  // one. Each claim has a runner.fault_claim.NAME.CHECK test that shows it.
  std::vector<std::string_view> caught_by;
  // Every fault takes from_step (first); these follow it.
  std::vector<FaultParam> params;
  // The engine side: switches the fault on in `f` with the resolved parameters of `spec`
  // (from_step is applied by to_fault_injection for every fault).
  void (*inject)(const FaultSpec& spec, engine::FaultInjection& f);
  // A generic (user-defined) fault: its parameters say what it corrupts (a glob over checkpoint
  // keys, tensors or linears), so one row expresses many bug classes (docs/design.md section
  // 23); `meshproof faults` marks it. Built-in rows reproduce one real bug each.
  bool generic = false;
  // A rule over several parameters: "" when `spec` is consistent, else why not (reported at the
  // fault's entry, exit 2).
  std::string (*check)(const Scenario& s, const FaultSpec& spec) = nullptr;
};

// The rows, in the order `meshproof faults` lists them.
std::span<const FaultDescriptor> fault_table();
const FaultDescriptor* find_fault(std::string_view name);  // nullptr when unknown

// `from_step`, which every fault takes: the first step (1-based) at which the fault is active, so
// a fault can be injected after a clean prefix (e.g. only in the resumed half of a resume check).
const FaultParam& from_step_param();
// from_step_param() followed by the row's own parameters.
std::vector<const FaultParam*> all_params(const FaultDescriptor& f);

// The scenario's faults as an engine::FaultInjection, each through its row's `inject`. Scenario
// `from_step` is 1-based (the first optimizer step at which the fault is active); the engine
// counts steps from 0, and one FaultInjection has one from_step: the earliest of the faults.
// A name outside the table is kInput.
engine::FaultInjection to_fault_injection(const std::vector<FaultSpec>& faults);

}  // namespace meshproof::harness
