// The golden store (docs/design.md section 7): golden/<scenario>/<platform>.h5 holds the per-step
// metrics of a reference run and where it came from.
//   /metrics/<name>   float64 [steps]   (loss, grad_norm, lr)
//   /steps            int64 [steps]     imported goldens only: the step of each value
//   / attributes      scenario, scenario_hash, meshproof_version, git_commit, backend, device,
//                     cuda_runtime, cublaslt, nccl, date, command   (strings)
// Goldens are written atomically (reports/writers/atomic_file.h: a mkstemp'd temporary in the
// golden's folder, fsynced, renamed over the golden, the folder fsynced), so a failed update leaves
// the previous golden intact and concurrent updates of one golden each leave a complete one.
#pragma once

#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "reports/record/environment.h"

namespace meshproof::harness {

struct GoldenData {
  std::map<std::string, std::vector<double>> metrics;  // name -> [n] values, in step order
  // [n] the step of each value, ascending, >= 1 (/steps int64): an imported golden's steps
  // (harness/checks/golden_import.h). Empty for a golden meshproof wrote: steps 1..n.
  std::vector<int64_t> steps;
  std::map<std::string, std::string> provenance;  // root attributes
};

// Whether a golden was imported from another tool's run (provenance origin "imported"): it is
// compared with a tolerance only, never bitwise.
bool golden_is_imported(const GoldenData& golden);

// The golden platform of a backend: "cpu", or the GPU family ("h100", "h200", "b200", ...) taken
// from the device name; unknown GPUs give their sanitised lower-case name.
std::string golden_platform(const std::string& backend, const reports::EnvironmentRecord& env);

// The folder name of a scenario: its expanded name with '[' -> '@', ']' dropped and anything
// outside [A-Za-z0-9_.,=@-] replaced by '_' ("fsdp[recipe=bf16]" -> "fsdp@recipe=bf16").
std::string golden_scenario_dir(const std::string& scenario_name);

// Whether `platform` is a golden platform name: [a-z0-9_-]+ (a file name, never a path).
bool valid_platform_name(const std::string& platform);

// root/<golden_scenario_dir>/<platform>.h5; a platform that is not valid_platform_name is a
// kInput error.
std::filesystem::path golden_path(const std::filesystem::path& root,
                                  const std::string& scenario_name, const std::string& platform);

// nullopt when the file does not exist; a file that exists but is malformed is a kInput error
// naming it.
std::optional<GoldenData> read_golden(const std::filesystem::path& path);

// Builds the HDF5 file in memory, then writes it atomically (see the top) after removing orphan
// temporaries of `path` left by killed updates (creating parent folders). kRuntime errors that
// name the golden and the reason (never source code).
void write_golden(const std::filesystem::path& path, const GoldenData& data);

// Signed mean relative shift of `now` against `before` over the common steps:
// mean((now - before) / |before|) over steps with before != 0. nullopt when nothing is comparable.
std::optional<double> mean_relative_shift(const std::vector<double>& before,
                                          const std::vector<double>& now);

}  // namespace meshproof::harness
