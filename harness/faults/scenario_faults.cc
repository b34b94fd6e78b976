// The fault table (docs/design.md section 19, "how to add a fault"): the functions that read a
// scenario's `faults:` list against it, the from_step parameter every fault takes, and the table
// itself, assembled from its row lists. The rows (one FaultDescriptor per fault: name, bug class,
// requirements, intended checks, the engine hook it sets) live in harness/scenario/fault_rows_*.cc,
// their requirements in fault_requirements.cc and their parameter checks in fault_param_checks.cc
// (harness/faults/scenario_faults_internal.h); a new row goes at the end of the last list.
#include "harness/faults/scenario_faults.h"

#include <fmt/format.h>

#include <algorithm>
#include <iterator>
#include <limits>

#include "harness/faults/scenario_faults_internal.h"
#include "kernels/core/error.h"

namespace meshproof::harness {
namespace {

const FaultParam kFromStep{"from_step",
                           FaultParam::Type::kInt,
                           1,
                           1,
                           FaultParam::Max::kLastStep,
                           {},
                           "first step (1-based) at which the fault is active"};

// ---- the table: the row lists of scenario_faults_internal.h back to back, in the order
// `meshproof faults` lists the rows.
const std::vector<FaultDescriptor>& fault_rows() {
  static const std::vector<FaultDescriptor> table = [] {
    std::vector<FaultDescriptor> all;
    for (std::vector<FaultDescriptor> (*part)() :
         {faults_internal::core_fault_rows, faults_internal::generic_state_fault_rows,
          faults_internal::numerics_checkpoint_fault_rows, faults_internal::collective_fault_rows,
          faults_internal::moe_pipeline_fault_rows}) {
      std::vector<FaultDescriptor> part_rows = part();
      all.insert(all.end(), std::make_move_iterator(part_rows.begin()),
                 std::make_move_iterator(part_rows.end()));
    }
    return all;
  }();
  return table;
}

}  // namespace

int64_t FaultParam::max_for(const Scenario& s) const {
  switch (max) {
    case Max::kLastLayer:
      return s.model.layers - 1;
    case Max::kLastStep:
      return s.train.steps;
    case Max::kNone:
      break;
  }
  return std::numeric_limits<int64_t>::max();
}

std::string FaultParam::describe() const {
  if (type == Type::kChoice) {
    return fmt::format("one of {}; default {}", fmt::join(choices, ", "), choices.front());
  }
  if (type == Type::kString) return required ? "text, required" : "text";
  if (type == Type::kDouble)
    return fmt::format("number in [{}, {}], default {}", min_double, max_double, default_double);
  switch (max) {
    case Max::kLastLayer:
      return fmt::format("int in [{}, model.layers - 1], default {}", min, default_int);
    case Max::kLastStep:
      return fmt::format("int in [{}, train.steps], default {}", min, default_int);
    case Max::kNone:
      break;
  }
  return fmt::format("int >= {}, default {}", min, default_int);
}

std::span<const FaultDescriptor> fault_table() { return fault_rows(); }

const FaultDescriptor* find_fault(std::string_view name) {
  for (const FaultDescriptor& f : fault_table()) {
    if (f.name == name) return &f;
  }
  return nullptr;
}

const FaultParam& from_step_param() { return kFromStep; }

std::vector<const FaultParam*> all_params(const FaultDescriptor& f) {
  std::vector<const FaultParam*> out = {&kFromStep};
  for (const FaultParam& p : f.params) out.push_back(&p);
  return out;
}

engine::FaultInjection to_fault_injection(const std::vector<FaultSpec>& faults) {
  engine::FaultInjection f;
  int64_t from = -1;
  for (const FaultSpec& spec : faults) {
    const FaultDescriptor* row = find_fault(spec.name);
    MP_CHECK_INPUT(row != nullptr, "fault {}: not in the fault table (`meshproof faults` lists it)",
                   spec.name);
    const auto it = spec.int_params.find(std::string(kFromStep.name));
    const int64_t first = it == spec.int_params.end() ? kFromStep.default_int : it->second;
    from = from < 0 ? first : std::min(from, first);
    row->inject(spec, f);
  }
  f.from_step = from < 1 ? 0 : from - 1;
  return f;
}

}  // namespace meshproof::harness
