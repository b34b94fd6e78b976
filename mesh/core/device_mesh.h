// A device mesh: named dims in the fixed order pp, dp_replicate, dp_shard, tp (cp reserved) and the
// mapping between ranks and mesh coordinates. pp (pipeline stages) is outermost, tp varies fastest:
//   rank = ((i_pp * n_replicate + i_replicate) * n_shard + i_shard) * n_tp + i_tp
// The three inner dims are the stage's dims: tensors are placed over them (mesh/core/layout.h), and
// Coords holds them only (a stage's ranks lay out their shards exactly as a pp = 1 mesh of the
// same inner sizes); stage(rank) is the pp coordinate. With pp = 1 every rank, group and string
// is what it was before pp existed.
// Groups are sets of ranks that differ only along some dims (e.g. dp_shard for FSDP, dp_replicate
// + dp_shard for the data-parallel group, dp_shard + tp for the weight-sharding group).
#pragma once

#include <array>
#include <string>
#include <string_view>
#include <vector>

namespace meshproof::mesh {

// kPp is numbered last so that the DimSet bits of the stage dims (and so every group's index,
// label and communicator slot) stay what they were before pp existed; in mesh order it is first.
enum class MeshDim : int { kDpReplicate = 0, kDpShard = 1, kTp = 2, kPp = 3 };
// The stage dims: the dims tensors are placed over (Coords, Layout placements).
inline constexpr int kNumMeshDims = 3;
inline constexpr std::array<MeshDim, kNumMeshDims> kAllMeshDims = {MeshDim::kDpReplicate,
                                                                   MeshDim::kDpShard, MeshDim::kTp};
// Every dim a group may span, in mesh order (pp outermost): DimSet bits range over 2^4 sets.
inline constexpr int kNumGroupDims = 4;
inline constexpr std::array<MeshDim, kNumGroupDims> kAllGroupDims = {
    MeshDim::kPp, MeshDim::kDpReplicate, MeshDim::kDpShard, MeshDim::kTp};

std::string_view mesh_dim_name(MeshDim d);  // "dp_replicate", "dp_shard", "tp", "pp"
// Parses a dim name; "cp" is reserved (not supported yet) and any other name is an input error.
MeshDim parse_mesh_dim(std::string_view name);

// A set of mesh dims, always iterated in mesh order (pp, dp_replicate, dp_shard, tp).
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
  static DimSet from_bits(unsigned bits);  // bit i = MeshDim i, bits < 2^kNumGroupDims

 private:
  unsigned bits_ = 0;
};

using Coords = std::array<int, kNumMeshDims>;  // indexed by MeshDim (the stage dims)

class DeviceMesh {
 public:
  // Sizes per dim; each must be >= 1 (input error otherwise).
  DeviceMesh(int dp_replicate, int dp_shard, int tp, int pp = 1);
  // Parses "pp=2,dp_shard=4,tp=2" (missing dims are 1). When world_size > 0 the product of the
  // dims must equal it. Unknown names, repeated names, sizes < 1 and bad syntax are input errors.
  static DeviceMesh parse(std::string_view spec, int world_size = 0);
  // Checks that the mesh covers exactly `world_size` ranks (input error otherwise).
  void check_world_size(int world_size) const;

  int size(MeshDim d) const { return d == MeshDim::kPp ? pp_ : sizes_[static_cast<int>(d)]; }
  int stage_size() const { return sizes_[0] * sizes_[1] * sizes_[2]; }  // ranks per stage
  int world_size() const { return pp_ * stage_size(); }
  bool is_hsdp() const { return size(MeshDim::kDpReplicate) > 1 && size(MeshDim::kDpShard) > 1; }

  // The stage coordinates of `rank` (its place inside its pipeline stage).
  Coords coords(int rank) const;
  int coord(int rank, MeshDim d) const {
    return d == MeshDim::kPp ? stage(rank) : coords(rank)[static_cast<int>(d)];
  }
  int stage(int rank) const;  // i_pp
  // The rank of stage coordinates `c` in pipeline stage `stage`.
  int rank_of(const Coords& c, int stage = 0) const;

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
  // Communicator slots: with pp = 1 a dim set with pp has the members of the same set without
  // it, so backends whose communicators are costly (NCCL) build 2^kNumMeshDims slots and map
  // both sets to one (group_slot); with pp > 1 every one of the 2^kNumGroupDims sets has a slot.
  unsigned group_slots() const { return pp_ > 1 ? 1u << kNumGroupDims : 1u << kNumMeshDims; }
  unsigned group_slot(DimSet dims) const { return dims.bits() & (group_slots() - 1); }

  // "dp_replicate=1,dp_shard=4,tp=2"; with pp > 1 prefixed "pp=2," (pp = 1 is not written, so
  // every string of a mesh without pipeline stages is unchanged).
  std::string str() const;
  bool operator==(const DeviceMesh&) const = default;

 private:
  void check_rank(int rank) const;
  std::array<int, kNumMeshDims> sizes_;
  int pp_ = 1;
};

}  // namespace meshproof::mesh
