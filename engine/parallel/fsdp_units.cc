#include "engine/parallel/fsdp_units.h"

#include <algorithm>
#include <chrono>

#include "engine/parallel/mesh_groups.h"
#include "kernels/core/error.h"
#include "kernels/ops/cast.h"
#include "kernels/ops/elementwise.h"
#include "mesh/core/padded_gather.h"

namespace meshproof::engine {

using kernels::DType;
using kernels::Tensor;
using mesh::Box;
using mesh::DimSet;
using mesh::MeshDim;

FsdpUnitExecutor::FsdpUnitExecutor(const RunOptions& options, ShardPlan& plan, Fp8WeightStore& fp8,
                                   mesh::RankComms& comms, Fp8Recipe& recipe,
                                   const FaultHooks& faults, kernels::Device device)
    : options_(options),
      plan_(plan),
      fp8_(fp8),
      comms_(comms),
      recipe_(recipe),
      faults_(faults),
      device_(device) {
  for (size_t i = 0; i < plan_.params().size(); ++i)
    if (plan_.params()[i].spec.tied_head) tied_ = i;
}

void FsdpUnitExecutor::begin_step(int64_t step) {
  step_ = step;
  weights_ = TensorMap{};
  grads_ = TensorMap{};
  gathered_bytes_.clear();
  gathered_now_ = 0;
}

void FsdpUnitExecutor::begin_micro_batch(bool first, bool last) {
  first_micro_batch_ = first;
  last_micro_batch_ = last;
}

void FsdpUnitExecutor::end_step() {
  MP_CHECK(grads_.names().empty() && weights_.names().empty(),
           "session: {} gradients and {} weights left unreleased after the backward",
           grads_.names().size(), weights_.names().size());
}

void FsdpUnitExecutor::discard_gradients() {
  const bool stages = comms_.mesh().size(MeshDim::kPp) > 1;
  for (ShardedParam& p : plan_.params()) {
    if (!grads_.contains(p.spec.name)) continue;
    // A tied embed.tok under stages is reduced after the schedule (sync_tied_embedding), not by
    // the last backward's deferred reduction: it keeps its accumulators.
    if (stages && p.spec.tied_head) continue;
    kernels::scale_(p.grad, 0.0);
    grads_.erase(p.spec.name);
  }
}

// Gathers the compute weights of `unit` that are not held (before its first use in a pass) and,
// in the backward, makes its gradient accumulators available.
void FsdpUnitExecutor::before(int64_t unit, Pass pass) {
  for (size_t i : plan_.unit(unit)) {
    const std::string& name = plan_.params()[i].spec.name;
    if (!weights_.contains(name)) gather_weight(i);
    if (pass != Pass::kBackward) continue;
    // The gradient has the gathered weight's shape (a weight gathered with its padding has the
    // padding's rows too, dropped before the reduce-scatter). A tied embed.tok has a second
    // accumulator for the LM head's part (engine/model/model.h kTiedHeadGrad) on the last stage;
    // under pipeline stages the last stage, which runs no embedding backward, holds only that one
    // and the first stage only the embedding's (each end stage allocates the [V, H] fp32 buffer it
    // uses).
    const bool tied = plan_.params()[i].spec.tied_head;
    const bool head = tied && plan_.stage().last_stage;
    const bool embedding = !tied || plan_.stage().first_stage;
    std::vector<std::string> keys;
    if (embedding) keys.push_back(name);
    if (head) keys.push_back(kTiedHeadGrad);
    for (const std::string& key : keys) {
      if (!grads_.contains(key)) {
        grads_.insert(key, Tensor::zeros(weights_.at(name).shape(), DType::kFloat32, device_));
      } else if (!first_micro_batch_ &&
                 (!faults_.accumulates_gradients(step_) ||
                  !faults_.pp_accumulates(comms_.mesh().stage(comms_.rank()),
                                          comms_.mesh().size(MeshDim::kPp), step_))) {
        // Deferred sync, the accumulator not kept (a fault): this micro-batch starts from zero.
        grads_.at(key) = Tensor::zeros(weights_.at(name).shape(), DType::kFloat32, device_);
      }
    }
  }
}

// After the forward of a layer: free its gathered weights (reshard_after_forward; the backward
// gathers them again) or keep them. After the backward of a unit: free its weights and, after
// the last micro-batch (deferred sync), reduce its gradients.
void FsdpUnitExecutor::after(int64_t unit, Pass pass) {
  const bool keep =
      pass == Pass::kForward && unit != kRootUnit && !options_.fsdp.reshard_after_forward;
  if (!keep) release_weights(unit);
  if (pass == Pass::kBackward && (last_micro_batch_ || options_.fsdp.sync_each_micro_batch)) {
    const auto t0 = std::chrono::steady_clock::now();
    reduce_gradients(unit);
    reduction_seconds_ +=
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  }
}

void FsdpUnitExecutor::gather_weight(size_t i) {
  const ShardedParam& p = plan_.params()[i];
  int64_t bytes = 0;
  if (fp8_.gathers_fp8() && p.spec.quantized()) {
    // FP8 all-gather: the FP8 bytes + scales of the local shard, quantized once per step (or
    // held as the FP8 primary weight), go to the recipe; the layer code reads only the shape.
    bytes = fp8_.gather(i, step_);
    weights_.insert(p.spec.name, Tensor::empty(p.compute.shape(), DType::kBFloat16, device_));
  } else {
    mesh::Communicator& shard = comms_.group(groups::kDpShard);
    const FaultHooks::CollectiveAction act =
        faults_.collective({.kind = mesh::CollectiveKind::kAllGather,
                            .group = groups::kDpShard,
                            .tensor = p.spec.name,
                            .step = step_});
    // On the masters' device: the gather, the casts and the padding never leave it.
    Tensor full;
    if (!act.run) {
      // Not gathered: only this rank's own rows, the others zero.
      full = Tensor::zeros(p.compute.shape(), DType::kFloat32, p.master.device());
      const Box& mine = p.layout.box(comms_.rank());
      mesh::copy_region(p.master, mine, full, p.compute, mine.intersect(p.compute));
    } else {
      const mesh::CollectiveRecorder::Subject subject(recorder_, p.spec.name);
      // The values travel in the action's dtype (the collective_dtype fault) or as fp32.
      const Tensor local = act.dtype ? kernels::cast_to(p.master, *act.dtype) : p.master;
      full = mesh::gather_padded(shard, shard_boxes(i), local, p.compute,
                                 faults_.weight_gather_padding(p.spec, step_));
      if (act.dtype) full = kernels::cast_to(full, DType::kFloat32);
    }
    if (options_.config.recipe.kind != RecipeKind::kFp32 && !p.spec.fp32_compute)
      full = kernels::cast_to(full, DType::kBFloat16);
    bytes = full.nbytes().value;
    weights_.insert(p.spec.name, full.on(device_));
  }
  gathered_bytes_[p.spec.name] = bytes;
  gathered_now_ += bytes;
  peak_gathered_ = std::max(peak_gathered_, gathered_now_);
}

const std::vector<mesh::Box>& FsdpUnitExecutor::shard_boxes(size_t i) {
  if (shard_boxes_.size() != plan_.params().size()) shard_boxes_.resize(plan_.params().size());
  std::vector<mesh::Box>& b = shard_boxes_[i];
  if (b.empty()) b = mesh::member_boxes(comms_.group(groups::kDpShard), plan_.params()[i].layout);
  return b;
}

void FsdpUnitExecutor::release_weights(int64_t unit) {
  for (size_t i : plan_.unit(unit)) {
    const ShardedParam& p = plan_.params()[i];
    if (!weights_.contains(p.spec.name)) continue;
    weights_.erase(p.spec.name);
    gathered_now_ -= gathered_bytes_.at(p.spec.name);
    if (p.spec.quantized()) recipe_.clear_prequantized_weight(p.spec.linear);
  }
}

// Reduce-scatter (avg) over dp_shard, then all-reduce (avg) over dp_replicate (HSDP), of the
// unit's accumulated gradients; the unsharded gradients are freed. With
// fsdp.sync_each_micro_batch this runs after every micro-batch and the reduced shards of the
// micro-batches after the first are added to the gradient shard (the next micro-batch's
// backward starts from fresh zero gradients).
void FsdpUnitExecutor::reduce_gradients(int64_t unit) {
  const bool stages = comms_.mesh().size(MeshDim::kPp) > 1;
  for (size_t i : plan_.unit(unit)) {
    const ShardedParam& p = plan_.params()[i];
    if (p.spec.tied_head && stages) {
      // After the schedule: sync_tied_embedding. With a reduction per micro-batch this
      // micro-batch's unreduced part is kept (E_i on the first stage, H_i on the last) and the
      // next backward starts a fresh accumulator.
      if (options_.fsdp.sync_each_micro_batch) {
        const std::string own = tied_part_key(p.spec.name);
        tied_parts_.push_back(grads_.at(own));
        grads_.erase(own);
      }
      continue;
    }
    if (p.spec.tied_head) {
      // One stage: the embedding's part plus the head's, E + H, once (engine/model/model.h
      // kTiedHeadGrad), in the operand order both end stages of a pipeline use.
      kernels::add_(grads_.at(p.spec.name), grads_.at(kTiedHeadGrad));
      grads_.erase(kTiedHeadGrad);
    }
    reduce_param(i);
  }
}

std::string FsdpUnitExecutor::tied_part_key(const std::string& name) const {
  return plan_.stage().first_stage ? name : std::string(kTiedHeadGrad);
}

void FsdpUnitExecutor::sync_tied_embedding(bool exchange) {
  const int stages = comms_.mesh().size(MeshDim::kPp);
  if (stages == 1 || !tied_) return;
  const std::string& name = plan_.params()[*tied_].spec.name;
  const bool first = plan_.stage().first_stage;
  // Each end stage's part is the only tied accumulator it holds.
  const std::string own = tied_part_key(name);
  // Deferred sync: one part, accumulated over the micro-batches. fsdp.sync_each_micro_batch: one
  // part per micro-batch, kept by reduce_gradients in micro-batch order (the backwards' order).
  std::vector<Tensor> parts;
  if (options_.fsdp.sync_each_micro_batch) {
    parts = std::move(tied_parts_);
    tied_parts_.clear();
    MP_CHECK(static_cast<int64_t>(parts.size()) == options_.config.training.micro_batches,
             "pipeline stage {}: {} per-micro-batch parts of the tied embedding's gradient for {} "
             "micro-batches",
             comms_.mesh().stage(comms_.rank()), parts.size(),
             options_.config.training.micro_batches);
  } else {
    MP_CHECK(grads_.contains(own),
             "pipeline stage {}: the tied embedding's gradient part was not accumulated this step",
             comms_.mesh().stage(comms_.rank()));
    parts.push_back(grads_.at(own));
    grads_.erase(own);
  }
  const bool first_micro_batch = first_micro_batch_;
  for (size_t mb = 0; mb < parts.size(); ++mb) {
    Tensor part = parts[mb];
    if (exchange) {
      // Between stage 0 and stage pp - 1 with the same (replicate, shard, tp) place: members 0
      // and pp - 1 of the rank's pp group. The first stage sends, then receives; the last
      // receives, then sends, so that rendezvous sends (MPI) cannot wait on each other. Both add
      // E + H with E as the first operand, as one stage does: the same bits (NaN payloads
      // included).
      mesh::Communicator& pp = comms_.group(groups::kPp);
      Tensor other = Tensor::empty(part.shape(), DType::kFloat32, part.device());
      if (first) {
        pp.send(part, stages - 1);
        pp.recv(other, stages - 1);
        kernels::add_(part, other);
      } else {
        pp.recv(other, 0);
        pp.send(part, 0);
        kernels::add_(other, part);
        part = other;
      }
    }
    grads_.erase(name);
    grads_.insert(name, part);
    // reduce_param's per-micro-batch rule: the first micro-batch's reduced part replaces the
    // gradient shard, the later ones add to it, in micro-batch order as with one stage.
    first_micro_batch_ = mb == 0;
    reduce_param(*tied_);
  }
  first_micro_batch_ = first_micro_batch;
}

void FsdpUnitExecutor::reduce_param(size_t i) {
  mesh::Communicator& shard = comms_.group(groups::kDpShard);
  mesh::Communicator& replicate = comms_.group(groups::kDpReplicate);
  const bool over_replicas = faults_.gradient_replicas(step_);
  // Sequence parallelism: gradients of TP-replicated parameters are partial sums over the
  // sequence shards of the tp ranks.
  const bool sp = options_.mesh.sequence_parallel && comms_.mesh().size(MeshDim::kTp) > 1;
  ShardedParam& p = plan_.params()[i];
  Tensor& g = grads_.at(p.spec.name);
  const mesh::CollectiveRecorder::Subject subject(recorder_, p.spec.name);
  const auto runs = [&](mesh::CollectiveKind kind, DimSet group) {
    return faults_.collective({.kind = kind, .group = group, .tensor = p.spec.name, .step = step_})
        .run;
  };
  if (sp && !p.layout.placement(MeshDim::kTp).is_shard() &&
      runs(mesh::CollectiveKind::kAllReduce, groups::kTp))
    comms_.group(groups::kTp).all_reduce(g, mesh::ReduceOp::kSum);
  // A gradient of a weight gathered with its padding: the padding's rows are dropped here.
  const Tensor real =
      g.shape()[0] == p.compute.extent[0].value ? g : g.slice_rows(0, p.compute.extent[0].value);
  // On the gradient shard's device (the rank's compute device when the state is resident).
  Tensor reduced = mesh::reduce_scatter_box(
      shard, p.layout, real.on(p.grad.device()), p.compute, mesh::ReduceOp::kAvg,
      runs(mesh::CollectiveKind::kReduceScatter, groups::kDpShard));
  if (replicate.size() > 1 && over_replicas && reduced.numel().value > 0 &&
      runs(mesh::CollectiveKind::kAllReduce, groups::kDpReplicate))
    replicate.all_reduce(reduced, mesh::ReduceOp::kAvg);
  if (!options_.fsdp.sync_each_micro_batch || first_micro_batch_ || reduced.numel().value == 0 ||
      !faults_.accumulates_gradients(step_)) {
    p.grad = std::move(reduced);
  } else {
    kernels::add_(p.grad, reduced);
  }
  grads_.erase(p.spec.name);
}

}  // namespace meshproof::engine
