// The golden store (harness/checks/golden.h): atomic round trips with provenance, concurrent
// writers, errors that name the file, the mean relative shift, platform names.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <string>
#include <utility>

#include "harness/checks/golden.h"
#include "kernels/core/error.h"
#include "runner_test_builders.h"

namespace meshproof::harness {
namespace {

namespace fs = std::filesystem;
using reports::Verdict;
using namespace test;

TEST(GoldenStore, AtomicRoundTripProvenanceAndShift) {
  const fs::path dir = fs::path(::testing::TempDir()) / "runner_golden_store";
  fs::remove_all(dir);
  const fs::path path = golden_path(dir, "fsdp[recipe=bf16]", "cpu");
  EXPECT_EQ(path, dir / "fsdp@recipe=bf16" / "cpu.h5");
  EXPECT_FALSE(read_golden(path).has_value());

  GoldenData g = golden_of({5.0, 4.0}, {1.0, 0.5});
  g.provenance = {{"scenario", "fsdp[recipe=bf16]"}, {"backend", "cpu"}, {"cuda_runtime", ""}};
  write_golden(path, g);
  for (const auto& e : fs::directory_iterator(path.parent_path()))
    EXPECT_EQ(e.path().filename(), "cpu.h5") << "temporary left behind: " << e.path();
  const auto back = read_golden(path);
  ASSERT_TRUE(back.has_value());
  EXPECT_EQ(back->metrics.at("loss"), g.metrics.at("loss"));
  EXPECT_EQ(back->metrics.at("grad_norm"), g.metrics.at("grad_norm"));
  EXPECT_EQ(back->provenance.at("scenario"), "fsdp[recipe=bf16]");
  EXPECT_EQ(back->provenance.at("cuda_runtime"), "");

  // +10% at step 1, -10% at step 2: mean 0; +10% both: +0.1.
  // 1e-15: 3.6 and 4.4 are not exact in binary, so the shifts are 0.1 only to a few ULP.
  EXPECT_NEAR(*mean_relative_shift({5.0, 4.0}, {5.5, 3.6}), 0.0, 1e-15);
  EXPECT_NEAR(*mean_relative_shift({5.0, 4.0}, {5.5, 4.4}), 0.1, 1e-15);
  EXPECT_FALSE(mean_relative_shift({0.0}, {1.0}).has_value());
}

// Issue #18.12: concurrent `golden update`s of one golden shared the name <golden>.partial; one
// renamed the other's half-written file or found it gone, and 1 in 8 left no golden. Now each
// writer stages its own mkstemp'd file: after every trial of two processes writing at once, the
// golden is one of the two complete goldens and no temporary is left.
TEST(GoldenStore, ConcurrentWritersEachLeaveACompleteGolden) {
  const fs::path dir = fs::path(::testing::TempDir()) / "runner_golden_concurrent";
  fs::remove_all(dir);
  const fs::path path = golden_path(dir, "tp[recipe=bf16]", "cpu");
  std::vector<GoldenData> versions;
  for (int w = 0; w < 2; ++w) {
    std::vector<double> loss(64), gn(64);
    for (int i = 0; i < 64; ++i) {
      loss[static_cast<size_t>(i)] = 5.0 - 0.01 * i + w;
      gn[static_cast<size_t>(i)] = 1.0 + w;
    }
    versions.push_back(golden_of(loss, gn));
    versions.back().provenance = {{"writer", std::to_string(w)}};
  }
  constexpr int kTrials = 12;
  for (int trial = 0; trial < kTrials; ++trial) {
    std::vector<pid_t> kids;
    for (int w = 0; w < 2; ++w) {
      const pid_t pid = fork();
      ASSERT_GE(pid, 0);
      if (pid == 0) {
        int code = 0;
        try {
          for (int k = 0; k < 4; ++k) write_golden(path, versions[static_cast<size_t>(w)]);
        } catch (...) {
          code = 1;
        }
        _exit(code);
      }
      kids.push_back(pid);
    }
    for (pid_t pid : kids) {
      int status = 0;
      waitpid(pid, &status, 0);
      EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "trial " << trial;
    }
    const auto back = read_golden(path);
    ASSERT_TRUE(back.has_value()) << "trial " << trial << ": no golden left";
    const std::string writer = back->provenance.at("writer");
    EXPECT_EQ(back->metrics.at("loss"), versions.at(std::stoul(writer)).metrics.at("loss"))
        << "trial " << trial;
    for (const auto& e : fs::directory_iterator(path.parent_path()))
      EXPECT_EQ(e.path().filename(), "cpu.h5") << "left behind: " << e.path();
  }
}

// An HDF5 failure names the golden and HDF5's reason, never the source text of the code that
// failed (MP_HDF5 quotes its expression: it was a whole lambda).
TEST(GoldenStore, ErrorsNameTheFileNotTheSourceCode) {
  const fs::path dir = fs::path(::testing::TempDir()) / "runner_golden_errors";
  fs::remove_all(dir);
  fs::create_directories(dir / "x");
  const fs::path bad = dir / "x" / "cpu.h5";
  { std::ofstream(bad) << "not hdf5"; }
  try {
    (void)read_golden(bad);
    FAIL() << "read a malformed golden";
  } catch (const kernels::Error& e) {
    EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
    EXPECT_NE(std::string(e.what()).find("reading golden " + bad.string()), std::string::npos)
        << e.what();
    EXPECT_EQ(std::string(e.what()).find("H5File"), std::string::npos) << e.what();
    EXPECT_EQ(std::string(e.what()).find("[&]"), std::string::npos) << e.what();
  }
  // The golden's name is taken by a folder: the rename fails.
  const fs::path taken = dir / "y" / "cpu.h5";
  fs::create_directories(taken / "sub");
  try {
    write_golden(taken, golden_of({1.0}, {1.0}));
    FAIL() << "wrote over a folder";
  } catch (const kernels::Error& e) {
    EXPECT_NE(std::string(e.what()).find("writing golden " + taken.string()), std::string::npos)
        << e.what();
    EXPECT_EQ(std::string(e.what()).find("[&]"), std::string::npos) << e.what();
  }
  EXPECT_EQ(std::distance(fs::directory_iterator(taken.parent_path()), fs::directory_iterator()),
            1);  // no temporary left beside it
}

TEST(GoldenPlatform, CpuAndGpuFamilies) {
  reports::EnvironmentRecord env;
  EXPECT_EQ(golden_platform("cpu", env), "cpu");
  env.gpus.push_back({0, "", "9.0", 0, 132});
  // A family whose name holds another's comes first: GB200 is not a B200, an H200 not an H20,
  // an L40S not an L4. Any other device: its name, lower case, other characters as '_'.
  const std::pair<const char*, const char*> cases[] = {
      {"NVIDIA H100 80GB HBM3", "h100"},
      {"NVIDIA H200", "h200"},
      {"NVIDIA H20", "h20"},
      {"NVIDIA GB200", "gb200"},
      {"NVIDIA L40S", "l40s"},
      {"NVIDIA L4", "l4"},
      {"NVIDIA RTX 6000 Ada", "nvidia_rtx_6000_ada"}};
  for (const auto& [name, platform] : cases) {
    env.gpus[0].name = name;
    EXPECT_EQ(golden_platform("cuda:0", env), platform) << name;
  }
}

// Issue #17.13: a platform is a file name, never a path.
TEST(GoldenPlatform, PlatformIsAFileName) {
  EXPECT_TRUE(valid_platform_name("h100"));
  EXPECT_TRUE(valid_platform_name("my_lab-gpu2"));
}

struct BadPlatform {
  const char* label;  // the case's name in the test list
  const char* platform;
};

class GoldenPlatformRefused : public ::testing::TestWithParam<BadPlatform> {};

// Anything but [a-z0-9_-]+ is refused, and golden_path never builds a path from it.
TEST_P(GoldenPlatformRefused, NotAFileNameOfLowerCaseWordCharacters) {
  const char* bad = GetParam().platform;
  EXPECT_FALSE(valid_platform_name(bad));
  EXPECT_THROW((void)golden_path("golden", "s", bad), kernels::Error);
}

INSTANTIATE_TEST_SUITE_P(
    GoldenPlatform, GoldenPlatformRefused,
    ::testing::Values(BadPlatform{"empty", ""}, BadPlatform{"path_escape", "x/../../y"},
                      BadPlatform{"upper_case", "H100"}, BadPlatform{"parent_folder", ".."},
                      BadPlatform{"space", "a b"}, BadPlatform{"file_extension", "cpu.h5"}),
    [](const auto& info) { return std::string(info.param.label); });

}  // namespace
}  // namespace meshproof::harness
