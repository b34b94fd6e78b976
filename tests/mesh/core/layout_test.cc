// Device meshes and shard layouts: the DP=4 x TP=2 strided example of TE's FSDP2 PR (appendix of
// /work/shared/seeds/002), uneven shapes, and property tests over random shapes, meshes and
// placements: shard then unshard is the identity; reshard equals unshard + shard.
#include "mesh/core/layout.h"

#include <gtest/gtest.h>

#include <numeric>
#include <random>

#include "kernels/core/error.h"
#include "kernels/core/tensor.h"
#include "mesh/core/device_mesh.h"

namespace meshproof::mesh {
namespace {

using kernels::Elements;
using kernels::Shape;
using kernels::Tensor;

const Placement R = Placement::replicate();
Placement S(int d) { return Placement::shard(d); }
Placement SS(int d, int sf) { return Placement::strided_shard(d, sf); }

template <typename F>
void expect_input_error(F&& f, std::string_view needle) {
  try {
    f();
    ADD_FAILURE() << "expected an input error mentioning '" << needle << "'";
  } catch (const kernels::Error& e) {
    EXPECT_EQ(e.kind(), kernels::ErrorKind::kInput) << e.what();
    EXPECT_NE(std::string(e.message()).find(needle), std::string::npos) << e.message();
  }
}

TEST(DeviceMeshTest, RankFormulaTpFastest) {
  const DeviceMesh m(2, 3, 2);
  EXPECT_EQ(m.world_size(), 12);
  for (int rep = 0; rep < 2; ++rep) {
    for (int sh = 0; sh < 3; ++sh) {
      for (int tp = 0; tp < 2; ++tp) {
        const int r = (rep * 3 + sh) * 2 + tp;
        EXPECT_EQ(m.rank_of({rep, sh, tp}), r);
        EXPECT_EQ(m.coords(r), (Coords{rep, sh, tp}));
      }
    }
  }
  EXPECT_TRUE(m.is_hsdp());
  EXPECT_FALSE(DeviceMesh(1, 4, 2).is_hsdp());
}

TEST(DeviceMeshTest, GroupsOfDimsAndFlattenedDims) {
  const DeviceMesh m(2, 2, 2);
  EXPECT_EQ(m.group_ranks(5, {MeshDim::kTp}), (std::vector<int>{4, 5}));
  EXPECT_EQ(m.group_ranks(5, {MeshDim::kDpShard}), (std::vector<int>{5, 7}));
  EXPECT_EQ(m.group_ranks(5, {MeshDim::kDpReplicate}), (std::vector<int>{1, 5}));
  // Data-parallel group: dp_replicate + dp_shard; weight-sharding group: dp_shard + tp.
  EXPECT_EQ(m.group_ranks(1, {MeshDim::kDpReplicate, MeshDim::kDpShard}),
            (std::vector<int>{1, 3, 5, 7}));
  EXPECT_EQ(m.group_ranks(6, {MeshDim::kDpShard, MeshDim::kTp}), (std::vector<int>{4, 5, 6, 7}));
  EXPECT_EQ(m.group_index(6, {MeshDim::kDpShard, MeshDim::kTp}), 2);
  EXPECT_EQ(m.group_ranks(3, {}), (std::vector<int>{3}));
  EXPECT_EQ(m.group_ranks(3, DimSet::parse("dp_replicate+dp_shard+tp")).size(), 8u);
  // groups() partitions the world; colors index them.
  const auto g = m.groups({MeshDim::kDpShard});
  ASSERT_EQ(g.size(), 4u);
  std::vector<int> seen(8, 0);
  for (size_t c = 0; c < g.size(); ++c) {
    for (int r : g[c]) {
      ++seen[static_cast<size_t>(r)];
      EXPECT_EQ(m.group_color(r, {MeshDim::kDpShard}), static_cast<int>(c));
    }
  }
  EXPECT_EQ(seen, std::vector<int>(8, 1));
}

TEST(DeviceMeshTest, ParseAndClearErrors) {
  const DeviceMesh m = DeviceMesh::parse("dp_shard=4,tp=2", 8);
  EXPECT_EQ(m, DeviceMesh(1, 4, 2));
  EXPECT_EQ(DeviceMesh::parse("tp=2,dp_replicate=2,dp_shard=2"), DeviceMesh(2, 2, 2));
  expect_input_error([] { DeviceMesh::parse("dp_shard=4,tp=2", 6); }, "world has 6");
  expect_input_error([] { DeviceMesh::parse("dp_shard=0"); }, ">= 1");
  expect_input_error([] { DeviceMesh(1, -1, 2); }, "dp_shard has size -1");
  // pp is a dim since pipeline parallelism (DeviceMeshTest.PipelineDimIsOutermost); ep is not.
  expect_input_error([] { DeviceMesh::parse("ep=2"); }, "unknown mesh dim 'ep'");
  expect_input_error([] { DeviceMesh::parse("cp=2"); }, "reserved");
  expect_input_error([] { DeviceMesh::parse("tp=2,tp=2"); }, "given twice");
  expect_input_error([] { DeviceMesh::parse("tp=x"); }, "not an integer");
  expect_input_error([] { DeviceMesh::parse("tp"); }, "not name=size");
  expect_input_error([] { DimSet::parse("dp_shard+foo"); }, "unknown mesh dim 'foo'");
}

// pp is the outermost dim: rank = ((i_pp * n_rep + i_rep) * n_shard + i_shard) * n_tp + i_tp.
// Coords are the stage's (every stage lays out its shards like a pp = 1 mesh), groups without pp
// stay inside one stage, the pp group links the same place of every stage, and with pp = 1
// every rank, group, color and string is what it was before pp existed.
TEST(DeviceMeshTest, PipelineDimIsOutermost) {
  const DeviceMesh m(2, 2, 2, 3);  // dp_replicate 2, dp_shard 2, tp 2, pp 3
  EXPECT_EQ(m.world_size(), 24);
  EXPECT_EQ(m.stage_size(), 8);
  EXPECT_EQ(m.size(MeshDim::kPp), 3);
  for (int pp = 0; pp < 3; ++pp)
    for (int rep = 0; rep < 2; ++rep)
      for (int sh = 0; sh < 2; ++sh)
        for (int tp = 0; tp < 2; ++tp) {
          const int r = ((pp * 2 + rep) * 2 + sh) * 2 + tp;
          EXPECT_EQ(m.rank_of({rep, sh, tp}, pp), r);
          EXPECT_EQ(m.coords(r), (Coords{rep, sh, tp}));
          EXPECT_EQ(m.stage(r), pp);
          EXPECT_EQ(m.coord(r, MeshDim::kPp), pp);
        }
  const DimSet pp{MeshDim::kPp};
  EXPECT_EQ(m.group_ranks(13, pp), (std::vector<int>{5, 13, 21}));
  EXPECT_EQ(m.group_index(13, pp), 1);
  EXPECT_EQ(m.group_ranks(13, {MeshDim::kDpShard}), (std::vector<int>{13, 15}));
  EXPECT_EQ(m.group_ranks(13, DimSet::parse("dp_replicate+dp_shard+tp")),
            (std::vector<int>{8, 9, 10, 11, 12, 13, 14, 15}));
  EXPECT_EQ(m.group_ranks(1, {MeshDim::kPp, MeshDim::kTp}), (std::vector<int>{0, 1, 8, 9, 16, 17}));
  EXPECT_EQ(DimSet::parse("tp+pp").str(), "pp+tp");
  // Every dim set's groups partition the world, ordered by color.
  for (unsigned bits = 0; bits < (1u << kNumGroupDims); ++bits) {
    const DimSet d = DimSet::from_bits(bits);
    const auto g = m.groups(d);
    std::vector<int> seen(24, 0);
    for (size_t c = 0; c < g.size(); ++c)
      for (int r : g[c]) {
        ++seen[static_cast<size_t>(r)];
        EXPECT_EQ(m.group_color(r, d), static_cast<int>(c)) << d.str();
        EXPECT_EQ(g[c][static_cast<size_t>(m.group_index(r, d))], r) << d.str();
      }
    EXPECT_EQ(seen, std::vector<int>(24, 1)) << d.str();
  }
  EXPECT_EQ(m.str(), "pp=3,dp_replicate=2,dp_shard=2,tp=2");
  EXPECT_EQ(DeviceMesh::parse("dp_shard=2,pp=2", 4), DeviceMesh(1, 2, 1, 2));
  expect_input_error([] { DeviceMesh::parse("pp=0"); }, ">= 1");
  expect_input_error([] { DeviceMesh(1, 1, 1, 0); }, "pp has size 0");
  expect_input_error([] { DeviceMesh(1, 2, 1, 2).rank_of({0, 0, 0}, 2); }, "stage 2 is outside");
  // pp = 1: the mesh of three dims, unchanged.
  const DeviceMesh flat(2, 2, 2);
  EXPECT_EQ(flat, DeviceMesh(2, 2, 2, 1));
  EXPECT_EQ(flat.str(), "dp_replicate=2,dp_shard=2,tp=2");
  for (int r = 0; r < 8; ++r)
    for (unsigned bits = 0; bits < 8; ++bits) {
      const DimSet d = DimSet::from_bits(bits);
      const DimSet with_pp = DimSet::from_bits(bits | (1u << static_cast<int>(MeshDim::kPp)));
      EXPECT_EQ(flat.group_ranks(r, with_pp), flat.group_ranks(r, d));
      EXPECT_EQ(flat.group_color(r, with_pp), flat.group_color(r, d));
      EXPECT_EQ(flat.group_index(r, with_pp), flat.group_index(r, d));
    }
  EXPECT_EQ(flat.group_ranks(5, {MeshDim::kDpShard}), (std::vector<int>{5, 7}));
  EXPECT_EQ(flat.group_color(5, {MeshDim::kDpShard}), 3);  // (rep 1, tp 1) over rep, tp
}

// Rows held by each rank of a [rows] tensor, as (offset, extent).
using Rows = std::pair<int64_t, int64_t>;
Rows rows_of(const Layout& l, int rank) {
  return {l.box(rank).offset[0].value, l.box(rank).extent[0].value};
}

TEST(LayoutTest, StridedShardDp4Tp2ReproducesTheAppendixExample) {
  const DeviceMesh mesh(1, 4, 2);
  const Layout strided(mesh, Shape{8, 3}, {R, SS(0, 2), S(0)});
  const Layout left_to_right(mesh, Shape{8, 3}, {R, S(0), S(0)});
  std::vector<float> v(24);
  std::iota(v.begin(), v.end(), 0.0f);
  const Tensor global = Tensor::from_vector(Shape{8, 3}, v);
  for (int i = 0; i < 4; ++i) {
    for (int j = 0; j < 2; ++j) {
      const int r = mesh.rank_of({0, i, j});
      EXPECT_EQ(rows_of(strided, r), Rows(4 * j + i, 1)) << "dp=" << i << " tp=" << j;
      EXPECT_EQ(rows_of(left_to_right, r), Rows(2 * i + j, 1));
      // The data, not just the box: row 4j+i of the global tensor.
      const std::vector<float> local = shard(global, strided, r).to_vector<float>();
      EXPECT_EQ(local, (std::vector<float>{static_cast<float>(3 * (4 * j + i)),
                                           static_cast<float>(3 * (4 * j + i) + 1),
                                           static_cast<float>(3 * (4 * j + i) + 2)}));
    }
  }
  // The dp_shard group of tp=j gathers exactly TP shard j (rows 4j..4j+3) in dp order.
  for (int j = 0; j < 2; ++j) {
    const auto group = mesh.group_ranks(mesh.rank_of({0, 0, j}), {MeshDim::kDpShard});
    for (int i = 0; i < 4; ++i)
      EXPECT_EQ(rows_of(strided, group[static_cast<size_t>(i)]).first, 4 * j + i);
  }
}

// The appendix's recipe, done literally on row lists for shapes the mesh divides: pre-shard into
// sf = tp pieces, chunk each piece over dp, concatenate rank i's chunks, then Shard(0) over tp.
TEST(LayoutTest, StridedShardMatchesTheLiteralPreShardConcatRecipe) {
  for (int dp : {1, 2, 3, 4}) {
    for (int tp : {1, 2, 4}) {
      for (int k : {1, 2, 3}) {
        const int64_t rows = static_cast<int64_t>(dp) * tp * k;
        const DeviceMesh m(1, dp, tp);
        const Layout l(m, Shape{rows, 2}, {R, SS(0, tp), S(0)});
        for (int i = 0; i < dp; ++i) {
          std::vector<int64_t> concat;
          for (int p = 0; p < tp; ++p) {
            const int64_t piece = rows / tp, sub = piece / dp;
            for (int64_t x = 0; x < sub; ++x) concat.push_back(p * piece + i * sub + x);
          }
          const int64_t per = static_cast<int64_t>(concat.size()) / tp;
          for (int j = 0; j < tp; ++j) {
            const Box& b = l.box(m.rank_of({0, i, j}));
            ASSERT_EQ(b.extent[0].value, per);
            for (int64_t x = 0; x < per; ++x) {
              EXPECT_EQ(b.offset[0].value + x, concat[static_cast<size_t>(j * per + x)])
                  << "dp=" << dp << " tp=" << tp << " rows=" << rows << " rank (" << i << "," << j
                  << ")";
            }
          }
        }
      }
    }
  }
}

TEST(LayoutTest, TorchChunkSemanticsOnUnevenShapes) {
  // torch.chunk(arange(5), 4) -> [0,1], [2,3], [4], [] : ceil size, trailing smaller or empty.
  const Layout l(DeviceMesh(1, 4, 1), Shape{5}, {R, S(0), R});
  EXPECT_EQ(rows_of(l, 0), Rows(0, 2));
  EXPECT_EQ(rows_of(l, 1), Rows(2, 2));
  EXPECT_EQ(rows_of(l, 2), Rows(4, 1));
  EXPECT_EQ(rows_of(l, 3).second, 0);
  EXPECT_EQ(l.local_shape(3), Shape{0});
  // torch.chunk(arange(6), 4) -> [0,1], [2,3], [4,5] and nothing: the fourth rank is empty.
  const Layout l6(DeviceMesh(1, 4, 1), Shape{6}, {R, S(0), R});
  EXPECT_EQ(rows_of(l6, 2), Rows(4, 2));
  EXPECT_EQ(rows_of(l6, 3).second, 0);
  // Strided over 9 rows (DP=4, TP=2): TP shards [0,5) and [5,9); FSDP chunks each TP shard:
  // tp0 -> [0,2) [2,4) [4,5) [], tp1 -> [5,6) [6,7) [7,8) [8,9).
  const DeviceMesh m(1, 4, 2);
  const Layout s9(m, Shape{9}, {R, SS(0, 2), S(0)});
  const std::vector<Rows> tp0 = {{0, 2}, {2, 2}, {4, 1}, {5, 0}};
  const std::vector<Rows> tp1 = {{5, 1}, {6, 1}, {7, 1}, {8, 1}};
  for (int i = 0; i < 4; ++i) {
    EXPECT_EQ(rows_of(s9, m.rank_of({0, i, 0})), tp0[static_cast<size_t>(i)]) << i;
    EXPECT_EQ(rows_of(s9, m.rank_of({0, i, 1})), tp1[static_cast<size_t>(i)]) << i;
  }
}

TEST(LayoutTest, HsdpReplicatesAndChunksHaveLowestOwner) {
  const DeviceMesh m(2, 2, 1);
  const Layout l(m, Shape{4, 2}, {R, S(1), R});
  EXPECT_EQ(l.box(0), l.box(2));
  EXPECT_EQ(l.box(1), l.box(3));
  ASSERT_EQ(l.chunks().size(), 2u);
  EXPECT_EQ(l.chunks()[0].owner, 0);
  EXPECT_EQ(l.chunks()[1].owner, 1);
  EXPECT_EQ(l.chunks()[1].box.str(), "[0:4, 1:2]");
}

TEST(LayoutTest, InvalidPlacementsAreInputErrors) {
  const DeviceMesh m(1, 4, 2);
  expect_input_error([&] { Layout(m, Shape{8}, {R, S(1), R}); }, "tensor has 1 dims");
  expect_input_error([&] { Layout(m, Shape{8}, {R, S(0)}); }, "2 placements given");
  expect_input_error([&] { Layout(m, Shape{8}, {R, SS(0, 4), S(0)}); }, "split factor");
  expect_input_error([&] { Layout(m, Shape{8}, {R, SS(0, 2), R}); }, "split factor");
  expect_input_error([&] { Layout(m, Shape{8, 4}, {R, SS(0, 2), S(1)}); }, "split factor");
}

// ---- property tests ------------------------------------------------------------------------

struct RandomCase {
  DeviceMesh mesh{1, 1, 1};
  std::vector<Placement> placements;
};

DeviceMesh random_mesh(std::mt19937& rng) {
  std::uniform_int_distribution<int> world_d(1, 8);
  const int world = world_d(rng);
  std::vector<std::array<int, 3>> options;
  for (int a = 1; a <= world; ++a) {
    for (int b = 1; b <= world; ++b) {
      if (world % (a * b) == 0) options.push_back({a, b, world / (a * b)});
    }
  }
  const auto& o = options[std::uniform_int_distribution<size_t>(0, options.size() - 1)(rng)];
  return DeviceMesh(o[0], o[1], o[2]);
}

// Replicate, Shard(d), or (on dp_shard, when tp shards the same dim) StridedShard(d, tp).
std::vector<Placement> random_placements(std::mt19937& rng, const DeviceMesh& m, int ndim) {
  std::vector<Placement> p(3, R);
  if (ndim == 0) return p;
  std::uniform_int_distribution<int> dim_d(0, ndim - 1);
  std::uniform_int_distribution<int> kind_d(0, 2);
  for (int i = 0; i < 3; ++i) {
    if (kind_d(rng) > 0) p[static_cast<size_t>(i)] = S(dim_d(rng));
  }
  const Placement& tp = p[2];
  if (p[1].is_shard() && tp.is_shard() && p[1].dim == tp.dim && kind_d(rng) == 0) {
    p[1] = SS(tp.dim, m.size(MeshDim::kTp));
  }
  return p;
}

Shape random_shape(std::mt19937& rng) {
  const int ndim = std::uniform_int_distribution<int>(0, 3)(rng);
  std::vector<int64_t> dims;
  for (int i = 0; i < ndim; ++i) dims.push_back(std::uniform_int_distribution<int64_t>(0, 11)(rng));
  return Shape(dims);
}

Tensor iota_tensor(const Shape& s) {
  std::vector<int32_t> v(static_cast<size_t>(s.numel().value));
  std::iota(v.begin(), v.end(), 0);
  return Tensor::from_vector(s, v);
}

std::vector<Tensor> shard_all(const Tensor& g, const Layout& l) {
  std::vector<Tensor> out;
  for (int r = 0; r < l.mesh().world_size(); ++r) out.push_back(shard(g, l, r));
  return out;
}

// Independent check of one local tensor: element at local index i must be the global linear
// index of (box.offset + unravel(i)).
void expect_local_matches_box(const Tensor& local, const Shape& global, const Box& box) {
  const std::vector<int32_t> v = local.to_vector<int32_t>();
  const int nd = global.rank();
  for (size_t i = 0; i < v.size(); ++i) {
    int64_t rem = static_cast<int64_t>(i), lin = 0, mul = 1;
    for (int d = nd - 1; d >= 0; --d) {
      const int64_t ext = box.extent[static_cast<size_t>(d)].value;
      const int64_t g = box.offset[static_cast<size_t>(d)].value + rem % ext;
      rem /= ext;
      lin += g * mul;
      mul *= global[d];
    }
    ASSERT_EQ(v[i], lin) << "local element " << i << " of box " << box.str();
  }
}

TEST(LayoutPropertyTest, ShardThenUnshardIsIdentity) {
  std::mt19937 rng(20260522);
  int strided_uneven = 0;  // cases with a real StridedShard over a dim the mesh does not divide
  for (int trial = 0; trial < 300; ++trial) {
    const DeviceMesh m = random_mesh(rng);
    const Shape shape = random_shape(rng);
    const Layout l(m, shape, random_placements(rng, m, shape.rank()));
    SCOPED_TRACE(l.str());
    const Placement& p = l.placement(MeshDim::kDpShard);
    if (p.kind == Placement::Kind::kStridedShard && p.split_factor > 1 &&
        shape[p.dim] % (p.split_factor * m.size(MeshDim::kDpShard)) != 0) {
      ++strided_uneven;
    }
    const Tensor g = iota_tensor(shape);
    const std::vector<Tensor> locals = shard_all(g, l);
    // Chunks tile the tensor exactly once; every rank's box is one of the chunks (or empty).
    std::vector<int> cover(static_cast<size_t>(shape.numel().value), 0);
    for (const Chunk& ch : l.chunks()) {
      for (int32_t x : shard(g, l, ch.owner).to_vector<int32_t>()) ++cover[static_cast<size_t>(x)];
    }
    EXPECT_EQ(cover, std::vector<int>(cover.size(), 1));
    for (int r = 0; r < m.world_size(); ++r) {
      expect_local_matches_box(locals[static_cast<size_t>(r)], shape, l.box(r));
    }
    EXPECT_EQ(unshard(locals, l).to_vector<int32_t>(), g.to_vector<int32_t>());
  }
  EXPECT_GE(strided_uneven, 5) << "the generator must exercise uneven strided layouts";
}

TEST(LayoutPropertyTest, ReshardEqualsUnshardThenShard) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 300; ++trial) {
    const Shape shape = random_shape(rng);
    const DeviceMesh ma = random_mesh(rng);
    const DeviceMesh mb = random_mesh(rng);
    const Layout a(ma, shape, random_placements(rng, ma, shape.rank()));
    const Layout b(mb, shape, random_placements(rng, mb, shape.rank()));
    SCOPED_TRACE(a.str() + " -> " + b.str());
    const Tensor g = iota_tensor(shape);
    const std::vector<Tensor> from = shard_all(g, a);
    const std::vector<Tensor> got = reshard(from, a, b);
    const std::vector<Tensor> want = shard_all(unshard(from, a), b);
    ASSERT_EQ(got.size(), want.size());
    for (size_t r = 0; r < got.size(); ++r) {
      EXPECT_EQ(got[r].shape(), want[r].shape());
      EXPECT_EQ(got[r].to_vector<int32_t>(), want[r].to_vector<int32_t>()) << "target rank " << r;
    }
    // Each target element arrives exactly once.
    for (int r = 0; r < mb.world_size(); ++r) {
      int64_t n = 0;
      for (const Transfer& t : reshard_plan(a, b)) {
        if (t.dst_rank == r) n += t.region.numel().value;
      }
      EXPECT_EQ(n, b.box(r).numel().value) << "target rank " << r;
    }
  }
}

