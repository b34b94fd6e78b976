// Strict scenario loader (DESIGN.md sections 7 and 10): YAML -> --set overrides -> matrix
// expansion -> typed, validated harness::Scenario values. Every problem is a kernels::Error of
// kind kInput whose message() is exactly `FILE:LINE:COLUMN: KEY.PATH: what is wrong` (1-based
// line and column), or `--set KEY.PATH=VALUE: KEY.PATH: what is wrong` when the offending value
// came from an override. Nothing is run or written.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "harness/scenario.h"

namespace meshproof::harness {

// One `--set key.path=value` override. The value is parsed as YAML (a scalar, or a flow
// sequence/mapping such as `[bf16, mxfp8]` or `{dp_shard: 4}`).
struct Override {
  std::string path;   // dotted key path, e.g. "mesh.tp"
  std::string value;  // YAML text of the value
  std::string text;   // the override as the user wrote it ("mesh.tp=2"), for messages
};

// Parses "key.path=value"; throws kInput naming the override when it is malformed.
Override parse_override(const std::string& text);

// Loads one scenario file and returns its scenarios: one, or one per matrix entry in a stable
// order (the cartesian product of the matrix keys in file order, last key varying fastest).
// Overrides whose path starts with `matrix` edit the matrix; all others apply to each expanded
// scenario after the matrix entry (so --set wins over the matrix).
std::vector<Scenario> load_scenario_file(const std::string& path,
                                         const std::vector<Override>& overrides = {});
// The same from YAML text; `source` names it in error messages (e.g. a file name).
std::vector<Scenario> load_scenario_text(std::string_view yaml, const std::string& source,
                                         const std::vector<Override>& overrides = {});

// Scenario names key the reports and goldens, so one run or validate may not hold a name twice
// (two files, or a file given twice). `seen` maps each name to where it was given; a repeat is
// a kInput error at the repeat's `name` naming where the first one came from.
void check_unique_name(const Scenario& s, std::map<std::string, std::string>& seen);

// Levenshtein distance, exposed for tests of the did-you-mean suggestions.
size_t edit_distance(std::string_view a, std::string_view b);

// Files as given, folders expanded to their *.yaml / *.yml files (sorted, so output is stable);
// a folder without any is an input error.
std::vector<std::string> expand_scenario_paths(const std::vector<std::string>& paths);

}  // namespace meshproof::harness
