// `meshproof export --out trace.h5 [model/training flags]` or
// `meshproof export SCENARIO.yaml --out trace.h5 [--filter NAME] [--set k=v]...`: trains the
// configured model on one rank and writes a trace that independent references
// (tests/reference/model_reference.py) can replay. A scenario file must resolve to exactly one
// scenario (a matrix needs --filter) on a 1-rank mesh without faults: anything else is bad input
// (exit 2), not a silently different run. The trace:
//   /config         attributes: every setting (strings) plus entropy_rate (float64)
//   /init/<param>   float32 global tensors before training
//   /data/tokens    int32 [steps, global_batch, seq_len + 1]
//   /metrics/loss, /metrics/grad_norm, /metrics/lr   float64 [steps]
//   /grads0/<param> float32 step-0 gradients (reduced, before clipping)
//   /final/<param>  float32 parameters after the last step
// Before any training --out must be a writable file path that is not the scenario file (spelled
// any way, harness/verbs/output_guard.h); the file is written to a fresh temporary beside it and
// renamed when complete, so a failure or a kill leaves the old file or none.
#pragma once

#include <CLI/CLI.hpp>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "engine/config/config.h"
#include "harness/verbs/output_guard.h"

namespace CLI {
class App;
}  // namespace CLI

namespace meshproof::harness {

// Validates `config` and --out against `inputs` (the scenario file it came from, if any), trains
// config.training.steps steps and writes the trace atomically.
void export_trace(const engine::Config& config, const std::string& out_path, std::ostream& log,
                  std::span<const NamedPath> inputs = {});

// The engine configuration of the one 1-rank scenario `path` resolves to (after `sets` and
// `filter`); kInput naming the file for a matrix, a mesh of more than one rank or faults.
engine::Config scenario_export_config(const std::string& path, const std::string& filter,
                                      const std::vector<std::string>& sets);

// Registers the `export` verb.
void add_export_command(CLI::App& app, std::ostream& out, int& exit_code);

}  // namespace meshproof::harness
