#include "engine/dcp/pickle.h"

#include <fmt/format.h>

#include <bit>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <unordered_map>

#include "kernels/core/error.h"

namespace meshproof::engine {
namespace {

using Kind = PyValue::Kind;

PyRef make(Kind kind) {
  auto v = std::make_shared<PyValue>();
  v->kind = kind;
  return v;
}

PyRef make_int(int64_t i) {
  PyRef v = make(Kind::kInt);
  v->integer = i;
  return v;
}

// The opcodes this reader refuses, by name, so that a message says what the pickle asked for.
std::string_view refused_opcode(uint8_t op) {
  switch (op) {
    case 'i':
      return "INST";
    case 'o':
      return "OBJ";
    case 0x82:
      return "EXT1";
    case 0x83:
      return "EXT2";
    case 0x84:
      return "EXT4";
    case 0x97:
      return "NEXT_BUFFER";
    case 0x98:
      return "READONLY_BUFFER";
    case 'S':
      return "STRING";
    case 'V':
      return "UNICODE";
    default:
      return {};
  }
}

class Unpickler {
 public:
  Unpickler(std::span<const uint8_t> bytes, const std::set<std::string>& allowed,
            std::string_view where)
      : in_(bytes), allowed_(allowed), where_(where) {}

  PyRef run() {
    while (true) {
      MP_CHECK_INPUT(pos_ < in_.size(), "{}: pickle ends at byte {} without STOP", where_, pos_);
      op_at_ = pos_;
      const uint8_t op = in_[pos_++];
      if (op == '.') {
        MP_CHECK_INPUT(!stack_.empty(), "{}: STOP with an empty stack at byte {}", where_, op_at_);
        return stack_.back();
      }
      step(op);
    }
  }

 private:
  [[noreturn]] void fail(std::string_view what) const {
    MP_FAIL_INPUT("{}: not a readable pickle: {} (opcode at byte {})", where_, what, op_at_);
  }

  std::span<const uint8_t> take(uint64_t n) {
    if (n > in_.size() - pos_) {
      fail(fmt::format("a length of {} bytes runs past the end ({} left)", n, in_.size() - pos_));
    }
    auto s = in_.subspan(pos_, static_cast<size_t>(n));
    pos_ += static_cast<size_t>(n);
    return s;
  }
  uint64_t le(int n) {
    auto b = take(static_cast<uint64_t>(n));
    uint64_t v = 0;
    for (int i = n - 1; i >= 0; --i) v = (v << 8) | b[static_cast<size_t>(i)];
    return v;
  }
  std::string line() {
    size_t end = pos_;
    while (end < in_.size() && in_[end] != '\n') ++end;
    if (end == in_.size()) fail("a text argument without its newline");
    std::string s(reinterpret_cast<const char*>(in_.data() + pos_), end - pos_);
    pos_ = end + 1;
    return s;
  }
  std::string str(uint64_t n) {
    auto b = take(n);
    return std::string(reinterpret_cast<const char*>(b.data()), b.size());
  }

