// Internal to the scenario resolver (harness/scenario/scenario_resolver.cc and the
// scenario_resolver_*.cc files beside it): the Resolver, everything resolving one scenario document
// needs (the document, its located keys, what checks.reference wrote), whose member functions those
// files define: the section reads and resolve() (scenario_resolver.cc), the checks
// (scenario_resolver_checks.cc), the faults (scenario_resolver_faults.cc) and the scenario-level
// rules after the reads (scenario_resolver_rules.cc).
#pragma once

#include <string>

#include "engine/config/config.h"
#include "engine/config/mesh_spec.h"
#include "harness/scenario/located_yaml.h"
#include "harness/scenario/scenario.h"

namespace meshproof::harness::resolver_internal {

using yaml::describe;
using yaml::fail;
using yaml::Locations;
using yaml::report;
using yaml::Section;
using yaml::unknown_message;
using yaml::Value;

// Everything the resolver needs about one scenario document.
struct Resolver {
  const Value& root;
  std::string source;
  std::string root_where;
  Locations locs;
  // Written in checks.reference (for no_effect_rules).
  bool ref_sync_written_ = false;
  bool ref_keep_last_written_ = false;

  // scenario_resolver.cc: locations, the mesh and recipe mappings, the key table's sections, the
  // whole document.
  std::string at(const std::string& path) const;
  void bad(const std::string& path, const std::string& what) const;
  engine::MeshSpec read_mesh(const Value* v, const std::string& path,
                             const std::string& absent_where);
  engine::RecipeConfig read_recipe(const Value* raw, const std::string& path,
                                   const std::string& absent_where);
  Section read_section(const Section& top, const std::string& name, Scenario& sc);
  void read_one(Section& s, const std::string& path, Scenario& sc);
  Scenario resolve(const std::string& default_name);

  // scenario_resolver_checks.cc: the checks mapping.
  double default_rtol(const engine::RecipeConfig& a, const engine::RecipeConfig* b,
                      const std::string& path) const;
  void same_world_under_mpi(const Scenario& sc, const engine::MeshSpec& m, const std::string& path,
                            const std::string& check) const;
  bool check_enabled(const Value* v, const std::string& path);
  void read_checks(const Value* v, Scenario& sc);

  // scenario_resolver_faults.cc: the faults list, against the fault table.
  void read_faults(const Value* v, Scenario& sc);

  // scenario_resolver_rules.cc: the rules over keys of several sections, after the reads.
  void check_fits(const engine::MeshSpec& m, const std::string& mesh_path,
                  const engine::RecipeConfig& r, const engine::ModelConfig& model,
                  const engine::TrainingConfig& train);
  void no_effect_rules(const Scenario& sc, const Section& ms, const Section& fs, const Section& ts,
                       const Section& cks);
  void engine_rules(const Scenario& sc);
};

}  // namespace meshproof::harness::resolver_internal
