#include "engine/fp8_all_gather.h"

#include <gtest/gtest.h>

#include <cstring>
#include <mutex>

#include "engine/params.h"
#include "kernels/quantize.h"
#include "mesh/local_comm.h"

namespace meshproof::engine {
namespace {

using kernels::Tensor;
using mesh::MeshDim;

std::vector<uint8_t> bytes(const Tensor& t) {
  std::vector<uint8_t> b(static_cast<size_t>(t.nbytes().value));
  std::memcpy(b.data(), t.raw_data(), b.size());
  return b;
}

// A weight with a wide dynamic range (N(0, 0.02) init, one row scaled up) so that the per-shard
// amax differs from the global one: amax reduction matters.
Tensor weight(int64_t rows, int64_t cols) {
  ParamSpec spec{"layers.0.mlp.fc1.weight", {rows, cols}, InitKind::kNormal, 0.02};
  Tensor w = init_param_rows(spec, 11, 0, rows);
  float* p = w.data<float>();
  for (int64_t c = 0; c < cols; ++c) p[(rows - 1) * cols + c] *= 40.0f;
  return w;
}

// What a rank gathered, as plain bytes (tensors made on a rank thread are accounted to that
// rank's memory tracker, which dies with the world).
struct Gathered {
  std::vector<uint8_t> row, row_sinv, col, col_sinv;
  bool fallback = false;
  std::string note;
};
struct Outcome {
  std::vector<Gathered> per_rank;
};

Outcome gather_on(int n, const Tensor& full, RecipeKind kind, const Tensor* scale,
                  bool reduce = true) {
  const mesh::DeviceMesh dm(1, n, 1);
  const mesh::Layout layout(
      dm, full.shape(),
      {mesh::Placement::replicate(), mesh::Placement::shard(0), mesh::Placement::replicate()});
  Outcome o;
  o.per_rank.resize(static_cast<size_t>(n));
  std::mutex mu;
  mesh::LocalWorld world(dm);
  world.run([&](mesh::RankComms& comms) {
    const Tensor local = mesh::shard(full, layout, comms.rank());
    mesh::Communicator& g = comms.group({MeshDim::kDpShard});
    const Fp8GatherResult r =
        fp8_all_gather(g, g, layout, local, mesh::Box::whole(full.shape()), kind, scale, reduce);
    Gathered out{bytes(r.weight.rowwise_data),    bytes(r.weight.rowwise_scale_inv),
                 bytes(r.weight.columnwise_data), bytes(r.weight.columnwise_scale_inv),
                 r.high_precision_fallback,       r.note};
    std::lock_guard<std::mutex> lock(mu);
    o.per_rank[static_cast<size_t>(comms.rank())] = std::move(out);
  });
  return o;
}

void expect_bitwise(const Gathered& got, const kernels::QuantizedTensor& want,
                    const std::string& what) {
  EXPECT_EQ(got.row, bytes(want.rowwise_data)) << what << " rowwise data";
  EXPECT_EQ(got.row_sinv, bytes(want.rowwise_scale_inv)) << what << " rowwise scale_inv";
  EXPECT_EQ(got.col, bytes(want.columnwise_data)) << what << " columnwise data";
  EXPECT_EQ(got.col_sinv, bytes(want.columnwise_scale_inv)) << what << " columnwise scale_inv";
}

TEST(Fp8AllGather, CurrentScalingGatherOfQuantizedShardsEqualsQuantizedWeight) {
  const Tensor full = weight(128, 64);
  const Tensor scale =
      kernels::compute_current_scale(kernels::compute_amax(full), kernels::DType::kE4M3);
  const kernels::QuantizedTensor want = kernels::quantize_per_tensor(
      full, scale, kernels::DType::kE4M3, {.rowwise = true, .columnwise = true},
      kernels::ScalingMode::kCurrentTensor);
  for (int n : {2, 4, 8}) {
    const Outcome o = gather_on(n, full, RecipeKind::kCurrent, nullptr);
    for (const Gathered& r : o.per_rank) {
      EXPECT_FALSE(r.fallback);
      expect_bitwise(r, want, fmt::format("current dp_shard={}", n));
    }
  }
}

TEST(Fp8AllGather, AmaxNotReducedBreaksParity) {
  const Tensor full = weight(128, 64);
  const Tensor scale =
      kernels::compute_current_scale(kernels::compute_amax(full), kernels::DType::kE4M3);
  const kernels::QuantizedTensor want = kernels::quantize_per_tensor(
      full, scale, kernels::DType::kE4M3, {.rowwise = true}, kernels::ScalingMode::kCurrentTensor);
  const Outcome o = gather_on(4, full, RecipeKind::kCurrent, nullptr, /*reduce=*/false);
  // The shards without the scaled-up last row quantize with a larger scale.
  EXPECT_NE(o.per_rank[0].row, bytes(want.rowwise_data));
}

TEST(Fp8AllGather, DelayedScalingUsesTheReplicatedScale) {
  const Tensor full = weight(96, 64);  // 96 rows over 4: chunks of 24 (per-tensor: no alignment)
  const Tensor scale = Tensor::from_vector<float>({1}, {1234.5f});
  const kernels::QuantizedTensor want = kernels::quantize_per_tensor(
      full, scale, kernels::DType::kE4M3, {.rowwise = true, .columnwise = true},
      kernels::ScalingMode::kDelayedTensor);
  const Outcome o = gather_on(4, full, RecipeKind::kDelayed, &scale);
  for (const Gathered& r : o.per_rank) expect_bitwise(r, want, "delayed");
}

TEST(Fp8AllGather, Mxfp8AlignedShardsGatherBitwise) {
  const Tensor full = weight(128, 64);  // 32-row shards over 4 ranks
  const kernels::QuantizedTensor want =
      kernels::quantize_mxfp8(full, kernels::DType::kE4M3, {.rowwise = true, .columnwise = true});
  for (int n : {2, 4}) {
    const Outcome o = gather_on(n, full, RecipeKind::kMxfp8, nullptr);
    for (const Gathered& r : o.per_rank) {
      EXPECT_FALSE(r.fallback);
      expect_bitwise(r, want, fmt::format("mxfp8 dp_shard={}", n));
    }
  }
}

TEST(Fp8AllGather, Mxfp8UnalignedShardsFallBackAndSayWhy) {
  const Tensor full = weight(96, 64);  // 48-row shards over 2 ranks: not multiples of 32
  const kernels::QuantizedTensor want =
      kernels::quantize_mxfp8(full, kernels::DType::kE4M3, {.rowwise = true, .columnwise = true});
  const Outcome o = gather_on(2, full, RecipeKind::kMxfp8, nullptr);
  for (const Gathered& r : o.per_rank) {
    EXPECT_TRUE(r.fallback);
    EXPECT_NE(r.note.find("multiples of 32"), std::string::npos) << r.note;
    expect_bitwise(r, want, "mxfp8 fallback");
  }
}

}  // namespace
}  // namespace meshproof::engine