  PyRef pop() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() == marks_.back())) {
      fail("a pop from an empty stack");
    }
    PyRef v = stack_.back();
    stack_.pop_back();
    return v;
  }
  PyRef& top() {
    if (stack_.empty() || (!marks_.empty() && stack_.size() == marks_.back())) {
      fail("an empty stack");
    }
    return stack_.back();
  }
  // The values pushed since the last MARK, which is removed.
  std::vector<PyRef> pop_mark() {
    if (marks_.empty()) fail("no MARK to pop to");
    const size_t m = marks_.back();
    marks_.pop_back();
    std::vector<PyRef> items(stack_.begin() + static_cast<std::ptrdiff_t>(m), stack_.end());
    stack_.resize(m);
    return items;
  }
  void push(PyRef v) { stack_.push_back(std::move(v)); }

  void memo_put(uint64_t index) { memo_[index] = top(); }
  void memo_get(uint64_t index) {
    auto it = memo_.find(index);
    if (it == memo_.end()) fail(fmt::format("memo entry {} read before it is stored", index));
    push(it->second);
  }

  void global(std::string module, std::string name) {
    std::string full = module + "." + name;
    if (!allowed_.contains(full)) {
      MP_FAIL_INPUT(
          "{}: the pickle names the global '{}' (byte {}), which this format does not "
          "use; refused (a checkpoint's pickles are never executed)",
          where_, full, op_at_);
    }
    PyRef v = make(Kind::kGlobal);
    v->text = std::move(full);
    push(std::move(v));
  }

  void object(const PyRef& callable, std::vector<PyRef> args, std::string_view op) {
    if (callable->kind != Kind::kGlobal) fail(fmt::format("{} of a non-global callable", op));
    PyRef v = make(Kind::kObject);
    v->text = callable->text;
    v->items = std::move(args);
    push(std::move(v));
  }

  std::vector<PyRef> tuple_items(const PyRef& v, std::string_view op) {
    if (v->kind != Kind::kTuple) fail(fmt::format("{} with arguments that are not a tuple", op));
    return v->items;
  }

  // SETITEM(S) fill a dict, or an OrderedDict object (which pickles as REDUCE(OrderedDict, ())
  // followed by its items); the pairs land in `pairs` either way.
  void set_items(PyValue& dict, std::vector<PyRef> kv) {
    const bool ordered = dict.kind == Kind::kObject && dict.text == "collections.OrderedDict";
    if (dict.kind != Kind::kDict && !ordered) fail("SETITEM(S) on something that is not a dict");
    if (kv.size() % 2 != 0) fail("SETITEMS with an odd number of values");
    for (size_t i = 0; i < kv.size(); i += 2) {
      dict.pairs.emplace_back(std::move(kv[i]), std::move(kv[i + 1]));
    }
  }

  PyRef long_value(std::span<const uint8_t> b) {
    if (b.size() > 8) fail(fmt::format("an integer of {} bytes (more than 64 bits)", b.size()));
    uint64_t u = 0;
    for (size_t i = b.size(); i-- > 0;) u = (u << 8) | b[i];
    if (!b.empty() && b.size() < 8 && (b.back() & 0x80)) u |= ~uint64_t{0} << (8 * b.size());
    return make_int(static_cast<int64_t>(u));
  }

  void step(uint8_t op) {
    switch (op) {
      case 0x80: {  // PROTO
        const uint64_t p = le(1);
        if (p > 5) fail(fmt::format("protocol {} (this reader knows 2 to 5)", p));
        return;
      }
      case 0x95:
        le(8);
        return;  // FRAME: a framing hint, the opcodes follow as usual
      case '(':
        marks_.push_back(stack_.size());
        return;
      case '0':
        pop();
        return;
      case '1':
        pop_mark();
        return;
      case '2':
        push(top());
        return;
      case 'N':
        push(make(Kind::kNone));
        return;
      case 0x88:
      case 0x89: {
        PyRef v = make(Kind::kBool);
        v->flag = op == 0x88;
        push(std::move(v));
        return;
      }
      case 'J':
        push(make_int(static_cast<int32_t>(static_cast<uint32_t>(le(4)))));
        return;
      case 'K':
        push(make_int(static_cast<int64_t>(le(1))));
        return;
      case 'M':
        push(make_int(static_cast<int64_t>(le(2))));
        return;
      case 0x8a:
        push(long_value(take(le(1))));
        return;
      case 0x8b:
        push(long_value(take(le(4))));
        return;
      case 'I':
      case 'L': {
        std::string s = line();
        if (op == 'L' && !s.empty() && s.back() == 'L') s.pop_back();
        if (op == 'I' && (s == "00" || s == "01")) {
          PyRef v = make(Kind::kBool);
          v->flag = s == "01";
          push(std::move(v));
          return;
        }
        char* end = nullptr;
        errno = 0;
        const long long i = std::strtoll(s.c_str(), &end, 10);
        if (s.empty() || *end != '\0' || errno == ERANGE) fail("a malformed or too wide INT/LONG");
        push(make_int(i));
        return;
      }
      case 'G': {
        auto b = take(8);
        uint64_t u = 0;
        for (uint8_t x : b) u = (u << 8) | x;  // big-endian
        PyRef v = make(Kind::kFloat);
        v->real = std::bit_cast<double>(u);
        push(std::move(v));
        return;
      }
      case 'F': {
        const std::string s = line();
        char* end = nullptr;
        const double d = std::strtod(s.c_str(), &end);
        if (s.empty() || *end != '\0') fail("a malformed FLOAT");
        PyRef v = make(Kind::kFloat);
        v->real = d;
        push(std::move(v));
        return;
      }
      case 'X':
      case 0x8c:
      case 0x8d: {
        PyRef v = make(Kind::kStr);
        v->text = str(le(op == 'X' ? 4 : op == 0x8c ? 1 : 8));
        push(std::move(v));
        return;
      }
      case 'B':
      case 'C':
      case 0x8e:
      case 0x96:
      case 'T':
      case 'U': {
        const int n = op == 'C' || op == 'U' ? 1 : (op == 'B' || op == 'T') ? 4 : 8;
        PyRef v = make(Kind::kBytes);
        v->text = str(le(n));
        push(std::move(v));
        return;
      }
      case ')':
        push(make(Kind::kTuple));
        return;
      case 't': {
        PyRef v = make(Kind::kTuple);
        v->items = pop_mark();
        push(std::move(v));
        return;
      }
      case 0x85:
      case 0x86:
      case 0x87: {
        const int n = op - 0x84;
        PyRef v = make(Kind::kTuple);
        v->items.resize(static_cast<size_t>(n));
        for (int i = n - 1; i >= 0; --i) v->items[static_cast<size_t>(i)] = pop();
        push(std::move(v));
        return;
      }
      case ']':
        push(make(Kind::kList));
        return;
      case 'l': {
        PyRef v = make(Kind::kList);
        v->items = pop_mark();
        push(std::move(v));
        return;
      }
      case 'a': {
        PyRef x = pop();
        PyRef& list = top();
        if (list->kind != Kind::kList) fail("APPEND to something that is not a list");
        list->items.push_back(std::move(x));
        return;
      }
      case 'e': {
        std::vector<PyRef> xs = pop_mark();
        PyRef& list = top();
        if (list->kind != Kind::kList) fail("APPENDS to something that is not a list");
        for (PyRef& x : xs) list->items.push_back(std::move(x));
        return;
      }
      case '}':
        push(make(Kind::kDict));
        return;
      case 'd': {
        PyRef v = make(Kind::kDict);
        set_items(*v, pop_mark());
        push(std::move(v));
        return;
      }
      case 's': {
        PyRef value = pop();
        PyRef key = pop();
        set_items(*top(), {std::move(key), std::move(value)});
        return;
      }
      case 'u': {
        std::vector<PyRef> kv = pop_mark();
        set_items(*top(), std::move(kv));
        return;
      }
      case 0x8f:
        push(make(Kind::kSet));
        return;
      case 0x90: {
        std::vector<PyRef> xs = pop_mark();
        PyRef& set = top();
        if (set->kind != Kind::kSet) fail("ADDITEMS to something that is not a set");
        for (PyRef& x : xs) set->items.push_back(std::move(x));
        return;
      }
      case 0x91: {
        PyRef v = make(Kind::kSet);
        v->items = pop_mark();
        push(std::move(v));
        return;
      }
      case 'c': {
        std::string module = line();
        std::string name = line();
        global(std::move(module), std::move(name));
        return;
      }
      case 0x93: {
        PyRef name = pop();
        PyRef module = pop();
        if (name->kind != Kind::kStr || module->kind != Kind::kStr) {
          fail("STACK_GLOBAL with a module or name that is not a str");
        }
        global(module->text, name->text);
        return;
      }
      case 'R': {
        PyRef args = pop();
        PyRef callable = pop();
        object(callable, tuple_items(args, "REDUCE"), "REDUCE");
        return;
      }
      case 0x81: {
        PyRef args = pop();
        PyRef cls = pop();
        object(cls, tuple_items(args, "NEWOBJ"), "NEWOBJ");
        return;
      }
      case 0x92: {
        PyRef kwargs = pop();
        PyRef args = pop();
        PyRef cls = pop();
        if (kwargs->kind != Kind::kDict || !kwargs->pairs.empty()) {
          fail("NEWOBJ_EX with keyword arguments");
        }
        object(cls, tuple_items(args, "NEWOBJ_EX"), "NEWOBJ_EX");
        return;
      }
      case 'b': {
        PyRef state = pop();
        PyRef& obj = top();
        if (obj->kind != Kind::kObject) fail("BUILD on something that is not an object");
        obj->state = std::move(state);
        obj->built = true;
        return;
      }
      case 'P':
      case 'Q': {
        PyRef v = make(Kind::kPersistent);
        if (op == 'P') {
          v->state = make(Kind::kStr);
          v->state->text = line();
        } else {
          v->state = pop();
        }
        push(std::move(v));
        return;
      }
      case 'p': {
        const std::string s = line();
        char* end = nullptr;
        const unsigned long long i = std::strtoull(s.c_str(), &end, 10);
        if (s.empty() || *end != '\0') fail("a malformed PUT");
        memo_put(i);
        return;
      }
      case 'g': {
        const std::string s = line();
        char* end = nullptr;
        const unsigned long long i = std::strtoull(s.c_str(), &end, 10);
        if (s.empty() || *end != '\0') fail("a malformed GET");
        memo_get(i);
        return;
      }
      case 'q':
        memo_put(le(1));
        return;
      case 'r':
        memo_put(le(4));
        return;
      case 0x94:
        memo_put(memo_.size());
        return;
      case 'h':
        memo_get(le(1));
        return;
      case 'j':
        memo_get(le(4));
        return;
      default: {
        const std::string_view name = refused_opcode(op);
        if (!name.empty()) fail(fmt::format("opcode {} is not used by this format", name));
        fail(fmt::format("unknown opcode 0x{:02x}", op));
      }
    }
  }

  std::span<const uint8_t> in_;
  const std::set<std::string>& allowed_;
  std::string_view where_;
  size_t pos_ = 0;
  size_t op_at_ = 0;
  std::vector<PyRef> stack_;
  std::vector<size_t> marks_;
  std::unordered_map<uint64_t, PyRef> memo_;
};

}  // namespace

