#include "harness/verbs/cli.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "harness/verbs/exit_codes.h"
#include "kernels/core/device.h"
#include "kernels/core/error.h"
#include "mesh/local/rank_fibers.h"
#include "tests/harness/cli_run.h"
#include "tests/scoped_env.h"
#include "tests/source_dir.h"

namespace meshproof::harness {
namespace {

using harness::testing::CliResult;
constexpr auto& run = harness::testing::run_meshproof;

TEST(CliTest, UnknownFlagIsUsageErrorWithExit2) {
  const CliResult r = run({"--bogus"});
  EXPECT_EQ(r.code, kExitBadInput);
  EXPECT_NE(r.err.find("--bogus"), std::string::npos) << r.err;
  EXPECT_NE(r.err.find("Usage"), std::string::npos) << r.err;
}

TEST(CliTest, UnknownVerbIsUsageError) { EXPECT_EQ(run({"frobnicate"}).code, kExitBadInput); }

TEST(CliTest, NoVerbIsUsageError) { EXPECT_EQ(run({}).code, kExitBadInput); }

TEST(CliTest, HelpListsRealVerbsOnly) {
  const CliResult r = run({"--help"});
  EXPECT_EQ(r.code, kExitOk);
  EXPECT_NE(r.out.find("env"), std::string::npos);
}

TEST(CliTest, VersionPrintsVersionAndCommit) {
  const CliResult r = run({"--version"});
  EXPECT_EQ(r.code, kExitOk);
  EXPECT_NE(r.out.find("meshproof 0."), std::string::npos) << r.out;
  EXPECT_NE(r.out.find("commit"), std::string::npos) << r.out;
}

TEST(CliTest, EnvNamesActiveBackendAndWhyCudaIsNotUsable) {
  const CliResult r = run({"env"});
  ASSERT_EQ(r.code, kExitOk) << r.err;
  EXPECT_NE(r.out.find("backends compiled cpu"), std::string::npos) << r.out;
  const kernels::CudaStatus& cuda = kernels::cuda_status();
  if (cuda.usable) {
    EXPECT_NE(r.out.find("active backend    cuda:0"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("compute capability"), std::string::npos) << r.out;
  } else {
    EXPECT_NE(r.out.find("active backend    cpu"), std::string::npos) << r.out;
    EXPECT_FALSE(cuda.reason.empty());
    EXPECT_NE(r.out.find(cuda.reason), std::string::npos) << r.out;
  }
}

TEST(CliTest, EnvJsonIsParseableAndConsistent) {
  const CliResult r = run({"env", "--json"});
  ASSERT_EQ(r.code, kExitOk) << r.err;
  const nlohmann::json j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["cuda"]["usable"].get<bool>(), kernels::cuda_status().usable);
  EXPECT_EQ(j["cuda"]["compiled"].get<bool>(), kernels::cuda_status().compiled);
  EXPECT_EQ(j["gpus"].size(), kernels::cuda_status().gpus.size());
  EXPECT_FALSE(j["hdf5"].get<std::string>().empty());
  // How virtual ranks run here: the process's CPUs and the MESHPROOF_VIRTUAL_RANKS setting.
  EXPECT_EQ(j["cpus"].get<int>(), mesh::usable_cpus());
  EXPECT_GE(j["cpus"].get<int>(), 1);
  EXPECT_EQ(j["virtual_ranks"].get<std::string>(),
            mesh::rank_threading_name(mesh::rank_threading_from_env()));
}

// `env` says how the local launcher runs host ranks, under each MESHPROOF_VIRTUAL_RANKS value.
TEST(CliTest, EnvNamesHowVirtualRanksRun) {
  const std::string cpus = std::to_string(mesh::usable_cpus());
  test_env::ScopedEnv env("MESHPROOF_VIRTUAL_RANKS", nullptr);
  const CliResult a = run({"env"});
  env.set("threads");
  const CliResult t = run({"env"});
  env.set("fibers");
  const CliResult f = run({"env"});
  ASSERT_EQ(a.code, kExitOk) << a.err;
  EXPECT_NE(a.out.find("CPUs              " + cpus +
                       " usable; virtual ranks auto (a thread per "
                       "rank up to " +
                       cpus + " ranks, beyond that fibers on " + cpus +
                       " worker threads, MESHPROOF_VIRTUAL_RANKS)"),
            std::string::npos)
      << a.out;
  EXPECT_NE(t.out.find("virtual ranks threads (a thread per rank,"), std::string::npos) << t.out;
  EXPECT_NE(f.out.find("virtual ranks fibers (fibers on up to " + cpus + " worker threads,"),
            std::string::npos)
      << f.out;
}

TEST(CliTest, CudaBackendWithoutDeviceIsInputError) {
  if (kernels::cuda_status().usable) GTEST_SKIP() << "a CUDA device is present";
  try {
    kernels::resolve_backend("cuda");
    FAIL() << "expected an input error";
  } catch (const kernels::Error& e) {
    EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput);
    EXPECT_NE(e.message().find("not usable"), std::string::npos);
  }
}

// Issue #17.6: `mpirun -np 4 meshproof run ...` without --launcher mpi ran the whole scenario in
// four processes racing on one output folder. A process that its launcher announces as one of
// several ranks refuses local-launcher scenarios (exit 2, nothing written) for run and golden
// update. (runner.mpirun_without_launcher_mpi_exits_2 does it under a real mpirun.)
TEST(CliTest, OneOfSeveralMpiRanksRefusesTheLocalLauncher) {
  const std::string scenario = (test_support::source_dir() / "scenarios/quickstart.yaml").string();
  const std::string out = ::testing::TempDir() + "cli_mpi_refused";
  const std::string golden = ::testing::TempDir() + "cli_mpi_refused_golden";
  std::filesystem::remove_all(out);
  std::filesystem::remove_all(golden);
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}) {
    const test_env::ScopedEnv env(var, "4");
    const CliResult r =
        run({"run", scenario.c_str(), "--backend", "cpu", "--out", out.c_str(), "--quiet"});
    EXPECT_EQ(r.code, kExitBadInput) << r.err;
    EXPECT_NE(r.err.find(std::string("scenario quickstart: this process is one of 4 MPI ranks (") +
                         var + "=4) but the scenario runs on the local launcher"),
              std::string::npos)
        << r.err;
    EXPECT_NE(r.err.find("pass --launcher mpi"), std::string::npos) << r.err;
    EXPECT_FALSE(std::filesystem::exists(out));
    const CliResult g = run(
        {"golden", "update", scenario.c_str(), "--backend", "cpu", "--golden-dir", golden.c_str()});
    EXPECT_EQ(g.code, kExitBadInput) << g.err;
    EXPECT_NE(g.err.find("MPI ranks"), std::string::npos) << g.err;
    EXPECT_FALSE(std::filesystem::exists(golden));
  }
}

