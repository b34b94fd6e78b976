// GPU communicators: the local backend with 8 virtual ranks sharing one GPU (device-to-device
// copies, the rank-order reduction kernel) must be bitwise equal to the CPU backend; NCCL runs
// the collectives with one rank per visible GPU (1 GPU: a world of one). Skips without a GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>

#include "kernels/core/device.h"
#include "kernels/core/device_reserve.h"
#include "kernels/core/runtime.h"
#include "kernels/core/tensor.h"
#include "kernels/ops/cast.h"
#include "mesh/core/padded_gather.h"
#include "mesh/local/local_comm.h"
#include "mesh/nccl/nccl_comm.h"
#include "tests/gpu_test.h"
#include "tests/mesh/core/dp_collective_suite.h"

namespace meshproof::mesh {
namespace {

using kernels::DType;
using kernels::Shape;
using kernels::Tensor;

// Mixed magnitudes: rank-order fp32 sums of these round, so a different order shows.
float noisy(int rank, int64_t k) {
  uint32_t h = static_cast<uint32_t>(rank) * 2654435761u ^ static_cast<uint32_t>(k) * 40503u;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  const double m = static_cast<double>(h & 0xFFFFFF) / 16777216.0 - 0.5;
  return static_cast<float>(std::ldexp(m, static_cast<int>((h >> 24) % 9) - 4));
}

Tensor on_current_device(const std::vector<float>& v) {
  Tensor host = Tensor::from_vector(Shape{static_cast<int64_t>(v.size())}, v);
  const kernels::Device d = kernels::current_context().device;
  return d.is_cpu() ? host : host.to(d);
}

std::vector<float> values(int rank, int64_t n) {
  std::vector<float> v(static_cast<size_t>(n));
  for (int64_t k = 0; k < n; ++k) v[static_cast<size_t>(k)] = noisy(rank, k);
  return v;
}

// Every collective on every group of `mesh` with `count` elements per rank; returns the host bits
// of each result, per rank.
std::vector<std::vector<float>> run_suite(kernels::Device device,
                                          const DeviceMesh& mesh = DeviceMesh(2, 2, 2),
                                          int64_t count = 1000) {
  LocalWorldOptions o;
  o.device = device;
  o.timeout = std::chrono::seconds(60);
  LocalWorld world(mesh, o);
  std::vector<std::vector<float>> out(static_cast<size_t>(mesh.world_size()));
  world.run([&](RankComms& comms) {
    std::vector<float>& mine = out[static_cast<size_t>(comms.rank())];
    for (unsigned bits = 1; bits < 8; ++bits) {
      Communicator& c = comms.group(DimSet::from_bits(bits));
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg, ReduceOp::kMax}) {
        Tensor b = on_current_device(values(comms.rank() + 10 * static_cast<int>(bits), count));
        c.all_reduce(b, op);
        for (float x : b.to_vector<float>()) mine.push_back(x);
      }
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kAvg}) {
        Tensor in = on_current_device(values(comms.rank() + 100, count * c.size()));
        Tensor r = Tensor::empty(Shape{count}, DType::kFloat32, kernels::current_context().device);
        c.reduce_scatter(in, r, op);
        for (float x : r.to_vector<float>()) mine.push_back(x);
      }
      Tensor in = on_current_device(values(comms.rank() + 200, count));
      Tensor g = Tensor::empty(Shape{count * c.size()}, DType::kFloat32,
                               kernels::current_context().device);
      c.all_gather(in, g);
      for (float x : g.to_vector<float>()) mine.push_back(x);
      Tensor b = on_current_device(values(comms.rank() + 300, count));
      c.broadcast(b, c.size() - 1);
      for (float x : b.to_vector<float>()) mine.push_back(x);
      c.barrier();
    }
  });
  return out;
}

TEST(GpuLocalCommTest, EightVirtualRanksOnOneGpuBitwiseEqualCpu) {
  MP_SKIP_WITHOUT_GPU();
  // 1000: not a multiple of any group size times the warp size.
  const auto cpu = run_suite(kernels::Device::cpu());
  const auto gpu = run_suite(kernels::Device::cuda(0));
  ASSERT_EQ(cpu.size(), gpu.size());
  for (size_t r = 0; r < cpu.size(); ++r) {
    ASSERT_EQ(cpu[r].size(), gpu[r].size());
    ASSERT_GT(cpu[r].size(), 0u);
    EXPECT_EQ(std::memcmp(cpu[r].data(), gpu[r].data(), cpu[r].size() * sizeof(float)), 0)
        << "rank " << r << ": device results differ from the CPU reference";
  }
}

