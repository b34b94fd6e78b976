#include "harness/scenario_loader.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>

#include "engine/params.h"
#include "engine/run_rules.h"
#include "harness/golden.h"
#include "harness/scenario_faults.h"
#include "harness/train_run.h"
#include "kernels/error.h"

namespace meshproof::harness {

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> prev(b.size() + 1), cur(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) prev[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    cur[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t subst = prev[j - 1] + (a[i - 1] == b[j - 1] ? 0 : 1);
      cur[j] = std::min({prev[j] + 1, cur[j - 1] + 1, subst});
    }
    std::swap(prev, cur);
  }
  return prev[b.size()];
}

namespace {

// ---------------------------------------------------------------------------------------------
// A YAML tree that remembers where every value came from. yaml-cpp's Clone() drops marks, and
// matrix entries and --set overrides must keep pointing at the line (or override) that wrote
// them, so the loader works on this copy.

// Every problem of a file is collected (up to kMaxIssues) and reported together. report()
// records one and goes on (the value read falls back to its default); fail() records one the
// loader cannot read past and stops the document (or the matrix entry) with Stop.
struct Issue {
  std::string where, path, what;
  std::string line() const { return fmt::format("{}: {}: {}", where, path, what); }
};
struct Issues {
  std::vector<Issue> list;
  size_t limit = kMaxIssues;
};
struct Stop {};  // unwinds to the document or matrix entry being read
thread_local Issues* g_issues = nullptr;

// Installs `issues` as the collector of this thread for its lifetime.
class Collect {
 public:
  explicit Collect(Issues& issues) : prev_(g_issues) { g_issues = &issues; }
  ~Collect() { g_issues = prev_; }
  Collect(const Collect&) = delete;
  Collect& operator=(const Collect&) = delete;

 private:
  Issues* prev_;
};

void report(const std::string& where, const std::string& path, const std::string& what) {
  if (g_issues == nullptr) MP_FAIL_INPUT("{}: {}: {}", where, path, what);
  g_issues->list.push_back({where, path, what});
  if (g_issues->list.size() >= g_issues->limit) throw Stop{};
}

[[noreturn]] void fail(const std::string& where, const std::string& path, const std::string& what) {
  report(where, path, what);
  throw Stop{};
}

struct Value {
  enum Kind { kNull, kScalar, kSeq, kMap };
  Kind kind = kNull;
  std::string where;    // "FILE:LINE:COL" or "--set PATH=VALUE"
  std::string scalar;   // kScalar
  bool quoted = false;  // a quoted scalar is always a string
  std::vector<Value> seq;
  // kMap, keys in document order; key_where[i] locates key i.
  std::vector<std::pair<std::string, Value>> map;
  std::vector<std::string> key_where;

  Value();
  Value(const Value&);
  Value(Value&&) noexcept;
  Value& operator=(const Value&);
  Value& operator=(Value&&) noexcept;
  ~Value();