// Box arithmetic on values from files (checkpoint indexes): overflow is an input error, not
// undefined behaviour (Box::numel and Box::contains multiplied and added unchecked).
TEST(BoxArithmeticTest, OverflowIsAnInputError) {
  Box big;
  big.offset = {Elements(0), Elements(0)};
  big.extent = {Elements(int64_t{1} << 62), Elements(8)};
  EXPECT_THROW(big.numel(), kernels::Error);
  Box far;
  far.offset = {Elements(INT64_MAX - 1)};
  far.extent = {Elements(4)};
  const Box whole = Box::whole(Shape{5});
  EXPECT_THROW((void)whole.contains(far), kernels::Error);
  EXPECT_THROW((void)whole.intersect(far), kernels::Error);
  EXPECT_EQ(far.str(), "[9223372036854775806+4]");
  Box ok;
  ok.offset = {Elements(1)};
  ok.extent = {Elements(3)};
  EXPECT_TRUE(whole.contains(ok));
  EXPECT_EQ(ok.numel().value, 3);
  EXPECT_EQ(ok.str(), "[1:4]");
}

// Chunking a dim near INT64_MAX: ceil(n/k) and i * chunk without overflow.
TEST(BoxArithmeticTest, LayoutOfAHugeDimDoesNotOverflow) {
  const Layout l(DeviceMesh(1, 4, 1), Shape{INT64_MAX},
                 {Placement::replicate(), Placement::shard(0), Placement::replicate()});
  const int64_t chunk = INT64_MAX / 4 + 1;
  EXPECT_EQ(l.box(1).offset[0].value, chunk);
  EXPECT_EQ(l.box(3).offset[0].value, 3 * chunk);
  EXPECT_EQ(l.box(3).extent[0].value, INT64_MAX - 3 * chunk);
}

}  // namespace
}  // namespace meshproof::mesh
