// The mesh a run asks for (docs/design.md section 5): sizes of dp_replicate, dp_shard and tp, and
// whether tensor parallelism runs with sequence parallelism. Kept apart from
// engine/session/session.h so that the tables derived from it (engine/parallel/amax_groups.h) need
// not include the executor.
#pragma once

#include "mesh/core/device_mesh.h"

namespace meshproof::engine {

struct MeshSpec {
  int dp_replicate = 1;
  int dp_shard = 1;
  int tp = 1;
  bool sequence_parallel = false;  // needs tp > 1
  // Expert-parallel ranks (MoE; docs/design.md "Expert parallelism"): borrowed from dp_shard
  // (divides it), not a mesh dim of its own: each group of ep consecutive dp_shard members splits
  // the experts' computation. Not part of world_size.
  int ep = 1;
  // Pipeline stages (docs/design.md section 33): the outermost mesh dim; each stage runs its
  // contiguous layers on dp_replicate x dp_shard x tp ranks.
  int pp = 1;
  mesh::DeviceMesh device_mesh() const { return mesh::DeviceMesh(dp_replicate, dp_shard, tp, pp); }
  int world_size() const { return pp * dp_replicate * dp_shard * tp; }
  bool operator==(const MeshSpec&) const = default;
};

}  // namespace meshproof::engine
