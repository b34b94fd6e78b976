// The groups of mesh dims the session's parts communicate over (docs/design.md section 5), named
// once: weights gather and gradients reduce-scatter over dp_shard, HSDP replicas all-reduce over
// dp_replicate, the model's tensor parallelism runs over tp, the data-parallel ranks (each its own
// rows of the batch) are dp_replicate x dp_shard, and global views span the world.
#pragma once

#include "mesh/core/device_mesh.h"

namespace meshproof::engine::groups {

inline const mesh::DimSet kDpShard{mesh::MeshDim::kDpShard};
inline const mesh::DimSet kDpReplicate{mesh::MeshDim::kDpReplicate};
inline const mesh::DimSet kTp{mesh::MeshDim::kTp};
inline const mesh::DimSet kData{mesh::MeshDim::kDpReplicate, mesh::MeshDim::kDpShard};
// The pipeline group: the same place of every stage (docs/design.md section 33).
inline const mesh::DimSet kPp{mesh::MeshDim::kPp};
inline const mesh::DimSet kWorld{mesh::MeshDim::kDpReplicate, mesh::MeshDim::kDpShard,
                                 mesh::MeshDim::kTp};
// Every rank of `m`: the stage dims, and pp when there are several stages. A mesh without
// stages keeps kWorld, so its communicators, labels and records are what they were before pp.
inline mesh::DimSet all_ranks(const mesh::DeviceMesh& m) {
  return m.size(mesh::MeshDim::kPp) > 1
             ? mesh::DimSet{mesh::MeshDim::kPp, mesh::MeshDim::kDpReplicate,
                            mesh::MeshDim::kDpShard, mesh::MeshDim::kTp}
             : kWorld;
}

}  // namespace meshproof::engine::groups
