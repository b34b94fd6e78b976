// A CPU run never opens cuBLASLt (kernels/gemm/cublaslt_api.h opens it on first use; docs/design.md
// section 31): its static initialisers cost a process about 0.15 s and tens of MB of zeroed pages,
// which every `meshproof run` of the CPU backend paid at its end while the performance inputs'
// GEMM-dtype label asked for the library's version though the CPU's label never reads it.
// CUDA builds only (where the library can be opened); needs no device. Each test runs in a process
// of its own (gtest_discover_tests), so nothing before it has opened the library.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "engine/bench/bench_recipes.h"
#include "harness/verbs/exit_codes.h"
#include "kernels/gemm/cublaslt_api.h"
#include "tests/harness/cli_run.h"
#include "tests/source_dir.h"

namespace meshproof::harness {
namespace {

TEST(CpuRunCublasLt, ARunWithItsChecksAndReportsDoesNotOpenIt) {
  ASSERT_FALSE(kernels::lt::api_loaded());
  // The quickstart: golden-loss and resume checks, every report format.
  const std::string scenario = (test_support::source_dir() / "scenarios/quickstart.yaml").string();
  const std::string golden = (test_support::source_dir() / "golden").string();
  const std::string out = ::testing::TempDir() + "cpu_run_cublaslt";
  std::filesystem::remove_all(out);
  const testing::CliResult r =
      testing::run_meshproof({"run", scenario.c_str(), "--backend", "cpu", "--golden-dir",
                              golden.c_str(), "--out", out.c_str(), "--quiet"});
  ASSERT_EQ(r.code, kExitOk) << r.out << r.err;
  EXPECT_FALSE(kernels::lt::api_loaded()) << "a CPU run opened " << kernels::lt::soname();
}

TEST(CpuRunCublasLt, TheCpuLabelsDoNotOpenItAGpusDo) {
  for (engine::RecipeKind recipe :
       {engine::RecipeKind::kFp32, engine::RecipeKind::kMxfp8, engine::RecipeKind::kNvfp4}) {
    EXPECT_EQ(engine::recipe_gemm_dtype(recipe, /*compute_capability=*/0), "fp32");
    EXPECT_EQ(engine::recipe_emulation(recipe, /*compute_capability=*/0), "CPU emulation");
  }
  EXPECT_EQ(engine::label_cublaslt_version(0), 0);
  EXPECT_FALSE(kernels::lt::api_loaded());
  // A GPU's label depends on the loaded library's version (block scaling needs >= 12.9 on
  // Hopper), so asking for one opens it: the check above is not vacuous.
  EXPECT_GT(engine::label_cublaslt_version(90), 0);
  EXPECT_TRUE(kernels::lt::api_loaded());
}

}  // namespace
}  // namespace meshproof::harness
