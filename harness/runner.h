// The scenario runner (DESIGN.md sections 7-9): runs each expanded scenario through the engine
// (harness/train_run.h), runs its checks (harness/checks.h), and fills a reports::ScenarioRecord.
// The `run` and `golden update` verbs (harness/run_verb.h) drive it.
#pragma once

#include <filesystem>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "harness/scenario.h"
#include "harness/train_run.h"
#include "reports/environment.h"
#include "reports/run_record.h"

namespace meshproof::harness {

struct RunnerOptions {
  std::optional<Backend> backend;    // --backend: overrides every scenario's backend
  std::optional<Launcher> launcher;  // --launcher
  std::filesystem::path golden_dir = "golden";
  std::filesystem::path out_dir = "out";  // report folder; checkpoints go under it
  bool trace = false;                     // first diverging tensor in check evidence
  bool progress = false;  // live per-step progress (terminal); else one line per scenario
  // How the user invoked the loader, for the `golden update` command printed by a missing golden.
  std::vector<std::string> sets;
};

// Loads and validates every scenario (scenario schema, engine config, fault mapping) before
// anything runs; keeps those whose name equals `filter` or whose base name equals it (empty
// filter: all). Throws kInput on any problem, or when the filter matches nothing.
std::vector<Scenario> load_scenarios(const std::vector<std::string>& paths,
                                     const std::vector<std::string>& sets,
                                     const std::string& filter);

// The backend a scenario runs on ("cpu" or "cuda:0"), or nullopt with `skip_reason` set when it
// must be skipped (needs a GPU this machine does not have).
std::optional<std::string> resolve_backend(const Scenario& s, const RunnerOptions& opts,
                                           const reports::EnvironmentRecord& env,
                                           std::string* skip_reason);

// Runs one scenario and its checks. Runtime failures of the scenario itself land in
// record.error (never thrown); `main` (when given) receives the main run's outcome.
reports::ScenarioRecord run_scenario(const Scenario& s, const RunnerOptions& opts,
                                     const reports::EnvironmentRecord& env, std::ostream& log,
                                     TrainOutcome* main = nullptr);

// Whether the scenario did what it promised: expect pass -> no check failed or errored;
// expect caught -> one of the fault catalog's caught_by checks failed. `why` explains a miss.
bool expectation_met(const Scenario& s, const reports::ScenarioRecord& r, std::string* why);

// The command that (re)creates a scenario's golden.
std::string golden_update_command(const Scenario& s, const std::vector<std::string>& sets,
                                  const std::string& platform);

}  // namespace meshproof::harness
