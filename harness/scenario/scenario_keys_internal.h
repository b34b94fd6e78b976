// Internal to the scenario key table (harness/scenario/scenario_keys.cc, scenario_key_table.cc and
// mesh_recipe_keys.cc): the factories the tables write their keys with, one per key type (each
// fills a Key<T>'s type, default, range, documentation and its get/set of the field it names), and
// names_of, an enum's names from its one name table. Only those files include it.
#pragma once

#include <fmt/format.h>

#include <cstddef>
#include <cstdint>
#include <iterator>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "harness/scenario/scenario_keys.h"
#include "kernels/core/error.h"

namespace meshproof::harness::keys_internal {

// The names of enum E from its one name table: `name(E(i))` for i in [0, count).
template <class E, class F>
std::vector<std::string> names_of(F name, size_t count) {
  std::vector<std::string> out;
  for (size_t i = 0; i < count; ++i) out.emplace_back(name(static_cast<E>(i)));
  return out;
}
template <class E, size_t N>
std::vector<std::string> names_of(const std::string_view (&table)[N]) {
  return {std::begin(table), std::end(table)};
}

// Key factories: `field(t)` is a reference to the field the key sets in T.
template <class T, class F>
Key<T> int_key(std::string path, int64_t def, int64_t min, int64_t max, F field, std::string doc) {
  Key<T> k;
  k.path = std::move(path);
  k.type = KeyType::kInt;
  k.def = def;
  k.imin = min;
  k.imax = max;
  k.doc = std::move(doc);
  k.get = [field](const T& t) { return KeyValue{static_cast<int64_t>(field(const_cast<T&>(t)))}; };
  k.set = [field](T& t, const KeyValue& v) {
    field(t) = static_cast<std::decay_t<decltype(field(t))>>(std::get<int64_t>(v));
  };
  return k;
}

template <class T, class F>
Key<T> number_key(std::string path, double def, double min, double max, bool min_open,
                  bool max_open, F field, std::string doc) {
  Key<T> k;
  k.path = std::move(path);
  k.type = KeyType::kNumber;
  k.def = def;
  k.dmin = min;
  k.dmax = max;
  k.min_open = min_open;
  k.max_open = max_open;
  k.doc = std::move(doc);
  k.get = [field](const T& t) { return KeyValue{field(const_cast<T&>(t))}; };
  k.set = [field](T& t, const KeyValue& v) { field(t) = std::get<double>(v); };
  return k;
}

template <class T, class F>
Key<T> bool_key(std::string path, bool def, F field, std::string doc) {
  Key<T> k;
  k.path = std::move(path);
  k.type = KeyType::kBool;
  k.def = def;
  k.doc = std::move(doc);
  k.get = [field](const T& t) { return KeyValue{static_cast<bool>(field(const_cast<T&>(t)))}; };
  k.set = [field](T& t, const KeyValue& v) { field(t) = std::get<bool>(v); };
  return k;
}

// An enum whose values are 0..n-1 in the order of `names`.
template <class T, class E, class F>
Key<T> enum_key(std::string path, E def, std::vector<std::string> names, F field, std::string doc) {
  Key<T> k;
  k.path = std::move(path);
  k.type = KeyType::kEnum;
  k.def = names.at(static_cast<size_t>(def));
  k.choices = names;
  k.doc = std::move(doc);
  k.get = [field, names](const T& t) {
    return KeyValue{names.at(static_cast<size_t>(field(const_cast<T&>(t))))};
  };
  k.set = [field, names](T& t, const KeyValue& v) {
    const std::string& s = std::get<std::string>(v);
    for (size_t i = 0; i < names.size(); ++i) {
      if (names[i] == s) {
        using Stored = std::decay_t<decltype(field(t))>;
        field(t) = static_cast<Stored>(i);
        return;
      }
    }
    MP_FAIL("enum key: '{}' is none of {}", s, fmt::join(names, ", "));
  };
  return k;
}

template <class T, class F>
Key<T> string_key(std::string path, std::string def, F field, std::string doc) {
  Key<T> k;
  k.path = std::move(path);
  k.type = KeyType::kString;
  k.def = std::move(def);
  k.doc = std::move(doc);
  k.get = [field](const T& t) { return KeyValue{field(const_cast<T&>(t))}; };
  k.set = [field](T& t, const KeyValue& v) { field(t) = std::get<std::string>(v); };
  return k;
}

// A key the loader reads with its own code (a section, a list, a check, a tolerance).
template <class T>
Key<T> own_key(std::string path, KeyType type, std::string default_text, std::string doc) {
  Key<T> k;
  k.path = std::move(path);
  k.type = type;
  k.default_text = std::move(default_text);
  k.doc = std::move(doc);
  k.hashed = false;  // its canonical form is written by to_canonical_json
  return k;
}

template <class T>
Key<T> with_text(Key<T> k, std::string default_text) {
  k.default_text = std::move(default_text);
  return k;
}

}  // namespace meshproof::harness::keys_internal
