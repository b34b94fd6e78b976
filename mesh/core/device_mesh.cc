#include "mesh/core/device_mesh.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <charconv>

#include "kernels/core/error.h"

namespace meshproof::mesh {

std::string_view mesh_dim_name(MeshDim d) {
  switch (d) {
    case MeshDim::kDpReplicate:
      return "dp_replicate";
    case MeshDim::kDpShard:
      return "dp_shard";
    case MeshDim::kTp:
      return "tp";
    case MeshDim::kPp:
      return "pp";
  }
  MP_FAIL("invalid MeshDim {}", static_cast<int>(d));
}

MeshDim parse_mesh_dim(std::string_view name) {
  for (MeshDim d : kAllGroupDims) {
    if (name == mesh_dim_name(d)) return d;
  }
  MP_CHECK_INPUT(name != "cp", "mesh dim 'cp' (context parallel) is reserved and not supported");
  MP_FAIL_INPUT("unknown mesh dim '{}' (expected pp, dp_replicate, dp_shard or tp)", name);
}

DimSet::DimSet(std::initializer_list<MeshDim> dims) {
  for (MeshDim d : dims) bits_ |= 1u << static_cast<int>(d);
}

std::vector<MeshDim> DimSet::dims() const {
  std::vector<MeshDim> out;
  for (MeshDim d : kAllGroupDims) {
    if (contains(d)) out.push_back(d);
  }
  return out;
}

std::string DimSet::str() const {
  if (empty()) return "none";
  std::vector<std::string_view> names;
  for (MeshDim d : dims()) names.push_back(mesh_dim_name(d));
  return fmt::format("{}", fmt::join(names, "+"));
}

DimSet DimSet::parse(std::string_view spec) {
  DimSet s;
  MP_CHECK_INPUT(!spec.empty(), "empty mesh dim set");
  size_t pos = 0;
  while (pos <= spec.size()) {
    const size_t plus = spec.find('+', pos);
    const std::string_view part =
        spec.substr(pos, plus == std::string_view::npos ? std::string_view::npos : plus - pos);
    s.bits_ |= 1u << static_cast<int>(parse_mesh_dim(part));
    if (plus == std::string_view::npos) break;
    pos = plus + 1;
  }
  return s;
}

DimSet DimSet::from_bits(unsigned bits) {
  MP_CHECK(bits < (1u << kNumGroupDims), "DimSet bits {} out of range", bits);
  DimSet s;
  s.bits_ = bits;
  return s;
}

DeviceMesh::DeviceMesh(int dp_replicate, int dp_shard, int tp, int pp)
    : sizes_{dp_replicate, dp_shard, tp}, pp_(pp) {
  for (MeshDim d : kAllGroupDims) {
    MP_CHECK_INPUT(size(d) >= 1, "mesh dim {} has size {}; every mesh dim must be >= 1",
                   mesh_dim_name(d), size(d));
  }
}

DeviceMesh DeviceMesh::parse(std::string_view spec, int world_size) {
  std::array<int, kNumGroupDims> sizes = {1, 1, 1, 1};  // indexed by MeshDim
  std::array<bool, kNumGroupDims> seen = {false, false, false, false};
  MP_CHECK_INPUT(!spec.empty(), "empty mesh spec (expected e.g. dp_shard=4,tp=2)");
  size_t pos = 0;
  while (true) {
    const size_t comma = spec.find(',', pos);
    const std::string_view item =
        spec.substr(pos, comma == std::string_view::npos ? std::string_view::npos : comma - pos);
    const size_t eq = item.find('=');
    MP_CHECK_INPUT(eq != std::string_view::npos,
                   "mesh spec '{}': item '{}' is not name=size (e.g. dp_shard=4)", spec, item);
    const MeshDim d = parse_mesh_dim(item.substr(0, eq));
    const std::string_view num = item.substr(eq + 1);
    int value = 0;
    const auto [end, ec] = std::from_chars(num.data(), num.data() + num.size(), value);
    MP_CHECK_INPUT(ec == std::errc() && end == num.data() + num.size(),
                   "mesh spec '{}': size '{}' of {} is not an integer", spec, num,
                   mesh_dim_name(d));
    MP_CHECK_INPUT(!seen[static_cast<int>(d)], "mesh spec '{}': dim {} given twice", spec,
                   mesh_dim_name(d));
    MP_CHECK_INPUT(value >= 1, "mesh spec '{}': {}={} but every mesh dim must be >= 1", spec,
                   mesh_dim_name(d), value);
    seen[static_cast<int>(d)] = true;
    sizes[static_cast<int>(d)] = value;
    if (comma == std::string_view::npos) break;
    pos = comma + 1;
  }
  DeviceMesh m(sizes[0], sizes[1], sizes[2], sizes[3]);
  if (world_size > 0) m.check_world_size(world_size);
  return m;
}

void DeviceMesh::check_world_size(int world_size) const {
  MP_CHECK_INPUT(world_size == this->world_size(),
                 "mesh {} has {} ranks but the world has {} (the product of the mesh dims must "
                 "equal the world size)",
                 str(), this->world_size(), world_size);
}

void DeviceMesh::check_rank(int rank) const {
  MP_CHECK_INPUT(0 <= rank && rank < world_size(), "rank {} is outside mesh {} ({} ranks)", rank,
                 str(), world_size());
}

Coords DeviceMesh::coords(int rank) const {
  check_rank(rank);
  Coords c{};
  int r = rank % stage_size();
  for (int i = kNumMeshDims - 1; i >= 0; --i) {
    c[static_cast<size_t>(i)] = r % sizes_[static_cast<size_t>(i)];
    r /= sizes_[static_cast<size_t>(i)];
  }
  return c;
}

int DeviceMesh::stage(int rank) const {
  check_rank(rank);
  return rank / stage_size();
}

int DeviceMesh::rank_of(const Coords& c, int stage) const {
  MP_CHECK_INPUT(0 <= stage && stage < pp_, "stage {} is outside mesh {} ({} pipeline stages)",
                 stage, str(), pp_);
  int r = stage;
  for (int i = 0; i < kNumMeshDims; ++i) {
    MP_CHECK_INPUT(0 <= c[static_cast<size_t>(i)] &&
                       c[static_cast<size_t>(i)] < sizes_[static_cast<size_t>(i)],
                   "coordinate {} of {} is outside mesh {}", c[static_cast<size_t>(i)],
                   mesh_dim_name(static_cast<MeshDim>(i)), str());
    r = r * sizes_[static_cast<size_t>(i)] + c[static_cast<size_t>(i)];
  }
  return r;
}

namespace {

// Every coordinate of a rank, pp included, indexed by MeshDim.
using AllCoords = std::array<int, kNumGroupDims>;

AllCoords all_coords(const DeviceMesh& m, int rank) {
  const Coords c = m.coords(rank);
  return {c[0], c[1], c[2], m.stage(rank)};
}

}  // namespace

int DeviceMesh::group_size(DimSet dims) const {
  int n = 1;
  for (MeshDim d : dims.dims()) n *= size(d);
  return n;
}

std::vector<int> DeviceMesh::group_ranks(int rank, DimSet dims) const {
  const AllCoords base = all_coords(*this, rank);
  const std::vector<MeshDim> ds = dims.dims();
  std::vector<int> out;
  const int n = group_size(dims);
  out.reserve(static_cast<size_t>(n));
  for (int idx = 0; idx < n; ++idx) {
    // Decompose idx over `ds` with the last dim fastest, matching the rank formula.
    AllCoords c = base;
    int rem = idx;
    for (auto it = ds.rbegin(); it != ds.rend(); ++it) {
      c[static_cast<size_t>(*it)] = rem % size(*it);
      rem /= size(*it);
    }
    out.push_back(rank_of({c[0], c[1], c[2]}, c[static_cast<size_t>(MeshDim::kPp)]));
  }
  return out;
}

int DeviceMesh::group_index(int rank, DimSet dims) const {
  const AllCoords c = all_coords(*this, rank);
  int idx = 0;
  for (MeshDim d : dims.dims()) idx = idx * size(d) + c[static_cast<size_t>(d)];
  return idx;
}

int DeviceMesh::group_color(int rank, DimSet dims) const {
  const AllCoords c = all_coords(*this, rank);
  int color = 0;
  for (MeshDim d : kAllGroupDims) {
    if (!dims.contains(d)) color = color * size(d) + c[static_cast<size_t>(d)];
  }
  return color;
}

std::vector<std::vector<int>> DeviceMesh::groups(DimSet dims) const {
  std::vector<std::vector<int>> out(static_cast<size_t>(world_size() / group_size(dims)));
  for (int r = 0; r < world_size(); ++r) {
    if (group_index(r, dims) == 0)
      out[static_cast<size_t>(group_color(r, dims))] = group_ranks(r, dims);
  }
  return out;
}

std::string DeviceMesh::str() const {
  return fmt::format("{}dp_replicate={},dp_shard={},tp={}",
                     pp_ > 1 ? fmt::format("pp={},", pp_) : std::string(), sizes_[0], sizes_[1],
                     sizes_[2]);
}

}  // namespace meshproof::mesh
