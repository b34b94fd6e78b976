// The shard plan (docs/design.md sections 5 and 20): each parameter's layout on the mesh, the box
// it computes with, the layout its checkpoint entries describe, and this rank's fp32 shards
// (master, AdamW moments, reduced gradient). Placements follow from the parameter spec's TP style
// (engine/model/params.h) and the mesh alone, torchtitan's colwise/rowwise plan as a table:
//
//   style       dp_replicate  dp_shard                                   tp
//   replicated  Replicate     Shard(0)                                   Replicate
//   column      Replicate     StridedShard(0, sf=tp) (Shard(0) if dp=1)  Shard(0)
//   row         Replicate     Shard(0)                                   Shard(1)
//
// (with tp = 1 every style is the replicated row: FSDP alone).
#pragma once

#include <cstdint>
#include <map>
#include <string_view>
#include <vector>

#include "engine/checkpoint/sharded_state.h"
#include "engine/config/config.h"
#include "engine/faults/fault_hooks.h"
#include "engine/model/params.h"
#include "engine/pipeline/pipeline.h"
#include "kernels/core/tensor.h"
#include "mesh/core/device_mesh.h"
#include "mesh/core/layout.h"

namespace meshproof::engine {

// The placements of `spec` on `mesh`, one per mesh dim (the table above).
std::vector<mesh::Placement> placements(const ParamSpec& spec, const mesh::DeviceMesh& mesh);

// The box of the tensor `rank` computes with: the layout with every data-parallel placement
// replaced by Replicate (what the all-gather over dp_shard reassembles).
mesh::Box compute_box(const mesh::Layout& layout, int rank);

// One parameter in the plan, with this rank's shards.
struct ShardedParam {
  ParamSpec spec;
  mesh::Layout layout;     // master / moments / gradient shard layout
  mesh::Box compute;       // box of the compute tensor after the dp_shard gather
  mesh::Layout described;  // the layout its checkpoint entries describe (FaultHooks)
  // On the plan's state device (the host on the CPU backend, the rank's GPU on the CUDA one):
  kernels::Tensor master;      // fp32, layout.box(rank)
  kernels::Tensor exp_avg;     // fp32, same
  kernels::Tensor exp_avg_sq;  // fp32, same
  kernels::Tensor grad;        // fp32, same (reduced gradient of the last step)
  // The parameter's index in param_specs(config.model) (the canonical model order): the same
  // on every pipeline stage, whose plans hold only their own parameters.
  size_t model_index = 0;
};

// Whether pipeline stage `stage` holds parameter `spec` (docs/design.md section 33): its layers'
// parameters, the embeddings on the first stage, the final norm and lm_head on the last. A tied
// embed.tok (ParamSpec::tied_head) is held by both end stages: one copy each, identical masters
// (the same Philox rows), kept identical by the exchange of their gradient parts.
bool stage_holds(const ParamSpec& spec, const StageLayers& stage);
// Whether stage `stage`'s copy of `spec` is the one counted in the global gradient norm and
// reported (gather_params, digests): every held parameter but the last stage's copy of a tied
// embed.tok (the first stage's copy is counted).
bool stage_reports(const ParamSpec& spec, const StageLayers& stage);

class ShardPlan {
 public:
  // Every parameter of config.model on `mesh`, this rank's master shard initialised (Philox keyed
  // by global element index: only the rows of its box are materialised), moments and gradient
  // zero. The shards live on `device` (docs/design.md section 2 and "Device-resident training
  // state"): the masters are initialised on the host and uploaded once, here.
  // With pipeline stages (mesh pp > 1) only the parameters of the rank's stage
  // (engine/pipeline/pipeline.h stage_layers: model.pp_layers, else the even split), laid out over
  // the stage's dims exactly as on a pp = 1 mesh.
  ShardPlan(const Config& config, const mesh::DeviceMesh& mesh, int rank, const FaultHooks& faults,
            kernels::Device device = kernels::Device::cpu());

  // Where the shards live.
  kernels::Device device() const { return device_; }

  std::vector<ShardedParam>& params() { return params_; }
  const std::vector<ShardedParam>& params() const { return params_; }
  // The rank's pipeline stage (all layers with pp = 1).
  const StageLayers& stage() const { return stage_; }
  // The number of parameters of the whole model (every stage's).
  size_t model_params() const { return model_params_; }
  // Indices into params() of FSDP unit `unit` (engine/model/params.h kRootUnit or a layer).
  const std::vector<size_t>& unit(int64_t unit) const { return units_.at(unit); }
  // Appends model/<param>, optim/<param>/exp_avg and /exp_avg_sq of every parameter, described
  // by their `described` layouts (engine/checkpoint/state_keys.h).
  void add_state_entries(ShardedState& state) const;
  // The kind of the quantized linear `linear` ("layers.0.attn.qkv"), from its weight's spec.
  LinearKind linear_kind(std::string_view linear) const;
  // The quantized linear layers, in canonical order.
  std::vector<std::string> linears() const;

 private:
  kernels::Device device_;
  StageLayers stage_;
  size_t model_params_ = 0;
  std::vector<ShardedParam> params_;
  std::map<int64_t, std::vector<size_t>> units_;
  std::map<std::string, LinearKind, std::less<>> linear_kinds_;
};

}  // namespace meshproof::engine
