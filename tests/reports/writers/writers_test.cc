// The four writers on the sample record: verdicts, counts, the failing check's evidence in
// every format, escaping of hostile strings, and write_reports' atomic, all-or-nothing output.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "reports/record/report_error.h"
#include "reports/writers/atomic_file.h"
#include "reports/writers/report_text.h"
#include "reports/writers/report_writers.h"
#include "sample_record.h"

namespace meshproof::reports {
namespace {

using testing::occurrences;

std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

class TempDir {
 public:
  TempDir() {
    path_ = std::filesystem::temp_directory_path() /
            ("meshproof_reports_test_" + std::to_string(::getpid()) + "_" +
             ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::remove_all(path_);
  }
  ~TempDir() { std::filesystem::remove_all(path_); }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

TEST(RunRecordTest, VerdictRules) {
  const RunRecord r = testing::sample_record();
  EXPECT_EQ(scenario_verdict(r.scenarios[0]), Verdict::kPass);
  EXPECT_EQ(scenario_verdict(r.scenarios[1]), Verdict::kFail);
  EXPECT_EQ(scenario_verdict(r.scenarios[2]), Verdict::kPass);  // fault caught as expected
  EXPECT_EQ(run_verdict(r), Verdict::kFail);

  ScenarioRecord s = r.scenarios[2];
  s.checks[0].verdict = Verdict::kPass;  // the fault slipped through
  EXPECT_EQ(scenario_verdict(s), Verdict::kFail);
  s.checks[0].verdict = Verdict::kError;
  EXPECT_EQ(scenario_verdict(s), Verdict::kError);
  s.checks[0].verdict = Verdict::kSkipped;  // no GPU here: recorded, not failed
  EXPECT_EQ(scenario_verdict(s), Verdict::kSkipped);
  s.checks[0].verdict = Verdict::kFail;
  s.checks[0].kind = "determinism";  // failed, but not one of caught_by
  EXPECT_EQ(scenario_verdict(s), Verdict::kFail);
  ScenarioRecord skipped;
  skipped.checks = {{"determinism", "determinism", Verdict::kSkipped, "off", 0, std::nullopt}};
  EXPECT_EQ(scenario_verdict(skipped), Verdict::kSkipped);
  ScenarioRecord broken = r.scenarios[0];
  broken.error = "CUDA error: out of memory";
  EXPECT_EQ(scenario_verdict(broken), Verdict::kError);
  EXPECT_EQ(format_utc(0), "1970-01-01T00:00:00Z");
  EXPECT_EQ(format_utc(1795321099), "2026-11-22T04:18:19Z");
}

TEST(RunRecordTest, JsonCarriesRecordAndDerivedFields) {
  const RunRecord r = testing::sample_record();
  const nlohmann::json j = nlohmann::json::parse(render_json(r));
  EXPECT_EQ(j["schema"], "meshproof.report");
  EXPECT_EQ(j["schema_version"], kReportSchemaVersion);
  EXPECT_EQ(j["verdict"], "fail");
  EXPECT_EQ(j["summary"]["scenarios"]["pass"], 2);
  EXPECT_EQ(j["summary"]["scenarios"]["fail"], 1);
  EXPECT_EQ(j["summary"]["checks"]["skipped"], 1);
  ASSERT_EQ(j["scenarios"].size(), 3u);
  const nlohmann::json& s = j["scenarios"][1];
  EXPECT_EQ(s["config"]["mesh"]["tp"], 2);
  EXPECT_EQ(s["steps"].size(), 20u);
  EXPECT_EQ(s["steps"][9]["time"]["checkpoint_s"], 0.041);
  EXPECT_EQ(s["steps"][0]["time"]["collectives_s"].size(), 3u);
  // other_s is total minus the attributed parts: the fixture adds 0.9 ms of overhead.
  EXPECT_NEAR(s["steps"][3]["time"]["other_s"].get<double>(), 0.0009, 1e-12);
  EXPECT_EQ(s["golden"]["tolerance"]["rtol"], 1e-2);
  const nlohmann::json& e = s["checks"][0]["evidence"];
  EXPECT_EQ(e["first_diverging_step"], 9);
  EXPECT_EQ(e["tensor"], "layers.2.attn.qkv.weight");
  EXPECT_EQ(e["ulp_distance"], 5767);
  EXPECT_EQ(s["checks"][1]["evidence"], nullptr);
  EXPECT_EQ(s["performance"]["peak_tflops"], 1979.0);
  EXPECT_EQ(s["memory"].size(), 8u);
  EXPECT_EQ(s["collectives"][3]["group"], "tp");
}

TEST(RunRecordTest, NonFiniteNumbersBecomeNullAndConfigMustBeAnObject) {
  RunRecord r = testing::sample_record();
  r.scenarios[0].steps[3].loss = std::nan("");
  const nlohmann::json j = nlohmann::json::parse(render_json(r));
  EXPECT_TRUE(j["scenarios"][0]["steps"][3]["loss"].is_null());
  r.scenarios[0].config = nlohmann::json::array();
  EXPECT_THROW(render_json(r), ReportError);
}

TEST(WritersTest, MarkdownSummaryRowsMatchTheRecord) {
  const RunRecord r = testing::sample_record();
  const std::string md = render_markdown(r);
  EXPECT_EQ(md.rfind("# meshproof report: fail\n", 0), 0u);
  for (const ScenarioRecord& s : r.scenarios) {
    const std::string row = "| " + s.name + " | " + s.mesh + " | " + s.recipe + " | " +
                            checks_tally(s) + " | " +
                            std::string(verdict_name(scenario_verdict(s))) + " | " +
                            step_time_ms(s) + " | " + mfu_percent(s) + " |";
    EXPECT_NE(md.find(row), std::string::npos) << row << "\n" << md;
  }
  EXPECT_NE(md.find("| gpt_tiny_hsdp2x2_tp2_delayed | dp_replicate=2 dp_shard=2 tp=2 | delayed | "
                    "1 pass, 1 fail, 1 skipped | fail |"),
            std::string::npos);
  EXPECT_NE(md.find("MXFP8 columnwise all-gather fell back"), std::string::npos);
}

TEST(WritersTest, JunitCountsFollowTheRecord) {
  const std::string x = render_junit(testing::sample_record());
  EXPECT_EQ(occurrences(x, "<testsuite "), 3u);
  // 3 + 3 + (1 check + 1 expectation testcase) = 8 testcases; 1 failure (the golden check); the
  // caught fault is not a failure; one skipped.
  EXPECT_EQ(occurrences(x, "<testcase "), 8u);
  EXPECT_EQ(occurrences(x, "<failure "), 1u);
  EXPECT_EQ(occurrences(x, "<skipped "), 1u);
  EXPECT_NE(x.find("<!-- meshproof: 8 tests, 1 failures, 0 errors, 1 skipped in 9.400 s -->"),
            std::string::npos);
  // The Ant schema allows no attributes on <testsuites>.
  EXPECT_NE(x.find("\n<testsuites>\n"), std::string::npos);
  EXPECT_NE(x.find("<system-out>caught as expected by allgather_parity: FP8 all-gathered weight "
                   "differs"),
            std::string::npos);
  EXPECT_NE(x.find("timestamp=\"2026-11-22T04:18:19\""), std::string::npos);
}

TEST(WritersTest, UncaughtFaultAndScenarioErrorAreReported) {
  RunRecord r = testing::sample_record();
  r.scenarios[2].checks[0].verdict = Verdict::kPass;
  r.scenarios[0].error = "CUDA error: out of memory";
  const std::string x = render_junit(r);
  EXPECT_NE(x.find("<failure message=\"fault not caught: none of the intended checks "
                   "(allgather_parity, reference) failed\" type=\"expectation\"/>"),
            std::string::npos)
      << x;
  EXPECT_EQ(occurrences(x, "<failure "), 2u);
  EXPECT_EQ(occurrences(x, "<error "), 1u);
  EXPECT_NE(x.find("CUDA error: out of memory"), std::string::npos);
}

// A fault caught only by a check that is not meant to catch it is a miss, in every format.
TEST(WritersTest, FaultCaughtByTheWrongCheckFailsInAllFourFormats) {
  const RunRecord r = testing::wrong_check_record();
  const ScenarioRecord& s = r.scenarios[2];
  EXPECT_FALSE(catches_fault(s, s.checks[1]));  // determinism failed, but is not in caught_by
  EXPECT_EQ(scenario_verdict(s), Verdict::kFail);
  const std::string why =
      "fault not caught: none of the intended checks (allgather_parity, reference) failed; "
      "determinism failed instead";
  EXPECT_EQ(verdict_reason(s), why);
  // The sample's own failing scenario stays a fail; the run is a fail.
  EXPECT_EQ(run_verdict(r), Verdict::kFail);

  const nlohmann::json j = nlohmann::json::parse(render_json(r));
  EXPECT_EQ(j["scenarios"][2]["verdict"], "fail");
  EXPECT_EQ(j["scenarios"][2]["caught_by"],
            nlohmann::json::array({"allgather_parity", "reference"}));
  EXPECT_EQ(j["summary"]["scenarios"]["fail"], 2);

  const std::string md = render_markdown(r);
  EXPECT_NE(md.find("| fault_amax_not_reduced | dp_replicate=1 dp_shard=4 tp=1 | current | 1 pass, "
                    "1 fail | fail |"),
            std::string::npos)
      << md;
  EXPECT_NE(md.find("- why: " + why + "\n"), std::string::npos);
  EXPECT_NE(md.find("- caught by (intended checks): allgather_parity, reference\n"),
            std::string::npos);

  const std::string x = render_junit(r);
  EXPECT_NE(x.find("<property name=\"verdict\" value=\"fail\"/>\n      <property "
                   "name=\"step_time_ms\""),
            std::string::npos);
  EXPECT_NE(x.find("<testcase name=\"expectation:caught\" classname=\"meshproof."
                   "fault_amax_not_reduced\" time=\"0.000\">\n      <failure message=\"" +
                   why + "\" type=\"expectation\"/>"),
            std::string::npos)
      << x;
  EXPECT_NE(x.find("failed, but is not an intended check (allgather_parity, reference): "
                   "determinism: rerun differs"),
            std::string::npos);
  // The golden failure of scenario 1 and the expectation testcase of scenario 2.
  EXPECT_EQ(occurrences(x, "<failure "), 2u);

  const std::string h = render_html(r);
  EXPECT_NE(h.find("<h2>fault_amax_not_reduced: fail</h2>"), std::string::npos);
  EXPECT_NE(h.find("<tr><th>why</th><td>" + why + "</td></tr>"), std::string::npos);
}

TEST(WritersTest, FailingCheckEvidenceAppearsInAllFourFormats) {
  const RunRecord r = testing::sample_record();
  const CheckResult& c = r.scenarios[1].checks[0];
  ASSERT_EQ(c.verdict, Verdict::kFail);
  const std::string ev = evidence_summary(*c.evidence);
  EXPECT_EQ(ev.rfind("first diverging step 9, metric loss, tensor layers.2.attn.qkv.weight, ", 0),
            0u)
      << ev;
  EXPECT_NE(ev.find("ULP distance 5767, 12 failing steps"), std::string::npos) << ev;
  EXPECT_NE(render_markdown(r).find(ev), std::string::npos);
  EXPECT_NE(render_html(r).find(ev), std::string::npos);
  const std::string x = render_junit(r);
  // The failure message carries the message and the evidence (with & escaped).
  EXPECT_NE(x.find("<failure message=\"loss left the band |x - g| &lt;= atol + rtol*|g| &amp; "
                   "stayed out: 12 steps &gt; 0 allowed (" +
                   ev + ")\" type=\"golden\">"),
            std::string::npos)
      << x;
  const nlohmann::json e =
      nlohmann::json::parse(render_json(r))["scenarios"][1]["checks"][0]["evidence"];
  EXPECT_EQ(e["first_diverging_step"], 9);
  EXPECT_DOUBLE_EQ(e["max_abs_err"].get<double>(), *c.evidence->max_abs_err);
  EXPECT_DOUBLE_EQ(e["max_rel_err"].get<double>(), *c.evidence->max_rel_err);
}

// The data's entropy floor: a number in report.json (null without one), a line in report.md, a
// row and a dashed line in the loss plot of report.html.
TEST(WritersTest, EntropyFloorInJsonMarkdownAndHtml) {
  const RunRecord r = testing::sample_record();
  const nlohmann::json j = nlohmann::json::parse(render_json(r));
  EXPECT_EQ(j["scenarios"][0]["entropy_floor"], 2 * std::log(2.0));
  EXPECT_TRUE(j["scenarios"][2]["entropy_floor"].is_null());
  const std::string md = render_markdown(r);
  EXPECT_EQ(occurrences(md,
                        "- data entropy floor: 1.386294 nats/token (the loss no model can beat); "
                        "final loss "),
            2u)
      << md;
  const std::string h = render_html(r);
  EXPECT_EQ(occurrences(h, "<tr><th>data entropy floor</th><td>1.386294 nats/token</td></tr>"), 2u);
  // #17.19: the sample's losses run from ~10 down to ~2.1 (axis from 2), the floor 1.386 lies
  // below: no line squashing the curves, the title says where it is.
  EXPECT_EQ(occurrences(h, ">entropy floor"), 0u);
  EXPECT_EQ(occurrences(h, " (entropy floor 1.386, below the range)</text>"), 2u)
      << h.substr(0, 4000);
  // A floor inside the curves' axis range is a labelled dashed line (legend "entropy floor V").
  RunRecord in_range = r;
  in_range.scenarios[0].entropy_floor = 2.2;
  const std::string h2 = render_html(in_range);
  EXPECT_EQ(occurrences(h2, ">entropy floor 2.2</text>"), 1u);
  EXPECT_EQ(occurrences(h2, "below the range)</text>"), 1u);  // scenario 1 keeps its 1.386
}

// The loss plot's y axis fits the curves: its lowest tick is at most one tick step below the
// lowest loss, never down at the far-away floor.
// Pipeline stages (docs/design.md section 38): the per-stage table in every format that carries
// per-rank figures, for the scenario with stages only.
TEST(WritersTest, PipelineStagesInEveryFormatOnlyWithStages) {
  const RunRecord r = testing::sample_record();
  ASSERT_EQ(r.scenarios[1].pipeline.size(), 2u);
  ASSERT_TRUE(r.scenarios[0].pipeline.empty());
  const nlohmann::json j = to_json(r);
  EXPECT_FALSE(j.at("scenarios").at(0).contains("pipeline"));
  const nlohmann::json& p = j.at("scenarios").at(1).at("pipeline");
  ASSERT_EQ(p.size(), 2u);
  EXPECT_EQ(p.at(1).at("stage"), 1);
  EXPECT_EQ(p.at(1).at("ranks"), nlohmann::json({4, 5, 6, 7}));
  EXPECT_DOUBLE_EQ(p.at(1).at("bubble_fraction").get<double>(), 0.125);  // 25 / 200
  EXPECT_DOUBLE_EQ(p.at(1).at("predicted_bubble_fraction").get<double>(), 0.2);
  EXPECT_EQ(p.at(1).at("peak_bytes").size(), 4u);

  const std::string md = render_markdown(r);
  EXPECT_EQ(occurrences(md, "| stage | ranks | layers | forward (ms) |"), 1u);
  // Stage 1: ranks 4-7, layers 6-11, 40/80/25/12/20/200 ms, bubble 0.125, predicted 0.200.
  EXPECT_NE(md.find("| 1 | 4, 5, 6, 7 | 6-11 | 40.000 | 80.000 | 25.000 | 12.000 | 20.000 | "
                    "200.000 | 0.125 | 0.200 | "),
            std::string::npos)
      << md;
  const std::string html = render_html(r);
  EXPECT_EQ(occurrences(html, "<h3>Pipeline stages</h3>"), 1u);
  EXPECT_NE(html.find("<td>4, 5, 6, 7</td><td>6-11</td>"), std::string::npos);
  const std::string x = render_junit(r);
  EXPECT_NE(x.find(R"(<property name="pp_stage1_bubble" value="0.125"/>)"), std::string::npos);
  EXPECT_NE(x.find(R"(<property name="pp_stage0_predicted_bubble" value="0.200"/>)"),
            std::string::npos);
  EXPECT_EQ(occurrences(x, "pp_stage0_step_ms"), 1u);  // the one scenario with stages

  // A stage whose ranks and peak figures disagree is refused before anything is written.
  RunRecord bad = r;
  bad.scenarios[1].pipeline[0].peak_bytes.pop_back();
  EXPECT_THROW(validate_record(bad), ReportError);
}

TEST(WritersTest, LossPlotAxisFitsTheCurves) {
  RunRecord r = testing::sample_record();
  r.scenarios.resize(1);
  r.scenarios[0].entropy_floor = 0.01;  // far below the curves (~2.1 .. 10)
  const std::string h = render_html(r);
  EXPECT_EQ(occurrences(h, ">entropy floor"), 0u);
  EXPECT_NE(h.find(" (entropy floor 0.01, below the range)"), std::string::npos);
}

// grad_norm of the run against the golden's, one plot per scenario with steps.
TEST(WritersTest, GradNormPlotAgainstGolden) {
  const RunRecord r = testing::sample_record();
  const std::string h = render_html(r);
  EXPECT_EQ(occurrences(h, "class=\"title\">Grad norm vs golden: "),
            2u);                                                 // scenarios 0 and 1 have a golden
  EXPECT_EQ(occurrences(h, "class=\"title\">Grad norm: "), 1u);  // scenario 2 has none
}

TEST(WritersTest, HtmlIsSelfContainedWithOneSvgPerPlot) {
  const std::string h = render_html(testing::sample_record());
  // Plots: scenarios 0 and 1 have loss, relative difference, grad norm, step time and memory (5
  // each); scenario 2 has no golden: loss, grad norm, step time and memory (4).
  EXPECT_EQ(occurrences(h, "<svg "), 14u);
  EXPECT_EQ(occurrences(h, "</svg>"), 14u);
  EXPECT_EQ(occurrences(h, "<script"), 0u);
  EXPECT_EQ(occurrences(h, " src="), 0u);
  EXPECT_EQ(occurrences(h, "href=\"http"), 0u);
  EXPECT_EQ(occurrences(h, "<section "), 3u);
  EXPECT_NE(h.find("Relative difference of loss vs golden: gpt_tiny_hsdp2x2_tp2_delayed"),
            std::string::npos);
}

TEST(WritersTest, HostileStringsAreEscapedEverywhere) {
  const RunRecord r = testing::hostile_record();
  const std::string h = render_html(r);
  const std::string x = render_junit(r);
  const std::string md = render_markdown(r);
  for (const std::string* doc : {&h, &x}) {
    EXPECT_EQ(doc->find("<script>x"), std::string::npos);
    EXPECT_EQ(doc->find("a<b>"), std::string::npos);
    EXPECT_EQ(doc->find('\x01'), std::string::npos);
    EXPECT_EQ(doc->find('\xff'), std::string::npos);
    EXPECT_NE(doc->find("a&lt;b&gt;&amp;c&quot;d&#39;e|f"), std::string::npos);
  }
  EXPECT_EQ(md.find('\x01'), std::string::npos);
  EXPECT_EQ(md.find('\xff'), std::string::npos);
  EXPECT_NE(md.find("e\\|f"), std::string::npos);  // pipes escaped in table cells
  // JSON keeps the text (control character escaped, invalid byte replaced).
  const nlohmann::json j = nlohmann::json::parse(render_json(r));
  EXPECT_NE(j["scenarios"][1]["name"].get<std::string>().find("a<b>&c\"d'e|f\x01g"),
            std::string::npos);
}

TEST(WriteReportsTest, WritesFourFilesAndNoTemporaries) {
  TempDir dir;
  const RunRecord r = testing::sample_record();
  const ReportPaths p = write_reports(r, dir.path() / "nested" / "out");
  EXPECT_EQ(slurp(p.json), render_json(r));
  EXPECT_EQ(slurp(p.markdown), render_markdown(r));
  EXPECT_EQ(slurp(p.junit), render_junit(r));
  EXPECT_EQ(slurp(p.html), render_html(r));
  size_t files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir.path() / "nested" / "out")) {
    ++files;
    EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << e.path();
  }
  EXPECT_EQ(files, 4u);
  // Rewriting replaces the files in place.
  RunRecord r2 = r;
  r2.scenarios.pop_back();
  write_reports(r2, dir.path() / "nested" / "out");
  EXPECT_EQ(slurp(p.json), render_json(r2));
}

TEST(WriteReportsTest, InvalidRecordWritesNothing) {
  TempDir dir;
  RunRecord r = testing::sample_record();
  r.scenarios[1].config = "not an object";
  EXPECT_THROW(write_reports(r, dir.path()), ReportError);
  EXPECT_FALSE(std::filesystem::exists(dir.path()));
}

TEST(RunRecordTest, ValidationNamesTheOffendingScenario) {
  auto expect_invalid = [](const RunRecord& r, const std::string& needle) {
    try {
      validate_record(r);
      FAIL() << "expected ReportError containing " << needle;
    } catch (const ReportError& e) {
      EXPECT_EQ(e.kind(), ReportError::Kind::kInput);
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  EXPECT_NO_THROW(validate_record(testing::sample_record()));
  RunRecord r = testing::sample_record();
  r.scenarios[2].name = r.scenarios[0].name;
  expect_invalid(r, "scenario 'gpt_tiny_fsdp4_mxfp8' appears twice");
  r = testing::sample_record();
  r.scenarios[1].name = "";
  expect_invalid(r, "scenarios[1]: empty scenario name");
  r = testing::sample_record();
  r.scenarios[1].checks[2].name = "golden";
  expect_invalid(r, "check 'golden' appears twice");
  r = testing::sample_record();
  r.scenarios[0].memory[1].rank = -1;
  expect_invalid(r, "memory of rank -1");
  r = testing::sample_record();
  r.scenarios[0].caught_by = {"golden"};
  expect_invalid(r,
                 "scenario 'gpt_tiny_fsdp4_mxfp8': caught_by is set but the expectation is pass");
}

TEST(WriteReportsTest, UnwritableDirectoryIsAnIoError) {
  TempDir dir;
  std::filesystem::create_directories(dir.path());
  std::ofstream(dir.path() / "file") << "x";
  try {
    write_reports(testing::sample_record(), dir.path() / "file" / "sub");
    FAIL() << "expected ReportError";
  } catch (const ReportError& e) {
    EXPECT_EQ(e.kind(), ReportError::Kind::kIo);
    EXPECT_NE(std::string(e.what()).find("file/sub"), std::string::npos) << e.what();
  }
}

// Issue #18.6: report temporaries had a predictable name (.report.json.tmp.<pid>) opened with
// O_TRUNC, so a symlink planted under that name made the run overwrite the symlink's target.
// Now they are mkstemp'd: a planted symlink is neither followed nor removed, its target keeps its
// contents, and the reports land in place.
TEST(AtomicFileTest, PlantedSymlinkAtTheOldTemporaryNameIsNotFollowed) {
  TempDir dir;
  std::filesystem::create_directories(dir.path());
  const std::filesystem::path victim = dir.path() / "victim.txt";
  std::ofstream(victim) << "precious";
  for (const std::string& name : report_file_names()) {
    std::filesystem::create_symlink(victim,
                                    dir.path() / ("." + name + ".tmp." + std::to_string(getpid())));
  }
  write_reports(testing::sample_record(), dir.path());
  std::ifstream in(victim);
  std::string content((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(content, "precious");
  for (const std::string& name : report_file_names()) {
    EXPECT_TRUE(std::filesystem::is_regular_file(dir.path() / name)) << name;
    EXPECT_FALSE(std::filesystem::is_symlink(dir.path() / name)) << name;
    EXPECT_GT(std::filesystem::file_size(dir.path() / name), 0u) << name;
  }
}

TEST(AtomicFileTest, TemporaryIsExclusiveAndUnique) {
  TempDir dir;
  std::filesystem::create_directories(dir.path());
  const std::filesystem::path target = dir.path() / "golden.h5";
  StagedFile a = create_temporary(target);
  StagedFile b = create_temporary(target);
  EXPECT_NE(a.path, b.path);
  long pid = 0;
  EXPECT_TRUE(is_temporary_of(a.path.filename().string(), "golden.h5", &pid));
  EXPECT_EQ(pid, static_cast<long>(getpid()));
  write_and_sync(a, "first");
  write_and_sync(b, "second");
  publish(a.path, target);
  publish(b.path, target);
  std::ifstream in(target);
  std::string content((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(content, "second");
  EXPECT_FALSE(std::filesystem::exists(a.path));
  EXPECT_FALSE(std::filesystem::exists(b.path));
}

// Issue #18.11: a run killed while staging leaves its temporary; the next run that owns the
// folder removes exactly the project's temporaries of processes that are gone, nothing else.
TEST(AtomicFileTest, OrphanTemporariesOfDeadWritersAreRemovedAndNothingElse) {
  TempDir dir;
  std::filesystem::create_directories(dir.path());
  const pid_t child = fork();
  if (child == 0) _exit(0);
  ASSERT_GT(child, 0);
  int status = 0;
  waitpid(child, &status, 0);  // a pid that no longer exists
  const std::string dead = std::to_string(child), alive = std::to_string(getpid());
  const std::vector<std::string> orphans = {".report.json.tmp." + dead + ".a1B2c3",
                                            ".junit.xml.tmp." + dead};  // the old pattern
  const std::vector<std::string> kept = {
      ".report.md.tmp." + alive + ".Zz9Yy8",  // a live writer's
      ".report.json.tmp." + dead + ".toolongname",
      ".report.json.tmp.x" + dead,
      ".notes.txt.tmp." + dead + ".a1B2c3",  // not one of the names asked for
      "report.json.tmp." + dead,             // no leading dot
      "data.tmp"};
  for (const std::string& n : orphans) std::ofstream(dir.path() / n) << "x";
  for (const std::string& n : kept) std::ofstream(dir.path() / n) << "x";
  const auto removed = remove_orphan_temporaries(dir.path(), report_file_names());
  EXPECT_EQ(removed.size(), orphans.size());
  for (const std::string& n : orphans) EXPECT_FALSE(std::filesystem::exists(dir.path() / n)) << n;
  for (const std::string& n : kept) EXPECT_TRUE(std::filesystem::exists(dir.path() / n)) << n;
}

}  // namespace
}  // namespace meshproof::reports