// Issue #17.13: the golden's platform is the device's; --platform is a guard that must match it,
// --force-platform a validated file name. Both refusals come before any training (exit 2, no
// golden folder).
TEST(CliTest, GoldenUpdatePlatformComesFromTheDevice) {
  const std::string scenario = (test_support::source_dir() / "scenarios/quickstart.yaml").string();
  const std::string golden = ::testing::TempDir() + "cli_platform_golden";
  std::filesystem::remove_all(golden);
  CliResult r = run({"golden", "update", scenario.c_str(), "--backend", "cpu", "--platform", "h100",
                     "--golden-dir", golden.c_str()});
  EXPECT_EQ(r.code, kExitBadInput) << r.err;
  EXPECT_NE(r.err.find("--platform h100: scenario quickstart runs on cpu here, whose golden "
                       "platform is cpu"),
            std::string::npos)
      << r.err;
  for (const char* bad : {"x/../../y", "H100", "a.b"}) {
    r = run({"golden", "update", scenario.c_str(), "--backend", "cpu", "--force-platform", bad,
             "--golden-dir", golden.c_str()});
    EXPECT_EQ(r.code, kExitBadInput) << bad << ": " << r.err;
    EXPECT_NE(r.err.find(std::string("--force-platform '") + bad +
                         "': expected a name of [a-z0-9_-] characters"),
              std::string::npos)
        << r.err;
    r = run({"golden", "update", scenario.c_str(), "--backend", "cpu", "--platform", bad,
             "--golden-dir", golden.c_str()});
    EXPECT_EQ(r.code, kExitBadInput) << bad << ": " << r.err;
  }
  EXPECT_FALSE(std::filesystem::exists(golden));
}

// `meshproof run` of the quickstart with `var`=`value`: exit 2 with `message`, nothing written.
void expect_run_refuses_env(const char* var, const char* value, const std::string& message) {
  const std::string scenario = (test_support::source_dir() / "scenarios/quickstart.yaml").string();
  const std::string out = ::testing::TempDir() + "cli_bad_env_" + var;
  std::filesystem::remove_all(out);
  const CliResult r = [&] {
    const test_env::ScopedEnv env(var, value);
    return run({"run", scenario.c_str(), "--backend", "cpu", "--out", out.c_str(), "--quiet"});
  }();
  EXPECT_EQ(r.code, kExitBadInput) << r.err;
  EXPECT_NE(r.err.find(message), std::string::npos) << r.err;
  EXPECT_FALSE(std::filesystem::exists(out));
}

// The watchdog's limit is checked with everything else, before anything runs or is written.
TEST(CliTest, MalformedCollectiveTimeoutIsBadInput) {
  expect_run_refuses_env(
      "MESHPROOF_COLLECTIVE_TIMEOUT", "5min",
      "MESHPROOF_COLLECTIVE_TIMEOUT=5min: expected a positive number of seconds");
}

// So is the way virtual ranks run (MESHPROOF_VIRTUAL_RANKS, mesh/local/rank_fibers.h).
TEST(CliTest, MalformedVirtualRanksIsBadInput) {
  expect_run_refuses_env("MESHPROOF_VIRTUAL_RANKS", "coroutines",
                         "MESHPROOF_VIRTUAL_RANKS=coroutines: expected auto, threads or fibers");
}

}  // namespace
}  // namespace meshproof::harness
