// `meshproof validate SCENARIO... [--set k=v]...`: load and validate scenario files (or folders,
// searched recursively for *.yaml / *.yml), print each expanded scenario's name and a one-line
// summary. Nothing is run or written.
#pragma once

#include <ostream>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace meshproof::harness {

// Returns kExitOk when every scenario is valid, else kExitBadInput after printing each error
// (its message, `FILE:LINE:COLUMN: KEY.PATH: what is wrong`) to `err`. Every file is checked
// even after an error so that one run reports all broken files, and each file reports all its
// problems (up to kMaxIssues, harness/scenario/scenario_loader.h). A non-empty `filter` validates
// only the matrix entries it names, as `run --filter` runs them; matching nothing is bad input.
int validate_scenarios(const std::vector<std::string>& paths, const std::vector<std::string>& sets,
                       std::ostream& out, std::ostream& err, const std::string& filter = "");

void add_validate_command(CLI::App& app, std::ostream& out, std::ostream& err, int& exit_code);

}  // namespace meshproof::harness
