#include "harness/verbs/validate_verb.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <CLI/CLI.hpp>
#include <map>
#include <memory>

#include "harness/scenario/scenario_loader.h"
#include "harness/verbs/exit_codes.h"
#include "kernels/core/error.h"

namespace meshproof::harness {
int validate_scenarios(const std::vector<std::string>& paths, const std::vector<std::string>& sets,
                       std::ostream& out, std::ostream& err, const std::string& filter) {
  std::vector<Override> overrides;
  for (const std::string& s : sets) overrides.push_back(parse_override(s));
  int failed = 0;
  size_t total = 0;
  const std::vector<std::string> files = expand_scenario_paths(paths);
  std::map<std::string, std::string> names;  // across files, as `run` requires
  for (const std::string& file : files) {
    try {
      // The loader reads only the entries --filter selects (run does the same).
      const std::vector<Scenario> scenarios = load_scenario_file(file, overrides, filter);
      for (const Scenario& s : scenarios) check_unique_name(s, names);
      for (const Scenario& s : scenarios) {
        fmt::print(out, "{}  {}  hash {}\n", s.name, summary_line(s), scenario_hash_hex(s));
      }
      total += scenarios.size();
    } catch (const kernels::Error& e) {
      if (e.kind() != kernels::ErrorKind::kInput) throw;
      fmt::print(err, "{}\n", e.message());
      ++failed;
    }
  }
  if (failed > 0) {
    fmt::print(err, "meshproof: {} of {} scenario file(s) invalid\n", failed, files.size());
    return kExitBadInput;
  }
  if (!filter.empty() && total == 0) {
    fmt::print(err, "meshproof: no scenario matches --filter {}\n", filter);
    return kExitBadInput;
  }
  fmt::print(out, "{} scenario(s) from {} file(s) valid\n", total, files.size());
  return kExitOk;
}

void add_validate_command(CLI::App& app, std::ostream& out, std::ostream& err, int& exit_code) {
  auto* cmd = app.add_subcommand(
      "validate", "Load and validate scenario files (or folders of them) without running them");
  auto paths = std::make_shared<std::vector<std::string>>();
  auto sets = std::make_shared<std::vector<std::string>>();
  auto filter = std::make_shared<std::string>();
  cmd->add_option("SCENARIO", *paths, "Scenario YAML files or folders")->required();
  cmd->add_option("--filter", *filter,
                  "Validate only the scenario with this (expanded or base) name, as run does");
  cmd->add_option("--set", *sets, "Override a field: --set key.path=value (repeatable)")
      ->allow_extra_args(false);
  cmd->callback([&out, &err, &exit_code, paths, sets, filter] {
    exit_code = validate_scenarios(*paths, *sets, out, err, *filter);
  });
}

}  // namespace meshproof::harness
