// The data-parallel collectives of an FSDP step (mesh/core/padded_gather.h: the weight gather
// gather_padded and the gradient reduce_scatter_box) over n = 1..8 members of dp_shard with
// uneven torch.chunk row shards (and empty members), run on `device` with the local
// communicator. The CPU test (padded_gather_test.cc) checks the host results against their
// definition; the GPU test (gpu_comm_test.cc) checks that the device results are bitwise the
// host's.
#pragma once

#include <cmath>
#include <cstdint>
#include <vector>

#include "kernels/core/tensor.h"
#include "mesh/core/padded_gather.h"
#include "mesh/local/local_comm.h"

namespace meshproof::mesh::testing {

// Mixed magnitudes (rank-order fp32 sums of these round, so another order would show).
inline float dp_value(int member, int64_t k) {
  uint32_t h = static_cast<uint32_t>(member + 1) * 2654435761u ^ static_cast<uint32_t>(k) * 40503u;
  h ^= h >> 15;
  h *= 2246822519u;
  h ^= h >> 13;
  const double m = static_cast<double>(h & 0xFFFFFF) / 16777216.0 - 0.5;
  return static_cast<float>(std::ldexp(m, static_cast<int>((h >> 24) % 9) - 4));
}

// Rows of the global [rows, 5] tensor for n members: 2n + 1 (uneven chunks) and 2n (equal row
// slabs: the padded collectives read and write the tensors themselves, mesh/core/padded_gather.cc
// stacked_rows) for every n, and n - 1 for n >= 3 (torch.chunk leaves trailing members empty).
inline std::vector<int64_t> dp_suite_rows(int n) {
  std::vector<int64_t> r{2 * n + 1, 2 * n};
  if (n >= 3) r.push_back(n - 1);
  return r;
}
inline constexpr int64_t kDpSuiteCols = 5;

struct DpSuiteResult {
  // Per rank: the gathered global tensor (from each member's shard of the global values
  // dp_value(-1, k)), then the reduce-scattered box (member s contributes dp_value(s, k) over the
  // whole tensor, ReduceOp::kAvg).
  std::vector<std::vector<float>> gathered, reduced;
};

// One run of both collectives over dp_shard = n, `rows` global rows, on `device`.
inline DpSuiteResult run_dp_suite(int n, int64_t rows, kernels::Device device) {
  const DeviceMesh mesh(1, n, 1);
  const kernels::Shape shape{rows, kDpSuiteCols};
  const Layout layout(mesh, shape,
                      {Placement::replicate(), Placement::shard(0), Placement::replicate()});
  const Box whole = Box::whole(shape);
  std::vector<float> global(static_cast<size_t>(shape.numel().value));
  for (size_t k = 0; k < global.size(); ++k) global[k] = dp_value(-1, static_cast<int64_t>(k));
  const kernels::Tensor global_host = kernels::Tensor::from_vector(shape, global);
  LocalWorldOptions o;
  o.device = device;
  o.timeout = std::chrono::seconds(60);
  LocalWorld world(mesh, o);
  DpSuiteResult r;
  r.gathered.resize(static_cast<size_t>(n));
  r.reduced.resize(static_cast<size_t>(n));
  world.run([&](RankComms& comms) {
    Communicator& c = comms.group({MeshDim::kDpShard});
    const auto on_device = [&](const kernels::Tensor& t) {
      return device.is_cpu() ? t : t.to(device);
    };
    const kernels::Tensor local = on_device(mesh::shard(global_host, layout, comms.rank()));
    const kernels::Tensor got = gather_padded(c, member_boxes(c, layout), local, whole);
    std::vector<float> mine(static_cast<size_t>(shape.numel().value));
    for (size_t k = 0; k < mine.size(); ++k) mine[k] = dp_value(c.rank(), static_cast<int64_t>(k));
    const kernels::Tensor full = on_device(kernels::Tensor::from_vector(shape, mine));
    const kernels::Tensor red = reduce_scatter_box(c, layout, full, whole, ReduceOp::kAvg, true);
    r.gathered[static_cast<size_t>(comms.rank())] = got.to_vector<float>();
    r.reduced[static_cast<size_t>(comms.rank())] = red.to_vector<float>();
  });
  return r;
}

}  // namespace meshproof::mesh::testing
