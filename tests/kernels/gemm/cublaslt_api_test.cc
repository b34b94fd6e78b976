// cuBLASLt opened on first use (kernels/gemm/cublaslt_api.h): a process that never needs a GPU GEMM
// never maps the library (it cost every process about 0.15 s of start-up when it was linked), and
// the table holds every entry point of the toolkit the build compiled against. Needs no device.
// Each test runs in a process of its own (gtest_discover_tests), so "first use" is this test's.
#include "kernels/gemm/cublaslt_api.h"

#include <gtest/gtest.h>

#include <fstream>
#include <string>

#include "kernels/core/device.h"
#include "kernels/gemm/cublaslt_resources.h"

namespace meshproof::kernels {
namespace {

bool mapped(const std::string& name) {
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);) {
    if (line.find(name) != std::string::npos) return true;
  }
  return false;
}

TEST(CublasLtApi, NotOpenedUntilAGemmOrTheVersionIsNeeded) {
  EXPECT_FALSE(mapped("libcublasLt")) << "the binary links cuBLASLt again";
  EXPECT_FALSE(lt::api_loaded());
  // What every run does at start: the CUDA probe and the environment record without a GPU.
  (void)cuda_status();
  EXPECT_EQ(cublaslt_version_text(/*open=*/false), "not loaded");
  EXPECT_FALSE(mapped("libcublasLt"));
  EXPECT_FALSE(lt::api_loaded());

  (void)lt::api();
  EXPECT_TRUE(lt::api_loaded());
  EXPECT_TRUE(mapped(lt::soname())) << lt::soname();
  EXPECT_NE(cublaslt_version_text(/*open=*/false), "not loaded");
}

TEST(CublasLtApi, EveryEntryPointOfTheToolkitTheBuildCompiledAgainst) {
  const lt::Api& a = lt::api();
  for (const void* p :
       {reinterpret_cast<const void*>(a.create), reinterpret_cast<const void*>(a.destroy),
        reinterpret_cast<const void*>(a.get_version),
        reinterpret_cast<const void*>(a.get_status_name),
        reinterpret_cast<const void*>(a.get_status_string),
        reinterpret_cast<const void*>(a.matmul_desc_create),
        reinterpret_cast<const void*>(a.matmul_desc_destroy),
        reinterpret_cast<const void*>(a.matmul_desc_set_attribute),
        reinterpret_cast<const void*>(a.matrix_layout_create),
        reinterpret_cast<const void*>(a.matrix_layout_destroy),
        reinterpret_cast<const void*>(a.matmul_preference_create),
        reinterpret_cast<const void*>(a.matmul_preference_destroy),
        reinterpret_cast<const void*>(a.matmul_preference_set_attribute),
        reinterpret_cast<const void*>(a.matmul_algo_get_heuristic),
        reinterpret_cast<const void*>(a.matmul)}) {
    EXPECT_NE(p, nullptr);
  }
  // The library opened is the headers' major version (the soname says so; the call proves it).
  EXPECT_EQ(a.get_version() / 10000, static_cast<size_t>(CUBLAS_VER_MAJOR));
  EXPECT_EQ(cublaslt_runtime_version(), static_cast<int>(a.get_version()));
  EXPECT_STREQ(a.get_status_name(CUBLAS_STATUS_SUCCESS), "CUBLAS_STATUS_SUCCESS");
  EXPECT_EQ(lt::soname(), "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR));
  // A handle does need a driver: without one the call through the table reports it (status 1,
  // CUBLAS_STATUS_NOT_INITIALIZED) instead of crashing; with a GPU the gpu tests create handles.
  if (!cuda_status().usable) {
    cublasLtHandle_t h = nullptr;
    EXPECT_EQ(a.create(&h), CUBLAS_STATUS_NOT_INITIALIZED);
  }
}

}  // namespace
}  // namespace meshproof::kernels
