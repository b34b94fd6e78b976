// A restricted reader of Python pickles (protocols 2 to 5), for the two kinds of pickle a PyTorch
// distributed checkpoint holds: its `.metadata` (a pickled torch.distributed.checkpoint Metadata)
// and the `data.pkl` of each torch.save archive in its `.distcp` files (docs/design.md section 40).
//
// It never executes anything. GLOBAL / STACK_GLOBAL name a callable; the caller passes the set of
// "module.name" globals its format uses, and any other is refused with its name. REDUCE, NEWOBJ
// and BUILD do not call: they record the callable, its arguments and the state as a PyValue of kind
// kObject, which the caller interprets by the callable's name. Persistent ids (torch.save's
// storages) become kPersistent values holding the id tuple. Opcodes outside what these formats use
// (protocol 0/1 INST and OBJ, the extension registry, out-of-band buffers) are refused by name.
//
// Every read is bounded by the input: a length past the end, a stack underflow, a missing MARK, a
// memo index never stored or an integer wider than 64 bits is an input error naming `where` and the
// byte offset. Values may share structure (the memo), and a crafted pickle can make a list contain
// itself; the helpers below walk at most kMaxPickleDepth levels.
#pragma once

#include <cstdint>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace meshproof::engine {

inline constexpr int kMaxPickleDepth = 64;

struct PyValue;
using PyRef = std::shared_ptr<PyValue>;

struct PyValue {
  enum class Kind : uint8_t {
    kNone,
    kBool,
    kInt,
    kFloat,
    kStr,
    kBytes,
    kTuple,
    kList,
    kDict,
    kSet,
    kGlobal,      // text: "module.name"
    kObject,      // text: the callable's "module.name"; items: its arguments; state: BUILD's
    kPersistent,  // state: the persistent id (torch.save: a tuple)
  };
  Kind kind = Kind::kNone;
  bool flag = false;
  int64_t integer = 0;
  double real = 0;
  std::string text;                            // str (UTF-8), bytes, or a global's name
  std::vector<PyRef> items;                    // tuple, list, set, an object's arguments
  std::vector<std::pair<PyRef, PyRef>> pairs;  // dict or OrderedDict, in insertion order
  PyRef state;                                 // kObject (after BUILD), kPersistent
  bool built = false;                          // kObject: BUILD was applied
};

// Parses `bytes` as one pickle. `allowed_globals` holds "module.name" strings; `where` names the
// file (and entry) in every message.
PyRef read_pickle(std::span<const uint8_t> bytes, const std::set<std::string>& allowed_globals,
                  std::string_view where);

// Helpers for interpreting a parsed pickle; each throws an input error naming `what` when the value
// is not of the expected kind.
std::string_view pickle_kind_name(PyValue::Kind kind);
const PyValue& expect(const PyRef& v, PyValue::Kind kind, std::string_view what);
int64_t expect_int(const PyRef& v, std::string_view what);
const std::string& expect_str(const PyRef& v, std::string_view what);
// An object built by `callable` ("module.name").
const PyValue& expect_object(const PyRef& v, std::string_view callable, std::string_view what);
// The value of `key` (a str key) in a dict, or nullptr.
PyRef dict_get(const PyValue& dict, std::string_view key);
// The tuple or list of ints `v` (torch.Size pickles as torch.Size((...),)).
std::vector<int64_t> int_sequence(const PyRef& v, std::string_view what);

}  // namespace meshproof::engine
