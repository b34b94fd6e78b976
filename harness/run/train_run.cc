#include "harness/run/train_run.h"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <exception>
#include <string_view>

#include "engine/checkpoint/checkpoint.h"
#include "engine/parallel/mesh_groups.h"
#include "engine/pipeline/pipeline.h"
#include "engine/session/session.h"
#include "harness/checks/golden.h"
#include "kernels/core/error.h"
#include "kernels/core/runtime.h"
#include "mesh/core/agreement.h"
#include "reports/record/perf_metrics.h"

namespace meshproof::harness {
namespace fs = std::filesystem;

engine::Config to_engine_config(const Scenario& s) {
  engine::Config c = engine_config_of(s);
  engine::validate(c);
  return c;
}

engine::Config engine_config_of(const Scenario& s) { return s.config(); }

engine::RunOptions engine_run_options(const Scenario& s) {
  // The scenario holds the engine's own objects (harness/scenario/scenario.h): nothing to map.
  engine::RunOptions o;
  o.config = s.config();
  o.mesh = s.mesh;
  o.fsdp = s.fsdp;
  o.launcher = to_string(s.launcher);
  return o;
}

namespace {

int group_size(const std::string& group, const engine::MeshSpec& m) {
  int n = 1;
  size_t begin = 0;
  while (begin <= group.size()) {
    const size_t end = std::min(group.find('+', begin), group.size());
    const std::string dim = group.substr(begin, end - begin);
    if (dim == "dp_replicate") n *= m.dp_replicate;
    if (dim == "dp_shard") n *= m.dp_shard;
    if (dim == "tp") n *= m.tp;
    begin = end + 1;
  }
  return n;
}

// A step's report row (no timing): the 1-based step, loss, grad norm, LR and the global tokens.
reports::StepMetrics step_row(const engine::StepMetrics& m, int64_t tokens) {
  reports::StepMetrics r;
  r.step = m.step + 1;
  r.loss = m.loss;
  r.grad_norm = m.grad_norm;
  r.lr = m.lr;
  r.tokens = tokens;
  return r;
}

// Runs `fn` on rank 0 alone (paths every rank shares: creating a folder, pruning checkpoints), then
// every rank of every stage agrees on the outcome (mesh/core/agreement.h): a failure on rank 0
// makes every rank throw at once, instead of some ranks failing while the others block forever in
// the next collective (issue #18). On success every rank returns fn's value (in [0, 2^24)).
int64_t on_rank0_agreed(mesh::RankComms& comms, const std::function<int64_t()>& fn,
                        std::string_view what) {
  int64_t value = 0;
  std::exception_ptr error;
  if (comms.rank() == 0) error = mesh::capture_error([&] { value = fn(); });
  return mesh::agree_on_outcome(comms.group(engine::groups::all_ranks(comms.mesh())),
                                std::move(error), value, what);
}

engine::CheckpointOptions checkpoint_options(const Scenario& s, const std::string& hash,
                                             const engine::FaultInjection& faults) {
  engine::CheckpointOptions co;
  co.keep_last = 0;  // the harness prunes, and only what the run itself wrote
  co.scenario_hash = hash.empty() ? scenario_hash_hex(s) : hash;
  co.model = model_record(s);
  co.faults = faults;
  return co;
}

// Loads the checkpoint a run starts from into a fresh session's state (collective; every rank).
// A failure (the loader verifies every chunk it reads) sets `failed`: the rank threads' errors
// reach the caller as plain kernels::Error (mesh::LocalWorld rethrows a copy), so the caller turns
// them into CheckpointLoadError with rethrow_load_failure.
void load_start(const fs::path& dir, engine::ShardedState& state, mesh::RankComms& comms,
                const engine::CheckpointOptions& co, std::atomic<bool>& failed) {
  try {
    engine::load_checkpoint(dir, state, comms, co);
  } catch (const kernels::Error&) {
    failed = true;
    throw;
  }
}

// Runs `fn`; a kernels::Error it throws after the start load failed is a CheckpointLoadError.
template <typename Fn>
void rethrow_load_failure(const std::atomic<bool>& failed, Fn&& fn) {
  try {
    fn();
  } catch (const kernels::Error& e) {
    if (failed) throw CheckpointLoadError(e);
    throw;
  }
}

// A fresh folder `base` (or base.<k>, the smallest k >= 2 free) under `root` for a check's
// checkpoints. Rank 0 alone creates it (create_directory fails on an existing one, so the suffix
// search never reuses a folder), every rank learns its suffix from the agreement.
// The first half of a check's own run on this rank: `session` (fresh) starts from `from` when
// given (its scalars loaded) and trains to step `at_step`, calling each_step(metrics) after every
// step.
template <class EachStep>
void train_until(engine::TrainingSession& session, mesh::RankComms& comms, const fs::path& from,
                 const engine::CheckpointOptions& co, std::atomic<bool>& load_failed,
                 int64_t at_step, EachStep each_step) {
  if (!from.empty()) {
    load_start(from, session.state(), comms, co, load_failed);
    session.load_scalars();
  }
  while (session.steps_done() < at_step) each_step(session.step());
}

fs::path create_check_folder(mesh::RankComms& comms, const fs::path& root, const std::string& base,
                             std::string_view check) {
  const int64_t suffix = on_rank0_agreed(
      comms,
      [&]() -> int64_t {
        std::error_code ec;
        fs::create_directories(root, ec);
        MP_CHECK(!ec, "cannot create checkpoint root {}: {}", root.string(), ec.message());
        for (int64_t k = 1; k < 10000; ++k) {
          const fs::path p = root / (k == 1 ? base : fmt::format("{}.{}", base, k));
          if (fs::create_directory(p, ec)) return k;
          MP_CHECK(!ec || ec == std::errc::file_exists, "cannot create {}: {}", p.string(),
                   ec.message());
        }
        MP_FAIL("{}: 9999 folders {}.* exist already; remove old ones", root.string(), base);
      },
      fmt::format("creating the {} check's folder", check));
  return root / (suffix == 1 ? base : fmt::format("{}.{}", base, suffix));
}

}  // namespace

fs::path checkpoint_root(const Scenario& s, const fs::path& out_dir) {
  // The default is derived from the scenario's name, so it must stay inside --out.
  return s.checkpoint.dir.empty()
             ? path_inside(out_dir, fs::path(golden_scenario_dir(s.name)) / "checkpoints")
             : fs::path(s.checkpoint.dir);
}

void check_checkpoint_root_unused(const Scenario& s, const fs::path& root) {
  if (s.checkpoint.every <= 0 || !fs::is_directory(root)) return;
  for (const auto& d : fs::directory_iterator(root)) {
    const std::string name = d.path().filename().string();
    MP_CHECK_INPUT(name.rfind("step_", 0) != 0,
                   "{}: checkpoint.every = {} would write into {}, which already holds {} from "
                   "another run (a run never overwrites or prunes checkpoints it did not write): "
                   "pass another --out or set checkpoint.dir",
                   s.name, s.checkpoint.every, root.string(), name);
  }
}

std::map<std::string, std::string> model_record(const Scenario& s) {
  std::map<std::string, std::string> out;
  const nlohmann::json canonical = to_canonical_json(s);  // outlives the loop over its items
  for (const auto& [key, value] : canonical.at("model").items()) {
    // The pipeline split is how the run divides the layers, not the model: a checkpoint saved
    // with one split loads with any other (docs/design.md section 33).
    if (key == "pp_layers") continue;
    out["model." + key] = value.dump();
  }
  return out;
}

int64_t check_start_checkpoint(const Scenario& s, const fs::path& dir) {
  // Without the file-size check: a truncated or missing rank file is an integrity failure of the
  // load (exit 1, like `ckpt verify`), not bad input.
  engine::CheckpointIndex index;
  try {
    index = engine::read_checkpoint_index(dir, {.checksum = true, .file_sizes = false});
  } catch (const kernels::Error& e) {
    if (e.kind() != kernels::ErrorKind::kInput) throw;
    MP_FAIL_INPUT("--from-checkpoint: {}", e.message());
  }
  const std::map<std::string, std::string> ours = model_record(s);
  // A checkpoint without a model record (saved by a tool or test) is checked by the load itself
  // (keys, global shapes and dtypes).
  if (!index.model.empty()) {
    for (const auto& [field, value] : ours) {
      const auto it = index.model.find(field);
      MP_CHECK_INPUT(it != index.model.end(),
                     "--from-checkpoint {}: the checkpoint records no {} (scenario {} has {})",
                     dir.string(), field, s.name, value);
      MP_CHECK_INPUT(it->second == value,
                     "--from-checkpoint {}: another model: {} is {} in the checkpoint, {} in "
                     "scenario {}",
                     dir.string(), field, it->second, value, s.name);
    }
    for (const auto& [field, value] : index.model)
      MP_CHECK_INPUT(ours.count(field) != 0,
                     "--from-checkpoint {}: another model: the checkpoint has {} = {}, which "
                     "scenario {} does not have",
                     dir.string(), field, value, s.name);
  }
  MP_CHECK_INPUT(index.step < s.train.steps,
                 "--from-checkpoint {}: the checkpoint is step {}, scenario {} has train.steps = "
                 "{}: nothing left to train",
                 dir.string(), index.step, s.name, s.train.steps);
  return index.step;
}

engine::RunOptions make_run_options(const Scenario& s, const TrainRequest& request) {
  // The engine config is built once; engine::check_run validates it (run_on_ranks and the session).
  engine::RunOptions o = engine_run_options(s);
  // The runner resolves auto before it gets here (harness/run/runner.h resolve_backend).
  MP_CHECK(s.backend != Backend::kAuto, "{}: backend auto reached the engine unresolved", s.name);
  o.backend = s.backend == Backend::kCuda ? kernels::Device::cuda(0) : kernels::Device::cpu();
  o.faults = request.faults;
  o.steps = request.steps < 0 ? s.train.steps : request.steps;
  o.trace = request.trace;
  o.allgather_parity = request.allgather_parity;
  o.record_collectives = request.record_collectives;
  return o;
}

std::vector<reports::PipelineStageRecord> pipeline_stages(const engine::RunResult& result,
                                                          const engine::RunOptions& options) {
  const int pp = options.mesh.pp;
  if (pp <= 1) return {};
  const engine::ScheduleTimeline predicted = engine::simulate_schedule(
      options.config.training.pp_schedule, pp, options.config.training.micro_batches, 1, 2);
  std::vector<reports::PipelineStageRecord> out(static_cast<size_t>(pp));
  std::vector<std::vector<std::vector<reports::PipelinePhases>>> phases(static_cast<size_t>(pp));
  for (const engine::RankReport& rr : result.ranks) {
    const engine::RankPipeline& rp = rr.pipeline;
    MP_CHECK(0 <= rp.stage && rp.stage < pp && !rp.steps.empty(),
             "pipeline report: rank {} reports stage {} with {} steps on {} stages", rr.rank,
             rp.stage, rp.steps.size(), pp);
    reports::PipelineStageRecord& st = out[static_cast<size_t>(rp.stage)];
    st.stage = rp.stage;
    st.first_layer = rp.first_layer;
    st.layers = rp.layers;
    st.ranks.push_back(rr.rank);
    st.peak_bytes.push_back(rr.memory.peak);
    std::vector<reports::PipelinePhases>& steps =
        phases[static_cast<size_t>(rp.stage)].emplace_back();
    for (const engine::PipelineStepTime& t : rp.steps)
      steps.push_back({t.forward, t.backward, t.p2p_wait, t.reduction, t.optimizer, t.total});
  }
  for (size_t i = 0; i < out.size(); ++i) {
    reports::PipelineStageRecord& st = out[i];
    // launcher mpi: the result holds this process's rank only; its stage alone is reported.
    if (st.ranks.empty()) continue;
    const int64_t n = static_cast<int64_t>(phases[i].front().size());
    st.warmup_steps = std::min(reports::default_warmup_steps(n), n - 1);
    st.steady_steps = n - st.warmup_steps;
    st.mean = reports::mean_pipeline_phases(phases[i], st.warmup_steps);
    st.bubble_fraction = reports::bubble_fraction(st.mean.p2p_wait_s, st.mean.step_s);
    st.predicted_bubble_fraction = predicted.bubble_fraction(static_cast<int>(i));
  }
  std::erase_if(out, [](const reports::PipelineStageRecord& st) { return st.ranks.empty(); });
  return out;
}

TrainOutcome train_scenario(const Scenario& s, const TrainRequest& request) {
  engine::RunOptions o = make_run_options(s, request);
  const engine::CheckpointOptions co = checkpoint_options(s, request.scenario_hash, request.faults);
  std::atomic<bool> load_failed{false};
  if (!request.from_checkpoint.empty()) {
    // The remaining steps up to train.steps; the session's step counter, data cursor and LR
    // schedule continue from the loaded scalars.
    const int64_t start = check_start_checkpoint(s, request.from_checkpoint);
    o.steps = s.train.steps - start;
    o.before_start = [&](engine::ShardedState& state, mesh::RankComms& comms) {
      load_start(request.from_checkpoint, state, comms, co, load_failed);
    };
  }
  // Rank 0's record of the periodic checkpoints this run committed (only rank 0 touches it).
  std::vector<fs::path> written;
  // The resume check's save (TrainRequest::resume_save_at), recorded by the lead rank(s) as
  // resume_scenario records its own.
  fs::path resume_saved;
  const bool lead_all = s.launcher == Launcher::kMpi;
  // A failure of this save is the resume check's, not the main run's: the ranks agree on it
  // (create_check_folder and save_checkpoint fail on every rank alike), the run goes on without
  // the save, and the check then trains its own first half and meets the same error there.
  auto resume_save = [&](engine::ShardedState& state, mesh::RankComms& comms, int64_t done) {
    if (request.resume_save_at == 0 || done != request.resume_save_at) return false;
    try {
      const fs::path root = create_check_folder(comms, request.resume_root,
                                                fmt::format("resume_check_step{}", done), "resume");
      const fs::path dir = engine::save_checkpoint(root, done, state, comms, co);
      if (lead_all || comms.rank() == 0) resume_saved = dir;
    } catch (const std::exception&) {
      return false;
    }
    return true;
  };
  if (request.resume_save_at > 0) {
    o.after_step = [&](engine::ShardedState& state, mesh::RankComms& comms, int64_t done) {
      return resume_save(state, comms, done);
    };
  }
  if (request.checkpoints && request.checkpoints->every > 0) {
    const CheckpointPlan plan = *request.checkpoints;
    const int64_t last = s.train.steps;
    o.after_step = [&, plan, last](engine::ShardedState& state, mesh::RankComms& comms,
                                   int64_t done) {
      const bool for_resume = resume_save(state, comms, done);
      if (done % plan.every != 0 && done != last) return for_resume;
      const fs::path dir = engine::save_checkpoint(plan.dir, done, state, comms, co);
      // After the commit: rank 0 removes this run's own oldest checkpoints beyond keep_last.
      on_rank0_agreed(
          comms,
          [&] {
            written.push_back(dir);
            while (static_cast<int64_t>(written.size()) > plan.keep_last) {
              std::error_code ec;
              fs::remove_all(written.front(), ec);
              MP_CHECK(!ec, "removing old checkpoint {}: {}", written.front().string(),
                       ec.message());
              written.erase(written.begin());
            }
            return int64_t{0};
          },
          "pruning checkpoints");
      return true;
    };
  }
  const int64_t steps = o.steps;
  const int64_t tokens = s.train.batch * s.train.seq_len;
  // Step wall clock as the caller sees it (rank 0 calls on_step after each step).
  auto last = std::chrono::steady_clock::now();
  if (request.on_step) {
    o.on_step = [&](const engine::StepMetrics& m) {
      reports::StepMetrics r = step_row(m, tokens);
      const auto now = std::chrono::steady_clock::now();
      r.time.total_s = std::chrono::duration<double>(now - last).count();
      last = now;
      request.on_step(r, s.train.steps);
    };
  }
  engine::RunResult res;
  rethrow_load_failure(load_failed, [&] { res = engine::run_training(o); });

  TrainOutcome out;
  out.device = o.backend.str();
  for (size_t i = 0; i < res.metrics.size(); ++i) {
    const engine::StepMetrics& m = res.metrics[i];
    reports::StepMetrics r = step_row(m, tokens);
    if (i < res.times.size()) {
      const engine::StepTime& t = res.times[i];
      r.time.total_s = t.total;
      r.time.compute_s = t.compute;
      r.time.optimizer_s = t.optimizer;
      r.time.checkpoint_s = t.checkpoint;
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
    for (const kernels::NamedReserve& d : rr.device_reserves)
      mem.device_reserves.emplace_back(d.name, d.bytes.value);
    out.memory.push_back(mem);
    if (request.record_collectives) out.calls.emplace_back(rr.rank, rr.calls);
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
  out.pipeline = pipeline_stages(res, o);
  out.notes = std::move(res.notes);
  out.trace = std::move(res.trace);
  out.parity = std::move(res.parity);
  out.checkpoints = std::move(written);
  out.resume_saved = std::move(resume_saved);
  if (!request.from_checkpoint.empty()) {
    out.notes.push_back(fmt::format("started from checkpoint {} (step {})",
                                    request.from_checkpoint.string(), s.train.steps - steps));
  }
  return out;
}

TrainOutcome resume_scenario(const Scenario& s, const ResumeRequest& request) {
  const int64_t start =
      request.from_checkpoint.empty() ? 0 : check_start_checkpoint(s, request.from_checkpoint);
  MP_CHECK(request.at_step > start && request.at_step < s.train.steps,
           "{}: resume at step {} outside ({}, {})", s.name, request.at_step, start, s.train.steps);
  TrainRequest tr;
  tr.faults = request.faults;
  // The sessions take the forward's FP8 state at each step's start only when tracing.
  tr.trace = request.trace;
  const engine::RunOptions first = make_run_options(s, tr);
  const Scenario resumed = request.mesh ? on_mesh(s, *request.mesh) : s;
  const engine::RunOptions second = make_run_options(resumed, tr);

  const engine::CheckpointOptions co = checkpoint_options(s, request.scenario_hash, request.faults);
  const int64_t tokens = s.train.batch * s.train.seq_len;
  TrainOutcome out;
  out.device = first.backend.str();
  auto record = [&](const engine::StepMetrics& m) {
    out.steps.push_back(step_row(m, tokens));
    if (request.on_step) request.on_step(out.steps.back(), s.train.steps);
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
  const std::string base = fmt::format("resume_check_step{}", request.at_step);
  std::filesystem::path saved;
  const TrainOutcome* main = request.first_half;
  if (main && !main->resume_saved.empty()) {
    // The main run trained the first half and saved after at_step: take its rows, not its time.
    const auto n = static_cast<size_t>(request.at_step - start);
    MP_CHECK(main->steps.size() >= n && (!request.trace || main->trace.size() >= n),
             "{}: the main run has {} steps, fewer than the {} before its resume save", s.name,
             main->steps.size(), n);
    saved = main->resume_saved;
    for (size_t i = 0; i < n; ++i) {
      reports::StepMetrics row = main->steps[i];
      row.time = {};
      out.steps.push_back(row);
    }
    if (request.trace) out.trace.assign(main->trace.begin(), main->trace.begin() + n);
  }
  // Run to at_step on the scenario's mesh and save into a folder of the check's own (also when the
  // main run's save failed: the check meets the error itself and reports it).
  std::atomic<bool> load_failed{false};
  if (saved.empty()) {
    rethrow_load_failure(load_failed, [&] {
      engine::run_on_ranks(first, [&](mesh::RankComms& comms) {
        engine::TrainingSession session(first, comms);
        train_until(session, comms, request.from_checkpoint, co, load_failed, request.at_step,
                    [&](const engine::StepMetrics& m) {
                      trace_step(session, comms);
                      if (lead(comms)) record(m);
                    });
        const fs::path root = create_check_folder(comms, request.checkpoint_root, base, "resume");
        const std::filesystem::path dir =
            engine::save_checkpoint(root, request.at_step, session.state(), comms, co);
        if (lead(comms)) saved = dir;
      });
    });
  }
  // A fresh engine (on the resume mesh), load, finish.
  std::map<std::string, kernels::Tensor> final_params;
  engine::run_on_ranks(
      second,
      [&](mesh::RankComms& comms) {
        engine::TrainingSession session(second, comms);
        engine::load_checkpoint(saved, session.state(), comms, co);
        session.load_scalars();
        // The remaining steps counted from the save, not up to the loaded optimizer step counter:
        // a checkpoint that lost optim/step (optimizer_state_not_restored) must still resume
        // for exactly the straight run's remaining steps, and be judged on what it computes.
        for (int64_t i = request.at_step; i < s.train.steps; ++i) {
          engine::StepMetrics m = session.step();
          m.step = i;  // the run's step, whatever optimizer step counter the checkpoint restored
          trace_step(session, comms);
          if (lead(comms)) record(m);
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
  // The folder the check created (saved is its step_N inside): the runner removes it on a pass.
  out.checkpoints.push_back(saved.parent_path());
  out.notes.push_back(
      fmt::format("resume: {} saved {} after step {}, resumed on {}",
                  main && !main->resume_saved.empty() ? "the main run" : "the check",
                  saved.string(), request.at_step, describe_mesh(resumed.mesh)));
  return out;
}

}  // namespace meshproof::harness

namespace meshproof::harness {

StateOutcome state_roundtrip(const Scenario& s, const StateRequest& request) {
  const int64_t start =
      request.from_checkpoint.empty() ? 0 : check_start_checkpoint(s, request.from_checkpoint);
  MP_CHECK(request.at_step > start && request.at_step <= s.train.steps,
           "{}: state check at step {} outside ({}, {}]", s.name, request.at_step, start,
           s.train.steps);
  TrainRequest tr;
  tr.faults = request.faults;
  const engine::RunOptions first = make_run_options(s, tr);
  const Scenario other = request.mesh ? on_mesh(s, *request.mesh) : s;
  const engine::RunOptions second = make_run_options(other, tr);
  // The checkpoint under test carries the faults (save and load side); `before` and `after` are
  // faithful dumps of the live state (no checkpoint faults), so that a save-side fault that
  // drops or rounds a key shows as the difference between what the run held and what the
  // resumed engine holds, not as two equally wrong files.
  const engine::CheckpointOptions co = checkpoint_options(s, request.scenario_hash, request.faults);
  engine::CheckpointOptions faithful = co;
  faithful.faults = {};
  // A second save only when some fault is on: a hand list of the save-side faults missed the
  // generic ones (drop_checkpoint_key, checkpoint_key_dtype) and swiglu_gate_up_swizzled_in_
  // checkpoint, which then saved faithfully and passed; any() cannot fall behind the table.
  const bool save_faults = request.faults.any();
  const int64_t tokens = s.train.batch * s.train.seq_len;
  const bool mpi = s.launcher == Launcher::kMpi;
  auto lead = [&](const mesh::RankComms& comms) { return mpi || comms.rank() == 0; };
  StateOutcome out;
  const std::string base = fmt::format("state_check_step{}", request.at_step);
  std::atomic<bool> load_failed{false};
  std::map<std::string, kernels::Tensor> gathered;
  rethrow_load_failure(load_failed, [&] {
    engine::run_on_ranks(
        first,
        [&](mesh::RankComms& comms) {
          engine::TrainingSession session(first, comms);
          train_until(session, comms, request.from_checkpoint, co, load_failed, request.at_step,
                      [&](const engine::StepMetrics& m) {
                        if (!lead(comms)) return;
                        out.steps.push_back(step_row(m, tokens));
                        if (request.on_step) request.on_step(out.steps.back(), s.train.steps);
                      });
          const fs::path folder =
              create_check_folder(comms, request.checkpoint_root, base, "state");
          const fs::path before = engine::save_checkpoint(folder / "before", request.at_step,
                                                          session.state(), comms, faithful);
          const fs::path saved = save_faults
                                     ? engine::save_checkpoint(folder / "saved", request.at_step,
                                                               session.state(), comms, co)
                                     : before;
          std::map<std::string, kernels::Tensor> p = session.gather_params();
          if (lead(comms)) {
            out.folder = folder;
            out.before = before;
            out.saved = saved;
            for (auto& [name, t] : p) gathered[name] = t;
          }
        },
        [&] {
          // Tensors made on a rank thread are accounted to that rank's tracker, which dies with the
          // world: copy them into this thread's context while the world is still alive.
          for (const engine::ParamSpec& spec : engine::param_specs(first.config.model)) {
            auto it = gathered.find(spec.name);
            MP_CHECK(it != gathered.end(), "{}: the engine returned no {}", s.name, spec.name);
            out.params.insert(spec.name, it->second.clone());
          }
          gathered.clear();
        });
  });
  // A fresh engine on the state mesh: load the checkpoint under test, save again at once.
  engine::run_on_ranks(second, [&](mesh::RankComms& comms) {
    engine::TrainingSession session(second, comms);
    engine::load_checkpoint(out.saved, session.state(), comms, co);
    session.load_scalars();
    const fs::path after = engine::save_checkpoint(out.folder / "after", request.at_step,
                                                   session.state(), comms, faithful);
    if (lead(comms)) out.after = after;
  });
  out.notes.push_back(fmt::format(
      "state: saved {} after step {} on {}, loaded and saved again "
      "on {}",
      out.saved.string(), request.at_step, describe_mesh(s.mesh), describe_mesh(other.mesh)));
  return out;
}

void wait_for_every_process(const Scenario& s) {
  if (s.launcher != Launcher::kMpi) return;
  engine::run_on_ranks(make_run_options(s, {}), [](mesh::RankComms& comms) {
    comms.group(engine::groups::all_ranks(comms.mesh())).barrier();
  });
}

}  // namespace meshproof::harness
