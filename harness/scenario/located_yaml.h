// The located-YAML layer of the scenario loader (docs/design.md sections 7 and 18): a YAML tree
// whose every value remembers where it was written (FILE:LINE:COL, or the `--set` override that
// wrote it), merged and overridden without losing those marks, read strictly by type, with
// did-you-mean suggestions for unknown names. yaml-cpp's Clone() drops marks, and matrix entries
// and --set overrides must keep pointing at the line that wrote them, so the loader works on
// this copy. Nothing here knows what a scenario is: harness/scenario/scenario_keys.h says which
// keys exist, harness/scenario/scenario_loader.cc reads them.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace meshproof::harness {

// Bounds of what the loader reads (docs/design.md section 11); each one passed is an input error at
// the value that passed it.
constexpr size_t kMaxScalarBytes = 4096;  // one scalar or key
constexpr int kMaxDepth = 64;             // nesting of sequences and mappings (aliases expanded)
constexpr size_t kMaxNodes = 100000;      // values in one document, aliases expanded
constexpr size_t kMaxIssues = 20;         // problems reported for one file before stopping

// One `--set key.path=value` override. The value is parsed as YAML (a scalar, or a flow
// sequence/mapping such as `[bf16, mxfp8]` or `{dp_shard: 4}`).
struct Override {
  std::string path;   // dotted key path, e.g. "mesh.tp"
  std::string value;  // YAML text of the value
  std::string text;   // the override as the user wrote it ("mesh.tp=2"), for messages
};

// Parses "key.path=value"; throws kInput naming the override when it is malformed.
Override parse_override(const std::string& text);

// Levenshtein distance, exposed for tests of the did-you-mean suggestions.
size_t edit_distance(std::string_view a, std::string_view b);

namespace yaml {

// ---- problems ----------------------------------------------------------------------------------
// Every problem of a file is collected (up to kMaxIssues) and reported together. report()
// records one and goes on (the value read falls back to its default); fail() records one the
// loader cannot read past and throws Stop, which unwinds to the document or matrix entry being
// read. Without a Collect in scope, report() throws the kInput error at once.
struct Issue {
  std::string where, path, what;
  std::string line() const;  // "WHERE: PATH: WHAT"
};
struct Issues {
  std::vector<Issue> list;
  size_t limit = kMaxIssues;
};
struct Stop {};

// Installs `issues` as the collector of this thread for its lifetime.
class Collect {
 public:
  explicit Collect(Issues& issues);
  ~Collect();
  Collect(const Collect&) = delete;
  Collect& operator=(const Collect&) = delete;

 private:
  Issues* prev_;
};

void report(const std::string& where, const std::string& path, const std::string& what);
[[noreturn]] void fail(const std::string& where, const std::string& path, const std::string& what);

// ---- the tree ----------------------------------------------------------------------------------
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

  const Value* find(const std::string& key) const;
  Value* find(const std::string& key);
  void erase(const std::string& key);
  // Where `key` is written, else where this mapping is.
  std::string key_location(const std::string& key) const;
};

// "nothing (null)", "a sequence", "a mapping", "the string \"x\"" or "'x'", for messages.
std::string describe(const Value& v);
std::string join_path(const std::string& parent, const std::string& key);
std::vector<std::string> split_path(const std::string& path);
// [A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*
bool is_key_path(std::string_view s);

// Parses one YAML document; `source` names it in every location ("SOURCE:LINE:COL"). A syntax
// error or a bound passed (kMaxScalarBytes, kMaxDepth, kMaxNodes) is fail()ed.
Value parse_document(std::string_view text, const std::string& source);
// The value of an override, every location being "--set PATH=VALUE" (set_where).
Value override_value(const Override& o);
// "--set PATH=VALUE" for messages; a value too long to read in one line is cut.
std::string set_where(const Override& o);

// Mappings merge key by key (the incoming side wins); anything else replaces.
void merge_into(Value& target, const Value& incoming);
// Sets (merges) `incoming` at dotted `path` below `root`, creating mappings on the way (located
// at `where`). `normalize(path, value)` rewrites the value first (the recipe shorthand).
using Normalize = std::function<Value(const std::string& path, Value value)>;
void set_at(Value& root, const std::string& path, Value incoming, const std::string& where,
            const Normalize& normalize = {});

// ---- did-you-mean ------------------------------------------------------------------------------
// The closest candidate within 2 edits (a third of the word for long names), else "".
std::string suggestion(const std::string& word, const std::vector<std::string>& candidates);
// "unknown WHAT; did you mean 'X'?" or "unknown WHAT (allowed: a, b, c)".
std::string unknown_message(const std::string& what, const std::string& word,
                            const std::vector<std::string>& allowed);

// ---- strict typed reading ----------------------------------------------------------------------
// Where each resolved key came from, for consistency errors raised after reading: the value's
// location when given, else the enclosing mapping's (the defaults live there).
using Locations = std::map<std::string, std::string>;

bool parse_int(const std::string& s, int64_t& out);   // [+-]?[0-9]+, in int64
bool parse_float(const std::string& s, double& out);  // a finite decimal number

// One mapping of known keys. `v` may be null (the section is absent: every key takes its
// default); a section written with no value (`mesh:` or `mesh: ~`) is an error, like every null.
// Unknown keys are reported with a did-you-mean. Each read records the key's location in `locs`.
// A value of the wrong type or out of range is reported and the default returned.
class Section {
 public:
  Section(const Value* v, std::string path, std::string absent_where, Locations& locs,
          std::vector<std::string> keys);

  const std::string& path() const { return path_; }
  const std::string& where() const { return where_; }
  std::string child(const std::string& key) const { return join_path(path_, key); }
  const Value* get(const std::string& key) const { return v_ != nullptr ? v_->find(key) : nullptr; }
  bool has(const std::string& key) const { return get(key) != nullptr; }
  std::string where(const std::string& key) const;

  int64_t integer(const std::string& key, int64_t def, int64_t min, int64_t max);
  // A finite number in [min, max] (or (min, max] when min_exclusive, [min, max) when
  // max_exclusive).
  double number(const std::string& key, double def, double min, double max,
                bool min_exclusive = false, bool max_exclusive = false);
  bool boolean(const std::string& key, bool def);
  std::string string(const std::string& key, const std::string& def);
  // The index in `names` of the value, else (reported) `def`.
  size_t choice(const std::string& key, size_t def, const std::vector<std::string>& names);

  static bool as_bool(const Value& v, const std::string& path, bool def);
  static size_t as_choice(const Value& v, const std::string& path,
                          const std::vector<std::string>& names, size_t def);

 private:
  const Value* note(const std::string& key);

  const Value* v_;
  std::string path_;
  std::string where_;
  Locations& locs_;
  std::vector<std::string> keys_;
};

}  // namespace yaml
}  // namespace meshproof::harness
