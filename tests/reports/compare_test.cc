// `report compare` logic: ratios B/A per scenario and metric, unmatched scenarios, bad input.
#include "reports/compare.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "reports/report_error.h"
#include "reports/report_writers.h"
#include "sample_record.h"

namespace meshproof::reports {
namespace {

const CompareRow* find(const CompareTable& t, const std::string& scenario, const std::string& m) {
  for (const CompareRow& r : t.rows) {
    if (r.scenario == scenario && r.metric == m) return &r;
  }
  return nullptr;
}

TEST(CompareTest, RatiosOfStepTimeThroughputAndBusBandwidth) {
  const RunRecord a = testing::sample_record();
  RunRecord b = a;
  // B: the FSDP scenario is 20% slower per step, its all-gather twice as fast.
  for (StepMetrics& m : b.scenarios[0].steps) m.time.total_s *= 1.25;
  PerformanceFigures& p = *b.scenarios[0].performance;
  p.median_step_time_s *= 1.25;
  p.tokens_per_s /= 1.25;
  p.tflops_per_device /= 1.25;
  *p.mfu /= 1.25;
  b.scenarios[0].collectives[0].busbw_gbps *= 2;
  b.scenarios.erase(b.scenarios.begin() + 2);  // the fault scenario only in A
  b.scenarios.push_back(a.scenarios[0]);
  b.scenarios.back().name = "new_in_b";

  const CompareTable t = compare_reports(to_json(a), to_json(b));
  const std::string s0 = a.scenarios[0].name;
  const CompareRow* st = find(t, s0, "step_time_ms");
  ASSERT_NE(st, nullptr);
  // Ratios of figures scaled by 1.25 (or 1/1.25): one rounding in the scaling and one in the
  // division B/A, so within 2 ulp of 1.25 (0.8); EXPECT_DOUBLE_EQ allows 4. The JSON documents
  // are compared in memory, so no text round trip adds error.
  EXPECT_DOUBLE_EQ(*st->ratio, 1.25);
  // A is the same product median_step_time_s * 1e3 that compare computes: exact.
  EXPECT_EQ(*st->a, a.scenarios[0].performance->median_step_time_s * 1e3);
  EXPECT_FALSE(st->higher_is_better);
  EXPECT_DOUBLE_EQ(*find(t, s0, "tokens_per_s")->ratio, 0.8);
  EXPECT_DOUBLE_EQ(*find(t, s0, "tflops_per_device")->ratio, 0.8);
  EXPECT_DOUBLE_EQ(*find(t, s0, "mfu")->ratio, 0.8);
  // Doubling is exact, and so is x / x: these ratios are exactly 2 and 1.
  EXPECT_EQ(*find(t, s0, "busbw_gbps all_gather dp_shard")->ratio, 2.0);
  EXPECT_EQ(*find(t, s0, "busbw_gbps reduce_scatter dp_shard")->ratio, 1.0);
  // Unchanged scenario: every ratio is 1; the two all-reduce groups are told apart.
  const std::string s1 = a.scenarios[1].name;
  EXPECT_EQ(*find(t, s1, "busbw_gbps all_reduce tp")->ratio, 1.0);
  EXPECT_NE(find(t, s1, "busbw_gbps all_reduce dp_replicate"), nullptr);
  EXPECT_EQ(t.only_in_a, std::vector<std::string>{"fault_amax_not_reduced"});
  EXPECT_EQ(t.only_in_b, std::vector<std::string>{"new_in_b"});

  const std::string text = format_compare_table(t, "a.json", "b.json");
  EXPECT_NE(text.find("A = a.json"), std::string::npos);
  EXPECT_NE(text.find("1.250 -"), std::string::npos) << text;  // slower step time is worse
  EXPECT_NE(text.find("2.000 +"), std::string::npos) << text;  // faster all-gather is better
  EXPECT_NE(text.find("only in A: fault_amax_not_reduced"), std::string::npos);
  EXPECT_NE(text.find("only in B: new_in_b"), std::string::npos);
}

TEST(CompareTest, MissingPeakGivesNoRatio) {
  RunRecord a = testing::sample_record();
  a.scenarios[0].performance->mfu.reset();
  const CompareTable t = compare_reports(to_json(a), to_json(testing::sample_record()));
  const CompareRow* r = find(t, a.scenarios[0].name, "mfu");
  ASSERT_NE(r, nullptr);
  EXPECT_FALSE(r->a);
  EXPECT_FALSE(r->ratio);
}

TEST(CompareTest, BenchmarkFiguresComparedByNameAndMetric) {
  RunRecord a = testing::sample_record();
  BenchmarkFigure gemm;
  gemm.name = "gemm fprop 256x256x256";
  gemm.metric = "tflops";
  gemm.value = 100;
  gemm.unit = "TFLOP/s";
  BenchmarkFigure step;
  step.name = "layer step";
  step.metric = "step_time_ms";
  step.value = 4;
  step.unit = "ms";
  step.higher_is_better = false;
  a.scenarios[1].benchmarks = {gemm, step};
  RunRecord b = a;
  b.scenarios[1].benchmarks[0].value = 150;  // faster GEMM
  b.scenarios[1].benchmarks[1].value = 5;    // slower step
  const CompareTable t = compare_reports(to_json(a), to_json(b));
  const std::string s1 = a.scenarios[1].name;
  const CompareRow* g = find(t, s1, "gemm fprop 256x256x256 tflops");
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(*g->ratio, 1.5);  // 150 / 100: exact in binary floating point
  EXPECT_TRUE(g->higher_is_better);
  const CompareRow* st = find(t, s1, "layer step step_time_ms");
  ASSERT_NE(st, nullptr);
  EXPECT_EQ(*st->ratio, 1.25);  // 5 / 4: exact
  EXPECT_FALSE(st->higher_is_better);
  const std::string text = format_compare_table(t, "a.json", "b.json");
  EXPECT_NE(text.find("1.500 +"), std::string::npos) << text;
  EXPECT_NE(text.find("1.250 -"), std::string::npos) << text;

  // Reports written before the benchmarks table existed still compare (no figures).
  nlohmann::json old = to_json(testing::sample_record());
  for (auto& s : old["scenarios"]) s.erase("benchmarks");
  EXPECT_EQ(find(compare_reports(old, to_json(b)), s1, "layer step step_time_ms")->a, std::nullopt);

  // A duplicated (name, metric) is an invalid record.
  a.scenarios[1].benchmarks.push_back(gemm);
  EXPECT_THROW(to_json(a), ReportError);
}

TEST(CompareTest, MalformedReportsAreInputErrorsNamingTheKey) {
  nlohmann::json a = to_json(testing::sample_record());
  nlohmann::json b = a;
  b["scenarios"][1]["performance"].erase("tokens_per_s");
  try {
    compare_reports(a, b);
    FAIL() << "expected ReportError";
  } catch (const ReportError& e) {
    EXPECT_EQ(e.kind(), ReportError::Kind::kInput);
    EXPECT_NE(std::string(e.what()).find("B.scenarios[1].performance: missing key 'tokens_per_s'"),
              std::string::npos)
        << e.what();
  }
  b = a;
  b["scenarios"][0]["collectives"][0]["busbw_gbps"] = "fast";
  EXPECT_THROW(compare_reports(a, b), ReportError);
}

TEST(CompareTest, LoadReportChecksFileAndSchemaVersion) {
  const std::filesystem::path dir = std::filesystem::temp_directory_path() /
                                    ("meshproof_compare_test_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const ReportPaths p = write_reports(testing::sample_record(), dir);
  EXPECT_EQ(load_report(p.json)["scenarios"].size(), 3u);
  auto expect_input_error = [](const std::filesystem::path& f, const std::string& needle) {
    try {
      load_report(f);
      FAIL() << "expected ReportError for " << f;
    } catch (const ReportError& e) {
      EXPECT_EQ(e.kind(), ReportError::Kind::kInput);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_input_error(dir / "missing.json", "cannot open report");
  std::ofstream(dir / "bad.json") << "{not json";
  expect_input_error(dir / "bad.json", "is not valid JSON");
  std::ofstream(dir / "other.json") << R"({"schema": "something else"})";
  expect_input_error(dir / "other.json", "is not a meshproof report");
  std::ofstream(dir / "v2.json") << R"({"schema": "meshproof.report", "schema_version": 2})";
  expect_input_error(dir / "v2.json", "schema_version 2 is not supported");
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace meshproof::reports
