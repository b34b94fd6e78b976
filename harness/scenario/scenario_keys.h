// The scenario key table (docs/design.md section 18): every key a scenario file may write, with
// its type, default, range and a line of documentation, and the field of the engine's (or the
// harness's) configuration it sets. The table drives the loader's reads
// (harness/scenario/scenario_loader.cc reads a section by walking its keys), the defaults of
// `Scenario()`, the canonical form that scenario_hash digests, and the key lists of
// docs/scenarios.md (tests/harness/scenario checks that the docs list exactly these keys with these
// defaults). Adding a key is one entry here.
#pragma once

#include <cstdint>
#include <functional>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <variant>
#include <vector>

#include "engine/config/config.h"
#include "engine/config/mesh_spec.h"
#include "harness/scenario/located_yaml.h"
#include "harness/scenario/scenario.h"

namespace meshproof::harness {

enum class KeyType : uint8_t {
  kInt,     // a plain integer in [imin, imax]
  kNumber,  // a finite number in [dmin, dmax] ("(" / ")" with min_open / max_open)
  kBool,
  kEnum,  // one of `choices`
  kString,
  // Read by the loader's own code (each holds keys of its own, or a list): a section, a check
  // (`true`, `false` or a mapping), faults, the matrix, the tolerances.
  kMapping,
  kList,
  kCheck,
  kRtol,  // a number, or (checks.reference.rtol) a mapping {loss, grad_norm}
};

// A scalar key's value: kInt, kNumber, kBool, or the text of a kEnum or kString.
using KeyValue = std::variant<int64_t, double, bool, std::string>;

// One key of a configuration object T: harness::Scenario (paths from the top, "model.vocab"),
// engine::MeshSpec ("tp": mesh, checks.resume.mesh, checks.reference.mesh) or
// engine::RecipeConfig ("margin": recipe, checks.reference.recipe).
template <class T>
struct Key {
  std::string path;
  KeyType type = KeyType::kInt;
  KeyValue def;              // the default (kEnum: its name)
  std::string default_text;  // the default as docs/scenarios.md writes it, where `def` is not it
  int64_t imin = 0, imax = 0;
  double dmin = 0, dmax = 0;
  bool min_open = false, max_open = false;
  std::vector<std::string> choices;  // kEnum, in the order messages list them
  std::string doc;
  // The field the key sets. Null for a key the loader reads itself (kMapping, ...) and for a
  // check-only key (mesh.world_size: compared, never stored).
  std::function<KeyValue(const T&)> get;
  std::function<void(T&, const KeyValue&)> set;
  // Part of the canonical form (and so of scenario_hash); with hash_if, only when it holds
  // (fsdp.sync_each_micro_batch: only when true, so older hashes stay what they were).
  bool hashed = true;
  std::function<bool(const T&)> hash_if;
  // A default or an upper bound that depends on keys read before it (model.ffn = 4 x hidden,
  // train.warmup_steps <= steps - 2).
  std::function<KeyValue(const T&)> default_of;
  std::function<int64_t(const T&)> imax_of;
  std::function<double(const T&)> dmax_of;

  std::string name() const;     // the last path component
  std::string section() const;  // the path before it ("" for a top-level key)
};

const std::vector<Key<Scenario>>& scenario_keys();
const std::vector<Key<engine::MeshSpec>>& mesh_keys();
const std::vector<Key<engine::RecipeConfig>>& recipe_keys();

// The key of `keys` at `path`; throws kInternal when there is none (a loader bug).
template <class T>
const Key<T>& key_at(const std::vector<Key<T>>& keys, std::string_view path);

// The names of the keys of `section` ("" for the top level), in table order: what a Section
// accepts.
template <class T>
std::vector<std::string> section_keys(const std::vector<Key<T>>& keys, std::string_view section);

// Reads one scalar key from `s` (its name under s.path()) by the table: type, range and default
// (both possibly depending on `target`, which holds the keys read before). A problem is
// reported (yaml::report) and the default returned.
template <class T>
KeyValue read_key(yaml::Section& s, const Key<T>& key, const T& target);

// Reads every scalar key of `section` that has a field into `target`, in table order.
template <class T>
void read_keys(yaml::Section& s, const std::vector<Key<T>>& keys, std::string_view section,
               T& target);

// The hashed keys of `section` with their values, as the canonical form writes them.
template <class T>
nlohmann::json keys_json(const std::vector<Key<T>>& keys, std::string_view section,
                         const T& target);

// Every key docs/scenarios.md must list: its full path and its default as the docs write it
// (backticks dropped). Mesh keys appear under "mesh.", recipe keys under "recipe.".
struct KeyDoc {
  std::string path;
  KeyType type;
  std::string default_text;
};
std::vector<KeyDoc> documented_keys();

}  // namespace meshproof::harness
