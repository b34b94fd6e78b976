// Checkpoints of device-resident state: ranks of a CUDA LocalWorld save their GPU tensors and load
// into GPU tensors on another mesh; the reassembled global tensors are bitwise equal to what was
// saved. Skips with the reason when no CUDA device is usable.
#include <gtest/gtest.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>

#include "ckpt_test_state.h"
#include "engine/checkpoint/checkpoint.h"
#include "kernels/core/device.h"
#include "mesh/local/local_comm.h"
#include "tests/gpu_test.h"

namespace meshproof::engine {
namespace {

namespace fs = std::filesystem;
using kernels::Device;

TEST(CheckpointGpuTest, DeviceStatesSaveAndReshardLoadBitwise) {
  MP_SKIP_WITHOUT_GPU();
  const fs::path root =
      fs::temp_directory_path() / fmt::format("meshproof_ckpt_gpu_{}", ::getpid());
  fs::remove_all(root);
  mesh::LocalWorldOptions gpu;
  gpu.device = Device::cuda(0);
  const mesh::DeviceMesh src(1, 2, 2);
  fs::path dir;
  {
    mesh::LocalWorld world(src, gpu);
    world.run([&](mesh::RankComms& comms) {
      ShardedState s = testing::make_state(src, comms.rank(), 1);
      for (StateEntry& e : s.entries) e.local = e.local.to(Device::cuda(0));
      fs::path d = save_checkpoint(root, 3, s, comms);
      if (comms.rank() == 0) dir = d;
    });
  }
  const mesh::DeviceMesh dst(2, 2, 1);
  std::vector<ShardedState> states(static_cast<size_t>(dst.world_size()));
  {
    mesh::LocalWorld world(dst, gpu);
    world.run([&](mesh::RankComms& comms) {
      ShardedState s = testing::make_state(dst, comms.rank(), 2);
      for (StateEntry& e : s.entries) e.local = e.local.to(Device::cuda(0));
      load_checkpoint(dir, s, comms);
      for (StateEntry& e : s.entries) {
        EXPECT_FALSE(e.local.device().is_cpu()) << e.key << ": loaded in place on the device";
        e.local = e.local.to(Device::cpu());
      }
      states[static_cast<size_t>(comms.rank())] = s;
    });
    for (ShardedState& s : states) {
      for (StateEntry& e : s.entries) e.local = e.local.clone();
    }
  }
  const auto& keys = testing::synthetic_keys();
  for (size_t k = 0; k < keys.size(); ++k) {
    std::vector<kernels::Tensor> locals;
    for (const ShardedState& s : states) locals.push_back(s.entries[k].local);
    const kernels::Tensor got = mesh::unshard(locals, states[0].entries[k].layout);
    const kernels::Tensor want = testing::synthetic_global(keys[k], 1);
    EXPECT_EQ(
        std::memcmp(got.raw_data(), want.raw_data(), static_cast<size_t>(want.nbytes().value)), 0)
        << keys[k].key;
  }
  EXPECT_EQ(states[3].scalars, testing::synthetic_scalars(1));
  fs::remove_all(root);
}

}  // namespace
}  // namespace meshproof::engine
