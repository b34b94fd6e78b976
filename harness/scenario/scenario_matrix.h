// Matrix expansion of a scenario document (docs/scenarios.md "Matrix", docs/design.md sections 7
// and 18): the `matrix` mapping's lists become axes, and every combination of their values (the
// cartesian product in file order, the last key varying fastest) is one document, named
// `base[key=label,...]`. Works on located YAML (harness/scenario/located_yaml.h), so every value of
// an entry still points at the line that wrote it.
#pragma once

#include <cstddef>
#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "harness/scenario/located_yaml.h"

namespace meshproof::harness {

constexpr size_t kMaxMatrixEntries = 10000;  // scenarios one matrix expands to

struct MatrixAxis {
  std::string key;                  // dotted key path, e.g. "recipe" or "mesh.tp"
  std::vector<yaml::Value> values;  // in file order
  std::vector<std::string> labels;  // label_of(values[i]), unique
};

// The label a matrix value gives the expanded name: a scalar is its text; a mapping joins
// `keyvalue` parts with `_` (a `name` entry first and bare; `true` booleans as `key`, `false` as
// `no_key`); a list joins with `-`.
std::string label_of(const yaml::Value& v);

// Reads the `matrix` mapping: each key's head must be one of `allowed` (did-you-mean otherwise),
// each value a non-empty list without repeated labels. Problems are fail()ed
// (harness/scenario/located_yaml.h).
std::vector<MatrixAxis> read_matrix(const yaml::Value& m, const std::vector<std::string>& allowed);

// The number of entries the axes expand to (in double: it may exceed any integer).
double matrix_entries(const std::vector<MatrixAxis>& axes);

// One expanded document.
struct MatrixEntry {
  yaml::Value doc;
  std::vector<std::pair<std::string, std::string>> labels;  // (matrix key, label)
  std::string base;                                         // the `name` key, else default_base
  std::string name;                                         // base[key=label,...]
};

// Calls `visit` for every entry in order (a single entry, named `base`, without axes). Each
// entry is `root` with the axes' values set (yaml::set_at with `normalize`), then `finish`
// applied (the --set overrides that win over the matrix). `visit` returns false to stop.
void expand_matrix(const yaml::Value& root, const std::vector<MatrixAxis>& axes,
                   const std::string& default_base, const yaml::Normalize& normalize,
                   const std::function<void(yaml::Value&)>& finish,
                   const std::function<bool(MatrixEntry&)>& visit);

}  // namespace meshproof::harness
