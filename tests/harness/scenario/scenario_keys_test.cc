// The scenario key table (harness/scenario/scenario_keys.h): docs/scenarios.md lists exactly its
// keys with its defaults; Scenario() and the loader agree on every default; every ranged or
// enumerated key is read by the table (its range and names in the message); one recipe-name table.
#include "harness/scenario/scenario_keys.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "harness/scenario/scenario_loader.h"
#include "kernels/core/error.h"
#include "tests/source_dir.h"

namespace meshproof::harness {
namespace {

namespace fs = std::filesystem;

using test_support::source_dir;

std::string strip(std::string s) {
  s.erase(std::remove(s.begin(), s.end(), '`'), s.end());
  const size_t b = s.find_first_not_of(' '), e = s.find_last_not_of(' ');
  return b == std::string::npos ? "" : s.substr(b, e - b + 1);
}

// Every `| key | type | default | ... |` row of docs/scenarios.md's "## Keys" tables: full key
// path -> default column (backticks dropped). A table belongs to the `### `section`` above it
// ("### Top level": no prefix), or under `checks` to the "`golden` — ..." paragraph above it.
std::map<std::string, std::string> documented_in(const fs::path& md) {
  std::ifstream in(md);
  std::map<std::string, std::string> rows;
  std::string line, section, prefix;
  bool in_keys = false, have_section = false, key_table = false;
  const std::regex heading(R"(^### `([a-z_]+)`$)"), paragraph(R"(^`([a-z_]+)` — )");
  std::smatch m;
  while (std::getline(in, line)) {
    if (line.rfind("## ", 0) == 0) in_keys = line == "## Keys";
    if (!in_keys) continue;
    if (line.rfind("### ", 0) == 0) {
      have_section = true;
      if (line == "### Top level") {
        section = prefix = "";
      } else if (std::regex_match(line, m, heading)) {
        section = prefix = m[1].str() + ".";
      } else {
        have_section = false;  // prose sections ("Starting from a checkpoint")
      }
      continue;
    }
    if (!have_section) continue;
    if (std::regex_search(line, m, paragraph)) prefix = section + m[1].str() + ".";
    if (line.rfind("| key |", 0) == 0) {
      key_table = true;
      continue;
    }
    if (line.rfind("|", 0) != 0) {
      key_table = false;
      continue;
    }
    if (!key_table || line.rfind("| ---", 0) == 0) continue;
    // Cells split on unescaped '|' ("enum `a` \| `b`" is one cell).
    std::vector<std::string> cells;
    std::string cell;
    for (size_t i = 1; i < line.size(); ++i) {
      if (line[i] == '\\' && i + 1 < line.size() && line[i + 1] == '|') {
        cell += '|';
        ++i;
      } else if (line[i] == '|') {
        cells.push_back(cell);
        cell.clear();
      } else {
        cell += line[i];
      }
    }
    EXPECT_GE(cells.size(), 3u) << line;
    if (cells.size() < 3) continue;
    const std::string key = prefix + strip(cells[0]);
    EXPECT_EQ(rows.count(key), 0u) << key << " is listed twice in " << md;
    rows[key] = strip(cells[2]);
  }
  return rows;
}

bool same_default(const std::string& docs, const std::string& table) {
  char* end_a = nullptr;
  char* end_b = nullptr;
  const double a = std::strtod(docs.c_str(), &end_a), b = std::strtod(table.c_str(), &end_b);
  if (!docs.empty() && !table.empty() && *end_a == '\0' && *end_b == '\0') return a == b;
  return docs == table;
}

TEST(ScenarioKeysDocs, DocsListExactlyTheKeysOfTheTableWithTheirDefaults) {
  const fs::path md = source_dir() / "docs" / "scenarios.md";
  const std::map<std::string, std::string> docs = documented_in(md);
  std::set<std::string> table;
  for (const KeyDoc& k : documented_keys()) {
    table.insert(k.path);
    const auto it = docs.find(k.path);
    if (it == docs.end()) {
      ADD_FAILURE() << k.path << " (default " << k.default_text << ") is not listed in " << md;
      continue;
    }
    EXPECT_TRUE(same_default(it->second, k.default_text))
        << k.path << ": docs/scenarios.md says the default is '" << it->second
        << "', the key table '" << k.default_text << "'";
  }
  for (const auto& [path, def] : docs) {
    EXPECT_EQ(table.count(path), 1u) << path << " is listed in " << md << " but is no key";
  }
}

// The comparison above can fail: a key the docs lack, a default that differs.
TEST(ScenarioKeysDocs, TheComparisonSeesAMissingKeyAndAWrongDefault) {
  const fs::path md = fs::temp_directory_path() / "meshproof_keys_docs_test.md";
  {
    std::ofstream out(md);
    out << "## Keys\n\n### `model`\n\n| key | type | default | rule |\n| --- | --- | --- | --- |\n"
        << "| `vocab` | int | 255 | x |\n| `hiden` | int | 64 | \\| y |\n";
  }
  const std::map<std::string, std::string> docs = documented_in(md);
  fs::remove(md);
  EXPECT_EQ(docs.size(), 2u);
  EXPECT_FALSE(same_default(docs.at("model.vocab"), "256"));
  EXPECT_EQ(docs.count("model.hidden"), 0u);
  EXPECT_TRUE(same_default("1e-3", "0.001"));
  EXPECT_TRUE(same_default("4 x hidden", "4 x hidden"));
}

TEST(ScenarioKeys, ScenarioDefaultsAreTheLoadersDefaults) {
  const std::vector<Scenario> loaded = load_scenario_text("name: stem\n", "stem.yaml");
  ASSERT_EQ(loaded.size(), 1u);
  Scenario d;
  d.name = "stem";
  EXPECT_EQ(canonical_text(d), canonical_text(loaded[0]));
  // The engine objects hold the scenario's documented defaults, not the engine's.
  EXPECT_EQ(d.model.vocab, 256);
  EXPECT_EQ(d.model.ffn, 4 * d.model.hidden);
  EXPECT_EQ(d.train.seq_len, 32);
  EXPECT_EQ(d.model.max_positions, d.train.seq_len);
  EXPECT_EQ(d.recipe.kind, RecipeKind::kBf16);
  EXPECT_EQ(d.seed, 1234u);
}

// model.preset (docs/design.md section 24): llama3_debug sets the defaults of the model keys;
// keys written next to it override them one by one; the default preset leaves the GPT-2-like
// model (and its hash) as it was.
TEST(ScenarioKeys, Llama3DebugPresetSetsDefaultsAndKeysOverrideIt) {
  const std::vector<Scenario> llama = load_scenario_text(
      "name: p\nmodel: {preset: llama3_debug, layers: 2, vocab: 2047}\n", "p.yaml");
  ASSERT_EQ(llama.size(), 1u);
  const engine::ModelConfig& m = llama[0].model;
  EXPECT_EQ(m.hidden, 256);
  EXPECT_EQ(m.heads, 16);
  EXPECT_EQ(engine::kv_heads_of(m), 4);
  EXPECT_EQ(m.ffn, 768);
  EXPECT_EQ(m.layers, 2);    // overridden
  EXPECT_EQ(m.vocab, 2047);  // overridden
  EXPECT_EQ(m.norm, engine::NormKind::kRmsNorm);
  EXPECT_EQ(m.activation, engine::Activation::kSwiGlu);
  EXPECT_EQ(m.position, engine::PositionKind::kRope);
  EXPECT_EQ(m.rope_theta, 500000.0);
  EXPECT_FALSE(m.bias);
  EXPECT_TRUE(m.vocab_parallel);
  const std::vector<Scenario> gpt =
      load_scenario_text("name: stem\nmodel: {preset: gpt_small}\n", "stem.yaml");
  Scenario d;
  d.name = "stem";
  EXPECT_EQ(canonical_text(d), canonical_text(gpt.at(0)));
  EXPECT_EQ(engine::kv_heads_of(gpt.at(0).model), gpt.at(0).model.heads);
  EXPECT_EQ(gpt.at(0).model.position, engine::PositionKind::kLearned);
  EXPECT_TRUE(gpt.at(0).model.bias);
}

TEST(ScenarioKeys, EveryRecipeNameComesFromTheEngineTable) {
  const Key<engine::RecipeConfig>& name = key_at(recipe_keys(), "name");
  ASSERT_EQ(name.choices.size(), std::size(engine::kRecipeNames));
  for (size_t i = 0; i < name.choices.size(); ++i) {
    EXPECT_EQ(name.choices[i], engine::kRecipeNames[i].name);
    EXPECT_EQ(static_cast<size_t>(engine::kRecipeNames[i].kind), i);  // index = enum value
    EXPECT_EQ(to_string(engine::kRecipeNames[i].kind), engine::kRecipeNames[i].name);
    EXPECT_EQ(engine::parse_recipe(name.choices[i], "recipe"), engine::kRecipeNames[i].kind);
  }
}

// "a.b" (or "a.b.c": model.moe.*) = VALUE as a YAML document, one mapping per level.
std::string yaml_at(const std::string& path, const std::string& value) {
  std::string out, indent;
  size_t begin = 0;
  for (size_t dot; (dot = path.find('.', begin)) != std::string::npos; begin = dot + 1) {
    out += indent + path.substr(begin, dot - begin) + ":\n";
    indent += "  ";
  }
  return out + indent + path.substr(begin) + ": " + value + "\n";
}

std::string first_problem(const std::string& yaml) {
  try {
    load_scenario_text(yaml, "x.yaml");
  } catch (const kernels::Error& e) {
    const std::string m = e.message();
    return m.substr(0, m.find('\n'));
  }
  return "";
}

// The keys a section read takes from the table (those under checks are read with their checks'
// own rules, and bounds that depend on other keys are shown with those keys in other tests).
std::vector<std::string> table_read_keys(KeyType type) {
  std::vector<std::string> out;
  for (const Key<Scenario>& k : scenario_keys()) {
    if (k.type == type && k.set && k.path.rfind("checks.", 0) != 0 && !k.imax_of && !k.dmax_of)
      out.push_back(k.path);
  }
  for (const Key<engine::MeshSpec>& k : mesh_keys()) {
    if (k.type == type && k.set) out.push_back("mesh." + k.path);
  }
  for (const Key<engine::RecipeConfig>& k : recipe_keys()) {
    if (k.type == type && k.set) out.push_back("recipe." + k.path);
  }
  return out;
}

// The key's entry whichever table holds it.
template <class F>
auto with_key(const std::string& path, F f) {
  if (path.rfind("mesh.", 0) == 0) return f(key_at(mesh_keys(), path.substr(5)));
  if (path.rfind("recipe.", 0) == 0) return f(key_at(recipe_keys(), path.substr(7)));
  return f(key_at(scenario_keys(), path));
}

class IntKey : public ::testing::TestWithParam<std::string> {};

TEST_P(IntKey, BelowItsRangeIsAnErrorAtTheKeyNamingTheTablesRange) {
  const std::string& path = GetParam();
  const auto [min, max] = with_key(path, [](const auto& k) { return std::pair{k.imin, k.imax}; });
  const std::string got = first_problem(yaml_at(path, std::to_string(min - 1)));
  const std::string want =
      fmt::format(": {}: must be in [{}, {}], got {}", path, min, max, min - 1);
  EXPECT_NE(got.find(want), std::string::npos) << got << "\nwanted ..." << want;
  EXPECT_EQ(got.rfind("x.yaml:", 0), 0u) << got;
}

INSTANTIATE_TEST_SUITE_P(ScenarioKeys, IntKey, ::testing::ValuesIn(table_read_keys(KeyType::kInt)),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           std::string n = i.param;
                           std::replace(n.begin(), n.end(), '.', '_');
                           return n;
                         });

class NumberKey : public ::testing::TestWithParam<std::string> {};

TEST_P(NumberKey, BelowItsRangeIsAnErrorAtTheKeyNamingTheTablesRange) {
  const std::string& path = GetParam();
  const std::string range = with_key(path, [](const auto& k) {
    return fmt::format("{}{}, {}{}", k.min_open ? "(" : "[", k.dmin, k.dmax,
                       k.max_open ? ")" : "]");
  });
  const std::string got = first_problem(yaml_at(path, "-1"));
  const std::string want = fmt::format(": {}: must be in {}, got -1", path, range);
  EXPECT_NE(got.find(want), std::string::npos) << got << "\nwanted ..." << want;
}

INSTANTIATE_TEST_SUITE_P(ScenarioKeys, NumberKey,
                         ::testing::ValuesIn(table_read_keys(KeyType::kNumber)),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           std::string n = i.param;
                           std::replace(n.begin(), n.end(), '.', '_');
                           return n;
                         });

