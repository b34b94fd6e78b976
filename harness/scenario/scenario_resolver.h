// One expanded scenario document -> a validated Scenario (docs/design.md sections 7 and 18). The
// step of the loader (harness/scenario/scenario_loader.h) after the --set overrides and the matrix:
// reads every key by the key table (harness/scenario/scenario_keys.h), then applies the scenario's
// own rules and engine::check_run's (engine/config/run_rules.h) to the run and to the runs its
// checks make, reporting each problem (yaml::report, harness/scenario/located_yaml.h) at the
// FILE:LINE:COL of the key that wrote the setting.
#pragma once

#include <string>

#include "harness/scenario/located_yaml.h"
#include "harness/scenario/scenario.h"

namespace meshproof::harness {

// `recipe: mxfp8` is shorthand for `recipe: {name: mxfp8}`.
yaml::Value recipe_shorthand(const yaml::Value& v);
// The shorthand wherever a recipe is set at `path` (recipe, checks.reference.recipe): the
// yaml::Normalize of --set overrides and matrix values.
yaml::Value normalize_recipe(const std::string& path, yaml::Value v);

// Reads `doc` (a mapping; locations name `source`) into a Scenario named `default_name` unless it
// has a `name`. Problems are reported to the yaml::Collect in scope (or thrown at once without
// one); the returned Scenario is meaningful only when none was reported.
Scenario resolve_scenario(const yaml::Value& doc, const std::string& source,
                          const std::string& default_name);

}  // namespace meshproof::harness
