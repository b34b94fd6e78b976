#include "engine/parallel/fp8_all_gather.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <mutex>

#include "engine/model/params.h"
#include "kernels/quantize/nvfp4.h"
#include "kernels/quantize/quantize.h"
#include "mesh/local/local_comm.h"

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
  ParamSpec spec;
  spec.name = "layers.0.mlp.fc1.weight";
  spec.shape = {rows, cols};
  spec.init = InitKind::kNormal;
  spec.std = 0.02;
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
                  bool reduce = true, ScalePadding scale_padding = {}) {
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
    const mesh::Box whole = mesh::Box::whole(full.shape());
    const Fp8GatherResult r =
        gather_shard(g, layout, quantize_shard(g, g, layout, local, whole, kind, scale, reduce),
                     whole, kind, scale_padding);
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

// ---- allgather_parity reference (fp8_all_gather_parity)

// Runs fp8_all_gather on every rank of dp_shard = n and compares its result with
// fp8_all_gather_parity given the same inputs; returns each rank's record.
std::vector<AllGatherParity> parity_on(int n, const Tensor& full, RecipeKind kind,
                                       const Tensor* scale, bool reduce = true) {
  const mesh::DeviceMesh dm(1, n, 1);
  const mesh::Layout layout(
      dm, full.shape(),
      {mesh::Placement::replicate(), mesh::Placement::shard(0), mesh::Placement::replicate()});
  std::vector<AllGatherParity> out(static_cast<size_t>(n));
  std::mutex mu;
  mesh::LocalWorld world(dm);
  world.run([&](mesh::RankComms& comms) {
    const Tensor local = mesh::shard(full, layout, comms.rank());
    mesh::Communicator& g = comms.group({MeshDim::kDpShard});
    const mesh::Box target = mesh::Box::whole(full.shape());
    const Fp8GatherResult r = fp8_all_gather(g, g, layout, local, target, kind, scale, reduce);
    AllGatherParity p = fp8_all_gather_parity(g, g, layout, local, target, kind, scale, r.weight);
    std::lock_guard<std::mutex> lock(mu);
    out[static_cast<size_t>(comms.rank())] = std::move(p);
  });
  return out;
}

// Bytes of the rowwise + columnwise data and scale_inv buffers of an [m, k] weight.
int64_t per_tensor_bytes(int64_t m, int64_t k) { return 2 * m * k + 2 * 4; }
int64_t mxfp8_bytes(int64_t m, int64_t k) { return 2 * m * k + m * (k / 32) + (m / 32) * k; }

// The block_scale_padding_reshard fault's gather (TransformerEngine's swizzle padding kept per
// shard: rowwise scale rows to 128, columnwise to 4): a 256-row weight gathers bitwise on DP2
// (128 rows, 4 columnwise scale rows per shard: no padding), while on DP4 (64 rows per shard)
// shard 1's scales land at rows 128.. (columnwise 4..) and the rows between are the zero padding.
TEST(Fp8AllGather, Mxfp8ScalePaddingShiftsScalesOnlyWhereShardRowsNeedIt) {
  const Tensor full = weight(256, 64);
  const kernels::QuantizedTensor want =
      kernels::quantize_mxfp8(full, kernels::DType::kE4M3, {.rowwise = true, .columnwise = true});
  const ScalePadding padded{.rowwise_rows = 128, .columnwise_rows = 4};
  for (const Gathered& g : gather_on(2, full, RecipeKind::kMxfp8, nullptr, true, padded).per_rank)
    expect_bitwise(g, want, "DP2 with padded scales");
  const std::vector<uint8_t> row = bytes(want.rowwise_scale_inv);     // [256, 2]
  const std::vector<uint8_t> col = bytes(want.columnwise_scale_inv);  // [8, 64]
  for (const Gathered& g : gather_on(4, full, RecipeKind::kMxfp8, nullptr, true, padded).per_rank) {
    EXPECT_EQ(g.row, bytes(want.rowwise_data));
    EXPECT_EQ(g.col, bytes(want.columnwise_data));
    ASSERT_EQ(g.row_sinv.size(), row.size());
    ASSERT_EQ(g.col_sinv.size(), col.size());
    const auto rows = [](const std::vector<uint8_t>& v, int64_t begin, int64_t end, int64_t w) {
      return std::vector<uint8_t>(v.begin() + begin * w, v.begin() + end * w);
    };
    EXPECT_EQ(rows(g.row_sinv, 0, 64, 2), rows(row, 0, 64, 2));
    EXPECT_EQ(rows(g.row_sinv, 64, 128, 2), std::vector<uint8_t>(128, 0));
    EXPECT_EQ(rows(g.row_sinv, 128, 192, 2), rows(row, 64, 128, 2));
    EXPECT_EQ(rows(g.col_sinv, 0, 2, 64), rows(col, 0, 2, 64));
    EXPECT_EQ(rows(g.col_sinv, 2, 4, 64), std::vector<uint8_t>(128, 0));
    EXPECT_EQ(rows(g.col_sinv, 4, 6, 64), rows(col, 2, 4, 64));
  }
}

TEST(AllGatherParity, HoldsForCurrentDelayedAndMxfp8) {
  const Tensor full = weight(128, 64);  // 32-row shards over 4 ranks, 64 over 2
  // The independent single-rank quantizations the gathered weights must equal.
  const kernels::QuantizedTensor current =
      kernels::quantize_current(full, kernels::DType::kE4M3, {.rowwise = true});
  const Tensor delayed_scale = Tensor::from_vector<float>({1}, {1234.5f});
  for (int n : {2, 4}) {
    for (const AllGatherParity& p : parity_on(n, full, RecipeKind::kCurrent, nullptr)) {
      EXPECT_EQ(p.bytes, per_tensor_bytes(128, 64)) << "current " << n;
      EXPECT_EQ(p.mismatched_bytes, 0) << "current " << n;
      EXPECT_EQ(p.max_abs_error, 0.0) << "current " << n;
      EXPECT_EQ(p.scale_inv, p.reference_scale_inv) << "current " << n;
      EXPECT_EQ(p.reference_scale_inv, current.rowwise_scale_inv.data<float>()[0]);
    }
    for (const AllGatherParity& p : parity_on(n, full, RecipeKind::kDelayed, &delayed_scale)) {
      EXPECT_EQ(p.bytes, per_tensor_bytes(128, 64)) << "delayed " << n;
      EXPECT_EQ(p.mismatched_bytes, 0) << "delayed " << n;
      EXPECT_EQ(p.reference_scale_inv, 1.0f / 1234.5f);
    }
    for (const AllGatherParity& p : parity_on(n, full, RecipeKind::kMxfp8, nullptr)) {
      EXPECT_EQ(p.bytes, mxfp8_bytes(128, 64)) << "mxfp8 " << n;
      EXPECT_EQ(p.mismatched_bytes, 0) << "mxfp8 " << n;
      EXPECT_EQ(p.max_abs_error, 0.0) << "mxfp8 " << n;
      EXPECT_GT(p.scale_inv, 0.0);  // an e8m0 block scale decoded as a power of two
      EXPECT_EQ(p.scale_inv, p.reference_scale_inv);
    }
  }
}

// allgather_parity with the amax (nvfp4: the global amax) not reduced over the shards, on
// dp_shard 4 of weight(128, 64), whose last row is 40x larger: the shards without it quantize with
// a larger scale, so every rank's gathered weight differs from quantizing the gathered weight.
// `bytes`: what parity compares for that weight under `recipe`.
void expect_unreduced_amax_caught(RecipeKind recipe, int64_t bytes) {
  const Tensor full = weight(128, 64);
  const std::vector<AllGatherParity> ps = parity_on(4, full, recipe, nullptr, /*reduce=*/false);
  for (size_t r = 0; r < ps.size(); ++r) {
    EXPECT_EQ(ps[r].bytes, bytes) << r;
    EXPECT_GT(ps[r].mismatched_bytes, 0) << r;
    EXPECT_LT(ps[r].mismatched_bytes, ps[r].bytes) << r;  // rank 3's own shard still matches
    EXPECT_GT(ps[r].max_abs_error, 0.0) << r;
  }
  // Rank 0's scale comes from its own rows (small amax): a smaller scale_inv (nvfp4: decode
  // scale) than the reference.
  EXPECT_LT(ps[0].scale_inv, ps[0].reference_scale_inv);
  // Rank 3 holds the largest row: its own amax is the global one.
  EXPECT_EQ(ps[3].scale_inv, ps[3].reference_scale_inv);
}

TEST(AllGatherParity, AmaxNotReducedIsCaught) {
  expect_unreduced_amax_caught(RecipeKind::kCurrent, per_tensor_bytes(128, 64));
}

TEST(AllGatherParity, TpShardedWeightsUseTheGlobalAmax) {
  // dp_shard 2 x tp 2, the column-parallel layout of the session: Shard(0) over tp with
  // StridedShard(0, sf=2) over dp_shard. Each rank gathers its TP-local half; the amax group is
  // the whole mesh, so the reference scale is the global weight's (what one rank would use).
  const Tensor full = weight(128, 64);
  const mesh::DeviceMesh dm(1, 2, 2);
  const mesh::Layout layout(dm, full.shape(),
                            {mesh::Placement::replicate(), mesh::Placement::strided_shard(0, 2),
                             mesh::Placement::shard(0)});
  const mesh::Layout tp_local(
      dm, full.shape(),
      {mesh::Placement::replicate(), mesh::Placement::replicate(), mesh::Placement::shard(0)});
  const kernels::QuantizedTensor global =
      kernels::quantize_current(full, kernels::DType::kE4M3, {.rowwise = true});
  std::vector<AllGatherParity> out(4);
  std::mutex mu;
  mesh::LocalWorld world(dm);
  world.run([&](mesh::RankComms& comms) {
    const Tensor local = mesh::shard(full, layout, comms.rank());
    mesh::Communicator& g = comms.group({MeshDim::kDpShard});
    mesh::Communicator& all = comms.group({MeshDim::kDpReplicate, MeshDim::kDpShard, MeshDim::kTp});
    const mesh::Box target = tp_local.box(comms.rank());
    const Fp8GatherResult r =
        fp8_all_gather(g, all, layout, local, target, RecipeKind::kCurrent, nullptr);
    AllGatherParity p = fp8_all_gather_parity(g, all, layout, local, target, RecipeKind::kCurrent,
                                              nullptr, r.weight);
    std::lock_guard<std::mutex> lock(mu);
    out[static_cast<size_t>(comms.rank())] = std::move(p);
  });
  for (size_t r = 0; r < out.size(); ++r) {
    EXPECT_EQ(out[r].bytes, per_tensor_bytes(64, 64)) << r;
    EXPECT_EQ(out[r].mismatched_bytes, 0) << r;
    EXPECT_EQ(out[r].reference_scale_inv, global.rowwise_scale_inv.data<float>()[0]) << r;
  }
}

TEST(AllGatherParity, CorruptedGatheredBytesAreCounted) {
  // One flipped data byte and a different scale_inv: exactly those bytes are reported.
  const Tensor full = weight(64, 64);
  const mesh::DeviceMesh dm(1, 1, 1);
  const mesh::Layout layout(
      dm, full.shape(),
      {mesh::Placement::replicate(), mesh::Placement::shard(0), mesh::Placement::replicate()});
  AllGatherParity p;
  mesh::LocalWorld world(dm);
  world.run([&](mesh::RankComms& comms) {
    mesh::Communicator& g = comms.group({MeshDim::kDpShard});
    const mesh::Box target = mesh::Box::whole(full.shape());
    Fp8GatherResult r = fp8_all_gather(g, g, layout, full, target, RecipeKind::kMxfp8, nullptr);
    kernels::QuantizedTensor& w = r.weight;
    w.rowwise_data = w.rowwise_data.clone();
    static_cast<uint8_t*>(w.rowwise_data.raw_data())[5] ^= 0x01;
    w.columnwise_scale_inv = w.columnwise_scale_inv.clone();
    static_cast<uint8_t*>(w.columnwise_scale_inv.raw_data())[0] += 1;
    p = fp8_all_gather_parity(g, g, layout, full, target, RecipeKind::kMxfp8, nullptr, w);
  });
  EXPECT_EQ(p.bytes, mxfp8_bytes(64, 64));
  EXPECT_EQ(p.mismatched_bytes, 2);
  EXPECT_GT(p.max_abs_error, 0.0);
}

// ---- NVFP4 all-gather (docs/design.md section 28)

// The single-rank NVFP4 quantization of a weight: 16x16 tiles, both copies.
kernels::QuantizedTensor nvfp4_weight(const Tensor& full) {
  return kernels::quantize_nvfp4(full, nvfp4_weight_options(),
                                 {.rowwise = true, .columnwise = true});
}
// Bytes allgather_parity compares for an [m, k] nvfp4 weight: both copies' packed data and E4M3
// codes, plus the two float32 global amaxes.
int64_t nvfp4_bytes(int64_t m, int64_t k) { return 2 * (m * k / 2) + 2 * (m * k / 16) + 2 * 4; }

TEST(Fp8AllGather, Nvfp4GatherOfQuantizedShardsEqualsQuantizedWeight) {
  // 128 rows: shards of 64, 32 and 16 rows (whole 16x16 tiles) over 2, 4 and 8 ranks. The last
  // row is 40x larger than the others, so only the last shard holds the global amax: without
  // the reduction the other shards would quantize with another second-level scale.
  const Tensor full = weight(128, 64);
  const kernels::QuantizedTensor want = nvfp4_weight(full);
  for (int n : {2, 4, 8}) {
    const Outcome o = gather_on(n, full, RecipeKind::kNvfp4, nullptr);
    for (const Gathered& r : o.per_rank) {
      EXPECT_FALSE(r.fallback);
      expect_bitwise(r, want, fmt::format("nvfp4 dp_shard={}", n));
    }
    for (const AllGatherParity& p : parity_on(n, full, RecipeKind::kNvfp4, nullptr)) {
      EXPECT_EQ(p.bytes, nvfp4_bytes(128, 64)) << "nvfp4 " << n;
      EXPECT_EQ(p.mismatched_bytes, 0) << "nvfp4 " << n;
      EXPECT_EQ(p.max_abs_error, 0.0) << "nvfp4 " << n;
      // The second-level scale is the whole weight's: 1 / (2688 / amax).
      const float amax = want.amax.data<float>()[0];
      EXPECT_EQ(p.scale_inv, 1.0f / (2688.0f / amax)) << "nvfp4 " << n;
      EXPECT_EQ(p.scale_inv, p.reference_scale_inv) << "nvfp4 " << n;
    }
  }
}

TEST(AllGatherParity, Nvfp4GlobalAmaxNotReducedIsCaught) {
  // Each rank's second-level scale from its own shard's amax: shards 0..2 (small values) get a
  // larger S_enc than the global one, so their tile codes and the decode scale they are read with
  // differ from the single-rank quantization's.
  expect_unreduced_amax_caught(RecipeKind::kNvfp4, nvfp4_bytes(128, 64));
}

TEST(Fp8AllGather, Nvfp4ShardsThatCutTilesAreInputErrors) {
  // 96 rows over 4 ranks: shards of 24 rows, so tiles would cross shards. Refused on every rank,
  // naming the box and the shard sizes (no fallback: see fp8_all_gather.h).
  const Tensor full = weight(96, 64);
  const mesh::DeviceMesh dm(1, 4, 1);
  const mesh::Layout layout(
      dm, full.shape(),
      {mesh::Placement::replicate(), mesh::Placement::shard(0), mesh::Placement::replicate()});
  std::vector<std::string> errors(4);
  mesh::LocalWorld world(dm);
  world.run([&](mesh::RankComms& comms) {
    const Tensor local = mesh::shard(full, layout, comms.rank());
    mesh::Communicator& g = comms.group({MeshDim::kDpShard});
    try {
      (void)fp8_all_gather(g, g, layout, local, mesh::Box::whole(full.shape()), RecipeKind::kNvfp4,
                           nullptr);
    } catch (const kernels::Error& e) {
      errors[static_cast<size_t>(comms.rank())] =
          e.kind() == kernels::ErrorKind::kInput ? e.message() : "not an input error";
    }
  });
  for (const std::string& e : errors) {
    EXPECT_NE(e.find("shards of 24, 24, 24, 24 rows"), std::string::npos) << e;
    EXPECT_NE(e.find("16x16 tiles may not cross shards"), std::string::npos) << e;
  }
}

TEST(AllGatherParity, Nvfp4TpShardedWeightsUseTheGlobalAmax) {
  // dp_shard 2 x tp 2, the column-parallel layout (StridedShard over dp_shard): each rank gathers
  // its TP-local half; the amax group is the whole mesh, so the second-level scale is the global
  // weight's and each TP half equals that part of the single-rank quantization's rows.
  const Tensor full = weight(128, 64);
  const mesh::DeviceMesh dm(1, 2, 2);
  const mesh::Layout layout(dm, full.shape(),
                            {mesh::Placement::replicate(), mesh::Placement::strided_shard(0, 2),
                             mesh::Placement::shard(0)});
  const mesh::Layout tp_local(
      dm, full.shape(),
      {mesh::Placement::replicate(), mesh::Placement::replicate(), mesh::Placement::shard(0)});
  const kernels::QuantizedTensor global = nvfp4_weight(full);
  std::vector<AllGatherParity> out(4);
  std::vector<std::vector<uint8_t>> rows(4);
  std::mutex mu;
  mesh::LocalWorld world(dm);
  world.run([&](mesh::RankComms& comms) {
    const Tensor local = mesh::shard(full, layout, comms.rank());
    mesh::Communicator& g = comms.group({MeshDim::kDpShard});
    mesh::Communicator& all = comms.group({MeshDim::kDpReplicate, MeshDim::kDpShard, MeshDim::kTp});
    const mesh::Box target = tp_local.box(comms.rank());
    const Fp8GatherResult r =
        fp8_all_gather(g, all, layout, local, target, RecipeKind::kNvfp4, nullptr);
    AllGatherParity p =
        fp8_all_gather_parity(g, all, layout, local, target, RecipeKind::kNvfp4, nullptr, r.weight);
    std::lock_guard<std::mutex> lock(mu);
    out[static_cast<size_t>(comms.rank())] = std::move(p);
    rows[static_cast<size_t>(comms.rank())] = bytes(r.weight.rowwise_data);
  });
  const std::vector<uint8_t> all_rows = bytes(global.rowwise_data);
  for (size_t r = 0; r < out.size(); ++r) {
    EXPECT_EQ(out[r].bytes, nvfp4_bytes(64, 64)) << r;
    EXPECT_EQ(out[r].mismatched_bytes, 0) << r;
    EXPECT_EQ(out[r].scale_inv, 1.0f / (2688.0f / global.amax.data<float>()[0])) << r;
    // TP rank t holds rows [64 t, 64 t + 64): 32 bytes per row.
    const size_t t = r % 2;
    EXPECT_TRUE(std::equal(rows[r].begin(), rows[r].end(), all_rows.begin() + t * 64 * 32)) << r;
  }
}

}  // namespace
}  // namespace meshproof::engine