class EnumKey : public ::testing::TestWithParam<std::string> {};

TEST_P(EnumKey, AnUnknownNameListsTheTablesNames) {
  const std::string& path = GetParam();
  const std::vector<std::string> names = with_key(path, [](const auto& k) { return k.choices; });
  const std::string got = first_problem(yaml_at(path, "zzzzzzzz"));
  const std::string want =
      fmt::format(": {}: expected one of {}, got 'zzzzzzzz'", path, fmt::join(names, "|"));
  EXPECT_NE(got.find(want), std::string::npos) << got << "\nwanted ..." << want;
}

INSTANTIATE_TEST_SUITE_P(ScenarioKeys, EnumKey,
                         ::testing::ValuesIn(table_read_keys(KeyType::kEnum)),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           std::string n = i.param;
                           std::replace(n.begin(), n.end(), '.', '_');
                           return n;
                         });

class BoolKey : public ::testing::TestWithParam<std::string> {};

TEST_P(BoolKey, ANonBooleanIsAnErrorAtTheKey) {
  const std::string got = first_problem(yaml_at(GetParam(), "maybe"));
  EXPECT_NE(got.find(fmt::format(": {}: expected true or false, got 'maybe'", GetParam())),
            std::string::npos)
      << got;
}

INSTANTIATE_TEST_SUITE_P(ScenarioKeys, BoolKey,
                         ::testing::ValuesIn(table_read_keys(KeyType::kBool)),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           std::string n = i.param;
                           std::replace(n.begin(), n.end(), '.', '_');
                           return n;
                         });

