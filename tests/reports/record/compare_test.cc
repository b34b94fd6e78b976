// `report compare` logic: ratios B/A per scenario and metric, unmatched scenarios, bad input.
#include "reports/record/compare.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <map>

#include "reports/record/report_error.h"
#include "reports/writers/report_writers.h"
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

  // Every step 1.25x slower: B's steady-state range lies above A's, so the change is flagged
  // (worse: step time); the all-gather total has no repetitions, so no noise to judge it by.
  EXPECT_EQ(st->change, Change::kWorse);
  EXPECT_EQ(find(t, s0, "tokens_per_s")->change, Change::kWorse);
  EXPECT_EQ(find(t, s0, "busbw_gbps all_gather dp_shard")->change, Change::kUnmeasured);
  const std::string text = format_compare_table(t, "a.json", "b.json");
  EXPECT_NE(text.find("A = a.json"), std::string::npos);
  EXPECT_NE(text.find("1.250  worse"), std::string::npos) << text;  // slower step time
  EXPECT_NE(text.find("2.000  no noise measured"), std::string::npos) << text;
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

// A bench report: one scenario of benchmark figures with their measured ranges.
RunRecord bench_record() {
  RunRecord a = testing::sample_record();
  a.scenarios.erase(a.scenarios.begin() + 2);
  a.scenarios.erase(a.scenarios.begin());
  ScenarioRecord& s = a.scenarios[0];
  s.steps.clear();
  s.collectives.clear();
  s.golden.reset();
  BenchmarkFigure gemm;
  gemm.name = "gemm fprop 256x256x256";
  gemm.metric = "tflops";
  gemm.value = 100;
  gemm.min = 95;
  gemm.max = 104;
  gemm.unit = "TFLOP/s";
  BenchmarkFigure step;
  step.name = "layer step";
  step.metric = "step_time_ms";
  step.value = 4;
  step.min = 3.9;
  step.max = 4.4;
  step.unit = "ms";
  step.higher_is_better = false;
  BenchmarkFigure tok = step;
  tok.metric = "tokens_per_s";
  tok.value = 1000;
  tok.min = 900;
  tok.max = 1020;
  tok.unit = "tokens/s";
  tok.higher_is_better = true;
  s.benchmarks = {gemm, step, tok};
  return a;
}

TEST(CompareTest, BenchmarkFiguresComparedByNameAndMetric) {
  const RunRecord a = bench_record();
  RunRecord b = a;
  b.scenarios[0].benchmarks[0].value = 150;  // faster GEMM, beyond A's range
  b.scenarios[0].benchmarks[0].min = 140;
  b.scenarios[0].benchmarks[0].max = 155;
  b.scenarios[0].benchmarks[1].value = 4.3;  // slower median step, but inside the noise
  b.scenarios[0].benchmarks[1].min = 4.1;
  b.scenarios[0].benchmarks[1].max = 4.6;
  const CompareTable t = compare_reports(to_json(a), to_json(b));
  EXPECT_EQ(t.kind, ReportKind::kBench);
  const std::string s1 = a.scenarios[0].name;
  const CompareRow* g = find(t, s1, "gemm fprop 256x256x256 tflops");
  ASSERT_NE(g, nullptr);
  EXPECT_EQ(*g->ratio, 1.5);  // 150 / 100: exact in binary floating point
  EXPECT_TRUE(g->higher_is_better);
  EXPECT_EQ(g->change, Change::kBetter);  // 140..155 lies above 95..104
  const CompareRow* st = find(t, s1, "layer step step_time_ms");
  ASSERT_NE(st, nullptr);
  EXPECT_DOUBLE_EQ(*st->ratio, 1.075);
  EXPECT_FALSE(st->higher_is_better);
  EXPECT_EQ(st->change, Change::kNone);  // 4.1..4.6 overlaps 3.9..4.4: within the noise
  const std::string text = format_compare_table(t, "a.json", "b.json");
  EXPECT_NE(text.find("95..104"), std::string::npos) << text;
  EXPECT_NE(text.find("1.500  better"), std::string::npos) << text;
  EXPECT_NE(text.find("1.075  within noise"), std::string::npos) << text;

  // No duplicate rows: the scenario's performance block repeats the layer figures (step time,
  // tokens/s, TFLOP/s); they appear once, as benchmark figures, and the MFU once.
  std::map<std::string, int> seen;
  for (const CompareRow& r : t.rows) ++seen[r.scenario + "/" + r.metric];
  for (const auto& [k, n] : seen) EXPECT_EQ(n, 1) << k;
  EXPECT_EQ(find(t, s1, "step_time_ms"), nullptr);
  EXPECT_EQ(find(t, s1, "tokens_per_s"), nullptr);
  EXPECT_NE(find(t, s1, "mfu"), nullptr);

  // Bench reports written before min/max existed still compare, without judging changes.
  nlohmann::json old = to_json(a);
  for (auto& f : old["scenarios"][0]["benchmarks"]) {
    f.erase("min");
    f.erase("max");
  }
  const CompareTable old_t = compare_reports(old, to_json(b));
  const CompareRow* o = find(old_t, s1, "layer step step_time_ms");
  ASSERT_NE(o, nullptr);
  EXPECT_EQ(o->change, Change::kUnmeasured);

  // With the repetitions kept, the noise is their range without the fastest and slowest fifth (one
  // each of 7): a single 20x outlier in A does not hide B's 2x slowdown, which min/max would.
  RunRecord sa = a, sb = a;
  BenchmarkFigure& fa = sa.scenarios[0].benchmarks[1];
  fa.samples = {4.0, 3.9, 80.0, 4.1, 4.2, 4.0, 3.95};
  fa.min = 3.9;
  fa.max = 80.0;
  BenchmarkFigure& fb = sb.scenarios[0].benchmarks[1];
  fb.samples.clear();
  for (double v : fa.samples) fb.samples.push_back(2 * v);
  fb.value = 8;
  fb.min = 7.8;
  fb.max = 160;
  // The table outlives the row pointer into it (a temporary here was a use after free).
  const CompareTable slow_t = compare_reports(to_json(sa), to_json(sb));
  const CompareRow* slow = find(slow_t, s1, "layer step step_time_ms");
  ASSERT_NE(slow, nullptr);
  EXPECT_EQ(slow->change, Change::kWorse);  // 7.9..8.4 lies above 3.95..4.2
  EXPECT_EQ(slow->a_range->min, 3.95);
  EXPECT_EQ(slow->a_range->max, 4.2);
  // Fewer than 5 repetitions: the min/max rule (3.9..80 overlaps 7.8..160).
  fa.samples.resize(4);
  fb.samples.resize(4);
  const CompareTable few = compare_reports(to_json(sa), to_json(sb));
  EXPECT_EQ(find(few, s1, "layer step step_time_ms")->change, Change::kNone);

  // The run-to-run floor (reports/record/compare.h): B 3% slower with both ranges tight and
  // disjoint (the drift two reruns showed on the CPU VM) is within noise by default, flagged when
  // the caller asks for changes of 1%.
  RunRecord ta = a, tb = a;
  BenchmarkFigure& ra = ta.scenarios[0].benchmarks[1];
  ra.samples = {4.0, 4.0, 4.01, 4.0, 3.99};
  ra.value = 4.0;
  ra.min = 3.99;
  ra.max = 4.01;
  BenchmarkFigure& rb = tb.scenarios[0].benchmarks[1];
  rb.samples.clear();
  for (double v : ra.samples) rb.samples.push_back(1.03 * v);
  rb.value = 4.12;
  rb.min = 1.03 * 3.99;
  rb.max = 1.03 * 4.01;
  const std::string step = "layer step step_time_ms";
  EXPECT_EQ(find(compare_reports(to_json(ta), to_json(tb)), s1, step)->change, Change::kNone);
  EXPECT_EQ(find(compare_reports(to_json(ta), to_json(tb), 0.01), s1, step)->change,
            Change::kWorse);

  // A duplicated (name, metric) is an invalid record.
  RunRecord dup = a;
  dup.scenarios[0].benchmarks.push_back(dup.scenarios[0].benchmarks[0]);
  EXPECT_THROW(to_json(dup), ReportError);
}

