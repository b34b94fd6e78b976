// Placements and shard layouts (docs/design.md section 5), following PyTorch DTensor semantics.
//
// A Layout maps a global tensor shape and one placement per mesh dim (dp_replicate, dp_shard, tp)
// to the box (offset + extent per tensor dim) that each rank holds. Chunking follows torch.chunk:
// a dim of size n split k ways gives chunks of ceil(n/k), trailing chunks smaller or empty.
//
// Order of sharding: placements apply left to right over the mesh dims, except that
// StridedShard(d, sf) on mesh dim m is applied only after the Shard(d) placements to its right
// whose mesh sizes multiply to sf (sf must equal that product). This is PyTorch's _StridedShard
// as FSDP2 uses it with TP: the tensor is sharded as if TP went first and FSDP then chunked each
// TP shard, so dp_shard ranks hold pieces of their own TP shard. For DP=4, TP=2 over 8 rows,
// (StridedShard(0, 2), Shard(0)) gives rank (dp=i, tp=j) row 4j+i, while the left-to-right
// (Shard(0), Shard(0)) gives row 2i+j. With nested chunking every rank holds exactly one box
// (possibly empty), which also holds for shapes the mesh does not divide.
//
// Reassembly (unshard) and resharding are functions of the layouts alone: the checkpoint loader
// uses reshard_plan to find which saved chunks overlap each target box.
#pragma once

#include <string>
#include <vector>

#include "kernels/core/tensor.h"
#include "kernels/core/units.h"
#include "mesh/core/device_mesh.h"

namespace meshproof::mesh {

struct Placement {
  enum class Kind : uint8_t { kReplicate, kShard, kStridedShard };
  Kind kind = Kind::kReplicate;
  int dim = 0;           // tensor dim for Shard / StridedShard
  int split_factor = 1;  // StridedShard only

  static Placement replicate() { return {Kind::kReplicate, 0, 1}; }
  static Placement shard(int d) { return {Kind::kShard, d, 1}; }
  static Placement strided_shard(int d, int sf) { return {Kind::kStridedShard, d, sf}; }
  bool is_shard() const { return kind != Kind::kReplicate; }
  std::string str() const;  // "Replicate()", "Shard(0)", "StridedShard(0, sf=2)"
  bool operator==(const Placement&) const = default;
};

// A hyperrectangle of a global tensor: per tensor dim an offset and an extent, in elements along
// that dim (never bytes). Boxes may come from files (checkpoint indexes): the arithmetic is
// checked, and a box whose element count or end (offset + extent) overflows int64, or whose extent
// is negative, is an input error rather than undefined behaviour.
struct Box {
  std::vector<kernels::Elements> offset;
  std::vector<kernels::Elements> extent;

  int rank() const { return static_cast<int>(offset.size()); }
  kernels::Elements numel() const;
  // offset + extent along dim d (checked).
  int64_t end(int d) const;
  bool empty() const { return numel().value == 0; }
  kernels::Shape shape() const;
  // The overlap of two boxes of the same tensor (extent 0 along some dim when disjoint).
  Box intersect(const Box& other) const;
  bool contains(const Box& inner) const;
  std::string str() const;  // "[0:4, 2:3]" (begin:end per dim)
  bool operator==(const Box&) const = default;
  static Box whole(const kernels::Shape& shape);
};

// One distinct piece of a sharded tensor and the lowest rank that holds it (replicas hold the
// same boxes; the owner is the one that saves it to a checkpoint or serves it in a reshard).
struct Chunk {
  int owner = 0;
  Box box;
};

class Layout {
 public:
  // `placements` has one entry per mesh dim in mesh order. Input errors: wrong count, a shard
  // dim outside the tensor, a StridedShard whose split factor is not the product of the mesh
  // sizes of the Shard placements on the same tensor dim to its right.
  Layout(DeviceMesh mesh, kernels::Shape global_shape, std::vector<Placement> placements);

  const DeviceMesh& mesh() const { return mesh_; }
  const kernels::Shape& global_shape() const { return global_shape_; }
  const std::vector<Placement>& placements() const { return placements_; }
  const Placement& placement(MeshDim d) const { return placements_[static_cast<size_t>(d)]; }

  const Box& box(int rank) const;
  kernels::Shape local_shape(int rank) const { return box(rank).shape(); }
  // Distinct boxes with their owners, in ascending owner order; non-empty boxes only. Together
  // they tile the global tensor exactly once.
  const std::vector<Chunk>& chunks() const { return chunks_; }
  std::string str() const;  // "[8, 4] (Replicate(), StridedShard(0, sf=2), Shard(0)) on mesh"

 private:
  DeviceMesh mesh_;
  kernels::Shape global_shape_;
  std::vector<Placement> placements_;
  std::vector<Box> boxes_;  // per rank
  std::vector<Chunk> chunks_;
};

// Copies `region` (a box of the global tensor) from `src`, which holds global box `src_box`, into
// `dst`, which holds `dst_box`. Tensors must be dense with matching dtypes; host or device.
void copy_region(const kernels::Tensor& src, const Box& src_box, kernels::Tensor& dst,
                 const Box& dst_box, const Box& region);

// The local tensor of `rank` cut out of the global tensor (same dtype and device).
kernels::Tensor shard(const kernels::Tensor& global, const Layout& layout, int rank);
// The global tensor reassembled from every rank's local tensor (index = rank).
kernels::Tensor unshard(const std::vector<kernels::Tensor>& locals, const Layout& layout);

// One piece of a reshard: `region` (global coordinates) moves from source chunk owner
// `src_rank` to target rank `dst_rank`.
struct Transfer {
  int src_rank = 0;
  int dst_rank = 0;
  Box region;
};
// For every target rank, the source chunks that overlap its box. Global shapes must match; the
// meshes may differ. Each target element is covered by exactly one transfer.
std::vector<Transfer> reshard_plan(const Layout& src, const Layout& dst);
// Executes reshard_plan on local tensors (src_locals indexed by source rank).
std::vector<kernels::Tensor> reshard(const std::vector<kernels::Tensor>& src_locals,
                                     const Layout& src, const Layout& dst);

}  // namespace meshproof::mesh
