#include "harness/run/runner.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <map>
#include <mutex>
#include <optional>
#include <set>

#include "engine/bench/bench_recipes.h"
#include "engine/model/data.h"
#include "harness/checks/check_table.h"
#include "harness/checks/golden.h"
#include "harness/faults/scenario_faults.h"
#include "harness/scenario/scenario_loader.h"
#include "harness/verbs/run_verb.h"
#include "kernels/core/error.h"
#include "kernels/core/runtime.h"
#include "reports/record/perf_metrics.h"

namespace meshproof::harness {
namespace fs = std::filesystem;
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

reports::CheckResult make_result(const std::string& name, reports::Verdict v, std::string msg) {
  reports::CheckResult r;
  r.name = name;
  r.kind = name;
  r.verdict = v;
  r.message = std::move(msg);
  return r;
}

// Runs `fn`, turning engine/runtime failures into an errored check (a check that could not run
// is an error, never a pass).
template <typename Fn>
reports::CheckResult guarded(const std::string& name, Fn&& fn) {
  const auto t0 = Clock::now();
  reports::CheckResult r;
  try {
    r = fn();
  } catch (const std::exception& e) {
    const auto* err = dynamic_cast<const kernels::Error*>(&e);
    r = make_result(name, reports::Verdict::kError, err ? err->message() : e.what());
  }
  r.duration_s = seconds_since(t0);
  return r;
}

// Live progress on a terminal: one rewritten line per scenario.
struct Progress {
  std::ostream* out = nullptr;
  std::string name;
  Clock::time_point t0 = Clock::now();
  // Restarts the clock for a re-run of the scenario (a check's own training), labelled
  // "NAME [PHASE]".
  void phase(const std::string& what) {
    label = what.empty() ? name : fmt::format("{} [{}]", name, what);
    t0 = Clock::now();
  }
  // The step callback of a training run (TrainRequest/ResumeRequest::on_step).
  std::function<void(const reports::StepMetrics&, int64_t)> callback() {
    if (!out) return {};
    return [this](const reports::StepMetrics& m, int64_t total) { step(m, total); };
  }
  void step(const reports::StepMetrics& m, int64_t total) const {
    if (!out) return;
    const double elapsed = seconds_since(t0);
    const double eta =
        m.step > 0 ? elapsed / static_cast<double>(m.step) * static_cast<double>(total - m.step)
                   : 0.0;
    fmt::print(*out, "\r\033[K{}  step {}/{}  loss {:.4f}  elapsed {:.1f}s  ETA {:.1f}s",
               label.empty() ? name : label, m.step, total, m.loss, elapsed, eta);
    out->flush();
  }
  void done() const {
    if (out) fmt::print(*out, "\r\033[K");
  }
  std::string label;
};

}  // namespace

std::vector<Scenario> load_scenarios(const std::vector<std::string>& paths,
                                     const std::vector<std::string>& sets,
                                     const std::string& filter) {
  std::vector<Override> overrides;
  for (const std::string& s : sets) overrides.push_back(parse_override(s));
  std::vector<Scenario> all;
  std::map<std::string, std::string> names;  // name -> where it was given
  for (const std::string& file : expand_scenario_paths(paths)) {
    for (Scenario& s : load_scenario_file(file, overrides, filter)) {
      if (!filter.empty() && s.name != filter && s.base_name != filter) continue;
      // Everything the engine would reject is bad input too: check it before running anything.
      try {
        (void)to_engine_config(s);
        (void)to_fault_injection(s.faults);
      } catch (const kernels::Error& e) {
        if (e.kind() != kernels::ErrorKind::kInput) throw;
        MP_FAIL_INPUT("{}: scenario {}: {}", s.source, s.name, e.message());
      }
      check_unique_name(s, names);
      all.push_back(std::move(s));
    }
  }
  MP_CHECK_INPUT(!all.empty(), "no scenario matches --filter {}", filter);
  return all;
}

void check_run_inputs(const std::vector<Scenario>& scenarios, const RunnerOptions& opts) {
  std::map<fs::path, std::string> periodic;  // checkpoint root -> the scenario saving there
  for (const Scenario& s : scenarios) {
    if (!opts.from_checkpoint.empty()) (void)check_start_checkpoint(s, opts.from_checkpoint);
    const fs::path root = checkpoint_root(s, opts.out_dir);
    check_checkpoint_root_unused(s, root);
    if (s.checkpoint.every <= 0) continue;
    const auto [it, fresh] = periodic.emplace(root.lexically_normal(), s.name);
    MP_CHECK_INPUT(
        fresh, "{}: checkpoint.dir {} is also scenario {}'s: two runs would save into one folder",
        s.name, root.string(), it->second);
  }
}

