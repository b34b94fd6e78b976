// SplitComm (the mpi launcher with a CUDA device: host buffers over MPI, device buffers over
// NCCL). Without a GPU only the host side can be driven: two LocalWorld group communicators stand
// in for the MPI and NCCL ones, and the test checks that host buffers go to the host side, that
// results and accounting are those of a plain collective, and that mismatched groups are refused.
#include "mesh/mpi/split_comm.h"

#include <gtest/gtest.h>

#include "kernels/core/error.h"
#include "mesh/local/local_comm.h"

namespace meshproof::mesh {
namespace {

using kernels::Tensor;

TEST(SplitComm, HostBuffersGoToTheHostCommunicator) {
  const DeviceMesh mesh(1, 2, 2);
  LocalWorld world(mesh);
  world.run([&](RankComms& comms) {
    SplitRankComms split(comms, comms);
    EXPECT_EQ(split.rank(), comms.rank());
    Communicator& shard = split.group(DimSet{MeshDim::kDpShard});
    EXPECT_EQ(shard.ranks(), comms.group(DimSet{MeshDim::kDpShard}).ranks());
    EXPECT_EQ(shard.backend(), "local+local");
    // Sum over the dp_shard pair: rank r holds r + 1 (exact in fp32).
    Tensor b = Tensor::from_vector<float>({2}, {float(comms.rank() + 1), 1.0f});
    shard.all_reduce(b, ReduceOp::kSum);
    float want = 0;
    for (int r : shard.ranks()) want += float(r + 1);
    EXPECT_EQ(b.to_vector<float>(), (std::vector<float>{want, 2.0f}));
    Tensor out = Tensor::zeros({4}, kernels::DType::kFloat32, kernels::Device::cpu());
    shard.all_gather(Tensor::from_vector<float>({2}, {float(comms.rank()), 0.5f}), out);
    EXPECT_EQ(out.to_vector<float>()[0], float(shard.ranks()[0]));
    EXPECT_EQ(out.to_vector<float>()[2], float(shard.ranks()[1]));
    // The split group accounts its own calls (and the host group underneath its own).
    EXPECT_EQ(shard.stats(CollectiveKind::kAllReduce).count, 1);
    EXPECT_EQ(shard.stats(CollectiveKind::kAllGather).count, 1);
    EXPECT_EQ(&split.group(DimSet{MeshDim::kDpShard}), &shard);  // one per group
  });
}

TEST(SplitComm, GroupsOfDifferentRanksAreRefused) {
  const DeviceMesh mesh(1, 2, 2);
  LocalWorld world(mesh);
  world.run([&](RankComms& comms) {
    EXPECT_THROW(
        SplitComm(comms.group(DimSet{MeshDim::kDpShard}), comms.group(DimSet{MeshDim::kTp})),
        kernels::Error);
  });
}

}  // namespace
}  // namespace meshproof::mesh