PyRef read_pickle(std::span<const uint8_t> bytes, const std::set<std::string>& allowed_globals,
                  std::string_view where) {
  return Unpickler(bytes, allowed_globals, where).run();
}

std::string_view pickle_kind_name(PyValue::Kind kind) {
  switch (kind) {
    case Kind::kNone:
      return "None";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kStr:
      return "str";
    case Kind::kBytes:
      return "bytes";
    case Kind::kTuple:
      return "tuple";
    case Kind::kList:
      return "list";
    case Kind::kDict:
      return "dict";
    case Kind::kSet:
      return "set";
    case Kind::kGlobal:
      return "global";
    case Kind::kObject:
      return "object";
    case Kind::kPersistent:
      return "persistent id";
  }
  return "?";
}

const PyValue& expect(const PyRef& v, PyValue::Kind kind, std::string_view what) {
  MP_CHECK_INPUT(v != nullptr && v->kind == kind, "{}: expected {}, found {}", what,
                 pickle_kind_name(kind), v ? pickle_kind_name(v->kind) : "nothing");
  return *v;
}

int64_t expect_int(const PyRef& v, std::string_view what) {
  return expect(v, Kind::kInt, what).integer;
}

const std::string& expect_str(const PyRef& v, std::string_view what) {
  return expect(v, Kind::kStr, what).text;
}