std::optional<std::string> resolve_backend(const Scenario& s, const RunnerOptions& opts,
                                           const reports::EnvironmentRecord& env,
                                           std::string* skip_reason) {
  const Backend b = opts.backend.value_or(s.backend);
  const std::string why_not = env.cuda_unusable_reason.empty() ? std::string("CUDA not compiled")
                                                               : env.cuda_unusable_reason;
  // An explicit cuda backend is a promise to run on the GPU: without one it is an error, not a
  // skip that exits 0 having run nothing (issue #17.3).
  MP_CHECK_INPUT(b != Backend::kCuda || env.cuda_usable,
                 "{}: scenario {}: backend cuda ({}) but no usable GPU: {}; --backend auto skips "
                 "requires_gpu scenarios where there is no GPU, --backend cpu runs on the CPU",
                 s.source, s.name, opts.backend ? "--backend cuda" : "the scenario's backend: cuda",
                 why_not);
  if (s.requires_gpu && !env.cuda_usable) {
    *skip_reason = fmt::format("requires_gpu but no usable GPU: {}", why_not);
    return std::nullopt;
  }
  // auto: the GPU when one is usable (virtual ranks share cuda:0), else the CPU.
  if (b == Backend::kCuda || s.requires_gpu || (b == Backend::kAuto && env.cuda_usable))
    return std::string("cuda:0");
  return std::string("cpu");
}

std::string golden_update_command(const Scenario& s, const RunnerOptions& opts,
                                  const std::string& platform) {
  // Every option of the run that decides what the golden holds or where it goes, so that the
  // printed command rewrites the golden this run read (issue #17.13).
  std::vector<std::string> args = {"meshproof", "golden", "update", s.source,
                                   // --filter picks this one scenario out of a matrix file.
                                   "--filter", s.name};
  for (const std::string& set : opts.sets) args.push_back("--set=" + set);
  if (opts.backend) args.push_back(std::string("--backend=") + to_string(*opts.backend));
  if (opts.launcher) args.push_back(std::string("--launcher=") + to_string(*opts.launcher));
  args.push_back("--golden-dir=" + opts.golden_dir.string());
  // A guard: golden update derives the platform from the device it runs on and refuses when
  // that is not this one.
  args.push_back("--platform=" + platform);
  return shell_join(args);
}

std::vector<std::string> intended_checks(const Scenario& s) {
  if (s.expect != Expect::kCaught) return {};
  const std::vector<std::string> enabled = enabled_claims(s);
  std::set<std::string> intended;  // sorted: the reports list them by name
  for (const FaultSpec& f : s.faults) {
    const FaultDescriptor* row = find_fault(f.name);
    if (!row) continue;
    for (std::string_view claim : row->caught_by) {
      if (std::find(enabled.begin(), enabled.end(), claim) == enabled.end()) continue;
      intended.emplace(check_of_claim(claim)->name);
    }
  }
  return {intended.begin(), intended.end()};
}

bool expectation_met(const reports::ScenarioRecord& r, std::string* why) {
  const reports::Verdict v = reports::scenario_verdict(r);
  *why = reports::verdict_reason(r);
  // Skipped scenarios (no GPU here) are recorded, not failed.
  return v == reports::Verdict::kPass || v == reports::Verdict::kSkipped;
}

std::string device_description(const std::string& device, const reports::EnvironmentRecord& env) {
  const size_t colon = device.find(':');
  if (device.rfind("cuda", 0) != 0 || colon == std::string::npos) return device;
  const int index = std::stoi(device.substr(colon + 1));
  for (const reports::GpuRecord& g : env.gpus) {
    if (g.index == index) return fmt::format("{} ({})", g.name, device);
  }
  return device;
}

std::optional<double> measured_bf16_peak(int device_index) {
  static std::mutex mu;
  static std::map<int, double> measured;
  std::lock_guard<std::mutex> lock(mu);
  if (const auto it = measured.find(device_index); it != measured.end()) return it->second;
  engine::RecipeBenchOptions o;
  o.device = kernels::Device::cuda(device_index);
  o.iters = 10;
  o.warmup = 3;
  kernels::RankContext ctx;
  ctx.device = o.device;
  kernels::ScopedRankContext scoped(ctx);
  const engine::Measurement m = engine::measure_bf16_gemm(o, {4096, 4096, 4096});
  const double best = m.seconds > 0 ? m.flops / m.seconds / 1e12 : 0;
  if (!(best > 0)) return std::nullopt;
  return measured[device_index] = best;
}

