// The FSDP unit executor of a training session (docs/design.md sections 5 and 20): the model's
// per-unit hooks (engine/model/model.h UnitHooks). Before a unit's first use in a pass it gathers
// the unit's compute weights over dp_shard (high precision through mesh::gather_padded, GEMM
// weights through the FP8 weight store when it gathers FP8) and, in the backward, provides its
// gradient accumulators; after a layer's forward it frees the gathered weights
// (reshard_after_forward) or keeps them; after a unit's backward it frees them and, in the last
// micro-batch (or every one with fsdp.sync_each_micro_batch), reduce-scatters (avg) its gradients
// over dp_shard and all-reduces (avg) them over dp_replicate into the plan's gradient shards.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "engine/faults/fault_hooks.h"
#include "engine/model/model.h"
#include "engine/model/params.h"
#include "engine/parallel/fp8_weights.h"
#include "engine/parallel/shard_plan.h"
#include "engine/session/session.h"
#include "mesh/core/collective_recorder.h"
#include "mesh/core/communicator.h"

namespace meshproof::engine {

class FsdpUnitExecutor : public UnitHooks {
 public:
  FsdpUnitExecutor(const RunOptions& options, ShardPlan& plan, Fp8WeightStore& fp8,
                   mesh::RankComms& comms, Fp8Recipe& recipe, const FaultHooks& faults,
                   kernels::Device device);

  // At a step's start: nothing gathered, no gradient accumulators.
  void begin_step(int64_t step);
  void begin_micro_batch(bool first, bool last);
  // After the step's backward: checks that every weight and gradient was released.
  void end_step();
  // Drops the gradient accumulators still held without reducing them and zeroes their shards:
  // what a deferred reduction that never ran leaves (the pp_last_backward_sync_skipped fault,
  // docs/design.md section 33).
  void discard_gradients();
  // Tied embeddings under pipeline stages (docs/design.md section 33), after the stage's schedule
  // of the step: the first and the last stage hold embed.tok's unreduced gradient parts, the
  // embedding backward's E and the LM head's H; each sends its part to the other over the pp
  // group and both add E + H (the one-stage sum, same operand order), then reduce it as the
  // deferred reduction does. With `exchange` false (the pp_tied_embedding_grad_not_synced fault)
  // each reduces only its own part. A no-op with one stage, untied embeddings or a middle stage.
  // Runs after the schedule, not inside the last backward: the last stage's last backward comes
  // before the first stage's, which waits for that backward's output. With
  // fsdp.sync_each_micro_batch the parts are per micro-batch (kept by the backwards), exchanged
  // and reduced one micro-batch after the other, in micro-batch order: E_i + H_i, the one-stage
  // per-micro-batch rule.
  void sync_tied_embedding(bool exchange);

  // The maps the model reads weights from and accumulates gradients into.
  TensorMap& weights() { return weights_; }
  TensorMap& grads() { return grads_; }
  // The largest number of gathered weight bytes held at once so far.
  int64_t peak_gathered_bytes() const { return peak_gathered_; }
  // Wall seconds spent reducing gradients (reduce-scatter over dp_shard, all-reduce over
  // dp_replicate, and their copies) since construction: the pipeline report's deferred reduction
  // (docs/design.md section 38).
  double reduction_seconds() const { return reduction_seconds_; }

  // Records the executor's collectives, each with the parameter it serves (nullptr: off).
  void set_recorder(mesh::CollectiveRecorder* r) { recorder_ = r; }

  void before(int64_t unit, Pass pass) override;
  void after(int64_t unit, Pass pass) override;

 private:
  // The key of this end stage's accumulator of the tied embed.tok under pipeline stages: the
  // embedding backward's part E (the parameter's own key) on the first stage, the LM head's H
  // (engine/model/model.h kTiedHeadGrad) on the last.
  std::string tied_part_key(const std::string& name) const;
  void gather_weight(size_t i);
  void release_weights(int64_t unit);
  void reduce_gradients(int64_t unit);
  // The reduction of parameter i's accumulated gradient (reduce_gradients' body).
  void reduce_param(size_t i);
  // The dp_shard members' boxes of parameter i (mesh::member_boxes), computed on first use and
  // kept: a layout never changes within a session, and every step gathers every parameter.
  const std::vector<mesh::Box>& shard_boxes(size_t i);

  const RunOptions& options_;
  ShardPlan& plan_;
  Fp8WeightStore& fp8_;
  mesh::RankComms& comms_;
  Fp8Recipe& recipe_;
  const FaultHooks& faults_;
  kernels::Device device_;
  int64_t step_ = 0;
  bool first_micro_batch_ = false, last_micro_batch_ = false;
  // Gathered compute weights and unsharded fp32 gradients of the units in use, and the bytes of
  // the gathered weights held.
  TensorMap weights_, grads_;
  std::map<std::string, int64_t> gathered_bytes_;
  int64_t gathered_now_ = 0;
  int64_t peak_gathered_ = 0;
  double reduction_seconds_ = 0;
  mesh::CollectiveRecorder* recorder_ = nullptr;
  std::vector<std::vector<mesh::Box>> shard_boxes_;  // by parameter index; empty: not yet made
  // The plan index of a tied embed.tok (ParamSpec::tied_head), if the stage holds it.
  std::optional<size_t> tied_;
  // Tied embed.tok under stages with fsdp.sync_each_micro_batch: this end stage's unreduced part
  // of each micro-batch's gradient (E_i on the first stage, H_i on the last), in micro-batch
  // order, held until sync_tied_embedding exchanges and reduces them after the schedule: m fp32
  // [V, H] buffers per end stage (docs/design.md section 33).
  std::vector<kernels::Tensor> tied_parts_;
};

}  // namespace meshproof::engine