const PyValue& expect_object(const PyRef& v, std::string_view callable, std::string_view what) {
  const PyValue& o = expect(v, Kind::kObject, what);
  MP_CHECK_INPUT(o.text == callable, "{}: expected {}, found {}", what, callable, o.text);
  return o;
}

PyRef dict_get(const PyValue& dict, std::string_view key) {
  for (const auto& [k, v] : dict.pairs) {
    if (k && k->kind == Kind::kStr && k->text == key) return v;
  }
  return nullptr;
}

std::vector<int64_t> int_sequence(const PyRef& v, std::string_view what) {
  MP_CHECK_INPUT(v != nullptr, "{}: missing", what);
  const PyValue* seq = v.get();
  // torch.Size((a, b)) pickles as REDUCE(torch.Size, ((a, b),)).
  if (seq->kind == Kind::kObject && seq->text == "torch.Size") {
    MP_CHECK_INPUT(seq->items.size() == 1, "{}: torch.Size with {} arguments", what,
                   seq->items.size());
    seq = seq->items[0].get();
    MP_CHECK_INPUT(seq != nullptr, "{}: torch.Size without its sizes", what);
  }
  MP_CHECK_INPUT(seq->kind == Kind::kTuple || seq->kind == Kind::kList,
                 "{}: expected a tuple of ints, found {}", what, pickle_kind_name(seq->kind));
  std::vector<int64_t> out;
  out.reserve(seq->items.size());
  for (const PyRef& x : seq->items) out.push_back(expect_int(x, what));
  return out;
}

}  // namespace meshproof::engine
