// Synthetic sharded training states for the checkpoint tests: a fixed set of keys (fp32 masters,
// AdamW moments, bf16 and e4m3 raw bits, FP8 scales and amax histories, int64 RNG state) whose
// global tensors depend only on a seed, laid out on any mesh with the engine's placements:
// FSDP Shard(0) or StridedShard(0, sf=tp) over dp_shard, TP Shard(0)/Shard(1), Replicate over
// dp_replicate, and uneven shapes the mesh does not divide (including fewer rows than ranks).
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "engine/checkpoint/sharded_state.h"
#include "kernels/core/tensor.h"
#include "mesh/core/device_mesh.h"
#include "mesh/core/layout.h"

namespace meshproof::engine::testing {

struct SyntheticKey {
  std::string key;
  kernels::Shape shape;
  kernels::DType dtype;
  // "fsdp_col": TP Shard(0) + FSDP (StridedShard when tp > 1); "fsdp_row": TP Shard(1) + FSDP
  // Shard(0); "fsdp": FSDP Shard(0) only; "tp": TP Shard(0) only; "replicated".
  std::string role;
};

// Tensors allocated on a virtual rank are accounted to that LocalWorld's memory trackers, which
// die with the world: states that outlive the world are re-allocated on this thread first.
inline void detach(std::vector<ShardedState>& states) {
  for (ShardedState& s : states) {
    for (StateEntry& e : s.entries) e.local = e.local.clone();
  }
}

const std::vector<SyntheticKey>& synthetic_keys();
mesh::Layout synthetic_layout(const SyntheticKey& k, const mesh::DeviceMesh& m);
// The global tensor of key `k` for `seed` (host, dense).
kernels::Tensor synthetic_global(const SyntheticKey& k, uint64_t seed);
std::map<std::string, int64_t> synthetic_scalars(uint64_t seed);
// `rank`'s share of the seed's globals on mesh `m`.
ShardedState make_state(const mesh::DeviceMesh& m, int rank, uint64_t seed);

}  // namespace meshproof::engine::testing
