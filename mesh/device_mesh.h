// A device mesh: named dims in the fixed order dp_replicate, dp_shard, tp (cp reserved) and the
// mapping between ranks and mesh coordinates. tp varies fastest:
//   rank = (i_replicate * n_shard + i_shard) * n_tp + i_tp
// Groups are sets of ranks that differ only along some dims (e.g. dp_shard for FSDP, dp_replicate
// + dp_shard for the data-parallel group, dp_shard + tp for the weight-sharding group).
#pragma once

#include <array>
#include <string>
#include <string_view>
#include <vector>

namespace meshproof::mesh {

enum class MeshDim : int { kDpReplicate = 0, kDpShard = 1, kTp = 2 };
inline constexpr int kNumMeshDims = 3;
inline constexpr std::array<MeshDim, kNumMeshDims> kAllMeshDims = {MeshDim::kDpReplicate,
                                                                   MeshDim::kDpShard, MeshDim::kTp};

std::string_view mesh_dim_name(MeshDim d);  // "dp_replicate", "dp_shard", "tp"
// Parses a dim name; "cp" is reserved (not supported yet) and any other name is an input error.
MeshDim parse_mesh_dim(std::string_view name);

// A set of mesh dims, always iterated in mesh order (dp_replicate, dp_shard, tp).
class DimSet {
 public:
  DimSet() = default;
  DimSet(std::initializer_list<MeshDim> dims);
  bool contains(MeshDim d) const { return (bits_ >> static_cast<int>(d)) & 1u; }
  bool empty() const { return bits_ == 0; }
  unsigned bits() const { return bits_; }
  std::vector<MeshDim> dims() const;
  std::string str() const;  // "dp_shard+tp"; "none" when empty
  bool operator==(const DimSet&) const = default;
  // Parses "dp_replicate+dp_shard" (input error naming the bad part).
  static DimSet parse(std::string_view spec);
  static DimSet from_bits(unsigned bits);  // bit i = MeshDim i

 private:
  unsigned bits_ = 0;
};

using Coords = std::array<int, kNumMeshDims>;  // indexed by MeshDim

class DeviceMesh {
 public:
  // Sizes per dim; each must be >= 1 (input error otherwise).
  DeviceMesh(int dp_replicate, int dp_shard, int tp);
  // Parses "dp_shard=4,tp=2" (missing dims are 1). When world_size > 0 the product of the dims
  // must equal it. Unknown names, repeated names, sizes < 1 and bad syntax are input errors.
  static DeviceMesh parse(std::string_view spec, int world_size = 0);
  // Checks that the mesh covers exactly `world_size` ranks (input error otherwise).
  void check_world_size(int world_size) const;

  int size(MeshDim d) const { return sizes_[static_cast<int>(d)]; }
  int world_size() const { return sizes_[0] * sizes_[1] * sizes_[2]; }
  bool is_hsdp() const { return size(MeshDim::kDpReplicate) > 1 && size(MeshDim::kDpShard) > 1; }

  Coords coords(int rank) const;
  int coord(int rank, MeshDim d) const { return coords(rank)[static_cast<int>(d)]; }
  int rank_of(const Coords& c) const;

  // Number of ranks in one group spanning `dims` (product of their sizes; 1 when empty).
  int group_size(DimSet dims) const;
  // The ranks of the group spanning `dims` that contains `rank`, ordered by the flattened
  // coordinate over `dims` in mesh order (which is also ascending rank order).
  std::vector<int> group_ranks(int rank, DimSet dims) const;
  // `rank`'s index inside its group spanning `dims`.
  int group_index(int rank, DimSet dims) const;
  // Which of the groups spanning `dims` holds `rank` (0 .. world/group_size - 1), as a flattened
  // coordinate over the remaining dims: the color for MPI_Comm_split / ncclCommSplit.
  int group_color(int rank, DimSet dims) const;
  // All groups spanning `dims`, a partition of the world, ordered by color.
  std::vector<std::vector<int>> groups(DimSet dims) const;

  std::string str() const;  // "dp_replicate=1,dp_shard=4,tp=2"
  bool operator==(const DeviceMesh&) const = default;

 private:
  void check_rank(int rank) const;
  std::array<int, kNumMeshDims> sizes_;
};

}  // namespace meshproof::mesh