// #17.18: a bench report and a run report share no figure: refused (input error, exit 2 at the
// CLI), not an empty table.
TEST(CompareTest, ReportsOfDifferentKindsAreRefused) {
  const nlohmann::json run = to_json(testing::sample_record());
  const nlohmann::json bench = to_json(bench_record());
  EXPECT_EQ(report_kind(run, "A"), ReportKind::kRun);
  EXPECT_EQ(report_kind(bench, "B"), ReportKind::kBench);
  for (const auto& [a, b] : {std::pair{run, bench}, std::pair{bench, run}}) {
    try {
      compare_reports(a, b);
      FAIL() << "expected ReportError";
    } catch (const ReportError& e) {
      EXPECT_EQ(e.kind(), ReportError::Kind::kInput);
      EXPECT_NE(std::string(e.what()).find("compare two reports of the same kind"),
                std::string::npos)
          << e.what();
    }
  }
}

// A run whose every step is a little slower, but within the spread of A's steady-state steps, is
// not flagged; the same slowdown beyond the spread is.
TEST(CompareTest, RunStepTimeFlaggedOnlyOutsideTheSteadyStateSpread) {
  const RunRecord a = testing::sample_record();
  const std::string s0 = a.scenarios[0].name;
  const CompareTable same = compare_reports(to_json(a), to_json(a));
  const CompareRow* base = find(same, s0, "step_time_ms");
  ASSERT_NE(base, nullptr);
  ASSERT_TRUE(base->a_range.has_value());
  ASSERT_GT(base->a_range->max, base->a_range->min) << "the sample's steps need a spread";
  EXPECT_EQ(base->change, Change::kNone);
  RunRecord b = a;
  b.scenarios[0].performance->median_step_time_s *= 1.001;
  EXPECT_EQ(find(compare_reports(to_json(a), to_json(b)), s0, "step_time_ms")->change,
            Change::kNone);
  const double spread = base->a_range->max / base->a_range->min;
  // Just outside the spread but under the run-to-run floor (kDefaultMinChange): not flagged.
  if (spread * 1.01 < 1 + kDefaultMinChange) {
    RunRecord near = b;
    for (StepMetrics& m : near.scenarios[0].steps) m.time.total_s *= spread * 1.01;
    near.scenarios[0].performance->median_step_time_s *= spread * 1.01;
    EXPECT_EQ(find(compare_reports(to_json(a), to_json(near)), s0, "step_time_ms")->change,
              Change::kNone);
  }
  // Outside both: worse.
  const double factor = std::max(spread * 1.01, 1 + kDefaultMinChange + 0.01);
  for (StepMetrics& m : b.scenarios[0].steps) m.time.total_s *= factor;
  b.scenarios[0].performance->median_step_time_s *= factor;
  EXPECT_EQ(find(compare_reports(to_json(a), to_json(b)), s0, "step_time_ms")->change,
            Change::kWorse);
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
