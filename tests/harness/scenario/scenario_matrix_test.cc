// Matrix expansion (harness/scenario/scenario_matrix.h) on located YAML: labels, order (last key
// fastest), names, the overrides that win over the matrix, and the problems of a bad matrix.
#include "harness/scenario/scenario_matrix.h"

#include <gtest/gtest.h>

#include <string>
#include <vector>

namespace meshproof::harness {
namespace {

using yaml::Value;

struct LabelCase {
  const char* name;
  const char* yaml;  // the value, as `v: VALUE`
  const char* label;
};
class MatrixLabel : public ::testing::TestWithParam<LabelCase> {};

TEST_P(MatrixLabel, LabelsFollowTheDocumentedRules) {
  const Value root = yaml::parse_document(GetParam().yaml, "m.yaml");
  EXPECT_EQ(label_of(*root.find("v")), GetParam().label);
}

INSTANTIATE_TEST_SUITE_P(
    ScenarioMatrix, MatrixLabel,
    ::testing::Values(LabelCase{"Scalar", "v: mxfp8\n", "mxfp8"},
                      LabelCase{"Mapping", "v: {dp_shard: 2, tp: 2}\n", "dp_shard2_tp2"},
                      LabelCase{"NameFirstAndBare", "v: {tp: 2, name: current}\n",
                                "current_tp2"},  // name first, bare
                      LabelCase{"Booleans", "v: {fp8_all_gather: true, reshard: false}\n",
                                "fp8_all_gather_no_reshard"},
                      LabelCase{"List", "v: [1, 2, 4]\n", "1-2-4"},
                      LabelCase{"Null", "v: ~\n", "null"}),
    [](const ::testing::TestParamInfo<LabelCase>& i) { return std::string(i.param.name); });

// The names and one value of every entry of `yaml`'s matrix, in expansion order.
std::vector<std::string> expand(const std::string& text, const std::string& probe,
                                const std::function<void(Value&)>& finish = {}) {
  Value root = yaml::parse_document(text, "m.yaml");
  const std::vector<MatrixAxis> axes =
      read_matrix(*root.find("matrix"), {"recipe", "mesh", "train"});
  root.erase("matrix");
  std::vector<std::string> out;
  expand_matrix(root, axes, "stem", {}, finish, [&](MatrixEntry& e) {
    const Value* v = &e.doc;
    for (const std::string& part : yaml::split_path(probe)) v = v->find(part);
    out.push_back(e.name + " " + v->scalar + " @" + v->where);
    return true;
  });
  return out;
}

TEST(ScenarioMatrix, CartesianProductInFileOrderLastKeyFastest) {
  const std::string text =
      "name: fsdp\nmesh: {dp_shard: 4}\nmatrix:\n  mesh.tp: [1, 2]\n  train.steps: [3, 5]\n";
  EXPECT_EQ(expand(text, "train.steps"),
            (std::vector<std::string>{"fsdp[mesh.tp=1,train.steps=3] 3 @m.yaml:5:17",
                                      "fsdp[mesh.tp=1,train.steps=5] 5 @m.yaml:5:20",
                                      "fsdp[mesh.tp=2,train.steps=3] 3 @m.yaml:5:17",
                                      "fsdp[mesh.tp=2,train.steps=5] 5 @m.yaml:5:20"}));
  // A matrix value merges into the document's mapping: its other keys stay.
  EXPECT_EQ(expand(text, "mesh.dp_shard").at(3), "fsdp[mesh.tp=2,train.steps=5] 4 @m.yaml:2:18");
}

TEST(ScenarioMatrix, WithoutAMatrixOneEntryNamedAfterTheDefaultBase) {
  Value root = yaml::parse_document("train: {steps: 3}\n", "m.yaml");
  std::vector<std::string> names;
  expand_matrix(root, {}, "stem", {}, {}, [&](MatrixEntry& e) {
    names.push_back(e.name);
    return true;
  });
  EXPECT_EQ(names, std::vector<std::string>{"stem"});
}

TEST(ScenarioMatrix, FinishRunsAfterTheAxesSoOverridesWinOverTheMatrix) {
  const std::string text = "matrix:\n  train.steps: [3, 5]\n";
  const auto pin = [](Value& doc) {
    const Override o = parse_override("train.steps=7");
    yaml::set_at(doc, o.path, yaml::override_value(o), yaml::set_where(o));
  };
  EXPECT_EQ(expand(text, "train.steps", pin),
            (std::vector<std::string>{"stem[train.steps=3] 7 @--set train.steps=7",
                                      "stem[train.steps=5] 7 @--set train.steps=7"}));
}

TEST(ScenarioMatrix, VisitFalseStopsTheExpansion) {
  Value root = yaml::parse_document("matrix:\n  recipe: [a, b, c]\n", "m.yaml");
  const std::vector<MatrixAxis> axes = read_matrix(*root.find("matrix"), {"recipe"});
  EXPECT_EQ(matrix_entries(axes), 3.0);
  int visited = 0;
  expand_matrix(root, axes, "s", {}, {}, [&](MatrixEntry&) { return ++visited < 2; });
  EXPECT_EQ(visited, 2);
}

struct BadMatrix {
  const char* name;
  const char* yaml;
  const char* problem;
};
class MatrixProblem : public ::testing::TestWithParam<BadMatrix> {};

TEST_P(MatrixProblem, NamesTheMatrixKeyAndItsLine) {
  const Value root = yaml::parse_document(GetParam().yaml, "m.yaml");
  yaml::Issues issues;
  {
    yaml::Collect collect(issues);
    try {
      read_matrix(*root.find("matrix"), {"recipe", "mesh"});
    } catch (const yaml::Stop&) {
    }
  }
  ASSERT_EQ(issues.list.size(), 1u);
  EXPECT_EQ(issues.list[0].line(), GetParam().problem);
}

INSTANTIATE_TEST_SUITE_P(
    ScenarioMatrix, MatrixProblem,
    ::testing::Values(
        BadMatrix{"UnknownKey", "matrix:\n  meshes: [1]\n",
                  "m.yaml:2:3: matrix.meshes: unknown key; did you mean 'mesh'?"},
        BadMatrix{
            "EmptyList", "matrix:\n  recipe: []\n",
            "m.yaml:2:11: matrix.recipe: expected a non-empty list of values, got a sequence"},
        BadMatrix{"DuplicateLabel", "matrix:\n  recipe: [bf16, bf16]\n",
                  "m.yaml:2:18: matrix.recipe[1]: duplicate matrix entry 'bf16'"},
        BadMatrix{"NotAMapping", "matrix: [1]\n",
                  "m.yaml:1:9: matrix: expected a mapping, got a sequence"}),
    [](const ::testing::TestParamInfo<BadMatrix>& i) { return std::string(i.param.name); });

}  // namespace
}  // namespace meshproof::harness