// Every hashed key reaches the canonical form: changing it changes scenario_hash.
class HashedKey : public ::testing::TestWithParam<std::string> {};

TEST_P(HashedKey, ANonDefaultValueChangesTheHash) {
  Scenario base;
  base.name = "h";
  const std::string& path = GetParam();
  // The model.moe keys are hashed with MoE on (a dense scenario's canonical text is unchanged).
  if (path.rfind("model.moe.", 0) == 0 && path != "model.moe.experts") base.model.moe.experts = 4;
  Scenario changed = base;
  with_key(path, [&](const auto& k) {
    KeyValue v = k.def;
    if (auto* i = std::get_if<int64_t>(&v)) *i = *i + 1;
    if (auto* d = std::get_if<double>(&v)) *d = *d + 0.25;
    if (auto* b = std::get_if<bool>(&v)) *b = !*b;
    if (auto* s = std::get_if<std::string>(&v)) *s = k.choices.size() > 1 ? k.choices[1] : "d";
    if (k.choices.size() > 1 && v == k.def) v = k.choices[0];
    using T = std::decay_t<decltype(k)>;
    if constexpr (std::is_same_v<T, Key<engine::MeshSpec>>) {
      k.set(changed.mesh, v);
    } else if constexpr (std::is_same_v<T, Key<engine::RecipeConfig>>) {
      k.set(changed.recipe, v);
    } else {
      k.set(changed, v);
    }
    return 0;
  });
  EXPECT_NE(scenario_hash(base), scenario_hash(changed)) << path;
}

std::vector<std::string> hashed_keys() {
  std::vector<std::string> out;
  for (const Key<Scenario>& k : scenario_keys()) {
    // data.kind has one value: there is nothing else to hash.
    if (k.hashed && k.set && !(k.type == KeyType::kEnum && k.choices.size() < 2)) {
      out.push_back(k.path);
    }
  }
  for (const Key<engine::MeshSpec>& k : mesh_keys()) {
    if (k.hashed && k.set) out.push_back("mesh." + k.path);
  }
  for (const Key<engine::RecipeConfig>& k : recipe_keys()) {
    if (k.hashed && k.set) out.push_back("recipe." + k.path);
  }
  return out;
}

INSTANTIATE_TEST_SUITE_P(ScenarioKeys, HashedKey, ::testing::ValuesIn(hashed_keys()),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           std::string n = i.param;
                           std::replace(n.begin(), n.end(), '.', '_');
                           return n;
                         });

}  // namespace
}  // namespace meshproof::harness