  const Value* find(const std::string& key) const {
    for (const auto& [k, v] : map) {
      if (k == key) return &v;
    }
    return nullptr;
  }
  Value* find(const std::string& key) {
    for (auto& [k, v] : map) {
      if (k == key) return &v;
    }
    return nullptr;
  }
  void erase(const std::string& key) {
    for (size_t i = 0; i < map.size(); ++i) {
      if (map[i].first == key) {
        map.erase(map.begin() + static_cast<std::ptrdiff_t>(i));
        key_where.erase(key_where.begin() + static_cast<std::ptrdiff_t>(i));
        return;
      }
    }
  }
  std::string key_location(const std::string& key) const {
    for (size_t i = 0; i < map.size(); ++i) {
      if (map[i].first == key) return key_where[i];
    }
    return where;
  }
};
// Defined once Value is complete: clang 14 with libstdc++ 12 (the sanitizer/fuzz build, design.md
// section 17) rejects the implicit ones, which instantiate std::pair<std::string, Value> inside
// Value's own definition.
Value::Value() = default;
Value::Value(const Value&) = default;
Value::Value(Value&&) noexcept = default;
Value& Value::operator=(const Value&) = default;
Value& Value::operator=(Value&&) noexcept = default;
Value::~Value() = default;

std::string join_path(const std::string& parent, const std::string& key) {
  return parent.empty() ? key : parent + "." + key;
}

std::string describe(const Value& v) {
  switch (v.kind) {
    case Value::kNull:
      return "nothing (null)";
    case Value::kSeq:
      return "a sequence";
    case Value::kMap:
      return "a mapping";
    case Value::kScalar:
      break;
  }
  return v.quoted ? fmt::format("the string \"{}\"", v.scalar) : fmt::format("'{}'", v.scalar);
}

using WhereFn = std::function<std::string(const YAML::Mark&)>;

// Bounds of one document's tree (docs/design.md section 11). yaml-cpp resolves an alias to the node
// it names, so `d: &a [*a]` is a cycle and 8 levels of 9 aliases are 9^8 nodes once expanded:
// the walk below counts nodes and depth as it copies and stops at the first bound it passes,
// before the expansion can grow.
struct TreeBudget {
  size_t nodes = 0;
};

Value convert(const YAML::Node& node, const WhereFn& where_of, const std::string& path,
              TreeBudget& budget, int depth = 0) {
  Value v;
  v.where = where_of(node.Mark());
  const std::string shown = path.empty() ? "scenario" : path;
  if (depth > kMaxDepth) {
    fail(
        v.where, shown,
        fmt::format("nested more than {} levels deep (a self-referential YAML alias?)", kMaxDepth));
  }
  if (++budget.nodes > kMaxNodes) {
    fail(v.where, shown,
         fmt::format("the document expands to more than {} values (YAML aliases repeat what "
                     "they name)",
                     kMaxNodes));
  }
  switch (node.Type()) {
    case YAML::NodeType::Undefined:
    case YAML::NodeType::Null:
      v.kind = Value::kNull;
      break;
    case YAML::NodeType::Scalar:
      v.kind = Value::kScalar;
      if (node.Scalar().size() > kMaxScalarBytes) {
        fail(v.where, shown,
             fmt::format("a value of {} bytes; values are at most {} bytes", node.Scalar().size(),
                         kMaxScalarBytes));
      }
      v.scalar = node.Scalar();
      v.quoted = node.Tag() == "!";
      break;
    case YAML::NodeType::Sequence: {
      v.kind = Value::kSeq;
      size_t i = 0;
      for (const YAML::Node& item : node) {
        v.seq.push_back(
            convert(item, where_of, fmt::format("{}[{}]", path, i++), budget, depth + 1));
      }
      break;
    }
    case YAML::NodeType::Map:
      v.kind = Value::kMap;
      for (auto it = node.begin(); it != node.end(); ++it) {
        const std::string key_where = where_of(it->first.Mark());
        if (!it->first.IsScalar()) fail(key_where, shown, "keys must be plain names");
        if (it->first.Scalar().size() > kMaxScalarBytes) {
          fail(key_where, shown,
               fmt::format("a key of {} bytes; keys are at most {} bytes",
                           it->first.Scalar().size(), kMaxScalarBytes));
        }
        const std::string key = it->first.Scalar();
        const std::string child_path = join_path(path, key);
        if (v.find(key) != nullptr) {
          report(key_where, child_path,
                 fmt::format("duplicate key (first given at {})", v.key_location(key)));
          continue;
        }
        v.map.emplace_back(key, convert(it->second, where_of, child_path, budget, depth + 1));
        v.key_where.push_back(key_where);
      }
      break;
  }
  return v;
}

// `recipe: mxfp8` is shorthand for `recipe: {name: mxfp8}`.
Value recipe_shorthand(const Value& v) {
  if (v.kind != Value::kScalar) return v;
  Value m;
  m.kind = Value::kMap;
  m.where = v.where;
  m.map.emplace_back("name", v);
  m.key_where.push_back(v.where);
  return m;
}

// Mappings merge key by key (the incoming side wins); anything else replaces.
void merge_into(Value& target, const Value& incoming) {
  if (target.kind == Value::kMap && incoming.kind == Value::kMap) {
    for (size_t i = 0; i < incoming.map.size(); ++i) {
      const auto& [key, val] = incoming.map[i];
      if (Value* existing = target.find(key)) {
        merge_into(*existing, val);
      } else {
        target.map.emplace_back(key, val);
        target.key_where.push_back(incoming.key_where[i]);
      }
    }
    return;
  }
  target = incoming;
}

std::vector<std::string> split_path(const std::string& path) {
  std::vector<std::string> parts;
  std::string cur;
  for (char c : path) {
    if (c == '.') {
      parts.push_back(cur);
      cur.clear();
    } else {
      cur += c;
    }
  }
  parts.push_back(cur);
  return parts;
}

// Sets (merges) `incoming` at dotted `path` below `root`, creating mappings on the way.
void set_at(Value& root, const std::string& path, Value incoming, const std::string& where) {
  const std::vector<std::string> parts = split_path(path);
  Value* cur = &root;
  std::string walked;
  for (size_t i = 0; i < parts.size(); ++i) {
    const std::string& key = parts[i];
    if (cur->kind == Value::kNull) {
      cur->kind = Value::kMap;
      cur->where = where;
    }
    if (cur->kind != Value::kMap) {
      fail(where, walked,
           fmt::format("is {}, not a mapping: cannot set '{}' inside it", describe(*cur), key));
    }
    walked = join_path(walked, key);
    Value* child = cur->find(key);
    if (i + 1 == parts.size()) {
      if (walked == "recipe" || walked == "checks.reference.recipe") {
        incoming = recipe_shorthand(incoming);
      }
      if (child != nullptr) {
        merge_into(*child, incoming);
      } else {
        cur->map.emplace_back(key, std::move(incoming));
        cur->key_where.push_back(where);
      }
      return;
    }
    if (child == nullptr) {
      Value empty;
      empty.where = where;
      cur->map.emplace_back(key, empty);
      cur->key_where.push_back(where);
      child = &cur->map.back().second;
    }
    cur = child;
  }
}

// ---------------------------------------------------------------------------------------------
// Did-you-mean.

std::string suggestion(const std::string& word, const std::vector<std::string>& candidates) {
  std::string best;
  size_t best_d = std::string::npos;
  for (const std::string& c : candidates) {
    const size_t d = edit_distance(word, c);
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  // Close enough to be a typo: at most 2 edits, or a third of the word for long names.
  const size_t limit = std::max<size_t>(2, word.size() / 3);
  if (best_d == std::string::npos || best_d > limit) return "";
  return best;
}

std::string unknown_message(const std::string& what, const std::string& word,
                            const std::vector<std::string>& allowed) {
  const std::string best = suggestion(word, allowed);
  if (!best.empty()) return fmt::format("unknown {}; did you mean '{}'?", what, best);
  return fmt::format("unknown {} (allowed: {})", what, fmt::join(allowed, ", "));
}

// ---------------------------------------------------------------------------------------------
// Typed, strict reading.

// Where each resolved key came from, for consistency errors raised after reading: the value's
// location when given, else the enclosing mapping's (the defaults live there).
using Locations = std::map<std::string, std::string>;

// Linear scanners (std::regex recurses per character and overflows the stack on scalars of a
// few ten thousand characters).
bool is_digit(char c) { return c >= '0' && c <= '9'; }

// [+-]?[0-9]+
bool is_integer_text(std::string_view s) {
  size_t i = (!s.empty() && (s[0] == '+' || s[0] == '-')) ? 1 : 0;
  if (i == s.size()) return false;
  for (; i < s.size(); ++i) {
    if (!is_digit(s[i])) return false;
  }
  return true;
}

// [+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?
bool is_float_text(std::string_view s) {
  size_t i = (!s.empty() && (s[0] == '+' || s[0] == '-')) ? 1 : 0;
  size_t int_digits = 0, frac_digits = 0;
  while (i < s.size() && is_digit(s[i])) ++i, ++int_digits;
  if (i < s.size() && s[i] == '.') {
    ++i;
    while (i < s.size() && is_digit(s[i])) ++i, ++frac_digits;
  }
  if (int_digits == 0 && frac_digits == 0) return false;
  if (i < s.size() && (s[i] == 'e' || s[i] == 'E')) {
    ++i;
    if (i < s.size() && (s[i] == '+' || s[i] == '-')) ++i;
    size_t exp_digits = 0;
    while (i < s.size() && is_digit(s[i])) ++i, ++exp_digits;
    if (exp_digits == 0) return false;
  }
  return i == s.size();
}

// [A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*
bool is_key_path(std::string_view s) {
  bool empty_part = true;
  for (char c : s) {
    if (c == '.') {
      if (empty_part) return false;
      empty_part = true;
      continue;
    }
    const bool ok = (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || is_digit(c) || c == '_';
    if (!ok) return false;
    empty_part = false;
  }
  return !empty_part;
}

bool parse_int(const std::string& s, int64_t& out) {
  if (!is_integer_text(s)) return false;
  const char* begin = s.data() + (s[0] == '+' ? 1 : 0);
  const auto [ptr, ec] = std::from_chars(begin, s.data() + s.size(), out);
  return ec == std::errc() && ptr == s.data() + s.size();
}

bool parse_float(const std::string& s, double& out) {
  if (!is_float_text(s)) return false;
  char* end = nullptr;
  out = std::strtod(s.c_str(), &end);
  return end == s.c_str() + s.size() && std::isfinite(out);
}

class Section {
 public:
  // `v` may be null (the section is absent: every key takes its default); a section written
  // with no value (`mesh:` or `mesh: ~`) is an error, like every null.
  Section(const Value* v, std::string path, std::string absent_where, Locations& locs,
          std::vector<std::string> keys)
      : v_(v), path_(std::move(path)), locs_(locs), keys_(std::move(keys)) {
    where_ = v != nullptr ? v->where : std::move(absent_where);
    if (v_ != nullptr && v_->kind != Value::kMap) {
      fail(v_->where, path_, fmt::format("expected a mapping, got {}", describe(*v_)));
    }
    if (v_ != nullptr) {
      for (size_t i = 0; i < v_->map.size(); ++i) {
        const std::string& key = v_->map[i].first;
        if (std::find(keys_.begin(), keys_.end(), key) == keys_.end()) {
          report(v_->key_where[i], child(key), unknown_message("key", key, keys_));
        }
      }
    }
    locs_[path_] = where_;
  }

  const std::string& path() const { return path_; }
  const std::string& where() const { return where_; }
  std::string child(const std::string& key) const { return join_path(path_, key); }
  const Value* get(const std::string& key) const { return v_ != nullptr ? v_->find(key) : nullptr; }
  bool has(const std::string& key) const { return get(key) != nullptr; }
  std::string where(const std::string& key) const {
    const Value* v = get(key);
    return v != nullptr ? v->where : where_;
  }

  int64_t integer(const std::string& key, int64_t def, int64_t min, int64_t max) {
    const Value* v = note(key);
    if (v == nullptr) return def;
    int64_t out = 0;
    if (v->kind != Value::kScalar || v->quoted || !parse_int(v->scalar, out)) {
      report(v->where, child(key), fmt::format("expected an integer, got {}", describe(*v)));
      return def;
    }
    if (out < min || out > max) {
      report(v->where, child(key), fmt::format("must be in [{}, {}], got {}", min, max, out));
      return def;
    }
    return out;
  }

  // A finite number in [min, max] (or (min, max] when min_exclusive).
  double number(const std::string& key, double def, double min, double max,
                bool min_exclusive = false, bool max_exclusive = false) {
    const Value* v = note(key);
    if (v == nullptr) return def;
    double out = 0;
    if (v->kind != Value::kScalar || v->quoted || !parse_float(v->scalar, out)) {
      report(v->where, child(key), fmt::format("expected a number, got {}", describe(*v)));
      return def;
    }
    const bool below = min_exclusive ? out <= min : out < min;
    const bool above = max_exclusive ? out >= max : out > max;
    if (below || above) {
      report(v->where, child(key),
             fmt::format("must be in {}{}, {}{}, got {}", min_exclusive ? "(" : "[", min, max,
                         max_exclusive ? ")" : "]", v->scalar));
      return def;
    }
    return out;
  }

  bool boolean(const std::string& key, bool def) {
    const Value* v = note(key);
    if (v == nullptr) return def;
    return as_bool(*v, child(key), def);
  }

  static bool as_bool(const Value& v, const std::string& path, bool def) {
    if (v.kind == Value::kScalar && !v.quoted) {
      if (v.scalar == "true" || v.scalar == "True" || v.scalar == "TRUE") return true;
      if (v.scalar == "false" || v.scalar == "False" || v.scalar == "FALSE") return false;
    }
    report(v.where, path, fmt::format("expected true or false, got {}", describe(v)));
    return def;
  }

  std::string string(const std::string& key, const std::string& def) {
    const Value* v = note(key);
    if (v == nullptr) return def;
    if (v->kind != Value::kScalar) {
      report(v->where, child(key), fmt::format("expected a string, got {}", describe(*v)));
      return def;
    }
    return v->scalar;
  }

  template <typename E>
  E choice(const std::string& key, E def, const std::vector<std::pair<std::string, E>>& table) {
    const Value* v = note(key);
    if (v == nullptr) return def;
    return as_choice(*v, child(key), table, def);
  }

  template <typename E>
  static E as_choice(const Value& v, const std::string& path,
                     const std::vector<std::pair<std::string, E>>& table, E def) {
    std::vector<std::string> names;
    for (const auto& [n, e] : table) names.push_back(n);
    if (v.kind != Value::kScalar) {
      report(v.where, path,
             fmt::format("expected one of {}, got {}", fmt::join(names, "|"), describe(v)));
      return def;
    }
    for (const auto& [n, e] : table) {
      if (n == v.scalar) return e;
    }
    const std::string best = suggestion(v.scalar, names);
    report(v.where, path,
           fmt::format("expected one of {}, got '{}'{}", fmt::join(names, "|"), v.scalar,
                       best.empty() ? "" : fmt::format("; did you mean '{}'?", best)));
    return def;
  }

 private:
  const Value* note(const std::string& key) {
    const Value* v = get(key);
    locs_[child(key)] = v != nullptr ? v->where : where_;
    if (v != nullptr && v->kind == Value::kNull) {
      report(v->where, child(key), "expected a value, got nothing (null)");
      return nullptr;
    }
    return v;
  }

  const Value* v_;
  std::string path_;
  std::string where_;
  Locations& locs_;
  std::vector<std::string> keys_;
};

const std::vector<std::pair<std::string, RecipeKind>> kRecipes = {
    {"fp32", RecipeKind::kFp32},       {"bf16", RecipeKind::kBf16},
    {"delayed", RecipeKind::kDelayed}, {"current", RecipeKind::kCurrent},
    {"mxfp8", RecipeKind::kMxfp8},     {"block", RecipeKind::kBlock}};
const std::vector<std::pair<std::string, Metric>> kMetrics = {{"loss", Metric::kLoss},
                                                              {"grad_norm", Metric::kGradNorm}};

const std::vector<std::string> kTopKeys = {
    "name",    "description", "model",        "mesh",       "recipe", "fsdp",   "train",  "data",
    "backend", "launcher",    "requires_gpu", "checkpoint", "checks", "faults", "expect", "matrix"};

constexpr int64_t kMaxDim = int64_t{1} << 20;

// engine::ConfigIssue key paths and message words in the scenario's names (the engine's Config
// calls the global batch training.batch, the sequence length training.seq_len and also
// model.max_positions, the data order data.markov_order).
const std::pair<std::string_view, std::string_view> kEngineNames[] = {
    {"training.batch", "train.global_batch"}, {"training.seq_len", "model.seq_len"},
    {"model.max_positions", "model.seq_len"}, {"data.markov_order", "data.order"},
    {"recipe.kind", "recipe.name"},           {"training.", "train."}};

std::string scenario_key(const std::string& key) {
  for (const auto& [engine_name, name] : kEngineNames) {
    if (key.rfind(engine_name, 0) == 0) return std::string(name) + key.substr(engine_name.size());
  }
  return key;
}

std::string scenario_text(std::string text) {
  for (const auto& [engine_name, name] : kEngineNames) {
    for (size_t pos = 0; (pos = text.find(engine_name, pos)) != std::string::npos;) {
      text.replace(pos, engine_name.size(), name);
      pos += name.size();
    }
  }
  return text;
}

// Everything the resolver needs about one scenario document.
struct Resolver {
  const Value& root;
  std::string source;
  std::string root_where;
  Locations locs;

  std::string at(const std::string& path) const {
    // The nearest recorded location: the key itself or an enclosing mapping.
    std::string p = path;
    while (true) {
      auto it = locs.find(p);
      if (it != locs.end()) return it->second;
      const size_t dot = p.rfind('.');
      if (dot == std::string::npos) return root_where;
      p = p.substr(0, dot);
    }
  }
  void bad(const std::string& path, const std::string& what) const { report(at(path), path, what); }

  MeshConfig read_mesh(const Value* v, const std::string& path, const std::string& absent_where) {
    Section s(v, path, absent_where, locs,
              {"dp_replicate", "dp_shard", "tp", "sequence_parallel", "world_size"});
    MeshConfig m;
    m.dp_replicate = s.integer("dp_replicate", 1, 1, 4096);
    m.dp_shard = s.integer("dp_shard", 1, 1, 4096);
    m.tp = s.integer("tp", 1, 1, 4096);
    m.sequence_parallel = s.boolean("sequence_parallel", false);
    if (s.has("world_size")) {
      const int64_t ws = s.integer("world_size", 1, 1, int64_t{1} << 24);
      if (ws != m.world_size()) {
        bad(s.child("world_size"),
            fmt::format("{} does not match dp_replicate x dp_shard x tp = {} x {} x {} = {}", ws,
                        m.dp_replicate, m.dp_shard, m.tp, m.world_size()));
      }
    }
    return m;
  }

  RecipeConfig read_recipe(const Value* raw, const std::string& path,
                           const std::string& absent_where) {
    if (raw != nullptr && raw->kind == Value::kNull) {
      fail(raw->where, path, "expected a recipe name or a mapping, got nothing (null)");
    }
    Value shorthand;
    const Value* v = raw;
    if (raw != nullptr && raw->kind == Value::kScalar) {
      shorthand = recipe_shorthand(*raw);
      v = &shorthand;
    }
    Section s(v, path, absent_where, locs,
              {"name", "fp8_format", "margin", "amax_history_len", "amax_compute_algo", "eps",
               "power_2_scale"});
    const RecipeKind kind = s.choice("name", RecipeKind::kBf16, kRecipes);
    RecipeConfig r = default_recipe(kind);
    r.fp8_format = s.choice("fp8_format", r.fp8_format,
                            {{"hybrid", Fp8Format::kHybrid}, {"e4m3", Fp8Format::kE4M3}});
    r.margin = s.integer("margin", 0, 0, 64);
    r.amax_history_len = s.integer("amax_history_len", 1024, 1, 1 << 16);
    r.amax_compute_algo =
        s.choice("amax_compute_algo", AmaxAlgo::kMax,
                 {{"max", AmaxAlgo::kMax}, {"most_recent", AmaxAlgo::kMostRecent}});
    r.eps = s.number("eps", 0.0, 0.0, 1.0);  // TE's amax_epsilon (docs/design.md section 15)
    r.power_2_scale = s.boolean("power_2_scale", r.power_2_scale);
    if (kind == RecipeKind::kMxfp8 && r.fp8_format != Fp8Format::kE4M3) {
      // docs/design.md section 4: MXFP8 is E4M3 for all tensors; we implement no MXFP8 E5M2 path.
      bad(s.child("fp8_format"), "recipe mxfp8 supports only e4m3");
    }
    return r;
  }

  // The shape rules a (mesh, recipe) pair imposes on the model and batch.
  void check_fits(const MeshConfig& m, const std::string& mesh_path, const RecipeConfig& r,
                  const ModelConfig& model, const TrainConfig& train) {
    // Scenario policy beyond the engine's rules (engine::check_run): whole ffn columns per TP
    // rank, and FP8 GEMM dims that cuBLASLt accepts on every backend.
    const std::string tp_path = mesh_path + ".tp";
    if (model.ffn % m.tp != 0) {
      bad(tp_path, fmt::format("model.ffn = {} is not divisible by tp = {}", model.ffn, m.tp));
    }
    if (!r.is_fp8()) return;
    // GEMM operand dims: K of qkv/fc1 is H; K of proj is H/tp and of fc2 F/tp (row parallel);
    // M is the tokens of one micro-batch on one rank (a sequence shard before the SP gather).
    const int64_t tokens =
        train.micro_batch_rows(m) * model.seq_len / (m.sequence_parallel ? m.tp : 1);
    const bool mx = r.name == RecipeKind::kMxfp8;
    // MXFP8 blocks are 32 elements along K (rowwise) and M (columnwise), docs/design.md section 4.
    // Per-tensor and block FP8 GEMMs (cuBLASLt, and TE's assertion) need dims % 16 == 0.
    const int64_t q = mx ? 32 : 16;
    const std::string why =
        mx ? "recipe mxfp8 needs multiples of 32 (1x32 / 32x1 blocks)"
           : fmt::format("recipe {} needs multiples of 16 (FP8 GEMM dims)", to_string(r.name));
    auto need = [&](int64_t value, const std::string& path, const std::string& what) {
      if (value % q != 0) bad(path, fmt::format("{} = {}: {}", what, value, why));
    };
    // The K of every linear layer of a block (engine/params.h block_linears): its in features,
    // divided by tp for a row-parallel layer ("hidden / tp (proj K)"), each distinct K once.
    std::set<std::string> asked;
    for (const engine::LinearLayer& l : engine::block_linears(model.activation)) {
      const std::string dim(engine::model_dim_name(l.in_dim));
      const int64_t size = l.in_dim == engine::ModelDim::kHidden ? model.hidden : model.ffn;
      const bool split = l.kind == engine::LinearKind::kRowParallel && m.tp > 1;
      const std::string_view layer = l.name.substr(l.name.rfind('.') + 1);
      const std::string what = split ? fmt::format("{} / tp ({} K)", dim, layer) : dim;
      if (asked.insert(what).second)
        need(split ? size / m.tp : size, split ? tp_path : "model." + dim, what);
    }
    need(tokens, "train.global_batch",
         fmt::format("tokens per rank and micro-batch (global_batch / (dp x micro_batches) x "
                     "seq_len{}{})",
                     m.sequence_parallel ? " / tp" : "",
                     mesh_path == "mesh" ? "" : fmt::format(" on {}", mesh_path)));
  }

  // Default relative tolerance for comparisons across meshes or recipes (docs/design.md section 8:
  // fp32 within 1e-5, bf16 within 1e-2). FP8 recipes have no default: their bound must be
  // measured and written into the scenario.
  double default_rtol(const RecipeConfig& a, const RecipeConfig* b, const std::string& path) const {
    auto rank = [](const RecipeConfig& r) {
      return r.is_fp8() ? 2 : r.name == RecipeKind::kBf16 ? 1 : 0;
    };
    const int worst = std::max(rank(a), b != nullptr ? rank(*b) : 0);
    if (worst == 2) {
      bad(path,
          "required: FP8 recipes have no default tolerance (docs/design.md section 8); give a "
          "measured bound");
    }
    // Measured on the library (CPU, 8 steps, `meshproof run`, "max rel diff" of loss and
    // grad_norm): bf16 against a 1-rank fp32 reference 4.7e-5 (reference_fp32.yaml), bf16
    // resumed on another mesh 1.8e-4 and fp32 1.2e-8 (resume_cross_mesh.yaml). The defaults are
    // docs/design.md section 8's bounds: 1e-2 leaves bf16 ~50x headroom over 1.8e-4 for longer runs
    // and other meshes while the faults it must catch move loss by >= 1.4e-3 relative (fp32
    // faults, caught under 1e-5: uneven_shard_padding_leak 1.4e-3, tp_fsdp_left_to_right 6e-3).
    return worst == 1 ? 1e-2 : 1e-5;
  }

  Scenario resolve(const std::string& default_name) {
    Section top(&root, "", root_where, locs, kTopKeys);
    Scenario sc;
    sc.source = source;
    sc.base_name = top.string("name", default_name);
    sc.name_where = top.where("name");
    if (const std::string why = name_problem(sc.base_name); !why.empty()) bad("name", why);
    sc.description = top.string("description", "");

    Section ms(top.get("model"), "model", root_where, locs,
               {"vocab", "hidden", "heads", "layers", "ffn", "seq_len", "norm", "activation",
                "tied_embeddings", "dropout"});
    ModelConfig& model = sc.model;
    model.vocab = ms.integer("vocab", 256, 2, kMaxDim);
    model.hidden = ms.integer("hidden", 64, 1, kMaxDim);
    model.heads = ms.integer("heads", 4, 1, 4096);
    model.layers = ms.integer("layers", 2, 1, 1024);
    model.ffn = ms.integer("ffn", 4 * model.hidden, 1, kMaxDim);
    model.seq_len = ms.integer("seq_len", 32, 1, int64_t{1} << 16);
    model.norm = ms.choice("norm", Norm::kLayerNorm,
                           {{"layernorm", Norm::kLayerNorm}, {"rmsnorm", Norm::kRmsNorm}});
    model.activation = ms.choice("activation", Activation::kGelu,
                                 {{"gelu", Activation::kGelu},
                                  {"relu", Activation::kRelu},
                                  {"swiglu", Activation::kSwiGlu}});
    model.tied_embeddings = ms.boolean("tied_embeddings", false);
    model.dropout = ms.number("dropout", 0.0, 0.0, 1.0, false, true);

    sc.mesh = read_mesh(top.get("mesh"), "mesh", root_where);
    sc.recipe = read_recipe(top.get("recipe"), "recipe", root_where);

    Section fs(top.get("fsdp"), "fsdp", root_where, locs,
               {"reshard_after_forward", "fp8_all_gather", "fp8_params", "sync_each_micro_batch"});
    sc.fsdp.reshard_after_forward = fs.boolean("reshard_after_forward", true);
    sc.fsdp.fp8_all_gather = fs.boolean("fp8_all_gather", false);
    sc.fsdp.fp8_params = fs.boolean("fp8_params", false);
    sc.fsdp.sync_each_micro_batch = fs.boolean("sync_each_micro_batch", false);
    // Scenario policy: the engine runs it with a note (a high-precision gather), which would make
    // the scenario mean something it does not do. (fsdp.fp8_params is the engine's rule.)
    if (sc.fsdp.fp8_all_gather && !sc.recipe.is_fp8()) {
      bad(fs.child("fp8_all_gather"),
          fmt::format("needs an FP8 recipe (delayed, current, mxfp8 or block), got recipe {}",
                      to_string(sc.recipe.name)));
    }

    Section ts(
        top.get("train"), "train", root_where, locs,
        {"steps", "global_batch", "micro_batches", "lr", "schedule", "warmup_steps", "min_lr",
         "weight_decay", "beta1", "beta2", "adam_eps", "max_grad_norm", "recompute", "seed"});
    TrainConfig& t = sc.train;
    t.steps = ts.integer("steps", 8, 1, 1000000);
    t.global_batch = ts.integer("global_batch", 8, 1, kMaxDim);
    t.micro_batches = ts.integer("micro_batches", 1, 1, 4096);
    t.lr = ts.number("lr", 1e-3, 0.0, 10.0, true);
    t.schedule =
        ts.choice("schedule", Schedule::kConstant,
                  {{"constant", Schedule::kConstant}, {"warmup_cosine", Schedule::kWarmupCosine}});
    // warmup_cosine: the peak step W and at least one cosine step to min_lr (CosineAnnealingLR's
    // T_max = steps - 1 - W >= 1; engine/optimizer.h).
    const bool cosine = t.schedule == Schedule::kWarmupCosine;
    if (cosine && t.steps < 2) {
      fail(ts.where("schedule"), ts.child("schedule"),
           fmt::format("warmup_cosine needs train.steps >= 2 (a peak step and a step at min_lr), "
                       "got {}",
                       t.steps));
    }
    t.warmup_steps = ts.integer("warmup_steps", 0, 0, cosine ? t.steps - 2 : t.steps);
    t.min_lr = ts.number("min_lr", 0.0, 0.0, t.lr);
    if (t.schedule == Schedule::kConstant) {
      for (const char* key : {"warmup_steps", "min_lr"}) {
        if (ts.has(key))
          fail(ts.where(key), ts.child(key), "only applies to schedule warmup_cosine");
      }
    }
    t.weight_decay = ts.number("weight_decay", 0.0, 0.0, 10.0);
    t.beta1 = ts.number("beta1", 0.9, 0.0, 1.0, false, true);
    t.beta2 = ts.number("beta2", 0.999, 0.0, 1.0, false, true);
    t.adam_eps = ts.number("adam_eps", 1e-8, 0.0, 1.0, true);
    t.max_grad_norm = ts.number("max_grad_norm", 1.0, 0.0, 1e9);
    t.recompute = ts.boolean("recompute", false);
    t.seed = static_cast<uint64_t>(ts.integer("seed", 1234, 0, INT64_MAX));

    Section ds(top.get("data"), "data", root_where, locs, {"kind", "order", "seed"});
    sc.data.kind = ds.choice("kind", DataKind::kMarkov, {{"markov", DataKind::kMarkov}});
    sc.data.order = ds.integer("order", 1, 1, 4);
    sc.data.seed = static_cast<uint64_t>(ds.integer("seed", 42, 0, INT64_MAX));
    sc.backend =
        top.choice("backend", Backend::kAuto,
                   {{"cpu", Backend::kCpu}, {"cuda", Backend::kCuda}, {"auto", Backend::kAuto}});
    sc.launcher = top.choice("launcher", Launcher::kLocal,
                             {{"local", Launcher::kLocal}, {"mpi", Launcher::kMpi}});
    sc.requires_gpu = top.boolean("requires_gpu", false);
    if (sc.requires_gpu && sc.backend == Backend::kCpu) {
      bad("requires_gpu", "true contradicts backend: cpu");
    }

    Section cs(top.get("checkpoint"), "checkpoint", root_where, locs,
               {"dir", "every", "keep_last"});
    sc.checkpoint.dir = cs.string("dir", "");
    sc.checkpoint.every = cs.integer("every", 0, 0, t.steps);
    sc.checkpoint.keep_last = cs.integer("keep_last", 2, 1, 1000000);

    read_checks(top.get("checks"), sc);
    read_faults(top.get("faults"), sc);

    engine_rules(sc);
    sc.expect =
        top.choice("expect", Expect::kPass, {{"pass", Expect::kPass}, {"caught", Expect::kCaught}});
    if (sc.expect == Expect::kCaught && sc.faults.empty()) {
      bad("expect", "caught needs at least one entry in faults");
    }
    if (sc.expect == Expect::kPass && !sc.faults.empty()) {
      bad("faults", "a scenario with injected faults must say expect: caught");
    }
    return sc;
  }

  // engine::check_run (engine/run_rules.h), the one set of model x mesh x recipe x FSDP rules
  // the training session applies, on the scenario's run and on the runs its checks make (the
  // resume half on checks.resume.mesh, the reference run). Each issue is reported at the
  // scenario key that wrote the setting; a key the loader's own reading already reported is
  // not reported twice.
  void engine_rules(const Scenario& sc) {
    std::set<std::pair<std::string, std::string>> main_issues;
    auto emit = [&](const std::string& path, const std::string& what) {
      report(at(path), path, what);
    };
    for (const engine::ConfigIssue& i : engine::check_run(engine_run_options(sc))) {
      main_issues.insert({i.key_path, i.message});
      emit(scenario_key(i.key_path), scenario_text(i.message));
    }
    check_fits(sc.mesh, "mesh", sc.recipe, sc.model, sc.train);
    const ChecksConfig& c = sc.checks;
    if (c.resume.enabled && c.resume.mesh) {
      Scenario r = sc;
      r.mesh = *c.resume.mesh;
      for (const engine::ConfigIssue& i : engine::check_run(engine_run_options(r))) {
        if (main_issues.count({i.key_path, i.message}) > 0) continue;
        if (i.key_path.rfind("mesh", 0) == 0) {
          emit("checks.resume." + i.key_path, scenario_text(i.message));
        } else {
          emit(scenario_key(i.key_path), scenario_text(i.message) + " (on checks.resume.mesh)");
        }
      }
      check_fits(*c.resume.mesh, "checks.resume.mesh", sc.recipe, sc.model, sc.train);
    }
    if (c.reference.enabled) {
      Scenario r = sc;
      if (c.reference.mesh) r.mesh = *c.reference.mesh;
      if (c.reference.recipe) r.recipe = *c.reference.recipe;
      const std::string owner =
          c.reference.recipe ? "checks.reference.recipe" : "checks.reference.mesh";
      for (const engine::ConfigIssue& i : engine::check_run(engine_run_options(r))) {
        if (main_issues.count({i.key_path, i.message}) > 0) continue;
        if (c.reference.mesh && i.key_path.rfind("mesh", 0) == 0) {
          emit("checks.reference." + i.key_path, scenario_text(i.message));
        } else if (c.reference.recipe && i.key_path.rfind("recipe", 0) == 0) {
          emit("checks.reference." + scenario_key(i.key_path), scenario_text(i.message));
        } else {
          // A setting of the scenario that the reference's mesh or recipe cannot run with
          // (e.g. fsdp.fp8_params with a reference recipe fp32): the reference key is the cause.
          emit(owner, fmt::format("{}: {} (in the reference run)", scenario_key(i.key_path),
                                  scenario_text(i.message)));
        }
      }
      check_fits(r.mesh, c.reference.mesh ? "checks.reference.mesh" : "mesh", r.recipe, sc.model,
                 sc.train);
    }
  }

  // Launcher mpi runs one process per rank of a single mpirun, so every run of a check (the
  // resume's load, the reference) has the scenario's rank count.
  void same_world_under_mpi(const Scenario& sc, const MeshConfig& m, const std::string& path,
                            const std::string& check) const {
    if (sc.launcher != Launcher::kMpi || m.world_size() == sc.mesh.world_size()) return;
    bad(path, fmt::format("launcher mpi runs the {} check in the same {} MPI processes as the "
                          "scenario; this mesh has {} rank{} (use launcher local, or a mesh of {} "
                          "ranks)",
                          check, sc.mesh.world_size(), m.world_size(),
                          m.world_size() == 1 ? "" : "s", sc.mesh.world_size()));
  }

  // `golden: true`, `golden: false` or `golden: {...}`; returns the mapping to read, or null.
  bool check_enabled(const Value* v, const std::string& path) {
    if (v == nullptr) return false;
    locs[path] = v->where;
    if (v->kind == Value::kMap) return true;
    if (v->kind == Value::kScalar && !v->quoted) {
      if (v->scalar == "true" || v->scalar == "false") return v->scalar == "true";
    }
    fail(v->where, path, fmt::format("expected true, false or a mapping, got {}", describe(*v)));
  }

  void read_checks(const Value* v, Scenario& sc) {
    Section cs(v, "checks", root_where, locs,
               {"golden", "resume", "reference", "allgather_parity", "determinism"});
    ChecksConfig& c = sc.checks;
    const TrainConfig& t = sc.train;

    if ((c.golden.enabled = check_enabled(cs.get("golden"), "checks.golden"))) {
      const Value* gv = cs.get("golden");
      Section g(gv->kind == Value::kMap ? gv : nullptr, "checks.golden", gv->where, locs,
                {"mode", "metrics", "rtol", "atol", "allowed_failing_steps"});
      c.golden.mode =
          g.choice("mode", GoldenMode::kExact,
                   {{"exact", GoldenMode::kExact}, {"tolerance", GoldenMode::kTolerance}});
      if (const Value* mv = g.get("metrics")) {
        locs["checks.golden.metrics"] = mv->where;
        if (mv->kind != Value::kSeq || mv->seq.empty()) {
          bad("checks.golden.metrics",
              fmt::format("expected a non-empty list of loss|grad_norm, got {}", describe(*mv)));
        }
        c.golden.metrics.clear();
        for (size_t i = 0; i < mv->seq.size(); ++i) {
          const std::string p = fmt::format("checks.golden.metrics[{}]", i);
          const Metric m = Section::as_choice(mv->seq[i], p, kMetrics, Metric::kLoss);
          if (std::find(c.golden.metrics.begin(), c.golden.metrics.end(), m) !=
              c.golden.metrics.end()) {
            fail(mv->seq[i].where, p, fmt::format("'{}' is listed twice", to_string(m)));
          }
          c.golden.metrics.push_back(m);
        }
      }
      if (c.golden.mode == GoldenMode::kExact) {
        for (const char* key : {"rtol", "atol", "allowed_failing_steps"}) {
          if (g.has(key)) {
            fail(g.where(key), g.child(key), "only applies to mode tolerance (exact is bitwise)");
          }
        }
      } else {
        c.golden.rtol = g.has("rtol") ? g.number("rtol", 0, 0, 1)
                                      : default_rtol(sc.recipe, nullptr, "checks.golden.rtol");
        c.golden.atol = g.number("atol", 0.0, 0.0, 1e9);
        c.golden.allowed_failing_steps = g.integer("allowed_failing_steps", 0, 0, t.steps - 1);
      }
    }

    if ((c.resume.enabled = check_enabled(cs.get("resume"), "checks.resume"))) {
      const Value* rv = cs.get("resume");
      Section r(rv->kind == Value::kMap ? rv : nullptr, "checks.resume", rv->where, locs,
                {"at_step", "mesh", "rtol"});
      if (t.steps < 2) {
        bad("checks.resume",
            fmt::format("needs train.steps >= 2 to stop and resume, got {}", t.steps));
      }
      if (r.has("at_step")) {
        const int64_t k = r.integer("at_step", 0, INT64_MIN, INT64_MAX);
        if (k < 1 || k >= t.steps) {
          bad("checks.resume.at_step",
              fmt::format("must be in [1, {}] (a step before the last of train.steps = {}), got "
                          "{}",
                          t.steps - 1, t.steps, k));
        }
        c.resume.at_step = k;
      } else {
        c.resume.at_step = t.steps / 2;
      }
      if (r.has("mesh")) {
        c.resume.mesh = read_mesh(r.get("mesh"), "checks.resume.mesh", r.where("mesh"));
        same_world_under_mpi(sc, *c.resume.mesh, "checks.resume.mesh", "resume");
        c.resume.rtol = r.has("rtol") ? r.number("rtol", 0, 0, 1)
                                      : default_rtol(sc.recipe, nullptr, "checks.resume.rtol");
      } else if (r.has("rtol")) {
        fail(r.where("rtol"), "checks.resume.rtol",
             "only applies with a mesh override (a same-mesh resume is bitwise)");
      }
    }

    if ((c.reference.enabled = check_enabled(cs.get("reference"), "checks.reference"))) {
      const Value* rv = cs.get("reference");
      Section r(rv->kind == Value::kMap ? rv : nullptr, "checks.reference", rv->where, locs,
                {"mesh", "recipe", "rtol"});
      if (!r.has("mesh") && !r.has("recipe")) {
        bad("checks.reference", "needs a mesh and/or recipe override to compare against");
      }
      if (r.has("mesh")) {
        c.reference.mesh = read_mesh(r.get("mesh"), "checks.reference.mesh", r.where("mesh"));
        same_world_under_mpi(sc, *c.reference.mesh, "checks.reference.mesh", "reference");
      }
      if (r.has("recipe")) {
        c.reference.recipe =
            read_recipe(r.get("recipe"), "checks.reference.recipe", r.where("recipe"));
      }
      const MeshConfig ref_mesh = c.reference.mesh.value_or(sc.mesh);
      const RecipeConfig ref_recipe = c.reference.recipe.value_or(sc.recipe);
      if (ref_mesh == sc.mesh && ref_recipe == sc.recipe) {
        bad("checks.reference", "the reference mesh and recipe equal the scenario's own");
      }
      const Value* tol = r.get("rtol");
      if (tol != nullptr && tol->kind == Value::kMap) {
        Section ts(tol, "checks.reference.rtol", tol->where, locs, {"loss", "grad_norm"});
        for (const auto& [name, metric] : kMetrics) {
          if (ts.has(name)) c.reference.rtol[metric] = ts.number(name, 0, 0, 1);
        }
        if (!ts.has("loss")) {
          c.reference.rtol[Metric::kLoss] =
              default_rtol(sc.recipe, &ref_recipe, "checks.reference.rtol.loss");
        }
      } else if (tol != nullptr) {
        c.reference.rtol[Metric::kLoss] = r.number("rtol", 0, 0, 1);  // a number: the loss rtol
      } else {
        c.reference.rtol[Metric::kLoss] =
            default_rtol(sc.recipe, &ref_recipe, "checks.reference.rtol");
      }
    }

    c.allgather_parity = cs.boolean("allgather_parity", false);
    if (c.allgather_parity && !sc.fsdp.fp8_all_gather) {
      bad("checks.allgather_parity", "needs fsdp.fp8_all_gather: true");
    }
    c.determinism = cs.boolean("determinism", false);
  }

  void read_faults(const Value* v, Scenario& sc) {
    if (v == nullptr) return;
    locs["faults"] = v->where;
    if (v->kind != Value::kSeq) {
      bad("faults", fmt::format("expected a list of faults, got {}", describe(*v)));
    }
    std::vector<std::string> names;
    for (const FaultInfo& f : fault_catalog()) names.push_back(f.name);
    const std::set<std::string> checks = [&] {
      std::vector<std::string> n = sc.checks.enabled_names();
      std::set<std::string> s(n.begin(), n.end());
      if (sc.checks.resume.enabled && sc.checks.resume.mesh) s.insert("resume_cross_mesh");
      if (sc.checks.resume.enabled && sc.checks.resume.mesh) s.erase("resume");
      return s;
    }();
    for (size_t i = 0; i < v->seq.size(); ++i) {
      const Value& item = v->seq[i];
      const std::string path = fmt::format("faults[{}]", i);
      locs[path] = item.where;
      const Value* name_v = &item;
      if (item.kind == Value::kMap) {
        name_v = item.find("name");
        if (name_v == nullptr) fail(at(path), path, "a fault mapping needs a name");
      }
      if (name_v->kind != Value::kScalar) {
        fail(name_v->where, path, fmt::format("expected a fault name, got {}", describe(*name_v)));
      }
      const FaultInfo* info = find_fault(name_v->scalar);
      if (info == nullptr) {
        fail(name_v->where, path,
             unknown_message(fmt::format("fault '{}'", name_v->scalar), name_v->scalar, names));
      }
      for (size_t j = 0; j < sc.faults.size(); ++j) {
        if (sc.faults[j].name == info->name) {
          fail(name_v->where, path,
               fmt::format("{} is listed twice (also faults[{}])", info->name, j));
        }
      }
      FaultSpec spec;
      spec.name = info->name;
      std::vector<std::string> keys = {"name"};
      for (const FaultParamInfo& p : info->params) keys.push_back(p.name);
      Section ps(item.kind == Value::kMap ? &item : nullptr, path, item.where, locs, keys);
      for (const FaultParamInfo& p : info->params) {
        if (p.is_int) {
          const int64_t max = p.max_is_last_layer  ? sc.model.layers - 1
                              : p.max_is_last_step ? sc.train.steps
                                                   : INT64_MAX;
          spec.int_params[p.name] = ps.integer(p.name, p.default_int, p.min, max);
        } else {
          std::vector<std::pair<std::string, std::string>> table;
          for (const std::string& c : p.choices) table.emplace_back(c, c);
          spec.string_params[p.name] = ps.choice(p.name, p.default_string, table);
        }
      }
      const FaultRequires& rq = info->requires_;
      auto need = [&](bool ok, const std::string& what) {
        if (!ok) bad(path, fmt::format("{} needs {}", info->name, what));
      };
      const RecipeKind rk = sc.recipe.name;
      need(!rq.fp8_recipe || sc.recipe.is_fp8(), "an FP8 recipe (delayed, current, mxfp8, block)");
      need(!rq.per_tensor_recipe || rk == RecipeKind::kDelayed || rk == RecipeKind::kCurrent,
           "a per-tensor recipe (delayed or current)");
      need(!rq.delayed_recipe || rk == RecipeKind::kDelayed, "recipe delayed");
      need(!rq.fp8_all_gather || sc.fsdp.fp8_all_gather, "fsdp.fp8_all_gather: true");
      need(!rq.fp8_params || sc.fsdp.fp8_params, "fsdp.fp8_params: true");
      need(sc.mesh.dp_shard >= rq.min_dp_shard,
           fmt::format("mesh.dp_shard >= {}", rq.min_dp_shard));
      need(sc.mesh.dp_replicate >= rq.min_dp_replicate,
           fmt::format("mesh.dp_replicate >= {}", rq.min_dp_replicate));
      need(sc.mesh.tp >= rq.min_tp, fmt::format("mesh.tp >= {}", rq.min_tp));
      need(!rq.uneven_vocab_shards || sc.model.vocab % sc.mesh.dp_shard != 0,
           "model.vocab not divisible by mesh.dp_shard (the padded vocabulary rows are what "
           "leaks)");
      bool caught = false;
      for (const std::string& c : info->caught_by) caught = caught || checks.count(c) > 0;
      if (!caught) {
        std::vector<std::string> shown;
        for (const std::string& c : info->caught_by) {
          shown.push_back(c == "resume_cross_mesh" ? "resume (with a mesh override)" : c);
        }
        bad(path, fmt::format("{} is caught only by {}; enable one of those checks", info->name,
                              fmt::join(shown, " or ")));
      }
      sc.faults.push_back(std::move(spec));
    }
  }
};

// ---------------------------------------------------------------------------------------------
// Matrix expansion.

struct Axis {
  std::string key;
  std::vector<Value> values;
  std::vector<std::string> labels;
};

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

std::vector<Axis> read_matrix(const Value& m) {
  std::vector<Axis> axes;
  if (m.kind != Value::kMap)
    fail(m.where, "matrix", fmt::format("expected a mapping, got {}", describe(m)));
  std::vector<std::string> allowed;
  for (const std::string& k : kTopKeys) {
    if (k != "name" && k != "description" && k != "matrix") allowed.push_back(k);
  }
  for (size_t i = 0; i < m.map.size(); ++i) {
    const auto& [key, list] = m.map[i];
    const std::string path = "matrix." + key;
    const std::string head = split_path(key)[0];
    if (std::find(allowed.begin(), allowed.end(), head) == allowed.end()) {
      fail(m.key_where[i], path, unknown_message("key", head, allowed));
    }
    for (const std::string& part : split_path(key)) {
      if (part.empty()) fail(m.key_where[i], path, "malformed key path");
    }
    if (list.kind != Value::kSeq || list.seq.empty()) {
      fail(list.where, path,
           fmt::format("expected a non-empty list of values, got {}", describe(list)));
    }
    Axis axis;
    axis.key = key;
    for (size_t j = 0; j < list.seq.size(); ++j) {
      const std::string label = label_of(list.seq[j]);
      if (std::find(axis.labels.begin(), axis.labels.end(), label) != axis.labels.end()) {
        fail(list.seq[j].where, fmt::format("{}[{}]", path, j),
             fmt::format("duplicate matrix entry '{}'", label));
      }
      axis.values.push_back(list.seq[j]);
      axis.labels.push_back(label);
    }
    axes.push_back(std::move(axis));
  }
  return axes;
}

// "--set PATH=VALUE" for messages; a value too long to read in one line is cut.
std::string set_where(const Override& o) {
  constexpr size_t kShown = 80;
  if (o.text.size() <= kShown) return "--set " + o.text;
  return fmt::format("--set {}... ({} bytes)", o.text.substr(0, kShown), o.text.size());
}

Value override_value(const Override& o) {
  const std::string where = set_where(o);
  YAML::Node node;
  try {
    node = YAML::Load(o.value);
  } catch (const YAML::Exception& e) {
    fail(where, o.path, fmt::format("cannot parse the value as YAML: {}", e.msg));
  }
  if (o.value.empty() || !node.IsDefined() || node.IsNull()) {
    fail(where, o.path, "expected a value after '='");
  }
  TreeBudget budget;
  return convert(
      node, [&](const YAML::Mark&) { return where; }, o.path, budget);
}

std::string file_stem(const std::string& source) {
  return std::filesystem::path(source).stem().string();
}

}  // namespace

Override parse_override(const std::string& text) {
  const size_t eq = text.find('=');
  if (eq == std::string::npos) {
    MP_FAIL_INPUT("--set {}: expected KEY.PATH=VALUE", text);
  }
  Override o;
  o.path = text.substr(0, eq);
  o.value = text.substr(eq + 1);
  o.text = text;
  if (!is_key_path(o.path)) {
    MP_FAIL_INPUT("--set {}: {}: malformed key path (expected names joined by '.')", text,
                  o.path.empty() ? "(empty)" : o.path);
  }
  return o;
}

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
    Collect collect(doc_issues);
    try {
      YAML::Node doc;
      try {
        doc = YAML::Load(std::string(yaml));
      } catch (const YAML::Exception& e) {
        fail(fmt::format("{}:{}:{}", source, e.mark.line + 1, e.mark.column + 1), "yaml", e.msg);
      }
      const std::string root_where = fmt::format("{}:1:1", source);
      TreeBudget budget;
      Value root = convert(
          doc,
          [&](const YAML::Mark& m) {
            if (m.is_null()) return root_where;
            return fmt::format("{}:{}:{}", source, m.line + 1, m.column + 1);
          },
          "", budget);
      if (root.kind != Value::kMap) {
        fail(root_where, "scenario",
             fmt::format("expected a mapping of keys, got {}", describe(root)));
      }
      if (Value* r = root.find("recipe")) *r = recipe_shorthand(*r);

      std::vector<std::pair<Override, Value>> later;
      for (const Override& o : overrides) {
        Value v = override_value(o);
        if (split_path(o.path)[0] == "matrix") {
          set_at(root, o.path, std::move(v), set_where(o));
        } else {
          later.emplace_back(o, std::move(v));
        }
      }

      std::vector<Axis> axes;
      if (const Value* m = root.find("matrix")) axes = read_matrix(*m);
      const std::string matrix_where = root.key_location("matrix");
      root.erase("matrix");
      has_matrix = !axes.empty();
      double entries = 1;  // the cartesian product; in double, it may exceed any integer
      for (const Axis& a : axes) entries *= static_cast<double>(a.values.size());
      if (entries > static_cast<double>(kMaxMatrixEntries)) {
        fail(matrix_where, "matrix",
             fmt::format("expands to {:.0f} scenarios, more than {}", entries, kMaxMatrixEntries));
      }

      // Odometer over the axes, last axis fastest.
      std::vector<size_t> idx(axes.size(), 0);
      std::set<std::string> seen;
      while (true) {
        Value doc_i = root;
        std::vector<std::pair<std::string, std::string>> labels;
        for (size_t a = 0; a < axes.size(); ++a) {
          set_at(doc_i, axes[a].key, axes[a].values[idx[a]], axes[a].values[idx[a]].where);
          labels.emplace_back(axes[a].key, axes[a].labels[idx[a]]);
        }
        for (const auto& [o, v] : later) set_at(doc_i, o.path, v, set_where(o));
        // The entry's name before it is read: --filter picks entries without reading the others.
        const Value* name_v = doc_i.find("name");
        const std::string base = name_v != nullptr && name_v->kind == Value::kScalar
                                     ? name_v->scalar
                                     : file_stem(source);
        std::string name = base;
        if (!labels.empty()) {
          std::vector<std::string> parts;
          for (const auto& [k, l] : labels) parts.push_back(k + "=" + l);
          name += fmt::format("[{}]", fmt::join(parts, ","));
        }
        if (filter.empty() || name == filter || base == filter) {
          ++entries_read;
          Issues entry;
          entry.limit = std::max<size_t>(1, kMaxIssues - std::min(kMaxIssues, count()));
          {
            Collect collect_entry(entry);
            try {
              Resolver resolver{doc_i, source, root_where, {}};
              Scenario sc = resolver.resolve(file_stem(source));
              sc.matrix_labels = labels;
              sc.name = name;
              if (!seen.insert(sc.name).second) {
                fail(root_where, "matrix",
                     fmt::format("two entries expand to the same name '{}'", sc.name));
              }
              // Matrix labels are free text: the folder the name derives must stay usable.
              const std::string dir = golden_scenario_dir(sc.name);
              if (dir.size() > kMaxNameBytes) {
                report(sc.name_where, "name",
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
            break;
          }
        }
        bool carry = true;  // advance the odometer; a carry out of the first axis ends it
        for (size_t a = axes.size(); a > 0 && carry; --a) {
          carry = ++idx[a - 1] == axes[a - 1].values.size();
          if (carry) idx[a - 1] = 0;
        }
        if (carry) break;
      }
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
