// The scenario runner (docs/design.md sections 7-9): runs each expanded scenario through the engine
// (harness/run/train_run.h), runs its checks (harness/checks/checks.h), and fills a
// reports::ScenarioRecord. The `run` and `golden update` verbs (harness/verbs/run_verb.h) drive it.
#pragma once

#include <filesystem>
#include <functional>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "harness/run/train_run.h"
#include "harness/scenario/scenario.h"
#include "reports/record/environment.h"
#include "reports/record/perf_metrics.h"
#include "reports/record/run_record.h"

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
  // --from-checkpoint: every run of the scenario (main run and checks) starts from this
  // step_NNNNNNN/ (validated by check_run_inputs) and trains the remaining steps.
  std::filesystem::path from_checkpoint;
};

// What `meshproof run` checks before anything runs or is written (kInput, exit 2): the start
// checkpoint fits each scenario (check_start_checkpoint) and no scenario's periodic checkpoints
// would go into a folder holding another run's checkpoints (check_checkpoint_root_unused).
void check_run_inputs(const std::vector<Scenario>& scenarios, const RunnerOptions& opts);

// Loads and validates every scenario (scenario schema, engine config, fault mapping) before
// anything runs; keeps those whose name equals `filter` or whose base name equals it (empty
// filter: all). Throws kInput on any problem, or when the filter matches nothing.
std::vector<Scenario> load_scenarios(const std::vector<std::string>& paths,
                                     const std::vector<std::string>& sets,
                                     const std::string& filter);

// The backend a scenario runs on ("cpu" or "cuda:0"), or nullopt with `skip_reason` set when it
// must be skipped: requires_gpu on a machine without a usable GPU (under --backend auto or cpu).
// An explicit cuda backend (--backend cuda, or the scenario's backend: cuda without --backend)
// without a usable GPU is a kInput error with the reason `meshproof env` gives.
std::optional<std::string> resolve_backend(const Scenario& s, const RunnerOptions& opts,
                                           const reports::EnvironmentRecord& env,
                                           std::string* skip_reason);

// Runs one scenario and its checks. Runtime failures of the scenario itself land in
// record.error (never thrown); `main` (when given) receives the main run's outcome. With
// opts.from_checkpoint a failed load of it (a corrupt chunk: the message names the key and file)
// is a failed `checkpoint` check and nothing else runs. The main run writes the periodic
// checkpoints of checkpoint.every (harness/run/train_run.h CheckpointPlan).
reports::ScenarioRecord run_scenario(const Scenario& s, const RunnerOptions& opts,
                                     const reports::EnvironmentRecord& env, std::ostream& log,
                                     TrainOutcome* main = nullptr);

// The check kinds whose failure counts as catching the scenario's injected faults: the fault
// catalog's caught_by ("resume_cross_mesh" is the resume check with a mesh override), restricted
// to the checks the scenario enables. Empty unless expect: caught. Goes into
// ScenarioRecord::caught_by.
std::vector<std::string> intended_checks(const Scenario& s);

// Whether the scenario did what it promised, by reports::scenario_verdict (the rule the reports
// show): pass or skipped. `why` explains a miss (reports::verdict_reason).
bool expectation_met(const reports::ScenarioRecord& r, std::string* why);

// What compute_performance needs beyond the steps, for a scenario run on `backend` ("cpu" or
// "cuda:N"): the model shape; the physical devices the ranks ran on (virtual ranks of the local
// launcher share one GPU or the host: 1; the mpi launcher: one GPU per process up to the GPUs of
// the host); the GPU's name from the probed environment (its compute capability picks the GEMM
// dtype, engine::recipe_gemm_dtype: MXFP8 is bf16 on Hopper, fp8 from cc 10). `note` says why
// the MFU will be unknown (CPU backend, GPU not in the peak table and no calibration), ""
// otherwise. For a GPU outside the peak table, `calibrate(N)` (when given) measures its peak
// in TFLOP/s: the MFU is then against that calibration (reports::resolve_peak_tflops).
using PeakCalibration = std::function<std::optional<double>(int device_index)>;
reports::PerformanceInputs performance_inputs(const Scenario& s, const std::string& backend,
                                              const reports::EnvironmentRecord& env,
                                              std::string* note,
                                              const PeakCalibration& calibrate = nullptr);

// The calibration `meshproof run` uses for GPUs outside the peak table: the best bf16 GEMM
// TFLOP/s of the recipe bench's ceiling measurement (engine::run_recipe_bench, 4096^3, median of
// 10 after 3 warm-up runs) on cuda:N, measured once per device and process.
std::optional<double> measured_bf16_peak(int device_index);

// A device for people and provenance: "cpu", or the probed name of GPU N with the device,
// "NVIDIA H100 80GB HBM3 (cuda:0)" (just "cuda:N" when that GPU was not probed).
std::string device_description(const std::string& device, const reports::EnvironmentRecord& env);

// The command that (re)creates the golden a run of `s` with `opts` reads: the scenario file, a
// --filter for its name, every --set, --backend and --launcher given, --golden-dir and
// --platform (a guard: golden update refuses when its device gives another platform), each word
// shell-quoted.
std::string golden_update_command(const Scenario& s, const RunnerOptions& opts,
                                  const std::string& platform);

}  // namespace meshproof::harness
