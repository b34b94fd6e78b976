// The one gate of every `gpu` test (docs/design.md section 34): MP_SKIP_WITHOUT_GPU() at the top of
// a test body (or a fixture's SetUp) runs the test when CUDA is usable, and otherwise skips it
// naming the probe's reason -- unless MESHPROOF_REQUIRE_GPU=1, where the same situation is a test
// FAILURE: on a GPU runner a driver mismatch or a missing device must not look green. Any other
// value than unset, "" , "0" or "1" is a failure too (a typo must not silently mean "skip").
#pragma once

#include <gtest/gtest.h>

#include <cstdlib>
#include <string>
#include <string_view>

#include "kernels/core/device.h"

namespace meshproof::gpu_test {

enum class GpuGate { kRun, kSkip, kFail };

struct GpuDecision {
  GpuGate gate = GpuGate::kRun;
  std::string message;  // why it skips or fails (empty when it runs)
};

// The policy, pure: `usable`/`reason` from kernels::cuda_status(), `require` the value of
// MESHPROOF_REQUIRE_GPU (nullptr when unset).
inline GpuDecision gpu_decision(bool usable, std::string_view reason, const char* require) {
  const std::string_view req = require == nullptr ? std::string_view() : std::string_view(require);
  if (req != "" && req != "0" && req != "1") {
    return {GpuGate::kFail, "MESHPROOF_REQUIRE_GPU='" + std::string(req) +
                                "': expected 1 (gpu tests must run) or 0/unset (they may skip)"};
  }
  if (usable) return {GpuGate::kRun, {}};
  const std::string why = "no usable GPU: " + std::string(reason);
  if (req == "1") return {GpuGate::kFail, "MESHPROOF_REQUIRE_GPU=1 but " + why};
  return {GpuGate::kSkip, why};
}

inline GpuDecision gpu_decision() {
  const kernels::CudaStatus& s = kernels::cuda_status();
  return gpu_decision(s.usable, s.reason, std::getenv("MESHPROOF_REQUIRE_GPU"));
}

}  // namespace meshproof::gpu_test

// Returns from the enclosing void function (a test body or SetUp) unless the test may run.
#define MP_SKIP_WITHOUT_GPU()                                                                 \
  do {                                                                                        \
    const ::meshproof::gpu_test::GpuDecision mp_gpu_ = ::meshproof::gpu_test::gpu_decision(); \
    if (mp_gpu_.gate == ::meshproof::gpu_test::GpuGate::kFail) {                              \
      GTEST_FAIL() << mp_gpu_.message;                                                        \
    } else if (mp_gpu_.gate == ::meshproof::gpu_test::GpuGate::kSkip) {                       \
      GTEST_SKIP() << mp_gpu_.message;                                                        \
    }                                                                                         \
  } while (0)
