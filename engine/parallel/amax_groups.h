// Amax reduction groups (docs/design.md section 5): the mesh dims over which the per-tensor amax of
// each quantized tensor is MAX-reduced, as data. The TransformerEngine guidance is that every rank
// holding a piece of a tensor takes part in its amax reduction, so that all of them quantize with
// the amax of the whole tensor (the single-rank scale). The quantized tensors of a linear layer
// (engine/model/recipe.h) and where their pieces live (engine/model/model_*.cc quantize
// full-sequence tensors: sequence parallelism gathers the sequence before a GEMM, so it changes
// nothing here):
//
//   linear kind               role         held as                               group
//   column (qkv, fc1[_up])    weight       Shard(0) over tp, (Strided)Shard(0)    dp_shard + tp
//                                          over dp_shard
//   row (proj, fc2)           weight       Shard(1) over tp, Shard(0) dp_shard    dp_shard + tp
//   column                    input        rows over the data ranks, the same     data
//                                          full-width copy on every tp rank
//   row                       input        rows over data, K columns over tp      data + tp
//   column                    grad_output  rows over data, N columns over tp      data + tp
//   row                       grad_output  rows over data, full width on every    data
//                                          tp rank
//
// data = dp_replicate + dp_shard (each data-parallel rank runs its own rows of the micro-batch).
// Weights leave dp_replicate out: HSDP replicas hold identical copies. Dims of size 1 are left
// out (they add no rank), so e.g. weights on a pure dp_replicate mesh reduce over nobody.
// A MAX over extra ranks that hold copies gives the same value, so any superset of these groups
// (the whole mesh) quantizes bitwise alike; a subset that misses a piece does not.
#pragma once

#include <compare>
#include <cstdint>
#include <map>
#include <string>
#include <string_view>

#include "engine/config/mesh_spec.h"
#include "engine/model/params.h"
#include "engine/model/recipe.h"
#include "mesh/core/device_mesh.h"

namespace meshproof::engine {

// One entry of the table: a linear kind and the role of the quantized tensor.
struct AmaxGroupKey {
  LinearKind kind = LinearKind::kColumnParallel;
  Fp8Role role = Fp8Role::kInput;
  auto operator<=>(const AmaxGroupKey&) const = default;
};

// Entries that replace the defaults (RunOptions::amax_groups): tests and fault injection.
using AmaxGroupOverrides = std::map<AmaxGroupKey, mesh::DimSet>;

// The default group of `key` on `mesh` (the table above).
mesh::DimSet default_amax_group(AmaxGroupKey key, const MeshSpec& mesh);
// The override of `key` when `overrides` has one, else the default.
mesh::DimSet amax_group(AmaxGroupKey key, const MeshSpec& mesh,
                        const AmaxGroupOverrides& overrides);

}  // namespace meshproof::engine
