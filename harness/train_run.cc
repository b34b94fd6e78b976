#include "harness/train_run.h"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>

#include "engine/checkpoint.h"
#include "engine/session.h"
#include "harness/scenario_faults.h"
#include "kernels/error.h"
#include "kernels/runtime.h"
#include "reports/perf_metrics.h"

namespace meshproof::harness {

engine::Config to_engine_config(const Scenario& s) {
  engine::Config c;
  c.model.vocab = s.model.vocab;
  c.model.hidden = s.model.hidden;
  c.model.heads = s.model.heads;
  c.model.layers = s.model.layers;
  c.model.ffn = s.model.ffn;
  c.model.max_positions = s.model.seq_len;
  c.model.norm = s.model.norm;  // the scenario uses the engine's enums (harness/scenario.h)
  c.model.activation = s.model.activation;
  c.model.tied_embeddings = s.model.tied_embeddings;
  c.model.dropout = s.model.dropout;

  c.recipe.kind = s.recipe.name;
  c.recipe.amax_history_len = s.recipe.amax_history_len;
  c.recipe.amax_compute_algo =
      s.recipe.amax_compute_algo == AmaxAlgo::kMostRecent ? "most_recent" : "max";
  c.recipe.margin = s.recipe.margin;
  c.recipe.fp8_format = s.recipe.fp8_format;  // the loader resolved the recipe defaults
  c.recipe.power_2_scale = s.recipe.power_2_scale;
  c.recipe.eps = s.recipe.eps;

  c.training.batch = s.train.global_batch;
  c.training.seq_len = s.model.seq_len;
  c.training.steps = s.train.steps;
  c.training.micro_batches = s.train.micro_batches;
  c.training.lr = s.train.lr;
  c.training.min_lr = s.train.min_lr;
  c.training.warmup_steps = s.train.warmup_steps;
  c.training.schedule = s.train.schedule;
  c.training.beta1 = s.train.beta1;
  c.training.beta2 = s.train.beta2;
  c.training.adam_eps = s.train.adam_eps;
  c.training.weight_decay = s.train.weight_decay;
  c.training.max_grad_norm = s.train.max_grad_norm;
  c.training.recompute = s.train.recompute;
  c.data.markov_order = s.data.order;
  c.data.seed = s.data.seed;
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

namespace {

// Faults whose engine side exists in this build. The others are refused (a fault that is not
// injected would make its scenario "not caught" for the wrong reason).
bool fault_implemented(const std::string& name) {
  return name == "hsdp_replicas_not_reduced" || name == "amax_not_reduced" ||
         name == "stale_columnwise_copy" || name == "tp_fsdp_left_to_right" ||
         name == "fp8_state_dropped_from_checkpoint" || name == "scale_inv_saved_bf16" ||
         name == "data_cursor_not_restored" || name == "optimizer_state_not_restored" ||
         name == "uneven_shard_padding_leak";
}

int group_size(const std::string& group, const MeshConfig& m) {
  int n = 1;
  size_t begin = 0;
  while (begin <= group.size()) {
    const size_t end = std::min(group.find('+', begin), group.size());
    const std::string dim = group.substr(begin, end - begin);
    if (dim == "dp_replicate") n *= static_cast<int>(m.dp_replicate);
    if (dim == "dp_shard") n *= static_cast<int>(m.dp_shard);
    if (dim == "tp") n *= static_cast<int>(m.tp);
    begin = end + 1;
  }
  return n;
}

}  // namespace

bool can_execute(const Scenario& s, std::string* why) {
  for (const FaultSpec& f : s.faults) {
    if (!fault_implemented(f.name)) {
      *why = fmt::format("fault {} has no engine side in this build", f.name);
      return false;
    }
  }
  return true;
}

bool fault_runnable(const std::string& name, std::string* why) {
  if (!fault_implemented(name)) {
    *why = fmt::format("fault {} has no engine side in this build", name);
    return false;
  }
  return true;
}

engine::RunOptions make_run_options(const Scenario& s, const TrainRequest& request) {
  engine::RunOptions o;
  o.config = to_engine_config(s);
  o.mesh.dp_replicate = static_cast<int>(s.mesh.dp_replicate);
  o.mesh.dp_shard = static_cast<int>(s.mesh.dp_shard);
  o.mesh.tp = static_cast<int>(s.mesh.tp);
  o.mesh.sequence_parallel = s.mesh.sequence_parallel;
  o.fsdp.reshard_after_forward = s.fsdp.reshard_after_forward;
  o.fsdp.fp8_all_gather = s.fsdp.fp8_all_gather;
  o.fsdp.fp8_params = s.fsdp.fp8_params;
  o.fsdp.sync_each_micro_batch = s.fsdp.sync_each_micro_batch;
  // The runner resolves auto before it gets here (harness/runner.h resolve_backend).
  MP_CHECK(s.backend != Backend::kAuto, "{}: backend auto reached the engine unresolved", s.name);
  o.backend = s.backend == Backend::kCuda ? kernels::Device::cuda(0) : kernels::Device::cpu();
  o.launcher = s.launcher == Launcher::kMpi ? "mpi" : "local";
  o.faults = request.faults;
  o.steps = request.steps < 0 ? s.train.steps : request.steps;
  o.trace = request.trace;
  o.allgather_parity = request.allgather_parity;
  return o;
}

TrainOutcome train_scenario(const Scenario& s, const TrainRequest& request) {
  std::string why;
  if (!can_execute(s, &why)) MP_FAIL("{}: {}", s.name, why);
  engine::RunOptions o = make_run_options(s, request);
  const int64_t steps = o.steps;
  const int64_t tokens = s.train.global_batch * s.model.seq_len;
  // Step wall clock as the caller sees it (rank 0 calls on_step after each step).
  auto last = std::chrono::steady_clock::now();
  if (request.on_step) {
    o.on_step = [&](const engine::StepMetrics& m) {
      reports::StepMetrics r;
      r.step = m.step + 1;
      r.loss = m.loss;
      r.grad_norm = m.grad_norm;
      r.lr = m.lr;
      r.tokens = tokens;
      const auto now = std::chrono::steady_clock::now();
      r.time.total_s = std::chrono::duration<double>(now - last).count();
      last = now;
      request.on_step(r, steps);
    };
  }
  engine::RunResult res = engine::run_training(o);

  TrainOutcome out;
  out.device = o.backend.str();
  for (size_t i = 0; i < res.metrics.size(); ++i) {
    const engine::StepMetrics& m = res.metrics[i];
    reports::StepMetrics r;
    r.step = m.step + 1;
    r.loss = m.loss;
    r.grad_norm = m.grad_norm;
    r.lr = m.lr;
    r.tokens = tokens;
    if (i < res.times.size()) {
      const engine::StepTime& t = res.times[i];
      r.time.total_s = t.total;
      r.time.compute_s = t.compute;
      r.time.optimizer_s = t.optimizer;
      for (const auto& [kind, sec] : t.collectives) {
        r.time.collectives.push_back({reports::parse_collective(kind), sec});
      }
    }
    out.steps.push_back(r);
  }
  // Final parameters in canonical order.
  for (const engine::ParamSpec& spec : engine::param_specs(o.config.model)) {
    auto it = res.final_params.find(spec.name);
    MP_CHECK(it != res.final_params.end(), "{}: the engine returned no final {}", s.name,
             spec.name);
    out.final_params.insert(spec.name, it->second);
  }
  for (const engine::RankReport& rr : res.ranks) {
    reports::RankMemory mem;
    mem.rank = rr.rank;
    mem.params_bytes = rr.memory.params;
    mem.grads_bytes = rr.memory.grads;
    mem.optimizer_bytes = rr.memory.optimizer;
    mem.gathered_weights_bytes = rr.memory.gathered_weights;
    mem.activations_bytes = rr.memory.activations;
    mem.peak_bytes = rr.memory.peak;
    out.memory.push_back(mem);
    if (rr.rank != 0) continue;
    for (const engine::CollectiveRecord& c : rr.collectives) {
      reports::CollectiveStats st;
      st.kind = reports::parse_collective(c.kind);
      st.group = c.group;
      st.group_size = group_size(c.group, s.mesh);
      st.count = c.count;
      st.bytes = c.bytes;
      st.time_s = c.seconds;
      reports::fill_bandwidths(st);
      out.collectives.push_back(st);
    }
  }
  out.notes = std::move(res.notes);
  out.trace = std::move(res.trace);
  out.parity = std::move(res.parity);
  return out;
}

TrainOutcome resume_scenario(const Scenario& s, const ResumeRequest& request) {
  std::string why;
  if (!can_execute(s, &why)) MP_FAIL("{}: {}", s.name, why);
  MP_CHECK(request.at_step >= 1 && request.at_step < s.train.steps,
           "{}: resume at step {} outside [1, {})", s.name, request.at_step, s.train.steps);
  TrainRequest tr;
  tr.faults = request.faults;
  const engine::RunOptions first = make_run_options(s, tr);
  Scenario resumed = s;
  if (request.mesh) resumed.mesh = *request.mesh;
  if (!can_execute(resumed, &why)) MP_FAIL("{}: resume mesh: {}", s.name, why);
  const engine::RunOptions second = make_run_options(resumed, tr);

  engine::CheckpointOptions co;
  co.keep_last = static_cast<int>(request.keep_last);
  co.scenario_hash = scenario_hash_hex(s);
  co.faults = request.faults;
  const int64_t tokens = s.train.global_batch * s.model.seq_len;
  TrainOutcome out;
  out.device = first.backend.str();
  auto record = [&](const engine::StepMetrics& m, int64_t step) {
    reports::StepMetrics r;
    r.step = step;
    r.loss = m.loss;
    r.grad_norm = m.grad_norm;
    r.lr = m.lr;
    r.tokens = tokens;
    out.steps.push_back(r);
    if (request.on_step) request.on_step(r, s.train.steps);
  };
  // With tracing, both halves digest every step like engine::run_training (collective).
  auto trace_step = [&](engine::TrainingSession& session, mesh::RankComms& comms) {
    if (!request.trace) return;
    std::vector<engine::TensorDigest> d = session.digests();
    if (s.launcher == Launcher::kMpi || comms.rank() == 0) out.trace.push_back(std::move(d));
  };

  // The global results are rank 0's; with launcher mpi every process is the only rank it has
  // and holds them (engine::run_on_ranks).
  const bool mpi = s.launcher == Launcher::kMpi;
  auto lead = [&](const mesh::RankComms& comms) { return mpi || comms.rank() == 0; };
  // Run to at_step on the scenario's mesh and save.
  std::filesystem::path saved;
  engine::run_on_ranks(first, [&](mesh::RankComms& comms) {
    engine::TrainingSession session(first, comms);
    for (int64_t i = 0; i < request.at_step; ++i) {
      const engine::StepMetrics m = session.step();
      trace_step(session, comms);
      if (lead(comms)) record(m, i + 1);
    }
    const std::filesystem::path dir = engine::save_checkpoint(
        request.checkpoint_root, request.at_step, session.state(), comms, co);
    if (lead(comms)) saved = dir;
  });
  // A fresh engine (on the resume mesh), load, finish.
  std::map<std::string, kernels::Tensor> final_params;
  engine::run_on_ranks(
      second,
      [&](mesh::RankComms& comms) {
        engine::TrainingSession session(second, comms);
        engine::load_checkpoint(saved, session.state(), comms, co);
        session.load_scalars();
        for (int64_t i = request.at_step; i < s.train.steps; ++i) {
          const engine::StepMetrics m = session.step();
          trace_step(session, comms);
          if (lead(comms)) record(m, i + 1);
        }
        std::map<std::string, kernels::Tensor> p = session.gather_params();
        if (lead(comms)) {
          for (auto& [name, t] : p) final_params[name] = t;
        }
      },
      [&] {
        // Tensors made on a rank thread are accounted to that rank's tracker, which dies with
        // the world: copy them into this thread's context while the world is still alive.
        for (const engine::ParamSpec& spec : engine::param_specs(first.config.model)) {
          auto it = final_params.find(spec.name);
          MP_CHECK(it != final_params.end(), "{}: the resumed engine returned no final {}", s.name,
                   spec.name);
          out.final_params.insert(spec.name, it->second.clone());
        }
        final_params.clear();
      });
  out.notes.push_back(fmt::format("resume: saved {} after step {}, resumed on {}", saved.string(),
                                  request.at_step, describe_mesh(resumed.mesh)));
  return out;
}

}  // namespace meshproof::harness
