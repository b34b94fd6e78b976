// The run's checkpoint lifecycle through `meshproof run` (run_cli, in process, as the binary runs
// it): periodic checkpoints with keep_last pruning and their save time in checkpoint_s, reruns
// that never delete or overwrite an earlier run's checkpoints, --from-checkpoint on the same mesh
// (bitwise) and on another mesh (within the cross-mesh bound), refused for another model (exit 2)
// and failing on a flipped chunk byte (exit 1), and one scenario hash in validate, golden and
// checkpoint. All on scenarios/quickstart.yaml (8 virtual ranks, MXFP8, CPU backend).
#include <H5Cpp.h>
#include <fmt/format.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <regex>
#include <sstream>

#include "harness/checks/golden.h"
#include "harness/verbs/cli.h"
#include "harness/verbs/exit_codes.h"
#include "tests/harness/cli_run.h"
#include "tests/source_dir.h"

namespace meshproof::harness {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

const std::string kQuickstart = (test_support::source_dir() / "scenarios/quickstart.yaml").string();
const std::string kGoldenDir = (test_support::source_dir() / "golden").string();

using harness::testing::CliResult;
constexpr auto& cli = harness::testing::run_meshproof;

std::string read_text(const fs::path& p) {
  std::ifstream f(p);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

json steps_of(const fs::path& out) {
  return json::parse(read_text(out / "report.json")).at("scenarios").at(0).at("steps");
}

std::vector<std::string> entries(const fs::path& dir) {
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

class Lifecycle : public ::testing::Test {
 protected:
  void SetUp() override {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    root_ = fs::temp_directory_path() /
            fmt::format("meshproof_lifecycle_{}_{}", info->name(), ::getpid());
    fs::remove_all(root_);
    fs::create_directories(root_);
  }
  void TearDown() override {
    if (!HasFailure()) fs::remove_all(root_);
  }

  // `meshproof run quickstart.yaml --backend cpu --out root_/tag --quiet` plus `extra`.
  CliResult run(const std::string& tag, std::vector<std::string> extra) {
    std::vector<std::string> args = {
        "run", kQuickstart, "--golden-dir",         kGoldenDir, "--backend",
        "cpu", "--out",     (root_ / tag).string(), "--quiet"};
    args.insert(args.end(), extra.begin(), extra.end());
    return cli(args);
  }
  fs::path checkpoints(const std::string& tag) const {
    return root_ / tag / "quickstart" / "checkpoints";
  }
  // A run saving every 4 steps (step_0000004 and step_0000008), resume check off.
  void base_run() {
    const CliResult r =
        run("base", {"--set", "checkpoint.every=4", "--set", "checks.resume=false"});
    ASSERT_EQ(r.code, kExitOk) << r.out << r.err;
    ASSERT_TRUE(fs::exists(checkpoints("base") / "step_0000004" / "index.json"));
  }

  fs::path root_;
};

TEST_F(Lifecycle, PeriodicCheckpointsPruneToKeepLastAndTimeTheSave) {
  const CliResult r = run("a", {"--set", "checkpoint.every=3", "--set", "checkpoint.keep_last=2",
                                "--set", "checks.resume=false"});
  ASSERT_EQ(r.code, kExitOk) << r.out << r.err;
  // Saved after steps 3, 6 and the last (8); step_0000003 pruned after step 8's commit.
  EXPECT_EQ(entries(checkpoints("a")), (std::vector<std::string>{"step_0000006", "step_0000008"}));
  EXPECT_EQ(json::parse(read_text(checkpoints("a") / "step_0000008" / "index.json")).at("step"), 8);
  const json steps = steps_of(root_ / "a");
  ASSERT_EQ(steps.size(), 8u);
  for (const json& s : steps) {
    const int64_t step = s.at("step").get<int64_t>();
    const double ck = s.at("time").at("checkpoint_s").get<double>();
    const double total = s.at("time").at("total_s").get<double>();
    if (step == 3 || step == 6 || step == 8) {
      EXPECT_GT(ck, 0.0) << "step " << step;
      EXPECT_LE(ck, total) << "step " << step << ": the save is part of the step's wall time";
    } else {
      EXPECT_EQ(ck, 0.0) << "step " << step;
    }
  }
}

TEST_F(Lifecycle, RerunsNeverDeleteOrOverwriteAnotherRunsCheckpoints) {
  // The resume check (quickstart saves after step 4) removes the folder it created when it
  // passes, so reruns into one --out leave nothing behind.
  CliResult r = run("a", {});
  ASSERT_EQ(r.code, kExitOk) << r.out << r.err;
  const fs::path first = checkpoints("a") / "resume_check_step4";
  EXPECT_FALSE(fs::exists(first)) << "a passing resume check removes its own folder";
  // A folder of that name that the run did not create (a user's, or a failed run's kept for
  // inspection) is left alone: the check saves into resume_check_step4.2 and removes only that.
  fs::create_directories(first / "step_0000004");
  std::ofstream(first / "step_0000004" / "index.json") << "theirs";
  std::ofstream(first / "mine.txt") << "kept";
  r = run("a", {});
  ASSERT_EQ(r.code, kExitOk) << r.out << r.err;
  EXPECT_EQ(read_text(first / "mine.txt"), "kept");
  EXPECT_EQ(read_text(first / "step_0000004" / "index.json"), "theirs");
  EXPECT_FALSE(fs::exists(checkpoints("a") / "resume_check_step4.2"));

  // Periodic checkpoints into a folder that holds another run's: exit 2 before any work, naming
  // the folder and what is there; the checkpoints stay as they were.
  r = run("b", {"--set", "checkpoint.every=4", "--set", "checks.resume=false"});
  ASSERT_EQ(r.code, kExitOk) << r.out << r.err;
  const std::string index = read_text(checkpoints("b") / "step_0000004" / "index.json");
  fs::remove(root_ / "b" / "report.json");
  r = run("b", {"--set", "checkpoint.every=4", "--set", "checks.resume=false"});
  EXPECT_EQ(r.code, kExitBadInput) << r.out << r.err;
  EXPECT_NE(r.err.find(checkpoints("b").string()), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("step_0000004"), std::string::npos) << r.err;
  EXPECT_FALSE(fs::exists(root_ / "b" / "report.json")) << "nothing is written on bad input";
  EXPECT_EQ(read_text(checkpoints("b") / "step_0000004" / "index.json"), index);
}

TEST_F(Lifecycle, FromCheckpointOnTheSameMeshReproducesTheRemainingStepsBitwise) {
  base_run();
  // The golden check (exact) compares the steps that ran, 5..8, with the golden's; the resume
  // check saves 2 steps after the start (after step 6) and resumes bitwise.
  const CliResult r =
      run("from", {"--from-checkpoint", (checkpoints("base") / "step_0000004").string(), "--set",
                   "checks.resume.at_step=2"});
  ASSERT_EQ(r.code, kExitOk) << r.out << r.err;
  EXPECT_NE(r.out.find("golden pass, resume pass"), std::string::npos) << r.out;
  const json base = steps_of(root_ / "base");
  const json from = steps_of(root_ / "from");
  ASSERT_EQ(from.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    const json& a = base.at(4 + i);
    const json& b = from.at(i);
    EXPECT_EQ(b.at("step"), 5 + static_cast<int64_t>(i));
    // Bitwise: report.json writes doubles in round-trip form.
    for (const char* key : {"loss", "grad_norm", "lr"})
      EXPECT_EQ(a.at(key).get<double>(), b.at(key).get<double>()) << key << " at step " << 5 + i;
  }
  EXPECT_FALSE(fs::exists(checkpoints("from") / "resume_check_step6")) << "removed on a pass";
}

TEST_F(Lifecycle, FromCheckpointOnAnotherMeshStaysWithinTheCrossMeshBound) {
  base_run();
  // Saved on HSDP 2 x 2 x TP 2, resumed on FSDP 4 (resharding load). The golden is exact for the
  // saving mesh, so it is off; the steps are compared with the straight run below.
  const CliResult r =
      run("xmesh", {"--from-checkpoint", (checkpoints("base") / "step_0000004").string(), "--set",
                    "mesh.dp_replicate=1", "--set", "mesh.dp_shard=4", "--set", "mesh.tp=1",
                    "--set", "checks.golden=false", "--set", "checks.resume=false"});
  ASSERT_EQ(r.code, kExitOk) << r.out << r.err;
  const json base = steps_of(root_ / "base");
  const json from = steps_of(root_ / "xmesh");
  ASSERT_EQ(from.size(), 4u);
  // The project's cross-mesh bound for MXFP8 (scenarios/resume_cross_mesh_fp8.yaml: 1e-2, 2.5x
  // the worst measured FP8 difference; another mesh reorders fp32 sums and flips FP8 roundings).
  constexpr double kRtol = 1e-2;
  for (size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(from.at(i).at("step"), 5 + static_cast<int64_t>(i));
    for (const char* key : {"loss", "grad_norm"}) {
      const double a = base.at(4 + i).at(key).get<double>();
      const double b = from.at(i).at(key).get<double>();
      EXPECT_LE(std::fabs(a - b), kRtol * std::fabs(a)) << key << " at step " << 5 + i;
    }
  }
}

TEST_F(Lifecycle, FromCheckpointOfAnotherModelIsBadInputNamingTheField) {
  base_run();
  const CliResult r =
      run("other", {"--from-checkpoint", (checkpoints("base") / "step_0000004").string(), "--set",
                    "model.hidden=128"});
  EXPECT_EQ(r.code, kExitBadInput) << r.out << r.err;
  EXPECT_NE(r.err.find("model.hidden is 64 in the checkpoint, 128 in scenario quickstart"),
            std::string::npos)
      << r.err;
  EXPECT_FALSE(fs::exists(root_ / "other")) << "nothing is written on bad input";
}

TEST_F(Lifecycle, FromCheckpointWithAFlippedChunkByteFailsNamingKeyAndFile) {
  base_run();
  const fs::path dir = root_ / "corrupt" / "step_0000004";
  fs::create_directories(dir.parent_path());
  fs::copy(checkpoints("base") / "step_0000004", dir);
  const fs::path file = dir / "rank_00000.h5";
  haddr_t offset;
  {
    H5::H5File f(file.string(), H5F_ACC_RDONLY);
    offset = f.openDataSet("/model/layers.0.attn.qkv.weight").getOffset();
  }
  {
    std::fstream s(file, std::ios::in | std::ios::out | std::ios::binary);
    s.seekg(static_cast<std::streamoff>(offset) + 3);
    char c = 0;
    s.read(&c, 1);
    c = static_cast<char>(c ^ 0x10);
    s.seekp(static_cast<std::streamoff>(offset) + 3);
    s.write(&c, 1);
  }
  const CliResult r = run("from_corrupt", {"--from-checkpoint", dir.string()});
  EXPECT_EQ(r.code, kExitCheckFailed) << r.out << r.err;
  EXPECT_NE(r.out.find("checkpoint: loading"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("model/layers.0.attn.qkv.weight"), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("rank_00000.h5"), std::string::npos) << r.out;
  const json rep = json::parse(read_text(root_ / "from_corrupt" / "report.json"));
  EXPECT_EQ(rep.at("verdict"), "fail");
}

TEST_F(Lifecycle, ValidateGoldenAndCheckpointCarryOneScenarioHash) {
  CliResult r = cli({"validate", kQuickstart});
  ASSERT_EQ(r.code, kExitOk) << r.out << r.err;
  std::smatch m;
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex("hash ([0-9a-f]{16})"))) << r.out;
  const std::string validated = m[1].str();

  const fs::path goldens = root_ / "golden";
  r = cli({"golden", "update", kQuickstart, "--backend", "cpu", "--golden-dir", goldens.string()});
  ASSERT_EQ(r.code, kExitOk) << r.out << r.err;
  const std::optional<GoldenData> g = read_golden(golden_path(goldens, "quickstart", "cpu"));
  ASSERT_TRUE(g.has_value());
  EXPECT_EQ(g->provenance.at("scenario_hash"), validated);

  // The resume check's checkpoint (kept because the check fails: the injected fault makes the
  // resumed run replay the first batches) and a periodic one (--set applies to validate the same
  // way).
  const std::vector<std::string> fault = {"--set", "faults=[data_cursor_not_restored]", "--set",
                                          "expect=caught"};
  std::vector<std::string> args = {"validate", kQuickstart};
  args.insert(args.end(), fault.begin(), fault.end());
  r = cli(args);
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex("hash ([0-9a-f]{16})"))) << r.out;
  const std::string validated_fault = m[1].str();
  r = run("a", fault);
  ASSERT_EQ(r.code, kExitOk) << r.out << r.err;
  const json index = json::parse(
      read_text(checkpoints("a") / "resume_check_step4" / "step_0000004" / "index.json"));
  EXPECT_EQ(index.at("scenario_hash"), validated_fault);
  EXPECT_EQ(index.at("model").at("model.hidden"), "64");

  r = cli({"validate", kQuickstart, "--set", "checkpoint.every=8"});
  ASSERT_TRUE(std::regex_search(r.out, m, std::regex("hash ([0-9a-f]{16})"))) << r.out;
  const std::string validated_every = m[1].str();
  r = run("b", {"--set", "checkpoint.every=8"});
  ASSERT_EQ(r.code, kExitOk) << r.out << r.err;
  EXPECT_EQ(
      json::parse(read_text(checkpoints("b") / "step_0000008" / "index.json")).at("scenario_hash"),
      validated_every);
}

}  // namespace
}  // namespace meshproof::harness
