#include "engine/parallel/shard_plan.h"

#include "engine/checkpoint/state_keys.h"
#include "kernels/core/error.h"

namespace meshproof::engine {

using kernels::DType;
using kernels::Tensor;
using mesh::Box;
using mesh::Layout;
using mesh::MeshDim;
using mesh::Placement;

std::vector<Placement> placements(const ParamSpec& spec, const mesh::DeviceMesh& mesh) {
  std::vector<Placement> p(3, Placement::replicate());
  p[static_cast<size_t>(MeshDim::kDpShard)] = Placement::shard(0);
  const int tp = mesh.size(MeshDim::kTp);
  if (tp == 1) return p;
  switch (spec.tp) {
    case TpStyle::kColumn:
      p[static_cast<size_t>(MeshDim::kTp)] = Placement::shard(0);
      // FSDP over a TP shard: dp_shard ranks hold pieces of their own TP shard.
      if (mesh.size(MeshDim::kDpShard) > 1)
        p[static_cast<size_t>(MeshDim::kDpShard)] = Placement::strided_shard(0, tp);
      break;
    case TpStyle::kRow:
      p[static_cast<size_t>(MeshDim::kTp)] = Placement::shard(1);
      break;
    case TpStyle::kReplicated:
      break;
  }
  return p;
}

Box compute_box(const Layout& layout, int rank) {
  std::vector<Placement> p = layout.placements();
  p[static_cast<size_t>(MeshDim::kDpReplicate)] = Placement::replicate();
  p[static_cast<size_t>(MeshDim::kDpShard)] = Placement::replicate();
  return Layout(layout.mesh(), layout.global_shape(), p).box(rank);
}

ShardPlan::ShardPlan(const Config& config, const mesh::DeviceMesh& mesh, int rank,
                     const FaultHooks& faults, kernels::Device device)
    : device_(device),
      stage_(stage_layers(config.model.layers, mesh.size(MeshDim::kPp), mesh.stage(rank),
                          config.model.pp_layers)) {
  const auto host = kernels::Device::cpu();
  std::vector<ParamSpec> specs = param_specs(config.model);
  model_params_ = specs.size();
  for (size_t index = 0; index < specs.size(); ++index) {
    ParamSpec& s = specs[index];
    if (!stage_holds(s, stage_)) continue;
    Layout layout(mesh, s.shape, placements(s, mesh));
    const Box& b = layout.box(rank);
    // Only this rank's box is drawn (a tp column shard draws its columns, not whole rows).
    Tensor master = init_param_box(s, config.seed, b);
    Layout described = faults.state_layout(s, layout, rank);
    units_[s.unit].push_back(params_.size());
    if (s.quantized()) linear_kinds_.emplace(s.linear, s.linear_kind);
    if (device != host) master = master.to(device);
    params_.push_back({std::move(s), layout, compute_box(layout, rank), std::move(described),
                       std::move(master), Tensor::zeros(b.shape(), DType::kFloat32, device),
                       Tensor::zeros(b.shape(), DType::kFloat32, device),
                       Tensor::zeros(b.shape(), DType::kFloat32, device), index});
  }
}

bool stage_holds(const ParamSpec& spec, const StageLayers& stage) {
  if (spec.unit != kRootUnit)
    return spec.unit >= stage.first && spec.unit < stage.first + stage.count;
  if (spec.tied_head) return stage.first_stage || stage.last_stage;
  return spec.end == ModelEnd::kInput ? stage.first_stage : stage.last_stage;
}

bool stage_reports(const ParamSpec& spec, const StageLayers& stage) {
  return stage_holds(spec, stage) && (!spec.tied_head || stage.first_stage);
}

void ShardPlan::add_state_entries(ShardedState& state) const {
  for (const ShardedParam& p : params_) {
    // A tied embed.tok on the last of several stages is the first stage's copy (equal masters
    // and moments): that one is saved (stage_reports), this one only loaded.
    const bool replica = !stage_reports(p.spec, stage_);
    state.entries.push_back({keys::model(p.spec.name), p.described, p.master, replica});
    state.entries.push_back({keys::exp_avg(p.spec.name), p.described, p.exp_avg, replica});
    state.entries.push_back({keys::exp_avg_sq(p.spec.name), p.described, p.exp_avg_sq, replica});
  }
}

LinearKind ShardPlan::linear_kind(std::string_view linear) const {
  const auto it = linear_kinds_.find(linear);
  MP_CHECK(it != linear_kinds_.end(), "shard plan: '{}' is not a quantized linear layer", linear);
  return it->second;
}

std::vector<std::string> ShardPlan::linears() const {
  std::vector<std::string> out;
  for (const ShardedParam& p : params_)
    if (p.spec.quantized()) out.push_back(p.spec.linear);
  return out;
}

}  // namespace meshproof::engine