// The raw collectives (all-reduce sum/avg/max, reduce-scatter sum/avg, all-gather, broadcast) of
// a group of every size 1..8 (dp_shard = n, so group sizes 3, 5, 6, 7 too) on device buffers are
// bitwise the CPU communicator's: 37 elements per rank (odd, below and not a multiple of the warp
// size or of any n > 1), so the rank-order reduction kernel's tails and uneven blocks are
// exercised.
TEST(GpuLocalCommTest, OneToEightRanksBitwiseEqualCpu) {
  MP_SKIP_WITHOUT_GPU();
  for (int n = 1; n <= 8; ++n) {
    const DeviceMesh mesh(1, n, 1);
    const auto cpu = run_suite(kernels::Device::cpu(), mesh, 37);
    const auto gpu = run_suite(kernels::Device::cuda(0), mesh, 37);
    ASSERT_EQ(cpu.size(), static_cast<size_t>(n));
    ASSERT_EQ(gpu.size(), cpu.size());
    for (size_t r = 0; r < cpu.size(); ++r) {
      ASSERT_EQ(cpu[r].size(), gpu[r].size()) << "n " << n << " rank " << r;
      ASSERT_GT(cpu[r].size(), 0u);
      EXPECT_EQ(std::memcmp(cpu[r].data(), gpu[r].data(), cpu[r].size() * sizeof(float)), 0)
          << "n " << n << " rank " << r << ": device results differ from the CPU reference";
    }
  }
}

// Send/recv of device buffers over the pp group of a pp = 4 mesh on one GPU (docs/design.md
// "Host-device traffic per step"): each stage passes its successor an fp32 buffer of odd size
// holding NaN payloads, denormals and -0, a bf16 buffer and 37 bytes (twice, to check the order),
// device to device: the received bits equal the sent ones and no rank copies a byte between the
// host and the device during the exchange (the rank's copy counter, taken after the uploads).
TEST(GpuLocalCommTest, SendRecvOfDeviceBuffersIsBitwiseWithoutHostCopies) {
  MP_SKIP_WITHOUT_GPU();
  const DeviceMesh mesh(1, 1, 1, 4);
  LocalWorldOptions o;
  o.device = kernels::Device::cuda(0);
  o.timeout = std::chrono::seconds(60);
  LocalWorld world(mesh, o);
  std::vector<kernels::CopyCounts> during(4);
  world.run([&](RankComms& comms) {
    Communicator& pp = comms.group({MeshDim::kPp});
    ASSERT_EQ(pp.size(), 4);
    const int s = pp.rank();
    const kernels::Device dev = kernels::current_context().device;
    // Host bits of stage `from`'s message `which`: 1001 floats, of which the first three are a NaN
    // payload, a denormal and -0.
    const auto bits_of = [](int from, int which) {
      std::vector<uint32_t> v(1001);
      for (size_t k = 0; k < v.size(); ++k)
        v[k] = 0x3f800000u + static_cast<uint32_t>(from * 7919 + which * 104729) +
               static_cast<uint32_t>(k) * 2654435761u % 8388608u;
      v[0] = 0x7fc00001u + static_cast<uint32_t>(from);
      v[1] = 0x00000001u;
      v[2] = 0x80000000u;
      return v;
    };
    const auto bytes_of = [](int from) {
      std::vector<uint8_t> v(37);
      for (size_t k = 0; k < v.size(); ++k) v[k] = static_cast<uint8_t>(k * 31 + from);
      return v;
    };
    const auto upload_bits = [&](const std::vector<uint32_t>& v) {
      Tensor h = Tensor::empty(Shape{static_cast<int64_t>(v.size())}, DType::kFloat32,
                               kernels::Device::cpu());
      std::memcpy(h.raw_data(), v.data(), v.size() * 4);
      return h.to(dev);
    };
    // Every upload and receive buffer made before the counting starts.
    std::vector<Tensor> out, in;
    if (s + 1 < pp.size()) {
      out.push_back(upload_bits(bits_of(s, 0)));
      out.push_back(upload_bits(bits_of(s, 1)));
      out.push_back(Tensor::from_vector(Shape{37}, bytes_of(s)).to(dev));
      out.push_back(
          kernels::cast_to(Tensor::from_vector(Shape{3}, std::vector<float>{1.5f, -2.f, float(s)}),
                           DType::kBFloat16)
              .to(dev));
    }
    if (s > 0) {
      in.push_back(Tensor::empty(Shape{1001}, DType::kFloat32, dev));
      in.push_back(Tensor::empty(Shape{1001}, DType::kFloat32, dev));
      in.push_back(Tensor::empty(Shape{37}, DType::kUInt8, dev));
      in.push_back(Tensor::empty(Shape{3}, DType::kBFloat16, dev));
    }
    kernels::synchronize_current();
    const kernels::CopyCounts before = kernels::current_context().copies->counts();
    for (const Tensor& t : out) pp.send(t, s + 1);
    for (Tensor& t : in) pp.recv(t, s - 1);
    during[static_cast<size_t>(comms.rank())] =
        kernels::current_context().copies->counts() - before;
    if (s > 0) {
      for (int which = 0; which < 2; ++which) {
        const std::vector<uint32_t> want = bits_of(s - 1, which);
        const Tensor got = in[static_cast<size_t>(which)].to(kernels::Device::cpu());
        EXPECT_EQ(std::memcmp(got.raw_data(), want.data(), want.size() * 4), 0)
            << "stage " << s << " message " << which;
      }
      EXPECT_EQ(in[2].to_vector<uint8_t>(), bytes_of(s - 1)) << "stage " << s;
      EXPECT_EQ(
          kernels::cast_to(in[3].to(kernels::Device::cpu()), DType::kFloat32).to_vector<float>(),
          (std::vector<float>{1.5f, -2.f, float(s - 1)}))
          << "stage " << s;
    }
  });
  for (size_t r = 0; r < during.size(); ++r)
    EXPECT_EQ(during[r].total(), 0) << "rank " << r << ": send/recv crossed PCIe";
}

