// Goldens from other tools' runs (harness/checks/golden_import.h): Megatron-LM golden values as
// Megatron-LM's repository holds them (tests/data/megatron), JSON-lines loss logs, the input
// errors, the export round trip, the step-indexed tolerance-only comparison, and end to end: an
// imported curve drives the golden check of `meshproof run`, passing on its own curve and
// failing on a perturbed one.
#include "harness/checks/golden_import.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>

#include "harness/checks/checks.h"
#include "kernels/core/error.h"
#include "runner_test_builders.h"
#include "tests/harness/cli_run.h"
#include "tests/source_dir.h"

namespace meshproof::harness {
namespace {

namespace fs = std::filesystem;
using reports::Verdict;
using testing::run_meshproof;

const fs::path kMegatron = test_support::source_dir() / "tests/data/megatron";

class GoldenImport : public ::testing::Test {
 protected:
  void SetUp() override {
    root_ = fs::temp_directory_path() /
            fmt::format("meshproof_golden_import_{}_{}", ::getpid(),
                        ::testing::UnitTest::GetInstance()->current_test_info()->name());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override { fs::remove_all(root_); }
  fs::path write(const std::string& name, const std::string& text) {
    std::ofstream(root_ / name) << text;
    return root_ / name;
  }
  // The input error that importing `text` gives.
  std::string refusal(const std::string& text, const std::string& format = "auto") {
    const fs::path p = write("bad.json", text);
    try {
      read_golden_source(p, format);
    } catch (const kernels::Error& e) {
      EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
      EXPECT_NE(e.message().find(p.string()), std::string::npos) << e.message();
      return e.message();
    }
    ADD_FAILURE() << "accepted " << text;
    return "";
  }
  fs::path root_;
};

TEST_F(GoldenImport, ReadsMegatronsCurrentFormat) {
  const ImportedGolden g =
      read_golden_source(kMegatron / "gpt3_345m_tp1_pp2_golden_values_dev.json", "auto");
  EXPECT_EQ(g.format, GoldenSourceFormat::kMegatron);
  EXPECT_EQ(g.data.steps, (std::vector<int64_t>{1, 5, 10, 15, 20, 25, 30, 35, 40, 45, 50}));
  ASSERT_EQ(g.data.metrics.size(), 1u);
  EXPECT_EQ(g.data.metrics.at("loss").front(), 10.84009);
  EXPECT_EQ(g.data.metrics.at("loss").back(), 10.25759);
  // num-zeros holds "nan" strings: ignored with the other metrics meshproof does not record.
  EXPECT_EQ(g.ignored, (std::vector<std::string>{"iteration-time", "mem-allocated-bytes",
                                                 "mem-max-allocated-bytes", "num-zeros"}));
  EXPECT_EQ(g.data.provenance.at("origin"), "imported");
  EXPECT_EQ(g.data.provenance.at("source_format"), "megatron");
  EXPECT_EQ(g.data.provenance.at("source_bytes"), "1338");
}

TEST_F(GoldenImport, ReadsMegatronsListFormat) {
  const ImportedGolden g =
      read_golden_source(kMegatron / "gpt3_345m_mcore_tp1_pp2_golden_values.json", "megatron");
  // Ten values from start_step 0 every 5 logged iterations: iterations 1, 6, ..., 46.
  EXPECT_EQ(g.data.steps, (std::vector<int64_t>{1, 6, 11, 16, 21, 26, 31, 36, 41, 46}));
  EXPECT_EQ(g.data.metrics.at("loss")[9], 9.80584);
}

TEST_F(GoldenImport, ReadsJsonLines) {
  const fs::path p = write("log.jsonl",
                           "{\"step\": 1, \"loss\": 5.5, \"grad_norm\": 1.25}\n\n"
                           "{\"step\": 3, \"loss\": 5.25, \"grad_norm\": 1.0}\n");
  const ImportedGolden g = read_golden_source(p, "auto");
  EXPECT_EQ(g.format, GoldenSourceFormat::kJsonLines);
  EXPECT_EQ(g.data.steps, (std::vector<int64_t>{1, 3}));
  EXPECT_EQ(g.data.metrics.at("loss"), (std::vector<double>{5.5, 5.25}));
  EXPECT_EQ(g.data.metrics.at("grad_norm"), (std::vector<double>{1.25, 1.0}));
}

TEST_F(GoldenImport, BadInputNamesFileLineAndKey) {
  EXPECT_NE(refusal("{\"num-zeros\": {\"values\": {\"1\": 2.0}}}").find("\"lm loss\" metric"),
            std::string::npos);
  EXPECT_NE(refusal("{\"lm loss\": {\"values\": {\"1\": \"nan\"}}}")
                .find("\"lm loss\" step \"1\": expected a number, found \"nan\""),
            std::string::npos);
  EXPECT_NE(refusal("{\"lm loss\": {\"values\": {\"0\": 1.0}}}").find("step 0 (meshproof counts"),
            std::string::npos);
  EXPECT_NE(refusal("{\"lm loss\": {\"values\": {\"x\": 1.0}}}").find("not an integer step"),
            std::string::npos);
  EXPECT_NE(refusal("{\"lm loss\": {\"values\": {\"1\": 1.0}}, \"grad norm\": {\"values\": {\"2\": "
                    "1.0}}}")
                .find("its steps differ"),
            std::string::npos);
  EXPECT_NE(refusal("{\"lm loss\": 3}", "megatron").find("expected an object with \"values\""),
            std::string::npos);
  EXPECT_NE(refusal("{oops", "megatron").find("not JSON"), std::string::npos);
  // JSON lines: the line number and the key.
  EXPECT_NE(refusal("{\"step\": 1, \"loss\": 2.0}\n{\"step\": 1, \"loss\": 2.0}\n")
                .find(":2: step 1 after step 1"),
            std::string::npos);
  EXPECT_NE(refusal("{\"step\": 1, \"loss\": 2.0}\n{\"step\": 2, \"loss\": 2.0, \"lr\": 1}\n")
                .find(":2: \"lr\" is on some lines and not on others"),
            std::string::npos);
  EXPECT_NE(refusal("{\"step\": 1.5, \"loss\": 2.0}\n").find(":1 \"step\": expected an integer"),
            std::string::npos);
  // JSON cannot spell infinity; a number past double's range is refused where it is read.
  EXPECT_NE(refusal("{\"step\": 1, \"loss\": 1e999}\n", "jsonl").find(":1: not a JSON object"),
            std::string::npos);
  EXPECT_NE(refusal("\n\n").find("no lines"), std::string::npos);
}

TEST_F(GoldenImport, ExportRoundTripsBitwise) {
  GoldenData g;
  g.metrics["loss"] = {5.123456789012345, 5.0, 4.75};
  g.metrics["grad_norm"] = {1.0 / 3.0, 0.5, 0.25};
  const fs::path p = write("exported.json", golden_as_megatron_json(g));
  const ImportedGolden back = read_golden_source(p, "auto");
  EXPECT_EQ(back.data.steps, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(back.data.metrics.at("loss"), g.metrics.at("loss"));
  EXPECT_EQ(back.data.metrics.at("grad_norm"), g.metrics.at("grad_norm"));
  const nlohmann::json doc = nlohmann::json::parse(std::ifstream(p));
  EXPECT_EQ(doc["lm loss"]["start_step"], 1);
  EXPECT_EQ(doc["lm loss"]["end_step"], 3);
  EXPECT_EQ(doc["lm loss"]["step_interval"], 1);
}

TEST(ImportedGoldenCheck, ComparedByStepWithATolerance) {
  const auto steps = test::steps_of({5.0, 4.5, 4.0, 3.5, 3.25}, {1, 1, 1, 1, 1});
  GoldenData g;
  g.steps = {2, 4};
  g.metrics["loss"] = {4.5, 3.5};
  g.provenance = {{"origin", "imported"}, {"imported_from", "/x/golden_values.json"}};
  GoldenCheck cfg;
  cfg.enabled = true;
  // Exact mode: refused, an imported curve makes no bitwise claim.
  auto r = check_golden(steps, g, cfg, "g.h5", "cmd");
  EXPECT_EQ(r.verdict, Verdict::kFail);
  EXPECT_NE(r.message.find("no bitwise claim"), std::string::npos) << r.message;
  cfg.mode = GoldenMode::kTolerance;
  cfg.rtol = 1e-3;
  // grad_norm is not in the golden: the message says to list only its metrics.
  r = check_golden(steps, g, cfg, "g.h5", "cmd");
  EXPECT_EQ(r.verdict, Verdict::kFail);
  EXPECT_NE(r.message.find("list only the metrics it holds"), std::string::npos) << r.message;
  cfg.metrics = {Metric::kLoss};
  r = check_golden(steps, g, cfg, "g.h5", "cmd");
  EXPECT_EQ(r.verdict, Verdict::kPass) << r.message;
  EXPECT_NE(r.message.find("2 steps match g.h5 (tolerance, imported)"), std::string::npos)
      << r.message;
  // Step 4 off by 1%: fails there.
  g.metrics["loss"][1] = 3.5 * 1.01;
  r = check_golden(steps, g, cfg, "g.h5", "cmd");
  ASSERT_EQ(r.verdict, Verdict::kFail) << r.message;
  EXPECT_EQ(r.evidence->first_diverging_step, 4);
  // A golden step past the run's last: named.
  g.steps = {2, 9};
  r = check_golden(steps, g, cfg, "g.h5", "cmd");
  EXPECT_EQ(r.verdict, Verdict::kFail);
  EXPECT_NE(r.message.find("has step 9, which the run (steps 1..5) does not"), std::string::npos)
      << r.message;
}

TEST_F(GoldenImport, AnImportedMegatronCurveDrivesTheRunsGoldenCheck) {
  const std::string scenario = (test_support::source_dir() / "scenarios/quickstart.yaml").string();
  const std::string committed = (test_support::source_dir() / "golden/quickstart/cpu.h5").string();
  // The quickstart's curve as Megatron golden values, then imported as the golden of a store of
  // our own.
  auto r = run_meshproof({"golden", "export", committed, "--format", "megatron", "--out",
                          (root_ / "quickstart.json").string()});
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  const fs::path store = root_ / "golden";
  r = run_meshproof({"golden", "import", (root_ / "quickstart.json").string(), "--scenario",
                     "quickstart", "--golden-dir", store.string()});
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  EXPECT_NE(r.out.find("(8 steps, 1..8; grad_norm, loss, lr from megatron"), std::string::npos)
      << r.out;
  // Tolerance mode: the two runs are the same program here, so the band only has to hold the
  // curve's own bits; 1e-9 relative is far below the 1% perturbation below.
  const std::vector<std::string> run = {"run",
                                        scenario,
                                        "--backend",
                                        "cpu",
                                        "--golden-dir",
                                        store.string(),
                                        "--set",
                                        "checks.golden.mode=tolerance",
                                        "--set",
                                        "checks.golden.rtol=1e-9",
                                        "--set",
                                        "checks.resume=false",
                                        "--quiet",
                                        "--out",
                                        (root_ / "out").string()};
  r = run_meshproof(run);
  EXPECT_EQ(r.code, 0) << r.out << r.err;
  // Exact mode against the imported golden: refused by the check (exit 1), with the reason.
  r = run_meshproof({"run", scenario, "--backend", "cpu", "--golden-dir", store.string(), "--set",
                     "checks.resume=false", "--quiet", "--out", (root_ / "exact").string()});
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  EXPECT_NE(
      std::string(std::istreambuf_iterator<char>(std::ifstream(root_ / "exact/report.md").rdbuf()),
                  {})
          .find("no bitwise claim"),
      std::string::npos);
  // Step 5's loss 1% higher: the run fails its golden check at step 5.
  nlohmann::json doc = nlohmann::json::parse(std::ifstream(root_ / "quickstart.json"));
  doc["lm loss"]["values"]["5"] = doc["lm loss"]["values"]["5"].get<double>() * 1.01;
  std::ofstream(root_ / "perturbed.json") << doc.dump();
  r = run_meshproof({"golden", "import", (root_ / "perturbed.json").string(), "--scenario",
                     "quickstart", "--golden-dir", store.string()});
  ASSERT_EQ(r.code, 0) << r.out << r.err;
  r = run_meshproof(run);
  EXPECT_EQ(r.code, 1) << r.out << r.err;
  const nlohmann::json report = nlohmann::json::parse(std::ifstream(root_ / "out/report.json"));
  bool found = false;
  for (const auto& s : report["scenarios"]) {
    for (const auto& c : s["checks"]) {
      if (c["name"] != "golden") continue;
      found = true;
      EXPECT_EQ(c["verdict"], "fail");
      EXPECT_EQ(c["evidence"]["first_diverging_step"], 5) << c.dump();
    }
  }
  EXPECT_TRUE(found) << report.dump();
}

TEST_F(GoldenImport, TheImportRefusesToOverwriteItsInput) {
  const fs::path store = root_ / "golden";
  const fs::path target = store / "q" / "cpu.h5";
  fs::create_directories(target.parent_path());
  fs::copy_file(kMegatron / "gpt3_345m_tp1_pp2_golden_values_dev.json", target);
  const auto r = run_meshproof(
      {"golden", "import", target.string(), "--scenario", "q", "--golden-dir", store.string()});
  EXPECT_EQ(r.code, 2) << r.out << r.err;
  EXPECT_EQ(fs::file_size(target), 1338u);
}

}  // namespace
}  // namespace meshproof::harness
