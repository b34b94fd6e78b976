// The located-YAML layer (harness/scenario/located_yaml.h) on its own: every value keeps the
// FILE:LINE:COL (or --set) that wrote it through parsing, merging and overrides; strict typed reads
// name the path and say what is wrong; did-you-mean suggests only close names.
#include "harness/scenario/located_yaml.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "kernels/core/error.h"

namespace meshproof::harness {
namespace {

using yaml::Value;

// The problems a read reports, one "WHERE: PATH: WHAT" line each.
template <class F>
std::vector<std::string> problems(F read) {
  yaml::Issues issues;
  {
    yaml::Collect collect(issues);
    try {
      read();
    } catch (const yaml::Stop&) {
    }
  }
  std::vector<std::string> lines;
  for (const yaml::Issue& i : issues.list) lines.push_back(i.line());
  return lines;
}

TEST(LocatedYaml, EveryValueAndKeyKeepsItsLineAndColumn) {
  const Value root = yaml::parse_document("a: 1\nb:\n  c: [x, y]\n", "f.yaml");
  ASSERT_EQ(root.kind, Value::kMap);
  EXPECT_EQ(root.find("a")->where, "f.yaml:1:4");
  EXPECT_EQ(root.key_location("b"), "f.yaml:2:1");
  const Value* c = root.find("b")->find("c");
  ASSERT_NE(c, nullptr);
  ASSERT_EQ(c->seq.size(), 2u);
  EXPECT_EQ(c->seq[1].where, "f.yaml:3:10");
  EXPECT_EQ(c->seq[1].scalar, "y");
}

TEST(LocatedYaml, QuotedScalarsAreStrings) {
  const Value root = yaml::parse_document("a: '1'\nb: 1\n", "f.yaml");
  EXPECT_TRUE(root.find("a")->quoted);
  EXPECT_FALSE(root.find("b")->quoted);
  EXPECT_EQ(yaml::describe(*root.find("a")), "the string \"1\"");
  EXPECT_EQ(yaml::describe(*root.find("b")), "'1'");
}

TEST(LocatedYaml, SyntaxErrorsAndDuplicateKeysNameTheirLine) {
  EXPECT_EQ(problems([] { yaml::parse_document("a: [1, 2\n", "f.yaml"); }).at(0).substr(0, 12),
            "f.yaml:2:1: ");
  EXPECT_EQ(problems([] { yaml::parse_document("a: 1\na: 2\n", "f.yaml"); }),
            (std::vector<std::string>{"f.yaml:2:1: a: duplicate key (first given at f.yaml:1:1)"}));
}

TEST(LocatedYaml, MergeKeepsTheMarksOfBothSides) {
  Value target = yaml::parse_document("m: {a: 1, b: 2}\n", "t.yaml");
  const Value incoming = yaml::parse_document("m: {b: 3, c: 4}\n", "i.yaml");
  yaml::merge_into(target, incoming);
  const Value* m = target.find("m");
  EXPECT_EQ(m->find("a")->where, "t.yaml:1:8");  // untouched
  EXPECT_EQ(m->find("b")->scalar, "3");          // the incoming side wins
  EXPECT_EQ(m->find("b")->where, "i.yaml:1:8");
  EXPECT_EQ(m->key_location("c"), "i.yaml:1:11");
}

TEST(LocatedYaml, OverridesAreLocatedAtTheirFlagAndMergeIntoMappings) {
  Value root = yaml::parse_document("mesh: {dp_shard: 2}\n", "s.yaml");
  const Override o = parse_override("mesh={tp: 2}");
  yaml::set_at(root, o.path, yaml::override_value(o), yaml::set_where(o));
  const Value* mesh = root.find("mesh");
  EXPECT_EQ(mesh->find("dp_shard")->where, "s.yaml:1:18");
  EXPECT_EQ(mesh->find("tp")->where, "--set mesh={tp: 2}");
  // New mappings on the way are created at the override.
  const Override deep = parse_override("a.b.c=5");
  yaml::set_at(root, deep.path, yaml::override_value(deep), yaml::set_where(deep));
  EXPECT_EQ(root.find("a")->find("b")->find("c")->scalar, "5");
  EXPECT_EQ(root.key_location("a"), "--set a.b.c=5");
}

TEST(LocatedYaml, NormalizeRewritesTheValueAtItsPath) {
  Value root = yaml::parse_document("x: 1\n", "s.yaml");
  const Override o = parse_override("r=7");
  yaml::set_at(root, o.path, yaml::override_value(o), yaml::set_where(o),
               [](const std::string& path, Value v) {
                 if (path == "r") v.scalar += "!";
                 return v;
               });
  EXPECT_EQ(root.find("r")->scalar, "7!");
}

TEST(LocatedYaml, SettingInsideAScalarIsAProblemAtTheOverride) {
  Value root = yaml::parse_document("mesh: 4\n", "s.yaml");
  const Override o = parse_override("mesh.tp=2");
  EXPECT_EQ(
      problems([&] { yaml::set_at(root, o.path, yaml::override_value(o), yaml::set_where(o)); }),
      (std::vector<std::string>{
          "--set mesh.tp=2: mesh: is '4', not a mapping: cannot set 'tp' inside it"}));
}

struct BadOverride {
  const char* name;
  const char* text;
  const char* message;
};
class ParseOverride : public ::testing::TestWithParam<BadOverride> {};

TEST_P(ParseOverride, MalformedOverridesNameTheOverride) {
  try {
    parse_override(GetParam().text);
    FAIL() << "accepted " << GetParam().text;
  } catch (const kernels::Error& e) {
    EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
    EXPECT_EQ(e.message(), GetParam().message);
  }
}

INSTANTIATE_TEST_SUITE_P(
    LocatedYaml, ParseOverride,
    ::testing::Values(BadOverride{"NoEquals", "mesh.tp", "--set mesh.tp: expected KEY.PATH=VALUE"},
                      BadOverride{"EmptyPath", "=2",
                                  "--set =2: (empty): malformed key path (expected names "
                                  "joined by '.')"},
                      BadOverride{"EmptyComponent", "mesh..tp=2",
                                  "--set mesh..tp=2: mesh..tp: malformed key path "
                                  "(expected names joined by '.')"},
                      BadOverride{"Space", "mesh.t p=2",
                                  "--set mesh.t p=2: mesh.t p: malformed key path "
                                  "(expected names joined by '.')"}),
    [](const ::testing::TestParamInfo<BadOverride>& i) { return std::string(i.param.name); });

// One typed read of key `k` from the mapping `yaml` and the problem it reports ("" when none).
struct TypedRead {
  const char* name;
  const char* yaml;
  std::function<void(yaml::Section&)> read;
  const char* problem;
};
class SectionRead : public ::testing::TestWithParam<TypedRead> {};

TEST_P(SectionRead, ReportsTheKeyPathAndWhatIsWrong) {
  const Value root = yaml::parse_document(GetParam().yaml, "x.yaml");
  yaml::Locations locs;
  const std::vector<std::string> got = problems([&] {
    yaml::Section s(root.find("s"), "s", "x.yaml:1:1", locs, {"k"});
    GetParam().read(s);
  });
  if (std::string(GetParam().problem).empty()) {
    EXPECT_TRUE(got.empty()) << got.at(0);
  } else {
    EXPECT_EQ(got, std::vector<std::string>{GetParam().problem});
  }
}

const auto kInt = [](yaml::Section& s) { s.integer("k", 0, 1, 4); };
const auto kNum = [](yaml::Section& s) { s.number("k", 0, 0, 1, false, true); };
const auto kBool = [](yaml::Section& s) { s.boolean("k", false); };
const auto kChoice = [](yaml::Section& s) { s.choice("k", 0, {"layernorm", "rmsnorm"}); };

INSTANTIATE_TEST_SUITE_P(
    LocatedYaml, SectionRead,
    ::testing::Values(
        TypedRead{"IntOk", "s: {k: 3}\n", kInt, ""},
        TypedRead{"IntOutOfRange", "s: {k: 5}\n", kInt,
                  "x.yaml:1:8: s.k: must be in [1, 4], got 5"},
        TypedRead{"IntAsFloat", "s: {k: 2.0}\n", kInt,
                  "x.yaml:1:8: s.k: expected an integer, got '2.0'"},
        TypedRead{"IntQuoted", "s: {k: '2'}\n", kInt,
                  "x.yaml:1:8: s.k: expected an integer, got the string \"2\""},
        TypedRead{"IntNull", "s: {k: ~}\n", kInt,
                  "x.yaml:1:8: s.k: expected a value, got nothing (null)"},
        TypedRead{"NumberOpenMax", "s: {k: 1}\n", kNum,
                  "x.yaml:1:8: s.k: must be in [0, 1), got 1"},
        TypedRead{"NumberNan", "s: {k: .nan}\n", kNum,
                  "x.yaml:1:8: s.k: expected a number, got '.nan'"},
        TypedRead{"BoolOk", "s: {k: True}\n", kBool, ""},
        TypedRead{"BoolWrong", "s: {k: yes}\n", kBool,
                  "x.yaml:1:8: s.k: expected true or false, got 'yes'"},
        TypedRead{"ChoiceDidYouMean", "s: {k: rmsnrm}\n", kChoice,
                  "x.yaml:1:8: s.k: expected one of layernorm|rmsnorm, got 'rmsnrm'; did you "
                  "mean 'rmsnorm'?"},
        TypedRead{"UnknownKey", "s: {kk: 1}\n", [](yaml::Section&) {},
                  "x.yaml:1:5: s.kk: unknown key; did you mean 'k'?"},
        TypedRead{"NotAMapping", "s: [1]\n", [](yaml::Section&) {},
                  "x.yaml:1:4: s: expected a mapping, got a sequence"}),
    [](const ::testing::TestParamInfo<TypedRead>& info) { return std::string(info.param.name); });

TEST(LocatedYaml, DidYouMeanSuggestsOnlyCloseNames) {
  EXPECT_EQ(edit_distance("dp_shrad", "dp_shard"), 2u);
  EXPECT_EQ(yaml::suggestion("dp_shrad", {"dp_replicate", "dp_shard", "tp"}), "dp_shard");
  EXPECT_EQ(yaml::suggestion("zzzzzz", {"dp_replicate", "dp_shard", "tp"}), "");
  // Long words: the limit grows with the word (a third of it), and candidates whose length
  // differs by more than the limit are never within it (the fuzz regression long_scalar_set_path
  // is the 40,000-byte case, which took seconds when every candidate was measured).
  EXPECT_EQ(yaml::suggestion("sequence_parallelx", {"sequence_parallel", "tp"}),
            "sequence_parallel");
  EXPECT_EQ(yaml::suggestion(std::string(40000, 'd'), {"dp_replicate", "dp_shard", "tp"}), "");
  EXPECT_EQ(yaml::unknown_message("key", "zzzzzz", {"a", "b"}), "unknown key (allowed: a, b)");
  EXPECT_EQ(yaml::unknown_message("key", "meshes", {"mesh", "model"}),
            "unknown key; did you mean 'mesh'?");
}

TEST(LocatedYaml, WithoutACollectorAProblemThrowsTheInputErrorAtOnce) {
  try {
    yaml::report("f.yaml:1:2", "a.b", "is wrong");
    FAIL();
  } catch (const kernels::Error& e) {
    EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
    EXPECT_EQ(e.message(), "f.yaml:1:2: a.b: is wrong");
  }
}

}  // namespace
}  // namespace meshproof::harness
