// mesh::gather_padded (mesh/core/padded_gather.h), on the local communicator: every member gets the
// global tensor (or a box of it) bitwise, for uneven torch.chunk shards, empty shards, strided
// layouts, byte dtypes and one-member groups; Padding::kKeep returns the padded receive buffer.
#include "mesh/core/padded_gather.h"

#include <gtest/gtest.h>

#include <cstring>

#include "kernels/core/error.h"
#include "kernels/core/tensor.h"
#include "mesh/local/local_comm.h"
#include "tests/mesh/core/dp_collective_suite.h"

namespace meshproof::mesh {
namespace {

using kernels::DType;
using kernels::Shape;
using kernels::Tensor;

LocalWorldOptions short_timeout() {
  LocalWorldOptions o;
  o.timeout = std::chrono::seconds(20);
  return o;
}

// A global fp32 tensor whose every element differs (and is no round number).
Tensor global_f32(const Shape& s) {
  std::vector<float> v(static_cast<size_t>(s.numel().value));
  for (size_t i = 0; i < v.size(); ++i) v[i] = 0.1f * static_cast<float>(i) + 1.0f / 3.0f;
  return Tensor::from_vector(s, v);
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.dtype() == b.dtype() && a.shape() == b.shape() &&
         std::memcmp(a.raw_data(), b.raw_data(), static_cast<size_t>(a.nbytes().value)) == 0;
}

struct Case {
  const char* name;
  DeviceMesh mesh;
  Shape shape;
  std::vector<Placement> placements;
};

class PaddedGatherTest : public ::testing::TestWithParam<Case> {};

// Every member of dp_shard reassembles the whole tensor (or its tp box) from uneven shards.
TEST_P(PaddedGatherTest, CutPaddingGivesTheGlobalTensorBitwise) {
  const Case& c = GetParam();
  const Tensor global = global_f32(c.shape);
  const Layout layout(c.mesh, c.shape, c.placements);
  LocalWorld world(c.mesh, short_timeout());
  world.run([&](RankComms& comms) {
    Communicator& shard = comms.group({MeshDim::kDpShard});
    const Tensor local = mesh::shard(global, layout, comms.rank());
    // The target: the box of every rank with the same tp coordinate (dp placements replaced).
    std::vector<Placement> p = c.placements;
    p[static_cast<size_t>(MeshDim::kDpShard)] = Placement::replicate();
    const Box target = Layout(c.mesh, c.shape, p).box(comms.rank());
    const Tensor got = gather_padded(shard, member_boxes(shard, layout), local, target);
    Tensor want = Tensor::empty(target.shape(), DType::kFloat32, kernels::Device::cpu());
    copy_region(global, Box::whole(c.shape), want, target, target);
    EXPECT_TRUE(same_bytes(got, want)) << c.name << " rank " << comms.rank();
  });
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, PaddedGatherTest,
    ::testing::Values(
        // 7 rows over 3: chunks 3, 3, 1.
        Case{"uneven",
             DeviceMesh(1, 3, 1),
             {7, 5},
             {Placement::replicate(), Placement::shard(0), Placement::replicate()}},
        // 2 rows over 3: chunks 1, 1, 0 (an empty member).
        Case{"empty_member",
             DeviceMesh(1, 3, 1),
             {2, 4},
             {Placement::replicate(), Placement::shard(0), Placement::replicate()}},
        // 1-D (a bias), 5 over 4: 2, 2, 1, 0.
        Case{"bias",
             DeviceMesh(1, 4, 1),
             {5},
             {Placement::replicate(), Placement::shard(0), Placement::replicate()}},
        // FSDP x TP column-parallel: StridedShard(0, sf=2) over dp_shard, Shard(0) over tp; the
        // target is the tp-local box.
        Case{"strided_tp",
             DeviceMesh(1, 2, 2),
             {11, 3},
             {Placement::replicate(), Placement::strided_shard(0, 2), Placement::shard(0)}},
        // Row-parallel: Shard(1) over tp, Shard(0) over dp_shard; with replicas.
        Case{"row_parallel_hsdp",
             DeviceMesh(2, 2, 2),
             {5, 6},
             {Placement::replicate(), Placement::shard(0), Placement::shard(1)}},
        // Equal row slabs that tile the target in member order (8 rows over 4; the strided
        // FSDP x TP and the row-parallel layouts with rows the groups divide): the gather writes
        // the target directly, without a padded receive buffer.
        Case{"even",
             DeviceMesh(1, 4, 1),
             {8, 5},
             {Placement::replicate(), Placement::shard(0), Placement::replicate()}},
        Case{"strided_tp_even",
             DeviceMesh(1, 2, 2),
             {8, 3},
             {Placement::replicate(), Placement::strided_shard(0, 2), Placement::shard(0)}},
        Case{"row_parallel_hsdp_even",
             DeviceMesh(2, 2, 2),
             {6, 6},
             {Placement::replicate(), Placement::shard(0), Placement::shard(1)}},
        // A group of one member: a copy, no collective.
        Case{"one_member",
             DeviceMesh(2, 1, 1),
             {3, 2},
             {Placement::replicate(), Placement::shard(0), Placement::replicate()}}),
    [](const auto& info) { return std::string(info.param.name); });

// Byte dtypes (FP8 codes) travel unchanged: e4m3 bytes 0..255, including NaN codes.
TEST(PaddedGather, ByteDtypeBitwise) {
  const DeviceMesh mesh(1, 3, 1);
  const Shape shape{8, 32};
  Tensor global = Tensor::empty(shape, DType::kE4M3, kernels::Device::cpu());
  auto* b = static_cast<uint8_t*>(global.raw_data());
  for (int64_t i = 0; i < shape.numel().value; ++i) b[i] = static_cast<uint8_t>((i * 37) & 0xff);
  const Layout layout(mesh, shape,
                      {Placement::replicate(), Placement::shard(0), Placement::replicate()});
  LocalWorld world(mesh, short_timeout());
  world.run([&](RankComms& comms) {
    Communicator& c = comms.group({MeshDim::kDpShard});
    const Tensor got = gather_padded(c, member_boxes(c, layout),
                                     mesh::shard(global, layout, comms.rank()), Box::whole(shape));
    EXPECT_TRUE(same_bytes(got, global)) << "rank " << comms.rank();
  });
}

// kKeep: the receive buffer [3 x 3 rows, cols] of 7 rows over 3 members: member s's real rows at
// row 3s, then the zero rows of its padding (member 2: 1 real row, 2 zero rows).
TEST(PaddedGather, KeepPaddingReturnsTheReceiveBuffer) {
  const DeviceMesh mesh(1, 3, 1);
  const Shape shape{7, 4};
  const Tensor global = global_f32(shape);
  const Layout layout(mesh, shape,
                      {Placement::replicate(), Placement::shard(0), Placement::replicate()});
  LocalWorld world(mesh, short_timeout());
  world.run([&](RankComms& comms) {
    Communicator& c = comms.group({MeshDim::kDpShard});
    const Tensor got =
        gather_padded(c, member_boxes(c, layout), mesh::shard(global, layout, comms.rank()),
                      Box::whole(shape), Padding::kKeep);
    ASSERT_EQ(got.shape(), (Shape{9, 4}));
    const std::vector<float> g = got.to_vector<float>();
    const std::vector<float> w = global.to_vector<float>();
    for (int64_t row = 0; row < 9; ++row) {
      const bool real = row < 7;  // members 0, 1 full (rows 0-5), member 2 row 6 real, 7-8 pad
      for (int64_t col = 0; col < 4; ++col) {
        const float want = real ? w[static_cast<size_t>(row * 4 + col)] : 0.0f;
        EXPECT_EQ(g[static_cast<size_t>(row * 4 + col)], want) << "row " << row;
      }
    }
  });
}

// kKeep refuses boxes that are not torch.chunk row chunks (here: column shards).
TEST(PaddedGather, KeepPaddingRejectsColumnShards) {
  const DeviceMesh mesh(1, 2, 1);
  const Shape shape{4, 6};
  const Tensor global = global_f32(shape);
  const Layout layout(mesh, shape,
                      {Placement::replicate(), Placement::shard(1), Placement::replicate()});
  LocalWorld world(mesh, short_timeout());
  EXPECT_THROW(world.run([&](RankComms& comms) {
    Communicator& c = comms.group({MeshDim::kDpShard});
    gather_padded(c, member_boxes(c, layout), mesh::shard(global, layout, comms.rank()),
                  Box::whole(shape), Padding::kKeep);
  }),
               kernels::Error);
}

// The DP suite on the host (tests/mesh/core/dp_collective_suite.h): for 1..8 members with uneven
// and empty chunks every member gathers the global tensor bitwise, and receives for its box the
// rank-order fp32 average (sum in member order, then / n: the communicator's contract) of every
// member's contribution. The GPU test runs the same suite on a device against this one.
TEST(ReduceScatterBox, AveragesEachMembersBoxInRankOrderForOneToEightMembers) {
  for (int n = 1; n <= 8; ++n) {
    for (const int64_t rows : testing::dp_suite_rows(n)) {
      const testing::DpSuiteResult r = testing::run_dp_suite(n, rows, kernels::Device::cpu());
      const kernels::Shape shape{rows, testing::kDpSuiteCols};
      const Layout layout(DeviceMesh(1, n, 1), shape,
                          {Placement::replicate(), Placement::shard(0), Placement::replicate()});
      for (int m = 0; m < n; ++m) {
        const auto& got = r.gathered[static_cast<size_t>(m)];
        ASSERT_EQ(got.size(), static_cast<size_t>(shape.numel().value));
        for (size_t k = 0; k < got.size(); ++k)
          ASSERT_EQ(got[k], testing::dp_value(-1, static_cast<int64_t>(k)))
              << "n=" << n << " rows=" << rows << " member " << m << " element " << k;
        const Box& b = layout.box(m);
        const auto& red = r.reduced[static_cast<size_t>(m)];
        ASSERT_EQ(red.size(), static_cast<size_t>(b.numel().value)) << "n=" << n << " m=" << m;
        for (int64_t i = 0; i < b.extent[0].value; ++i) {
          for (int64_t j = 0; j < testing::kDpSuiteCols; ++j) {
            const int64_t k = (b.offset[0].value + i) * testing::kDpSuiteCols + j;
            float acc = testing::dp_value(0, k);
            for (int s = 1; s < n; ++s) acc += testing::dp_value(s, k);
            acc = acc / static_cast<float>(n);
            ASSERT_EQ(red[static_cast<size_t>(i * testing::kDpSuiteCols + j)], acc)
                << "n=" << n << " rows=" << rows << " member " << m << " element " << k;
          }
        }
      }
    }
  }
}

// stacked_rows decides when the padded collectives skip their padded buffers: only equal,
// non-empty row slabs spanning the other dims, in member order, that tile the whole box exactly.
TEST(PaddedGather, StackedRowsOnlyForEqualRowSlabsInMemberOrder) {
  const auto boxes = [](const Layout& l, const std::vector<int>& ranks) {
    std::vector<Box> b;
    for (int r : ranks) b.push_back(l.box(r));
    return b;
  };
  const auto rows = [](int d) {
    return std::vector<Placement>{Placement::replicate(), Placement::shard(d),
                                  Placement::replicate()};
  };
  const Layout even(DeviceMesh(1, 4, 1), {8, 5}, rows(0));
  const Box whole = Box::whole({8, 5});
  EXPECT_TRUE(stacked_rows(boxes(even, {0, 1, 2, 3}), whole));
  EXPECT_FALSE(stacked_rows(boxes(even, {1, 0, 2, 3}), whole)) << "member order";
  EXPECT_FALSE(stacked_rows(boxes(even, {0, 1, 2}), whole)) << "does not cover the rows";
  const Layout uneven(DeviceMesh(1, 3, 1), {7, 5}, rows(0));
  EXPECT_FALSE(stacked_rows(boxes(uneven, {0, 1, 2}), Box::whole({7, 5}))) << "3, 3, 1 rows";
  const Layout empty_member(DeviceMesh(1, 3, 1), {2, 4}, rows(0));
  EXPECT_FALSE(stacked_rows(boxes(empty_member, {0, 1, 2}), Box::whole({2, 4})));
  const Layout columns(DeviceMesh(1, 2, 1), {4, 6}, rows(1));
  EXPECT_FALSE(stacked_rows(boxes(columns, {0, 1}), Box::whole({4, 6}))) << "column shards";
  const Layout bias(DeviceMesh(1, 4, 1), {8}, rows(0));
  EXPECT_TRUE(stacked_rows(boxes(bias, {0, 1, 2, 3}), Box::whole({8})));
  // The strided FSDP x TP layout: the dp_shard members of one tp rank tile that rank's box.
  const Layout strided(
      DeviceMesh(1, 2, 2), {8, 3},
      {Placement::replicate(), Placement::strided_shard(0, 2), Placement::shard(0)});
  std::vector<Placement> tp_only = {Placement::replicate(), Placement::replicate(),
                                    Placement::shard(0)};
  const Box tp1 = Layout(DeviceMesh(1, 2, 2), {8, 3}, tp_only).box(1);
  EXPECT_TRUE(stacked_rows(boxes(strided, {1, 3}), tp1)) << tp1.str();
  EXPECT_FALSE(stacked_rows(boxes(strided, {1, 3}), whole));
}

// A float32 contribution is required (the reductions are fp32), named in the error.
TEST(ReduceScatterBox, RejectsANonFloat32Contribution) {
  const DeviceMesh mesh(1, 2, 1);
  const Shape shape{4, 2};
  const Layout layout(mesh, shape,
                      {Placement::replicate(), Placement::shard(0), Placement::replicate()});
  LocalWorld world(mesh, short_timeout());
  EXPECT_THROW(
      {
        try {
          world.run([&](RankComms& comms) {
            Communicator& c = comms.group({MeshDim::kDpShard});
            const Tensor full = Tensor::zeros(shape, DType::kBFloat16, kernels::Device::cpu());
            reduce_scatter_box(c, layout, full, Box::whole(shape), ReduceOp::kSum, true);
          });
        } catch (const kernels::Error& e) {
          EXPECT_NE(std::string(e.what()).find("is not float32"), std::string::npos) << e.what();
          throw;
        }
      },
      kernels::Error);
}

}  // namespace
}  // namespace meshproof::mesh
