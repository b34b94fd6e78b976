#include "harness/scenario/located_yaml.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdlib>

#include "kernels/core/error.h"

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

Override parse_override(const std::string& text) {
  const size_t eq = text.find('=');
  if (eq == std::string::npos) {
    MP_FAIL_INPUT("--set {}: expected KEY.PATH=VALUE", text);
  }
  Override o;
  o.path = text.substr(0, eq);
  o.value = text.substr(eq + 1);
  o.text = text;
  if (!yaml::is_key_path(o.path)) {
    MP_FAIL_INPUT("--set {}: {}: malformed key path (expected names joined by '.')", text,
                  o.path.empty() ? "(empty)" : o.path);
  }
  return o;
}

namespace yaml {

namespace {
thread_local Issues* g_issues = nullptr;
}  // namespace

std::string Issue::line() const { return fmt::format("{}: {}: {}", where, path, what); }

Collect::Collect(Issues& issues) : prev_(g_issues) { g_issues = &issues; }
Collect::~Collect() { g_issues = prev_; }

void report(const std::string& where, const std::string& path, const std::string& what) {
  if (g_issues == nullptr) MP_FAIL_INPUT("{}: {}: {}", where, path, what);
  g_issues->list.push_back({where, path, what});
  if (g_issues->list.size() >= g_issues->limit) throw Stop{};
}

[[noreturn]] void fail(const std::string& where, const std::string& path, const std::string& what) {
  report(where, path, what);
  throw Stop{};
}

// Defined once Value is complete: clang 14 with libstdc++ 12 (the sanitizer/fuzz build, design.md
// section 17) rejects the implicit ones, which instantiate std::pair<std::string, Value> inside
// Value's own definition.
Value::Value() = default;
Value::Value(const Value&) = default;
Value::Value(Value&&) noexcept = default;
Value& Value::operator=(const Value&) = default;
Value& Value::operator=(Value&&) noexcept = default;
Value::~Value() = default;

const Value* Value::find(const std::string& key) const {
  for (const auto& [k, v] : map) {
    if (k == key) return &v;
  }
  return nullptr;
}

Value* Value::find(const std::string& key) {
  for (auto& [k, v] : map) {
    if (k == key) return &v;
  }
  return nullptr;
}

void Value::erase(const std::string& key) {
  for (size_t i = 0; i < map.size(); ++i) {
    if (map[i].first == key) {
      map.erase(map.begin() + static_cast<std::ptrdiff_t>(i));
      key_where.erase(key_where.begin() + static_cast<std::ptrdiff_t>(i));
      return;
    }
  }
}

std::string Value::key_location(const std::string& key) const {
  for (size_t i = 0; i < map.size(); ++i) {
    if (map[i].first == key) return key_where[i];
  }
  return where;
}

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

namespace {

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

}  // namespace

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

Value parse_document(std::string_view text, const std::string& source) {
  YAML::Node doc;
  try {
    doc = YAML::Load(std::string(text));
  } catch (const YAML::Exception& e) {
    fail(fmt::format("{}:{}:{}", source, e.mark.line + 1, e.mark.column + 1), "yaml", e.msg);
  }
  const std::string root_where = fmt::format("{}:1:1", source);
  TreeBudget budget;
  return convert(
      doc,
      [&](const YAML::Mark& m) {
        if (m.is_null()) return root_where;
        return fmt::format("{}:{}:{}", source, m.line + 1, m.column + 1);
      },
      "", budget);
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
void set_at(Value& root, const std::string& path, Value incoming, const std::string& where,
            const Normalize& normalize) {
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
      if (normalize) incoming = normalize(walked, std::move(incoming));
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
  // Close enough to be a typo: at most 2 edits, or a third of the word for long names.
  const size_t limit = std::max<size_t>(2, word.size() / 3);
  std::string best;
  size_t best_d = std::string::npos;
  for (const std::string& c : candidates) {
    // The distance is at least the length difference: a candidate that cannot be within the
    // limit is not measured (a 40,000-byte unknown key against every key took seconds).
    const size_t gap = word.size() > c.size() ? word.size() - c.size() : c.size() - word.size();
    if (gap > limit) continue;
    const size_t d = edit_distance(word, c);
    if (d < best_d) {
      best_d = d;
      best = c;
    }
  }
  if (best_d == std::string::npos || best_d > limit) return "";
  return best;
}

std::string unknown_message(const std::string& what, const std::string& word,
                            const std::vector<std::string>& allowed) {
  const std::string best = suggestion(word, allowed);
  if (!best.empty()) return fmt::format("unknown {}; did you mean '{}'?", what, best);
  return fmt::format("unknown {} (allowed: {})", what, fmt::join(allowed, ", "));
}

Section::Section(const Value* v, std::string path, std::string absent_where, Locations& locs,
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

std::string Section::where(const std::string& key) const {
  const Value* v = get(key);
  return v != nullptr ? v->where : where_;
}

int64_t Section::integer(const std::string& key, int64_t def, int64_t min, int64_t max) {
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

double Section::number(const std::string& key, double def, double min, double max,
                       bool min_exclusive, bool max_exclusive) {
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

bool Section::boolean(const std::string& key, bool def) {
  const Value* v = note(key);
  if (v == nullptr) return def;
  return as_bool(*v, child(key), def);
}

bool Section::as_bool(const Value& v, const std::string& path, bool def) {
  if (v.kind == Value::kScalar && !v.quoted) {
    if (v.scalar == "true" || v.scalar == "True" || v.scalar == "TRUE") return true;
    if (v.scalar == "false" || v.scalar == "False" || v.scalar == "FALSE") return false;
  }
  report(v.where, path, fmt::format("expected true or false, got {}", describe(v)));
  return def;
}

std::string Section::string(const std::string& key, const std::string& def) {
  const Value* v = note(key);
  if (v == nullptr) return def;
  if (v->kind != Value::kScalar) {
    report(v->where, child(key), fmt::format("expected a string, got {}", describe(*v)));
    return def;
  }
  return v->scalar;
}

size_t Section::choice(const std::string& key, size_t def, const std::vector<std::string>& names) {
  const Value* v = note(key);
  if (v == nullptr) return def;
  return as_choice(*v, child(key), names, def);
}

size_t Section::as_choice(const Value& v, const std::string& path,
                          const std::vector<std::string>& names, size_t def) {
  if (v.kind != Value::kScalar) {
    report(v.where, path,
           fmt::format("expected one of {}, got {}", fmt::join(names, "|"), describe(v)));
    return def;
  }
  for (size_t i = 0; i < names.size(); ++i) {
    if (names[i] == v.scalar) return i;
  }
  const std::string best = suggestion(v.scalar, names);
  report(v.where, path,
         fmt::format("expected one of {}, got '{}'{}", fmt::join(names, "|"), v.scalar,
                     best.empty() ? "" : fmt::format("; did you mean '{}'?", best)));
  return def;
}

const Value* Section::note(const std::string& key) {
  const Value* v = get(key);
  locs_[child(key)] = v != nullptr ? v->where : where_;
  if (v != nullptr && v->kind == Value::kNull) {
    report(v->where, child(key), "expected a value, got nothing (null)");
    return nullptr;
  }
  return v;
}

}  // namespace yaml
}  // namespace meshproof::harness
