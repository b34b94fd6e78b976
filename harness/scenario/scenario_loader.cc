// The strict scenario loader (docs/design.md sections 7, 10 and 18): located YAML
// (harness/scenario/located_yaml.h) -> --set overrides -> matrix expansion
// (harness/scenario/scenario_matrix.h) -> one Scenario per entry
// (harness/scenario/scenario_resolver.h), every problem collected with its entry.
#include "harness/scenario/scenario_loader.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "harness/checks/golden.h"
#include "harness/scenario/located_yaml.h"
#include "harness/scenario/scenario_keys.h"
#include "harness/scenario/scenario_matrix.h"
#include "harness/scenario/scenario_resolver.h"
#include "kernels/core/error.h"

namespace meshproof::harness {

namespace {

using yaml::describe;
using yaml::fail;
using yaml::Issue;
using yaml::Issues;
using yaml::report;
using yaml::Stop;
using yaml::Value;

std::string file_stem(const std::string& source) {
  return std::filesystem::path(source).stem().string();
}

}  // namespace

namespace {

// One problem and the matrix entries it was found in (empty: the document itself).
struct Found {
  Issue issue;
  std::vector<std::string> entries;
};

// " (in matrix entry a[x=1])", " (in matrix entries a[x=1], a[x=2] and 3 more)".
std::string entries_note(const std::vector<std::string>& entries) {
  constexpr size_t kShown = 3;
  std::vector<std::string> shown(
      entries.begin(),
      entries.begin() + static_cast<std::ptrdiff_t>(std::min(entries.size(), kShown)));
  std::string more = entries.size() > kShown ? fmt::format(" and {} more", entries.size() - kShown)
                                             : std::string();
  return fmt::format(" (in matrix entr{} {}{})", entries.size() == 1 ? "y" : "ies",
                     fmt::join(shown, ", "), more);
}

}  // namespace

std::vector<Scenario> load_scenario_text(std::string_view yaml, const std::string& source,
                                         const std::vector<Override>& overrides,
                                         const std::string& filter) {
  Issues doc_issues;  // problems of the document (parse, tree, overrides, matrix)
  std::vector<Found> found;
  std::vector<Scenario> out;
  size_t entries_read = 0;
  bool has_matrix = false, truncated = false;
  auto count = [&] { return doc_issues.list.size() + found.size(); };
  {
    yaml::Collect collect(doc_issues);
    try {
      Value root = yaml::parse_document(yaml, source);
      const std::string root_where = fmt::format("{}:1:1", source);
      if (root.kind != Value::kMap) {
        fail(root_where, "scenario",
             fmt::format("expected a mapping of keys, got {}", describe(root)));
      }
      if (Value* r = root.find("recipe")) *r = recipe_shorthand(*r);

      std::vector<std::pair<Override, Value>> later;
      for (const Override& o : overrides) {
        Value v = yaml::override_value(o);
        if (yaml::split_path(o.path)[0] == "matrix") {
          yaml::set_at(root, o.path, std::move(v), yaml::set_where(o), normalize_recipe);
        } else {
          later.emplace_back(o, std::move(v));
        }
      }

      // Every top-level key but name, description and matrix can be a matrix key.
      std::vector<std::string> matrix_keys;
      for (const std::string& k : section_keys(scenario_keys(), "")) {
        if (k != "name" && k != "description" && k != "matrix") matrix_keys.push_back(k);
      }
      std::vector<MatrixAxis> axes;
      if (const Value* m = root.find("matrix")) axes = read_matrix(*m, matrix_keys);
      const std::string matrix_where = root.key_location("matrix");
      root.erase("matrix");
      has_matrix = !axes.empty();
      const double entries = matrix_entries(axes);
      if (entries > static_cast<double>(kMaxMatrixEntries)) {
        fail(matrix_where, "matrix",
             fmt::format("expands to {:.0f} scenarios, more than {}", entries, kMaxMatrixEntries));
      }

      std::set<std::string> seen;
      const auto apply_later = [&](Value& doc_i) {
        for (const auto& [o, v] : later)
          yaml::set_at(doc_i, o.path, v, yaml::set_where(o), normalize_recipe);
      };
      expand_matrix(
          root, axes, file_stem(source), normalize_recipe, apply_later, [&](MatrixEntry& e) {
            const Value& doc_i = e.doc;
            const std::string& name = e.name;
            const std::string& base = e.base;
            const auto& labels = e.labels;
            if (filter.empty() || name == filter || base == filter) {
              ++entries_read;
              Issues entry;
              entry.limit = std::max<size_t>(1, kMaxIssues - std::min(kMaxIssues, count()));
              {
                yaml::Collect collect_entry(entry);
                try {
                  Scenario sc = resolve_scenario(doc_i, source, file_stem(source));
                  sc.matrix_labels = labels;
                  sc.name = name;
                  if (!seen.insert(sc.name).second) {
                    fail(root_where, "matrix",
                         fmt::format("two entries expand to the same name '{}'", sc.name));
                  }
                  // Matrix labels are free text: the folder the name derives must stay usable.
                  const std::string dir = golden_scenario_dir(sc.name);
                  if (dir.size() > kMaxNameBytes) {
                    report(
                        sc.name_where, "name",
                        fmt::format("the expanded name gives a folder name of {} bytes, more than "
                                    "{} (shorten the name or the matrix labels)",
                                    dir.size(), kMaxNameBytes));
                  }
                  if (entry.list.empty()) out.push_back(std::move(sc));
                } catch (const Stop&) {
                }
              }
              // One problem per key: the engine's rule and the loader's stricter policy on the
              // same key (or one rule seen from two runs) would say the same thing twice.
              std::set<std::string> paths;
              std::vector<Issue> kept;
              for (const Issue& i : entry.list) {
                if (paths.insert(i.path).second) kept.push_back(i);
              }
              for (const Issue& i : kept) {
                auto it = std::find_if(found.begin(), found.end(),
                                       [&](const Found& f) { return f.issue.line() == i.line(); });
                if (it == found.end()) {
                  found.push_back({i, {name}});
                } else {
                  it->entries.push_back(name);
                }
              }
              if (count() >= kMaxIssues) {
                truncated = true;
                return false;
              }
            }
            return true;
          });
    } catch (const Stop&) {
      truncated = truncated || count() >= kMaxIssues;
    }
  }
  if (count() == 0) return out;
  std::vector<std::string> lines;
  for (const Issue& i : doc_issues.list) lines.push_back(i.line());
  for (const Found& f : found) {
    // Name the entries unless every entry read has the problem (then it is the file's).
    const bool everywhere = f.entries.size() == entries_read && entries_read > 1;
    lines.push_back(f.issue.line() +
                    (has_matrix && !everywhere ? entries_note(f.entries) : std::string()));
  }
  if (truncated) {
    lines.push_back(fmt::format("{}: stopped after {} problems", source, kMaxIssues));
  }
  MP_FAIL_INPUT("{}", fmt::join(lines, "\n"));
}

std::vector<Scenario> load_scenario_file(const std::string& path,
                                         const std::vector<Override>& overrides,
                                         const std::string& filter) {
  std::ifstream in(path, std::ios::binary);
  if (!in) MP_FAIL_INPUT("{}: cannot open the scenario file", path);
  std::ostringstream text;
  text << in.rdbuf();
  return load_scenario_text(text.str(), path, overrides, filter);
}

void check_unique_name(const Scenario& s, std::map<std::string, std::string>& seen) {
  const auto [it, inserted] = seen.emplace(s.name, s.name_where);
  if (!inserted) {
    fail(s.name_where, "name",
         fmt::format("scenario name '{}' is also used by {} (reports and goldens key on it)",
                     s.name, it->second));
  }
}

std::vector<std::string> expand_scenario_paths(const std::vector<std::string>& paths) {
  std::vector<std::string> files;
  for (const std::string& p : paths) {
    std::error_code ec;
    if (std::filesystem::is_directory(p, ec)) {
      std::vector<std::string> found;
      for (const auto& entry : std::filesystem::recursive_directory_iterator(p)) {
        if (entry.is_regular_file() &&
            (entry.path().extension() == ".yaml" || entry.path().extension() == ".yml"))
          found.push_back(entry.path().string());
      }
      std::sort(found.begin(), found.end());
      if (found.empty()) MP_FAIL_INPUT("{}: the folder holds no .yaml scenarios", p);
      files.insert(files.end(), found.begin(), found.end());
    } else {
      files.push_back(p);
    }
  }
  return files;
}

}  // namespace meshproof::harness