reports::PerformanceInputs performance_inputs(const Scenario& s, const std::string& backend,
                                              const reports::EnvironmentRecord& env,
                                              std::string* note, const PeakCalibration& calibrate) {
  reports::PerformanceInputs perf;
  perf.model.layers = s.model.layers;
  perf.model.hidden = s.model.hidden;
  perf.model.ffn = s.model.ffn;
  perf.model.vocab = s.model.vocab;
  perf.model.seq_len = s.train.seq_len;
  perf.model.swiglu = s.model.activation == Activation::kSwiGlu;
  note->clear();
  if (backend == "cpu") {
    // Every rank is a thread (or an MPI process) of this host: one device, and no tensor-core
    // peak to measure utilisation against.
    perf.num_devices = 1;
    perf.gemm_dtype = engine::recipe_gemm_dtype(s.recipe.kind, 0);
    *note = "MFU n/a: the CPU backend has no dense tensor-core peak";
    return perf;
  }
  // backend "cuda:N": the engine puts every local-launcher rank on that one GPU (virtual ranks);
  // the mpi launcher gives process i GPU (local rank i) mod (GPUs on the host).
  const int index = std::stoi(backend.substr(backend.find(':') + 1));
  const reports::GpuRecord* gpu = nullptr;
  for (const reports::GpuRecord& g : env.gpus) {
    if (g.index == index) gpu = &g;
  }
  const int64_t world = s.mesh.world_size();
  const int64_t gpus = std::max<int64_t>(1, static_cast<int64_t>(env.gpus.size()));
  perf.num_devices = static_cast<int>(s.launcher == Launcher::kMpi ? std::min(world, gpus) : 1);
  int cc = 0;
  if (gpu) {
    perf.gpu_name = gpu->name;
    const size_t dot = gpu->compute_capability.find('.');
    if (dot != std::string::npos) {
      cc = std::stoi(gpu->compute_capability.substr(0, dot)) * 10 +
           std::stoi(gpu->compute_capability.substr(dot + 1));
    }
  }
  perf.gemm_dtype = engine::recipe_gemm_dtype(s.recipe.kind, cc);
  if (!gpu) {
    *note = fmt::format("MFU n/a: {} is not among the probed GPUs", backend);
  } else if (reports::table_peak_tflops(perf.gpu_name, perf.gemm_dtype)) {
    // The table's dense peak applies; nothing to say.
  } else if (calibrate && (perf.calibration_tflops = calibrate(index))) {
    *note = fmt::format(
        "MFU against a measured bf16 GEMM ({:.1f} TFLOP/s on {}): no dense {} peak for it in the "
        "table (docs/report-schema.md)",
        *perf.calibration_tflops, perf.gpu_name, perf.gemm_dtype);
  } else {
    *note = fmt::format(
        "MFU n/a: no dense {} peak for {} in the table (docs/report-schema.md); `meshproof "
        "bench recipes --backend cuda` measures its bf16 GEMM ceiling",
        perf.gemm_dtype, perf.gpu_name);
  }
  return perf;
}

