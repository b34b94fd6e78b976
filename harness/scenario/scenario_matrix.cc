#include "harness/scenario/scenario_matrix.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>

namespace meshproof::harness {

using yaml::Value;

std::string label_of(const Value& v) {
  switch (v.kind) {
    case Value::kNull:
      return "null";
    case Value::kScalar:
      return v.scalar;
    case Value::kSeq: {
      std::vector<std::string> parts;
      for (const Value& item : v.seq) parts.push_back(label_of(item));
      return fmt::format("{}", fmt::join(parts, "-"));
    }
    case Value::kMap:
      break;
  }
  std::vector<std::string> parts;
  if (const Value* name = v.find("name")) parts.push_back(label_of(*name));
  for (const auto& [k, child] : v.map) {
    if (k == "name") continue;
    if (child.kind == Value::kScalar && !child.quoted &&
        (child.scalar == "true" || child.scalar == "false")) {
      parts.push_back(child.scalar == "true" ? k : "no_" + k);
    } else {
      parts.push_back(k + label_of(child));
    }
  }
  return fmt::format("{}", fmt::join(parts, "_"));
}

std::vector<MatrixAxis> read_matrix(const Value& m, const std::vector<std::string>& allowed) {
  std::vector<MatrixAxis> axes;
  if (m.kind != Value::kMap) {
    yaml::fail(m.where, "matrix", fmt::format("expected a mapping, got {}", yaml::describe(m)));
  }
  for (size_t i = 0; i < m.map.size(); ++i) {
    const auto& [key, list] = m.map[i];
    const std::string path = "matrix." + key;
    const std::string head = yaml::split_path(key)[0];
    if (std::find(allowed.begin(), allowed.end(), head) == allowed.end()) {
      yaml::fail(m.key_where[i], path, yaml::unknown_message("key", head, allowed));
    }
    for (const std::string& part : yaml::split_path(key)) {
      if (part.empty()) yaml::fail(m.key_where[i], path, "malformed key path");
    }
    if (list.kind != Value::kSeq || list.seq.empty()) {
      yaml::fail(list.where, path,
                 fmt::format("expected a non-empty list of values, got {}", yaml::describe(list)));
    }
    MatrixAxis axis;
    axis.key = key;
    for (size_t j = 0; j < list.seq.size(); ++j) {
      const std::string label = label_of(list.seq[j]);
      if (std::find(axis.labels.begin(), axis.labels.end(), label) != axis.labels.end()) {
        yaml::fail(list.seq[j].where, fmt::format("{}[{}]", path, j),
                   fmt::format("duplicate matrix entry '{}'", label));
      }
      axis.values.push_back(list.seq[j]);
      axis.labels.push_back(label);
    }
    axes.push_back(std::move(axis));
  }
  return axes;
}

double matrix_entries(const std::vector<MatrixAxis>& axes) {
  double entries = 1;
  for (const MatrixAxis& a : axes) entries *= static_cast<double>(a.values.size());
  return entries;
}

void expand_matrix(const Value& root, const std::vector<MatrixAxis>& axes,
                   const std::string& default_base, const yaml::Normalize& normalize,
                   const std::function<void(Value&)>& finish,
                   const std::function<bool(MatrixEntry&)>& visit) {
  // Odometer over the axes, last axis fastest.
  std::vector<size_t> idx(axes.size(), 0);
  while (true) {
    MatrixEntry e;
    e.doc = root;
    for (size_t a = 0; a < axes.size(); ++a) {
      const Value& v = axes[a].values[idx[a]];
      yaml::set_at(e.doc, axes[a].key, v, v.where, normalize);
      e.labels.emplace_back(axes[a].key, axes[a].labels[idx[a]]);
    }
    if (finish) finish(e.doc);
    // The entry's name before it is read: --filter picks entries without reading the others.
    const Value* name_v = e.doc.find("name");
    e.base = name_v != nullptr && name_v->kind == Value::kScalar ? name_v->scalar : default_base;
    e.name = e.base;
    if (!e.labels.empty()) {
      std::vector<std::string> parts;
      for (const auto& [k, l] : e.labels) parts.push_back(k + "=" + l);
      e.name += fmt::format("[{}]", fmt::join(parts, ","));
    }
    if (!visit(e)) return;
    bool carry = true;  // advance the odometer; a carry out of the first axis ends it
    for (size_t a = axes.size(); a > 0 && carry; --a) {
      carry = ++idx[a - 1] == axes[a - 1].values.size();
      if (carry) idx[a - 1] = 0;
    }
    if (carry) return;
  }
}

}  // namespace meshproof::harness
