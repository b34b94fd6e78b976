// Label gpu: host <-> device round trip and device memory accounting. Skips with the probe's
// reason when CUDA is not usable (no driver, no device, or built without CUDA).
#include <gtest/gtest.h>

#include "kernels/core/device.h"
#include "kernels/core/tensor.h"
#include "tests/gpu_test.h"

namespace meshproof::kernels {
namespace {

TEST(CudaSmokeTest, HostDeviceRoundTrip) {
  MP_SKIP_WITHOUT_GPU();
  MemoryTracker tracker;
  ScopedRankContext ctx(RankContext{0, Device::cuda(0), nullptr, &tracker});
  std::vector<float> values(1000);
  for (size_t i = 0; i < values.size(); ++i) values[i] = static_cast<float>(i) * 0.5f;
  Tensor host = Tensor::from_vector<float>(Shape{10, 100}, values);
  Tensor dev = host.to(Device::cuda(0));
  EXPECT_EQ(tracker.current(DeviceType::kCuda).value, 4000);
  EXPECT_EQ(dev.to_vector<float>(), values);
}

}  // namespace
}  // namespace meshproof::kernels
