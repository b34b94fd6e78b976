#include "harness/train_run.h"

#include <fmt/format.h>

#include <chrono>

#include "engine/trainer.h"
#include "kernels/error.h"
#include "kernels/runtime.h"

namespace meshproof::harness {

engine::Config to_engine_config(const Scenario& s) {
  engine::Config c;
  c.model.vocab = s.model.vocab;
  c.model.hidden = s.model.hidden;
  c.model.heads = s.model.heads;
  c.model.layers = s.model.layers;
  c.model.ffn = s.model.ffn;
  c.model.max_positions = s.model.seq_len;
  c.model.norm =
      s.model.norm == Norm::kRmsNorm ? engine::NormKind::kRmsNorm : engine::NormKind::kLayerNorm;
  switch (s.model.activation) {
    case Activation::kGelu:
      c.model.activation = engine::Activation::kGelu;
      break;
    case Activation::kRelu:
      c.model.activation = engine::Activation::kRelu;
      break;
    case Activation::kSwiglu:
      c.model.activation = engine::Activation::kSwiGlu;
      break;
  }
  c.model.tied_embeddings = s.model.tied_embeddings;
  c.model.dropout = s.model.dropout;

  switch (s.recipe.name) {
    case RecipeKind::kFp32:
      c.recipe.kind = engine::RecipeKind::kFp32;
      break;
    case RecipeKind::kBf16:
      c.recipe.kind = engine::RecipeKind::kBf16;
      break;
    case RecipeKind::kDelayed:
      c.recipe.kind = engine::RecipeKind::kDelayed;
      break;
    case RecipeKind::kCurrent:
      c.recipe.kind = engine::RecipeKind::kCurrent;
      break;
    case RecipeKind::kMxfp8:
      c.recipe.kind = engine::RecipeKind::kMxfp8;
      break;
    case RecipeKind::kBlock:
      c.recipe.kind = engine::RecipeKind::kBlock;
      break;
  }
  c.recipe.amax_history_len = s.recipe.amax_history_len;
  c.recipe.amax_compute_algo =
      s.recipe.amax_compute_algo == AmaxAlgo::kMostRecent ? "most_recent" : "max";
  c.recipe.margin = s.recipe.margin;
  c.recipe.power_2_scale = s.recipe.power_2_scale;
  MP_CHECK_INPUT(s.recipe.eps == 0.0,
                 "{}: recipe.eps = {} is not supported by the engine (current scaling uses "
                 "amax 0 -> scale 1)",
                 s.name, s.recipe.eps);

  c.training.batch = s.train.global_batch;
  c.training.seq_len = s.model.seq_len;
  c.training.steps = s.train.steps;
  c.training.micro_batches = s.train.micro_batches;
  c.training.lr = s.train.lr;
  c.training.min_lr = s.train.min_lr;
  c.training.warmup_steps = s.train.warmup_steps;
  c.training.schedule = s.train.schedule == Schedule::kWarmupCosine
                            ? engine::LrSchedule::kWarmupCosine
                            : engine::LrSchedule::kConstant;
  c.training.beta1 = s.train.beta1;
  c.training.beta2 = s.train.beta2;
  c.training.adam_eps = s.train.adam_eps;
  c.training.weight_decay = s.train.weight_decay;
  c.training.max_grad_norm = s.train.max_grad_norm;
  c.training.recompute = s.train.recompute;
  c.data.markov_order = s.data.order;
  c.seed = s.train.seed;
  engine::validate(c);
  return c;
}

engine::FaultInjection to_fault_injection(const std::vector<FaultSpec>& faults) {
  engine::FaultInjection f;
  int64_t from = -1;
  for (const FaultSpec& spec : faults) {
    auto it = spec.int_params.find("from_step");
    const int64_t fs = it == spec.int_params.end() ? 1 : it->second;
    // One FaultInjection has one from_step: the earliest of the injected faults.
    from = from < 0 ? fs : std::min(from, fs);
    if (spec.name == "amax_not_reduced") {
      f.amax_not_reduced = true;
    } else if (spec.name == "tp_fsdp_left_to_right") {
      f.tp_fsdp_left_to_right = true;
    } else if (spec.name == "fp8_state_dropped_from_checkpoint") {
      f.fp8_state_dropped_from_checkpoint = true;
    } else if (spec.name == "scale_inv_saved_bf16") {
      f.scale_inv_saved_bf16 = true;
    } else if (spec.name == "stale_columnwise_copy") {
      f.stale_columnwise_copy = true;
      auto layer = spec.int_params.find("layer");
      if (layer != spec.int_params.end()) f.stale_columnwise_layer = layer->second;
    } else if (spec.name == "data_cursor_not_restored") {
      f.data_cursor_not_restored = true;
    } else if (spec.name == "optimizer_state_not_restored") {
      f.optimizer_state_not_restored = true;
      auto part = spec.string_params.find("state");
      if (part != spec.string_params.end()) f.optimizer_state_part = part->second;
    } else if (spec.name == "hsdp_replicas_not_reduced") {
      f.hsdp_replicas_not_reduced = true;
    } else if (spec.name == "uneven_shard_padding_leak") {
      f.uneven_shard_padding_leak = true;
    } else {
      MP_FAIL_INPUT("fault {}: not known to the engine", spec.name);
    }
  }
  f.from_step = from < 1 ? 0 : from - 1;
  return f;
}

bool can_execute(const Scenario& s, std::string* why) {
  if (s.mesh.world_size() != 1) {
    *why = fmt::format(
        "mesh {} needs the sharded engine (engine/session.h), which this build does not have; "
        "only 1-rank meshes run",
        describe_mesh(s.mesh));
    return false;
  }
  if (s.launcher == Launcher::kMpi) {
    *why = "launcher mpi needs the sharded engine (engine/session.h), not in this build";
    return false;
  }
  if (!s.faults.empty()) {
    *why = "fault injection needs the sharded engine (engine/session.h), not in this build";
    return false;
  }
  return true;
}

TrainOutcome train_scenario(const Scenario& s, const TrainRequest& request) {
  std::string why;
  if (!can_execute(s, &why)) MP_FAIL("{}: {}", s.name, why);
  engine::Config config = to_engine_config(s);
  const int64_t steps = request.steps < 0 ? s.train.steps : request.steps;
  config.training.steps = s.train.steps;  // the schedule always spans the planned run

  kernels::MemoryTracker tracker;
  kernels::RankContext ctx;
  ctx.rank = 0;
  ctx.memory = &tracker;
  kernels::ScopedRankContext scope(ctx);

  TrainOutcome out;
  out.device = "cpu";
  engine::Trainer trainer(config);
  for (int64_t i = 0; i < steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    const engine::StepMetrics m = trainer.step();
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    reports::StepMetrics r;
    r.step = m.step + 1;
    r.loss = m.loss;
    r.grad_norm = m.grad_norm;
    r.lr = m.lr;
    r.tokens = s.train.global_batch * s.model.seq_len;
    r.time.total_s = dt;
    out.steps.push_back(r);
    if (request.on_step) request.on_step(r, steps);
  }
  out.final_params = trainer.params();

  reports::RankMemory mem;
  mem.rank = 0;
  for (const std::string& n : out.final_params.names()) {
    const int64_t b = out.final_params.at(n).nbytes().value;
    mem.params_bytes += b;
    mem.grads_bytes += b;
    mem.optimizer_bytes += 2 * b;
  }
  mem.peak_bytes = tracker.peak(kernels::DeviceType::kCpu).value;
  out.memory.push_back(mem);
  return out;
}

}  // namespace meshproof::harness