TEST(GpuNcclCommTest, CollectivesOnePerGpu) {
  MP_SKIP_WITHOUT_GPU();
  const int n = std::min<int>(static_cast<int>(kernels::cuda_status().gpus.size()), 8);
  const DeviceMesh mesh(1, n, 1);
  const int64_t count = 1024;
  // Small integers: sums are exact whatever order NCCL uses, so the expected values are exact.
  auto v = [](int r, int64_t k) { return static_cast<float>(r * 16 + k % 11); };
  run_nccl_single_process(mesh, [&](NcclRankComms& comms) {
    Communicator& c = comms.group({MeshDim::kDpShard});
    ASSERT_EQ(c.backend(), "nccl");
    ASSERT_EQ(c.size(), n);
    std::vector<float> mine(static_cast<size_t>(count)), big(static_cast<size_t>(count * n));
    for (int64_t k = 0; k < count; ++k) mine[static_cast<size_t>(k)] = v(c.rank(), k);
    for (int64_t k = 0; k < count * n; ++k) big[static_cast<size_t>(k)] = v(c.rank(), k);

    Tensor b = on_current_device(mine);
    c.all_reduce(b, ReduceOp::kSum);
    std::vector<float> got = b.to_vector<float>();
    for (int64_t k = 0; k < count; ++k) {
      float want = 0;
      for (int s = 0; s < n; ++s) want += v(s, k);
      ASSERT_EQ(got[static_cast<size_t>(k)], want) << "all_reduce " << k;
    }
    Tensor in = on_current_device(big);
    Tensor r = Tensor::empty(Shape{count}, DType::kFloat32, comms.context().device);
    c.reduce_scatter(in, r, ReduceOp::kSum);
    got = r.to_vector<float>();
    for (int64_t k = 0; k < count; ++k) {
      float want = 0;
      for (int s = 0; s < n; ++s) want += v(s, c.rank() * count + k);
      ASSERT_EQ(got[static_cast<size_t>(k)], want) << "reduce_scatter " << k;
    }
    Tensor g = Tensor::empty(Shape{count * n}, DType::kFloat32, comms.context().device);
    c.all_gather(on_current_device(mine), g);
    got = g.to_vector<float>();
    for (int64_t i = 0; i < count * n; ++i) {
      ASSERT_EQ(got[static_cast<size_t>(i)], v(static_cast<int>(i / count), i % count));
    }
    Tensor bc = on_current_device(mine);
    c.broadcast(bc, 0);
    got = bc.to_vector<float>();
    for (int64_t k = 0; k < count; ++k) ASSERT_EQ(got[static_cast<size_t>(k)], v(0, k));
    c.barrier();
    EXPECT_EQ(c.stats(CollectiveKind::kAllReduce).bytes.value, count * 4);
  });
}

