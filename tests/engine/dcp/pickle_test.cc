// The restricted unpickler (engine/dcp/pickle.h) on pickles CPython wrote (the byte strings below
// are pickle.dumps output of Debian's python3 3.11, protocols 2, 4 and 5), and its refusals.
#include "engine/dcp/pickle.h"

#include <gtest/gtest.h>

#include <string>

#include "kernels/core/error.h"

namespace meshproof::engine {
namespace {

using Kind = PyValue::Kind;

std::span<const uint8_t> bytes_of(const std::string& s) {
  return {reinterpret_cast<const uint8_t*>(s.data()), s.size()};
}

PyRef parse(const std::string& s, const std::set<std::string>& allowed = {}) {
  return read_pickle(bytes_of(s), allowed, "test.pkl");
}

// The message of the input error parse(s) throws.
std::string refusal(const std::string& s, const std::set<std::string>& allowed = {}) {
  try {
    parse(s, allowed);
  } catch (const kernels::Error& e) {
    EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput) << e.what();
    return e.message();
  }
  ADD_FAILURE() << "accepted";
  return "";
}

// ("ab", -3, 70000, 2**40, -2**63, [2.5, None, True, False], {"k": "v"}, (1,), (1, 2), (1, 2, 3))
const std::string kProto2 = std::string(
    "\x80\x02\x28\x58\x02\x00\x00\x00\x61\x62\x71\x00\x4a\xfd\xff\xff\xff\x4a\x70\x11\x01\x00\x8a"
    "\x06\x00\x00\x00\x00\x00\x01\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80\x5d\x71\x01\x28\x47\x40"
    "\x04\x00\x00\x00\x00\x00\x00\x4e\x88\x89\x65\x7d\x71\x02\x58\x01\x00\x00\x00\x6b\x71\x03\x58"
    "\x01\x00\x00\x00\x76\x71\x04\x73\x4b\x01\x85\x71\x05\x4b\x01\x4b\x02\x86\x71\x06\x4b\x01\x4b"
    "\x02\x4b\x03\x87\x71\x07\x74\x71\x08\x2e",
    102);
// ("ab", -3, 70000, 2**40, -2**63, [2.5, None, True, False], {"k": b"\x00\x01"}, (1,), (1, 2),
//  (1, 2, 3), frozenset(), {1}) at protocol 4; protocol 5 writes the same bytes but its header.
const std::string kProto4 = std::string(
    "\x80\x04\x95\x5c\x00\x00\x00\x00\x00\x00\x00\x28\x8c\x02\x61\x62\x94\x4a\xfd\xff\xff\xff\x4a"
    "\x70\x11\x01\x00\x8a\x06\x00\x00\x00\x00\x00\x01\x8a\x08\x00\x00\x00\x00\x00\x00\x00\x80\x5d"
    "\x94\x28\x47\x40\x04\x00\x00\x00\x00\x00\x00\x4e\x88\x89\x65\x7d\x94\x8c\x01\x6b\x94\x43\x02"
    "\x00\x01\x94\x73\x4b\x01\x85\x94\x4b\x01\x4b\x02\x86\x94\x4b\x01\x4b\x02\x4b\x03\x87\x94\x28"
    "\x91\x94\x8f\x94\x28\x4b\x01\x90\x74\x94\x2e",
    103);

void expect_common_prefix(const PyRef& v) {
  ASSERT_EQ(v->kind, Kind::kTuple);
  ASSERT_GE(v->items.size(), 10u);
  EXPECT_EQ(expect_str(v->items[0], "0"), "ab");
  EXPECT_EQ(expect_int(v->items[1], "1"), -3);
  EXPECT_EQ(expect_int(v->items[2], "2"), 70000);
  EXPECT_EQ(expect_int(v->items[3], "3"), int64_t{1} << 40);
  EXPECT_EQ(expect_int(v->items[4], "4"), std::numeric_limits<int64_t>::min());
  const PyValue& list = expect(v->items[5], Kind::kList, "5");
  ASSERT_EQ(list.items.size(), 4u);
  EXPECT_EQ(list.items[0]->kind, Kind::kFloat);
  EXPECT_EQ(list.items[0]->real, 2.5);
  EXPECT_EQ(list.items[1]->kind, Kind::kNone);
  EXPECT_TRUE(list.items[2]->flag);
  EXPECT_EQ(list.items[3]->kind, Kind::kBool);
  EXPECT_FALSE(list.items[3]->flag);
  EXPECT_EQ(int_sequence(v->items[7], "7"), std::vector<int64_t>({1}));
  EXPECT_EQ(int_sequence(v->items[8], "8"), std::vector<int64_t>({1, 2}));
  EXPECT_EQ(int_sequence(v->items[9], "9"), std::vector<int64_t>({1, 2, 3}));
}

TEST(Pickle, ReadsProtocol2) {
  const PyRef v = parse(kProto2);
  expect_common_prefix(v);
  const PyValue& d = expect(v->items[6], Kind::kDict, "6");
  EXPECT_EQ(expect_str(dict_get(d, "k"), "k"), "v");
  EXPECT_EQ(dict_get(d, "missing"), nullptr);
}

TEST(Pickle, ReadsProtocols4And5) {
  std::string proto5 = kProto4;
  proto5[1] = '\x05';
  for (const std::string& s : {kProto4, proto5}) {
    const PyRef v = parse(s);
    expect_common_prefix(v);
    ASSERT_EQ(v->items.size(), 12u);
    const PyValue& d = expect(v->items[6], Kind::kDict, "6");
    const PyRef b = dict_get(d, "k");
    ASSERT_EQ(b->kind, Kind::kBytes);
    EXPECT_EQ(b->text, std::string("\x00\x01", 2));
    EXPECT_EQ(expect(v->items[10], Kind::kSet, "10").items.size(), 0u);
    const PyValue& set = expect(v->items[11], Kind::kSet, "11");
    ASSERT_EQ(set.items.size(), 1u);
    EXPECT_EQ(set.items[0]->integer, 1);
  }
}

TEST(Pickle, MemoSharesValues) {
  // l = [1]; pickle.dumps([l, l], protocol=4): the second element is a memo GET of the first.
  const std::string s(
      "\x80\x04\x95\x0c\x00\x00\x00\x00\x00\x00\x00\x5d\x94\x28\x5d\x94\x4b\x01\x61"
      "\x68\x01\x65\x2e",
      23);
  const PyRef v = parse(s);
  const PyValue& outer = expect(v, Kind::kList, "outer");
  ASSERT_EQ(outer.items.size(), 2u);
  EXPECT_EQ(outer.items[0], outer.items[1]);
  EXPECT_EQ(outer.items[0]->items[0]->integer, 1);
}

TEST(Pickle, ReduceRecordsTheCallWithoutMakingIt) {
  // collections.OrderedDict([("a", 1)]) at protocol 4: STACK_GLOBAL, REDUCE, SETITEM.
  const std::string s(
      "\x80\x04\x95\x29\x00\x00\x00\x00\x00\x00\x00\x8c\x0b\x63\x6f\x6c\x6c\x65\x63\x74\x69\x6f\x6e"
      "\x73\x94\x8c\x0b\x4f\x72\x64\x65\x72\x65\x64\x44\x69\x63\x74\x94\x93\x94\x29\x52\x94\x8c\x01"
      "\x61\x94\x4b\x01\x73\x2e",
      52);
  EXPECT_NE(refusal(s).find("'collections.OrderedDict'"), std::string::npos);
  const PyRef v = parse(s, {"collections.OrderedDict"});
  const PyValue& o = expect_object(v, "collections.OrderedDict", "od");
  EXPECT_TRUE(o.items.empty());
  EXPECT_EQ(expect_int(dict_get(o, "a"), "a"), 1);
}

TEST(Pickle, RefusesGlobalsOutsideTheFormat) {
  // pickle.dumps(os.system, protocol=2): GLOBAL 'posix system'.
  const std::string s(
      "\x80\x02\x63\x70\x6f\x73\x69\x78\x0a\x73\x79\x73\x74\x65\x6d\x0a\x71\x00\x2e", 19);
  const std::string msg = refusal(s, {"torch.Size"});
  EXPECT_NE(msg.find("test.pkl"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'posix.system'"), std::string::npos) << msg;
  EXPECT_NE(msg.find("never executed"), std::string::npos) << msg;
}

TEST(Pickle, RefusesMalformedInput) {
  struct Case {
    std::string bytes, expect;
  };
  const Case cases[] = {
      {"", "without STOP"},
      {std::string("\x80\x02", 2), "without STOP"},
      {std::string("\x80\x06.", 3), "protocol 6"},
      {"X\xff\xff\xff\x7f", "runs past the end"},
      {".", "empty stack"},
      {"t.", "no MARK"},
      {"a.", "empty stack"},
      {std::string("h\x05.", 3), "memo entry 5"},
      {std::string("\x8a\x09\x00\x00\x00\x00\x00\x00\x00\x00\x01.", 12), "more than 64 bits"},
      {"(i__main__\nX\n.", "INST"},
      {std::string("\x82\x01.", 3), "EXT1"},
      {"\xff.", "unknown opcode 0xff"},
      {"K\x01K\x02R.", "not a tuple"},
      {"N}b.", "BUILD on something that is not an object"},
      {"K\x05K\x01K\x02s.", "not a dict"},
  };
  for (const Case& c : cases) {
    const std::string msg = refusal(c.bytes);
    EXPECT_NE(msg.find(c.expect), std::string::npos) << "expected '" << c.expect << "' in: " << msg;
    EXPECT_NE(msg.find("test.pkl"), std::string::npos) << msg;
  }
}

TEST(Pickle, HelpersNameWhatIsWrong) {
  const PyRef v = parse(kProto2);
  try {
    expect_int(v->items[0], "key 'x' size");
    FAIL() << "accepted a str as an int";
  } catch (const kernels::Error& e) {
    EXPECT_NE(e.message().find("key 'x' size: expected int, found str"), std::string::npos)
        << e.message();
  }
}

}  // namespace
}  // namespace meshproof::engine
