// Strict scenario loader (docs/design.md sections 7, 10 and 18): YAML -> --set overrides -> matrix
// expansion -> typed, validated harness::Scenario values, read by the key table
// (harness/scenario/scenario_keys.h). Every problem is a kernels::Error of
// kind kInput whose message() is exactly `FILE:LINE:COLUMN: KEY.PATH: what is wrong` (1-based
// line and column), or `--set KEY.PATH=VALUE: KEY.PATH: what is wrong` when the offending value
// came from an override. Nothing is run or written.
#pragma once

#include <map>
#include <string>
#include <string_view>
#include <vector>

#include "harness/scenario/located_yaml.h"
#include "harness/scenario/scenario.h"
#include "harness/scenario/scenario_matrix.h"

namespace meshproof::harness {

// The bounds (kMaxScalarBytes, ...), Override and parse_override are the located-YAML layer's
// (harness/scenario/located_yaml.h); kMaxMatrixEntries is the matrix's
// (harness/scenario/scenario_matrix.h).

// Loads one scenario file and returns its scenarios: one, or one per matrix entry in a stable
// order (the cartesian product of the matrix keys in file order, last key varying fastest).
// Overrides whose path starts with `matrix` edit the matrix; all others apply to each expanded
// scenario after the matrix entry (so --set wins over the matrix). A non-empty `filter` keeps
// only the entries whose expanded or base name equals it; the others are not read, so their
// errors do not count (the result may be empty).
//
// Every problem found is reported, up to kMaxIssues: the kInput error's message() holds one
// line per problem, the first being the first found; a problem of a matrix entry names the
// entry ("... (in matrix entry NAME[KEY=LABEL])") unless every entry has it. The rules are the
// loader's own plus engine::check_run's (engine/config/run_rules.h): what loads runs.
std::vector<Scenario> load_scenario_file(const std::string& path,
                                         const std::vector<Override>& overrides = {},
                                         const std::string& filter = "");
// The same from YAML text; `source` names it in error messages (e.g. a file name). Any text is
// safe to pass (the fuzzing entry point): bounded by kMaxScalarBytes, kMaxDepth and kMaxNodes.
std::vector<Scenario> load_scenario_text(std::string_view yaml, const std::string& source,
                                         const std::vector<Override>& overrides = {},
                                         const std::string& filter = "");

// Scenario names key the reports and goldens, so one run or validate may not hold a name twice
// (two files, or a file given twice). `seen` maps each name to where it was given; a repeat is
// a kInput error at the repeat's `name` naming where the first one came from.
void check_unique_name(const Scenario& s, std::map<std::string, std::string>& seen);

// Files as given, folders expanded to their *.yaml / *.yml files (sorted, so output is stable);
// a folder without any is an input error.
std::vector<std::string> expand_scenario_paths(const std::vector<std::string>& paths);

}  // namespace meshproof::harness
