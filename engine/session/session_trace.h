// Tracing and timing of a training session (docs/design.md sections 16 and 20): global fp32
// digests of the gradients, weights and FP8 state (RunOptions::trace), and the seconds spent in
// collectives per kind (StepTime). Everything here reads the session's state; nothing writes it.
#pragma once

#include <map>
#include <string>
#include <vector>

#include "engine/checkpoint/sharded_state.h"
#include "engine/parallel/shard_plan.h"
#include "engine/session/session.h"
#include "kernels/core/tensor.h"
#include "mesh/core/communicator.h"

namespace meshproof::engine {

// Digest of a global fp32 tensor: XXH64 (seed 0) of its bytes, sum, L2 norm and the values.
TensorDigest digest(const std::string& name, const kernels::Tensor& t);

// Every parameter's global fp32 master weight (grad: reduced gradient) gathered over the whole
// mesh (collective), keyed by parameter name, on the host (gathered where the shards live).
std::map<std::string, kernels::Tensor> gather_global(const ShardPlan& plan, mesh::RankComms& comms,
                                                     bool grad);

// Global fp32 digests of the FP8 state entries (checkpoint keys fp8/...), named prefix + key, in
// the order a step uses them: per quantized linear in forward order, the delayed-scaling scale
// and amax history of its input, weight and grad_output, then its FP8 primary weight (data and
// scale_inv); any other fp8/ entry after them in state order. FP8 codes and e8m0 scales are
// decoded to the value each code stands for (not dequantized by a scale). Collective.
std::vector<TensorDigest> fp8_state_digests(const ShardPlan& plan, const ShardedState& state,
                                            mesh::RankComms& comms, const std::string& prefix);

// Every non-empty group of mesh dims (collective statistics: the amax groups may be any of them).
const std::vector<mesh::DimSet>& all_mesh_groups();
// Seconds spent so far in every collective of every group, per collective kind.
std::map<std::string, double> collective_seconds(mesh::RankComms& comms);
// The same, all kinds together.
double all_collective_seconds(mesh::RankComms& comms);

}  // namespace meshproof::engine
