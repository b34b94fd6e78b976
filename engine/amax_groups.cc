#include "engine/amax_groups.h"

#include <string>
#include <vector>

#include "kernels/error.h"

namespace meshproof::engine {

using mesh::DimSet;
using mesh::MeshDim;

LinearKind linear_kind(std::string_view linear) {
  // MoE expert linears (docs/design.md section 27): "layers.0.moe.experts.3.fc1" and
  // "layers.0.moe.shared.fc2" are the MLP rows "mlp.fc1" / "mlp.fc2".
  if (const size_t at = linear.find(".moe."); at != std::string_view::npos) {
    const size_t dot = linear.rfind('.');
    const std::string mlp = "mlp." + std::string(linear.substr(dot + 1));
    for (Activation a : {Activation::kGelu, Activation::kSwiGlu})
      for (const LinearLayer& l : block_linears(a))
        if (l.name == mlp) return l.kind;
  }
  for (Activation a : {Activation::kGelu, Activation::kSwiGlu})
    for (const LinearLayer& l : block_linears(a))
      if (linear.ends_with(l.name) && linear.size() > l.name.size() &&
          linear[linear.size() - l.name.size() - 1] == '.')
        return l.kind;
  MP_FAIL("amax groups: '{}' is not a quantized linear layer", linear);
}

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
