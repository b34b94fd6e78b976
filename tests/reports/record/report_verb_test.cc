// `meshproof report compare` through run_cli: the table on success, exit 2 on bad input.
#include <gtest/gtest.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "harness/verbs/cli.h"
#include "harness/verbs/exit_codes.h"
#include "reports/writers/report_writers.h"
#include "sample_record.h"
#include "tests/harness/cli_run.h"

namespace meshproof::harness {
namespace {

using harness::testing::CliResult;
constexpr auto& run = harness::testing::run_meshproof;

class ReportVerbTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("meshproof_report_verb_" + std::to_string(::getpid()));
    reports::RunRecord a = reports::testing::sample_record();
    reports::write_reports(a, dir_ / "a");
    a.scenarios[0].performance->median_step_time_s *= 2;
    for (reports::StepMetrics& m : a.scenarios[0].steps) m.time.total_s *= 2;
    reports::write_reports(a, dir_ / "b");
    // A bench report: one scenario of benchmark figures.
    reports::RunRecord bench = reports::testing::sample_record();
    bench.scenarios.resize(1);
    bench.scenarios[0].steps.clear();
    bench.scenarios[0].golden.reset();
    reports::BenchmarkFigure f;
    f.name = "gemm fprop 256x256x256";
    f.metric = "tflops";
    f.value = 100;
    f.unit = "TFLOP/s";
    bench.scenarios[0].benchmarks = {f};
    reports::write_reports(bench, dir_ / "bench");
    a_ = (dir_ / "a" / "report.json").string();
    b_ = (dir_ / "b" / "report.json").string();
    bench_ = (dir_ / "bench" / "report.json").string();
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  std::filesystem::path dir_;
  std::string a_, b_, bench_;
};

TEST_F(ReportVerbTest, ComparePrintsRatios) {
  const CliResult r = run({"report", "compare", a_.c_str(), b_.c_str()});
  ASSERT_EQ(r.code, kExitOk) << r.err;
  EXPECT_NE(r.out.find("B = " + b_), std::string::npos) << r.out;
  // Doubled step time (every step): ratio 2.000, beyond the steady-state spread: worse.
  EXPECT_NE(r.out.find("2.000  worse"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("busbw_gbps all_reduce tp"), std::string::npos) << r.out;
}

// #17.18: a run report against a bench report used to print an empty table and exit 0.
TEST_F(ReportVerbTest, ReportsOfDifferentKindsAreExit2) {
  for (const auto& [x, y] : {std::pair{a_, bench_}, std::pair{bench_, a_}}) {
    const CliResult r = run({"report", "compare", x.c_str(), y.c_str()});
    EXPECT_EQ(r.code, kExitBadInput) << r.out;
    EXPECT_NE(r.err.find("compare two reports of the same kind"), std::string::npos) << r.err;
    EXPECT_EQ(r.out.find("scenario"), std::string::npos) << r.out;  // no table
  }
}

TEST_F(ReportVerbTest, MissingOrMalformedReportIsExit2) {
  const std::string missing = (dir_ / "nope.json").string();
  CliResult r = run({"report", "compare", a_.c_str(), missing.c_str()});
  EXPECT_EQ(r.code, kExitBadInput);
  EXPECT_NE(r.err.find("cannot open report " + missing), std::string::npos) << r.err;
  std::ofstream(dir_ / "junk.json") << "[1, 2";
  const std::string junk = (dir_ / "junk.json").string();
  r = run({"report", "compare", junk.c_str(), a_.c_str()});
  EXPECT_EQ(r.code, kExitBadInput);
  EXPECT_NE(r.err.find("is not valid JSON"), std::string::npos) << r.err;
  EXPECT_EQ(run({"report", "compare", a_.c_str()}).code, kExitBadInput);  // usage
  EXPECT_EQ(run({"report"}).code, kExitBadInput);
}

}  // namespace
}  // namespace meshproof::harness
