#include "engine/parallel/amax_groups.h"

#include <string>
#include <vector>

#include "kernels/core/error.h"

namespace meshproof::engine {

using mesh::DimSet;
using mesh::MeshDim;

DimSet default_amax_group(AmaxGroupKey key, const MeshSpec& mesh) {
  // Whether the tensor is split over tp (the other dims follow from the role).
  bool over_tp = true;
  bool over_data = true;
  switch (key.role) {
    case Fp8Role::kWeight:
      over_data = false;  // weights: dp_shard only, added below
      break;
    case Fp8Role::kInput:
      over_tp = key.kind == LinearKind::kRowParallel;
      break;
    case Fp8Role::kGradOutput:
      over_tp = key.kind == LinearKind::kColumnParallel;
      break;
  }
  std::vector<MeshDim> dims;
  if (over_data && mesh.dp_replicate > 1) dims.push_back(MeshDim::kDpReplicate);
  if (mesh.dp_shard > 1) dims.push_back(MeshDim::kDpShard);
  if (over_tp && mesh.tp > 1) dims.push_back(MeshDim::kTp);
  unsigned bits = 0;
  for (MeshDim d : dims) bits |= 1u << static_cast<int>(d);
  return DimSet::from_bits(bits);
}

DimSet amax_group(AmaxGroupKey key, const MeshSpec& mesh, const AmaxGroupOverrides& overrides) {
  const auto it = overrides.find(key);
  return it != overrides.end() ? it->second : default_amax_group(key, mesh);
}

}  // namespace meshproof::engine
