#include "harness/cli.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

#include "harness/exit_codes.h"
#include "kernels/device.h"
#include "kernels/error.h"

namespace meshproof::harness {
namespace {

struct CliResult {
  int code;
  std::string out;
  std::string err;
};

CliResult run(std::vector<const char*> args) {
  args.insert(args.begin(), "meshproof");
  std::ostringstream out, err;
  const int code = run_cli(static_cast<int>(args.size()), args.data(), out, err);
  return {code, out.str(), err.str()};
}

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

}  // namespace
}  // namespace meshproof::harness
