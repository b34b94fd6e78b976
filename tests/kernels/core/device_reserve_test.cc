// The named device reserves (kernels/core/device_reserve.h): fixed entries per device, providers
// asked at query time, the totals, and the errors. Host logic only; "cuda_pool" is 0 here
// without a usable device and on the CPU.
#include "kernels/core/device_reserve.h"

#include <gtest/gtest.h>

#include "kernels/core/device.h"
#include "kernels/core/error.h"

namespace meshproof::kernels {
namespace {

const Device kDev1 = Device::cuda(1), kDev2 = Device::cuda(2);

std::vector<std::pair<std::string, int64_t>> plain(const std::vector<NamedReserve>& r) {
  std::vector<std::pair<std::string, int64_t>> out;
  for (const NamedReserve& x : r)
    if (x.name != "cuda_pool") out.emplace_back(x.name, x.bytes.value);
  return out;
}

TEST(DeviceReserve, FixedEntriesPerDeviceSortedAndSummed) {
  set_device_reserve(kDev1, "test_nccl", Bytes(100));
  set_device_reserve(kDev1, "test_a", Bytes(5));
  set_device_reserve(kDev2, "test_nccl", Bytes(7));
  set_device_reserve(kDev1, "test_zero", Bytes(0));  // zero entries are not listed
  using V = std::vector<std::pair<std::string, int64_t>>;
  EXPECT_EQ(plain(device_reserves(kDev1)), (V{{"test_a", 5}, {"test_nccl", 100}}));
  EXPECT_EQ(plain(device_reserves(kDev2)), (V{{"test_nccl", 7}}));
  EXPECT_TRUE(plain(device_reserves(Device::cpu())).empty());
  set_device_reserve(kDev1, "test_nccl", Bytes(40));  // replaces
  EXPECT_EQ(plain(device_reserves(kDev1)), (V{{"test_a", 5}, {"test_nccl", 40}}));
  if (!cuda_status().usable) {  // no cuda_pool entry: the fixed reserves alone
    EXPECT_EQ(total_of(device_reserves(kDev1)).value, 45);
  }
  clear_device_reserve(kDev1, "test_nccl");
  clear_device_reserve(kDev1, "test_a");
  clear_device_reserve(kDev1, "test_zero");
  clear_device_reserve(kDev2, "test_nccl");
  EXPECT_TRUE(plain(device_reserves(kDev1)).empty());
}

TEST(DeviceReserve, ProvidersAreAskedPerDeviceAtQueryTime) {
  int64_t workspace = 64;
  register_reserve_provider("test_cublaslt", [&workspace](Device d) {
    return Bytes(d.is_cuda() ? workspace * (d.index + 1) : 0);
  });
  using V = std::vector<std::pair<std::string, int64_t>>;
  EXPECT_EQ(plain(device_reserves(kDev1)), (V{{"test_cublaslt", 128}}));
  workspace = 0;  // a provider at zero is not listed
  EXPECT_TRUE(plain(device_reserves(kDev1)).empty());
  workspace = 1;
  EXPECT_EQ(plain(device_reserves(kDev2)), (V{{"test_cublaslt", 3}}));
  EXPECT_TRUE(plain(device_reserves(Device::cpu())).empty());
  unregister_reserve_provider("test_cublaslt");
  EXPECT_TRUE(plain(device_reserves(kDev2)).empty());
}

TEST(DeviceReserve, BadEntriesAreErrors) {
  EXPECT_THROW(set_device_reserve(kDev1, "test_neg", Bytes(-1)), Error);
  EXPECT_THROW(set_device_reserve(kDev1, "cuda_pool", Bytes(1)), Error);
  // The built-in names (the pool and the cuBLASLt workspaces) are the library's own.
  EXPECT_THROW(set_device_reserve(kDev1, "cublaslt", Bytes(1)), Error);
  EXPECT_THROW(register_reserve_provider("cublaslt", [](Device) { return Bytes(1); }), Error);
  EXPECT_THROW(set_device_reserve(kDev1, "", Bytes(1)), Error);
  register_reserve_provider("test_both", [](Device) { return Bytes(1); });
  EXPECT_THROW(set_device_reserve(kDev1, "test_both", Bytes(1)), Error);
  unregister_reserve_provider("test_both");
  set_device_reserve(kDev1, "test_fixed", Bytes(1));
  EXPECT_THROW(register_reserve_provider("test_fixed", [](Device) { return Bytes(1); }), Error);
  clear_device_reserve(kDev1, "test_fixed");
  register_reserve_provider("test_negative", [](Device) { return Bytes(-5); });
  EXPECT_THROW(device_reserves(kDev1), Error);
  unregister_reserve_provider("test_negative");
  EXPECT_EQ(cuda_pool_reserve(Device::cpu()).value, 0);
}

}  // namespace
}  // namespace meshproof::kernels