// The FSDP data-parallel collectives on device tensors (tests/mesh/core/dp_collective_suite.h:
// gather_padded, reduce_scatter_box) for 1..8 virtual ranks with uneven and empty chunks are
// bitwise the host path's (the rank-order device reduction kernel).
TEST(GpuDpCollectivesTest, GatherPaddedAndReduceScatterBoxBitwiseEqualCpu) {
  MP_SKIP_WITHOUT_GPU();
  for (int n = 1; n <= 8; ++n) {
    for (const int64_t rows : testing::dp_suite_rows(n)) {
      const testing::DpSuiteResult cpu = testing::run_dp_suite(n, rows, kernels::Device::cpu());
      const testing::DpSuiteResult gpu = testing::run_dp_suite(n, rows, kernels::Device::cuda(0));
      for (int m = 0; m < n; ++m) {
        const size_t i = static_cast<size_t>(m);
        EXPECT_EQ(std::memcmp(cpu.gathered[i].data(), gpu.gathered[i].data(),
                              cpu.gathered[i].size() * sizeof(float)),
                  0)
            << "gather n=" << n << " rows=" << rows << " member " << m;
        ASSERT_EQ(cpu.reduced[i].size(), gpu.reduced[i].size());
        EXPECT_EQ(std::memcmp(cpu.reduced[i].data(), gpu.reduced[i].data(),
                              cpu.reduced[i].size() * sizeof(float)),
                  0)
            << "reduce_scatter n=" << n << " rows=" << rows << " member " << m;
      }
    }
  }
}

// copy_region between device tensors (strided 2-D copies, a 3-D box with an outer loop) equals the
// host's copy bitwise.
TEST(GpuDpCollectivesTest, CopyRegionOnTheDeviceEqualsTheHost) {
  MP_SKIP_WITHOUT_GPU();
  for (const kernels::Shape& shape : {kernels::Shape{7, 9}, kernels::Shape{4, 6, 5}}) {
    std::vector<float> v(static_cast<size_t>(shape.numel().value));
    for (size_t k = 0; k < v.size(); ++k) v[k] = noisy(0, static_cast<int64_t>(k));
    const Tensor src = Tensor::from_vector(shape, v);
    const Box whole = Box::whole(shape);
    Box region = whole;
    for (int d = 0; d < shape.rank(); ++d) {
      region.offset[static_cast<size_t>(d)] = kernels::Elements(1);
      region.extent[static_cast<size_t>(d)] = kernels::Elements(shape[d] - 2);
    }
    Tensor want = Tensor::zeros(region.shape(), DType::kFloat32, kernels::Device::cpu());
    copy_region(src, whole, want, region, region);
    const Tensor dsrc = src.to(kernels::Device::cuda(0));
    Tensor got = Tensor::zeros(region.shape(), DType::kFloat32, kernels::Device::cuda(0));
    copy_region(dsrc, whole, got, region, region);
    EXPECT_EQ(got.to_vector<float>(), want.to_vector<float>()) << shape.str();
  }
}

// Lifetime (mesh/nccl/nccl_comm.h): a mesh's communicators are made once per process and reused by
// later runs; their creation shows as the device reserve "nccl"; nccl_teardown destroys them
// (every rank on its own thread) and a later run makes a fresh set.
TEST(GpuNcclCommTest, CommunicatorsAreMadeOnceReusedAndTornDown) {
  MP_SKIP_WITHOUT_GPU();
  const int n = std::min<int>(static_cast<int>(kernels::cuda_status().gpus.size()), 8);
  const DeviceMesh mesh(1, n, 1);
  nccl_teardown();
  const int64_t made = nccl_comm_sets_created();
  auto one_run = [&] {
    run_nccl_single_process(mesh, [&](NcclRankComms& comms) {
      Communicator& c = comms.group({MeshDim::kDpShard});
      EXPECT_EQ(c.stats(CollectiveKind::kAllReduce).count, 0) << "stats carried over a run";
      Tensor b = on_current_device(values(comms.rank(), 64));
      c.all_reduce(b, ReduceOp::kSum);
    });
  };
  auto nccl_reserve = [] {
    int64_t bytes = 0;
    for (const kernels::NamedReserve& r : kernels::device_reserves(kernels::Device::cuda(0)))
      if (r.name == "nccl") bytes = r.bytes.value;
    return bytes;
  };
  for (int run = 0; run < 3; ++run) one_run();
  EXPECT_EQ(nccl_comm_sets_created(), made + 1);
  EXPECT_EQ(nccl_comm_sets_cached(), 1u);
  EXPECT_GT(nccl_reserve(), 0) << "creating the communicators took no device memory?";
  EXPECT_EQ(nccl_teardown(), 1);
  EXPECT_EQ(nccl_comm_sets_cached(), 0u);
  EXPECT_EQ(nccl_reserve(), 0);
  one_run();
  EXPECT_EQ(nccl_comm_sets_created(), made + 2);
  EXPECT_EQ(nccl_teardown(), 1);
}

}  // namespace
}  // namespace meshproof::mesh
