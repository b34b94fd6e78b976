// Everything about the scenario key table beyond its entries (harness/scenario/scenario_keys.h,
// docs/design.md section 18): a key's name and section, looking a key up, reading a section's keys
// from a located document by the table (type, range, default), the canonical form's keys, the
// defaults of Scenario() and default_recipe(), and the key list docs/scenarios.md must show. The
// entries are scenario_key_table.cc's (the scenario's keys) and mesh_recipe_keys.cc's.
#include "harness/scenario/scenario_keys.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "kernels/core/error.h"

namespace meshproof::harness {

namespace {

using engine::MeshSpec;
using engine::RecipeConfig;

std::string text_of(const KeyValue& v) {
  return std::visit(
      [](const auto& x) -> std::string {
        using X = std::decay_t<decltype(x)>;
        if constexpr (std::is_same_v<X, bool>) {
          return x ? "true" : "false";
        } else if constexpr (std::is_same_v<X, std::string>) {
          return x.empty() ? "\"\"" : x;
        } else {
          return fmt::format("{}", x);
        }
      },
      v);
}

template <class T>
void add_docs(std::vector<KeyDoc>& out, const std::vector<Key<T>>& keys,
              const std::string& prefix) {
  for (const Key<T>& k : keys) {
    out.push_back(
        {prefix + k.path, k.type, k.default_text.empty() ? text_of(k.def) : k.default_text});
  }
}

}  // namespace

template <class T>
std::string Key<T>::name() const {
  const size_t dot = path.rfind('.');
  return dot == std::string::npos ? path : path.substr(dot + 1);
}

template <class T>
std::string Key<T>::section() const {
  const size_t dot = path.rfind('.');
  return dot == std::string::npos ? std::string() : path.substr(0, dot);
}

template <class T>
const Key<T>& key_at(const std::vector<Key<T>>& keys, std::string_view path) {
  for (const Key<T>& k : keys) {
    if (k.path == path) return k;
  }
  MP_FAIL("the scenario key table has no key {}", path);
}

template <class T>
std::vector<std::string> section_keys(const std::vector<Key<T>>& keys, std::string_view section) {
  std::vector<std::string> names;
  for (const Key<T>& k : keys) {
    if (k.section() == section) names.push_back(k.name());
  }
  return names;
}

template <class T>
KeyValue read_key(yaml::Section& s, const Key<T>& k, const T& target) {
  const KeyValue def = k.default_of ? k.default_of(target) : k.def;
  const std::string name = k.name();
  switch (k.type) {
    case KeyType::kInt:
      return s.integer(name, std::get<int64_t>(def), k.imin,
                       k.imax_of ? k.imax_of(target) : k.imax);
    case KeyType::kNumber:
      return s.number(name, std::get<double>(def), k.dmin, k.dmax_of ? k.dmax_of(target) : k.dmax,
                      k.min_open, k.max_open);
    case KeyType::kBool:
      return s.boolean(name, std::get<bool>(def));
    case KeyType::kEnum: {
      const auto it = std::find(k.choices.begin(), k.choices.end(), std::get<std::string>(def));
      const size_t i = s.choice(name, static_cast<size_t>(it - k.choices.begin()), k.choices);
      return k.choices.at(i);
    }
    case KeyType::kString:
      return s.string(name, std::get<std::string>(def));
    default:
      break;
  }
  MP_FAIL("key {} is read by the loader's own code, not by read_key", k.path);
}

template <class T>
void read_keys(yaml::Section& s, const std::vector<Key<T>>& keys, std::string_view section,
               T& target) {
  for (const Key<T>& k : keys) {
    if (k.section() != section || !k.set) continue;
    k.set(target, read_key(s, k, target));
  }
}

template <class T>
nlohmann::json keys_json(const std::vector<Key<T>>& keys, std::string_view section,
                         const T& target) {
  nlohmann::json j = nlohmann::json::object();
  for (const Key<T>& k : keys) {
    if (k.section() != section || !k.hashed || !k.get) continue;
    if (k.hash_if && !k.hash_if(target)) continue;
    std::visit([&](const auto& v) { j[k.name()] = v; }, k.get(target));
  }
  return j;
}

#define MESHPROOF_KEY_TEMPLATES(T)                                                              \
  template struct Key<T>;                                                                       \
  template const Key<T>& key_at(const std::vector<Key<T>>&, std::string_view);                  \
  template std::vector<std::string> section_keys(const std::vector<Key<T>>&, std::string_view); \
  template KeyValue read_key(yaml::Section&, const Key<T>&, const T&);                          \
  template void read_keys(yaml::Section&, const std::vector<Key<T>>&, std::string_view, T&);    \
  template nlohmann::json keys_json(const std::vector<Key<T>>&, std::string_view, const T&);
MESHPROOF_KEY_TEMPLATES(Scenario)
MESHPROOF_KEY_TEMPLATES(MeshSpec)
MESHPROOF_KEY_TEMPLATES(RecipeConfig)
#undef MESHPROOF_KEY_TEMPLATES

Scenario::Scenario() {
  // Every key with a field at its default, in table order (so that model.ffn = 4 x hidden sees
  // the hidden default).
  for (const Key<Scenario>& k : scenario_keys()) {
    if (k.set) k.set(*this, k.default_of ? k.default_of(*this) : k.def);
  }
  recipe = default_recipe(RecipeKind::kBf16);
}

engine::RecipeConfig default_recipe(RecipeKind name) {
  engine::RecipeConfig r;
  r.kind = name;
  for (const Key<RecipeConfig>& k : recipe_keys()) {
    if (k.path != "name" && k.set) k.set(r, k.default_of ? k.default_of(r) : k.def);
  }
  return r;
}

std::vector<KeyDoc> documented_keys() {
  std::vector<KeyDoc> out;
  add_docs(out, scenario_keys(), "");
  add_docs(out, mesh_keys(), "mesh.");
  add_docs(out, recipe_keys(), "recipe.");
  return out;
}

}  // namespace meshproof::harness
