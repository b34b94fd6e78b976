// The check table (docs/design.md sections 7, 8 and 19): one descriptor row per check a scenario
// can enable under `checks:`, in the order the runner runs them and the reports list them. The
// runner (harness/run/runner.cc) iterates the rows: for each enabled one it asks what the main run
// must record, whether the check can run from this start, and runs it on a CheckContext. The
// comparisons themselves are harness/checks/checks.h; the fault table
// (harness/faults/scenario_faults.h) names these rows in its caught_by. Adding a check is one row
// here, its key in the scenario, its comparison and its tests.
#pragma once

#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/faults/faults.h"
#include "harness/run/train_run.h"
#include "harness/scenario/scenario.h"
#include "reports/record/environment.h"
#include "reports/record/run_record.h"

namespace meshproof::harness {

struct RunnerOptions;

// The rows' ids, in table order (check(id) is row `id`).
enum class CheckId {
  kGolden,
  kResume,
  kReference,
  kAllgatherParity,
  kDeterminism,
  kState,
  kCollectives
};

// What a check sees of the scenario being run: the scenario, the main run it judges, and the
// runner's services for its own training runs.
struct CheckContext {
  const Scenario& scenario;  // as loaded (the golden's name, the hash, the checks' settings)
  const Scenario& run;       // with the resolved backend and launcher: what the checks re-run
  const RunnerOptions& opts;
  const reports::EnvironmentRecord& env;
  std::string backend;  // "cpu" or "cuda:0"
  std::string hash;     // scenario_hash_hex(scenario)
  int64_t start = 0;    // the step the run starts from (--from-checkpoint), 0 otherwise
  const TrainOutcome& main;
  engine::FaultInjection faults;    // the scenario's faults, for the checks that re-run them
  reports::ScenarioRecord& record;  // notes and the golden band a check adds
  // Progress of a check's own training run: `phase(what)` labels the live line "NAME [what]" and
  // returns the step callback of the run; `done()` clears the line.
  std::function<std::function<void(const reports::StepMetrics&, int64_t)>(const std::string&)>
      phase;
  std::function<void()> done;
  // --trace on a fault scenario: the fault-free straight run from the same start, trained once on
  // first use (the resume and reference checks' noise floors).
  std::function<const TrainOutcome&()> fault_free_control;
};

// What a check may ask of the main run needs to know where it starts and saves.
struct MainRunPlan {
  int64_t start = 0;                      // the step the run starts from (CheckContext::start)
  std::filesystem::path checkpoint_root;  // harness::checkpoint_root of the scenario and --out
};

struct CheckDescriptor {
  CheckId id;
  std::string_view name;  // the key under `checks:`, the report's check kind and name
  std::string_view doc;   // what it compares, one line (docs and `meshproof faults`)
  bool (*enabled)(const Scenario& s);
  // The name fault rows use for this check in `s` (caught_by): its name, except the resume check
  // with a mesh override, "resume_cross_mesh".
  std::string_view (*claim)(const Scenario& s);
  // What the check asks of the main run (the allgather_parity comparisons, the resume check's
  // save); may be null.
  void (*prepare_main)(const Scenario& s, const MainRunPlan& plan, TrainRequest& main);
  // Why the check cannot run from this start (it is reported skipped with this reason), or
  // nullopt; may be null.
  std::optional<std::string> (*skip)(const CheckContext& ctx);
  reports::CheckResult (*run)(CheckContext& ctx);
  // Its duration includes the main run's training: the check judges the main run itself.
  bool judges_main_run = false;
};

// The rows, in run and report order: golden, resume, reference, allgather_parity, determinism,
// state, collectives.
std::span<const CheckDescriptor> check_table();
const CheckDescriptor* find_check(std::string_view name);  // nullptr when unknown
const CheckDescriptor& check(CheckId id);

// The names of the checks `s` enables, in table order.
std::vector<std::string> enabled_checks(const Scenario& s);
// The claim names (CheckDescriptor::claim) of the checks `s` enables, in table order.
std::vector<std::string> enabled_claims(const Scenario& s);
// A claim name for people: "resume (with a mesh override)" for resume_cross_mesh, else itself.
std::string describe_claim(std::string_view claim);
// The check a claim name stands for (resume_cross_mesh: resume); nullptr when none.
const CheckDescriptor* check_of_claim(std::string_view claim);

}  // namespace meshproof::harness
