// The gpu test gate (tests/gpu_test.h) and its MESHPROOF_REQUIRE_GPU policy, on any machine: the
// pure decision for every combination, and the real macro failing (not skipping) when the
// variable is 1 and this process has no usable GPU.
#include <gtest/gtest-spi.h>
#include <gtest/gtest.h>
#include <stdlib.h>

#include <optional>
#include <string>

#include "kernels/core/device.h"
#include "tests/gpu_test.h"
#include "tests/scoped_env.h"

namespace meshproof::gpu_test {
namespace {

// Sets MESHPROOF_REQUIRE_GPU for its lifetime, then restores the previous value.
class ScopedRequireGpu {
 public:
  explicit ScopedRequireGpu(const char* value) : env_("MESHPROOF_REQUIRE_GPU", value) {}

 private:
  test_env::ScopedEnv env_;
};

TEST(GpuPolicy, DecisionForEveryCase) {
  EXPECT_EQ(gpu_decision(true, "", nullptr).gate, GpuGate::kRun);
  EXPECT_EQ(gpu_decision(true, "", "1").gate, GpuGate::kRun);
  EXPECT_EQ(gpu_decision(true, "", "0").gate, GpuGate::kRun);
  const GpuDecision skip = gpu_decision(false, "driver too old", nullptr);
  EXPECT_EQ(skip.gate, GpuGate::kSkip);
  EXPECT_EQ(skip.message, "no usable GPU: driver too old");
  EXPECT_EQ(gpu_decision(false, "driver too old", "").gate, GpuGate::kSkip);
  EXPECT_EQ(gpu_decision(false, "driver too old", "0").gate, GpuGate::kSkip);
  const GpuDecision fail = gpu_decision(false, "driver too old", "1");
  EXPECT_EQ(fail.gate, GpuGate::kFail);
  EXPECT_EQ(fail.message, "MESHPROOF_REQUIRE_GPU=1 but no usable GPU: driver too old");
  // A value that is neither 0 nor 1 is a failure whether or not a GPU is usable.
  EXPECT_EQ(gpu_decision(false, "x", "yes").gate, GpuGate::kFail);
  EXPECT_EQ(gpu_decision(true, "", "true").gate, GpuGate::kFail);
  EXPECT_NE(gpu_decision(true, "", "true").message.find("MESHPROOF_REQUIRE_GPU='true'"),
            std::string::npos);
}

void gate_with_require_gpu() {
  const ScopedRequireGpu env("1");
  MP_SKIP_WITHOUT_GPU();
}

// The macro every gpu test uses: with MESHPROOF_REQUIRE_GPU=1 and no usable device it records a
// fatal failure naming the probe's reason (a skipped test would pass this assertion's check
// "exactly one fatal failure" only by failing). Where a GPU is usable the gate lets the test run.
TEST(GpuPolicy, RequireGpuTurnsTheSkipIntoAFailure) {
  const kernels::CudaStatus& s = kernels::cuda_status();
  if (s.usable) {
    const ScopedRequireGpu env("1");
    EXPECT_EQ(gpu_decision().gate, GpuGate::kRun);
    return;
  }
  EXPECT_FATAL_FAILURE(gate_with_require_gpu(), "MESHPROOF_REQUIRE_GPU=1 but no usable GPU: ");
  EXPECT_FATAL_FAILURE(gate_with_require_gpu(), kernels::cuda_status().reason);
}

}  // namespace
}  // namespace meshproof::gpu_test