reports::ScenarioRecord run_scenario(const Scenario& s, const RunnerOptions& opts,
                                     const reports::EnvironmentRecord& env, std::ostream& log,
                                     TrainOutcome* main_out) {
  const auto t0 = Clock::now();
  reports::ScenarioRecord rec;
  rec.name = s.name;
  rec.config = to_canonical_json(s);
  rec.mesh = mesh_text(s.mesh);
  rec.recipe = to_string(s.recipe.kind);
  rec.expectation =
      s.expect == Expect::kCaught ? reports::Expectation::kCaught : reports::Expectation::kPass;
  rec.caught_by = intended_checks(s);
  const engine::Config engine_config = to_engine_config(s);
  rec.entropy_floor =
      engine::markov_entropy_rate(engine_config.model.vocab, engine_config.data.decay);
  const std::vector<std::string> check_names = enabled_checks(s);

  std::string skip_reason;
  const std::optional<std::string> backend = resolve_backend(s, opts, env, &skip_reason);
  rec.backend = backend.value_or("none");
  if (!backend) {
    rec.notes.push_back("skipped: " + skip_reason);
    for (const std::string& c : check_names)
      rec.checks.push_back(make_result(c, reports::Verdict::kSkipped, skip_reason));
    if (check_names.empty())
      rec.checks.push_back(make_result("run", reports::Verdict::kSkipped, skip_reason));
    rec.duration_s = seconds_since(t0);
    return rec;
  }

  Scenario run = s;
  if (opts.launcher) run.launcher = *opts.launcher;
  // One hash everywhere: the scenario as loaded (validate and golden update print and record
  // this), not `run`, whose backend and launcher the CLI has resolved.
  const std::string hash = scenario_hash_hex(s);
  const fs::path& from = opts.from_checkpoint;
  const int64_t start = from.empty() ? 0 : check_start_checkpoint(s, from);
  TrainOutcome main;
  double main_s = 0;  // the main run's training: the measurement golden and allgather_parity judge
  Progress progress;
  if (opts.progress) {
    progress.out = &log;
    progress.name = s.name;
  }
  // --trace on a fault scenario: the fault-free straight run from the same start is the control
  // the resume and reference checks measure every tensor's noise floor against. Trained once, on
  // first use.
  std::optional<TrainOutcome> control;
  auto fault_free_control = [&]() -> const TrainOutcome& {
    if (!control) {
      Scenario clean = run;
      clean.faults.clear();
      TrainRequest creq;
      creq.trace = true;
      creq.scenario_hash = hash;
      creq.from_checkpoint = from;
      progress.phase("control");
      creq.on_step = progress.callback();
      control = train_scenario(clean, creq);
      progress.done();
    }
    return *control;
  };
  try {
    run.backend = *backend == "cpu" ? Backend::kCpu : Backend::kCuda;
    TrainRequest req;
    req.faults = to_fault_injection(run.faults);
    req.trace = opts.trace;
    const MainRunPlan plan{.start = start, .checkpoint_root = checkpoint_root(s, opts.out_dir)};
    for (const CheckDescriptor& c : check_table()) {
      if (c.enabled(s) && c.prepare_main) c.prepare_main(s, plan, req);
    }
    req.on_step = progress.callback();
    req.scenario_hash = hash;
    req.from_checkpoint = from;
    if (s.checkpoint.every > 0) {
      req.checkpoints = CheckpointPlan{checkpoint_root(s, opts.out_dir), s.checkpoint.every,
                                       s.checkpoint.keep_last};
    }
    const auto main_t0 = Clock::now();
    main = train_scenario(run, req);
    main_s = seconds_since(main_t0);
    progress.done();
  } catch (const CheckpointLoadError& e) {
    // The checkpoint the run starts from does not load (the loader verified its chunks): a failed
    // check, like `meshproof ckpt verify` (exit 1), with the key and file in the message.
    progress.done();
    rec.checks.push_back(make_result("checkpoint", reports::Verdict::kFail,
                                     fmt::format("loading {}: {}", from.string(), e.message())));
    rec.duration_s = seconds_since(t0);
    return rec;
  } catch (const std::exception& e) {
    const auto* err = dynamic_cast<const kernels::Error*>(&e);
    rec.error = err ? err->message() : e.what();
    rec.duration_s = seconds_since(t0);
    progress.done();
    return rec;
  }
  rec.steps = main.steps;
  rec.memory = main.memory;
  rec.pipeline = main.pipeline;
  rec.collectives = main.collectives;
  rec.notes.insert(rec.notes.end(), main.notes.begin(), main.notes.end());
  if (!main.checkpoints.empty()) {
    std::string kept;
    for (const fs::path& p : main.checkpoints) kept += (kept.empty() ? "" : ", ") + p.string();
    rec.notes.push_back(fmt::format("checkpoints (every {} steps, keep_last {}): {}",
                                    s.checkpoint.every, s.checkpoint.keep_last, kept));
  }

  CheckContext ctx{.scenario = s,
                   .run = run,
                   .opts = opts,
                   .env = env,
                   .backend = *backend,
                   .hash = hash,
                   .start = start,
                   .main = main,
                   .faults = to_fault_injection(run.faults),
                   .record = rec,
                   .phase =
                       [&](const std::string& what) {
                         progress.phase(what);
                         return progress.callback();
                       },
                   .done = [&] { progress.done(); },
                   .fault_free_control = fault_free_control};
  for (const CheckDescriptor& c : check_table()) {
    if (!c.enabled(s)) continue;
    if (const std::optional<std::string> why = c.skip ? c.skip(ctx) : std::nullopt) {
      rec.checks.push_back(make_result(std::string(c.name), reports::Verdict::kSkipped, *why));
      continue;
    }
    rec.checks.push_back(guarded(std::string(c.name), [&] { return c.run(ctx); }));
    // The time of a check that judges the main run includes that run (the resume, reference and
    // determinism checks time their own re-runs): a golden check of a 3 s run does not take 0 s.
    if (c.judges_main_run) rec.checks.back().duration_s += main_s;
  }

  std::string perf_note;
  const reports::PerformanceInputs perf =
      performance_inputs(run, *backend, env, &perf_note, measured_bf16_peak);
  if (!perf_note.empty()) rec.notes.push_back(perf_note);
  if (!main.steps.empty()) {
    try {
      rec.performance = reports::compute_performance(main.steps, perf);
    } catch (const std::exception& e) {
      rec.notes.push_back(fmt::format("performance figures not computed: {}", e.what()));
    }
  }
  progress.done();  // a check that threw left its progress line behind
  if (main_out) *main_out = std::move(main);
  rec.duration_s = seconds_since(t0);
  return rec;
}

}  // namespace meshproof::harness
