#include "harness/verbs/bench_recipes_verb.h"

#include <fmt/format.h>
#include <fmt/ostream.h>
#include <fmt/ranges.h>

#include <CLI/CLI.hpp>
#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <memory>

#include "harness/scenario/scenario_loader.h"
#include "harness/verbs/env_verb.h"
#include "harness/verbs/exit_codes.h"
#include "harness/verbs/output_guard.h"
#include "kernels/core/device.h"
#include "kernels/core/error.h"
#include "reports/record/perf_metrics.h"
#include "reports/record/report_error.h"
#include "reports/writers/atomic_file.h"
#include "reports/writers/report_writers.h"

namespace meshproof::harness {
namespace {

using reports::BenchmarkFigure;

double tflops(const engine::Measurement& m) { return m.flops / m.seconds / 1e12; }
double gbps(const engine::Measurement& m) { return m.bytes / m.seconds / 1e9; }

// The figure's range over the timed iterations from the fastest and slowest one: `per_second`
// is the work per iteration in the figure's unit (a throughput: work / seconds), 0 for a time in
// milliseconds.
reports::BenchmarkFigure with_range(reports::BenchmarkFigure f, const engine::Measurement& m,
                                    double per_second) {
  if (m.min_seconds <= 0 || m.max_seconds <= 0) return f;
  if (per_second > 0) {
    f.min = per_second / m.max_seconds;
    f.max = per_second / m.min_seconds;
  } else {
    f.min = m.min_seconds * 1e3;
    f.max = m.max_seconds * 1e3;
  }
  return f;
}

// A throughput figure with its ceiling (ratio = value / ceiling).
BenchmarkFigure figure(std::string name, std::string metric, double value, std::string unit,
                       std::optional<double> ceiling, std::string ceiling_source) {
  BenchmarkFigure f;
  f.name = std::move(name);
  f.metric = std::move(metric);
  f.value = value;
  f.unit = std::move(unit);
  if (ceiling && *ceiling > 0) {
    f.ceiling = ceiling;
    f.ceiling_source = std::move(ceiling_source);
    f.ratio = value / *ceiling;
  }
  return f;
}

// Each repetition's throughput: work / seconds (work in the figure's unit).
std::vector<double> throughput_samples(const engine::Measurement& m, double work) {
  std::vector<double> out;
  for (double t : m.samples) out.push_back(t > 0 ? work / t : 0);
  return out;
}

// a[i] / b[i] per repetition (both timed back to back the same number of times); empty when the
// counts differ or a time is not positive.
std::vector<double> paired_ratios(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> out;
  if (a.size() != b.size()) return out;
  for (size_t i = 0; i < a.size(); ++i) {
    if (!(b[i] > 0)) return {};
    out.push_back(a[i] / b[i]);
  }
  return out;
}

// The i-th repetitions of a GEMM's quantizations summed (seconds).
std::vector<double> summed_samples(const std::vector<engine::QuantizeFigure>& qs) {
  std::vector<double> out;
  for (const engine::QuantizeFigure& q : qs) {
    if (out.empty()) out.assign(q.m.samples.size(), 0.0);
    if (q.m.samples.size() != out.size()) return {};
    for (size_t i = 0; i < out.size(); ++i) out[i] += q.m.samples[i];
  }
  return out;
}

// "qkv fprop 512x768x256": the linear, the role and the role's own M x N x K (gemm_dims).
std::string role_label(const engine::LinearGemm& g) {
  return fmt::format("{} {} {}", g.linear, kernels::gemm_role_name(g.role),
                     engine::gemm_dims(g).str());
}

// A time in milliseconds (lower is better) with its range and repetitions.
BenchmarkFigure time_figure(const std::string& name, const std::string& metric,
                            const engine::Measurement& m) {
  BenchmarkFigure f =
      with_range(figure(name, metric, m.seconds * 1e3, "ms", std::nullopt, ""), m, 0);
  f.higher_is_better = false;
  for (double t : m.samples) f.samples.push_back(t * 1e3);
  return f;
}

// A speedup over BF16 (engine::gemm_speedup, a ratio of medians). Its range combines the
// operands' ranges (slowest bf16 over fastest recipe and the reverse), which holds the value;
// its samples are the per-repetition ratios: repetition i of the bf16 GEMM over repetition i of
// the recipe's GEMM (+ its quantizations' repetition i when `autocast`).
BenchmarkFigure speedup_figure(const std::string& name, const std::string& metric, double value,
                               const engine::RoleFigure& g, bool autocast) {
  BenchmarkFigure f = figure(name, metric, value, "x", std::nullopt, "");
  std::vector<double> denom = g.time.samples;
  double q_min = 0, q_max = 0;
  if (autocast) {
    for (const engine::QuantizeFigure& q : g.quantize) {
      q_min += q.m.min_seconds;
      q_max += q.m.max_seconds;
    }
  }
  if (autocast && !g.quantize.empty()) {
    const std::vector<double> q = summed_samples(g.quantize);
    if (q.size() == denom.size()) {
      for (size_t i = 0; i < denom.size(); ++i) denom[i] += q[i];
    } else {
      denom.clear();
    }
  }
  f.samples = paired_ratios(g.bf16.samples, denom);
  if (g.bf16.min_seconds > 0 && g.time.min_seconds > 0) {
    f.min = g.bf16.min_seconds / (g.time.max_seconds + q_max);
    f.max = g.bf16.max_seconds / (g.time.min_seconds + q_min);
  }
  return f;
}

// The "measured" check: every figure a positive finite number (a zero or NaN median means a
// broken timer or an operation that did nothing).
reports::CheckResult measured_check(const reports::ScenarioRecord& s) {
  reports::CheckResult c;
  c.name = "measured";
  c.kind = "benchmark";
  c.verdict = reports::Verdict::kPass;
  c.message = fmt::format("{} figures measured", s.benchmarks.size());
  for (const BenchmarkFigure& f : s.benchmarks) {
    if (!(std::isfinite(f.value) && f.value > 0)) {
      c.verdict = reports::Verdict::kFail;
      c.message =
          fmt::format("{} {} = {} is not a positive finite number", f.name, f.metric, f.value);
      break;
    }
  }
  return c;
}

}  // namespace

reports::RunRecord bench_recipes_record(const engine::RecipeBenchReport& rep,
                                        const engine::RecipeBenchOptions& o,
                                        const std::string& backend, const std::string& gpu_name) {
  reports::RunRecord run;
  const bool cpu = gpu_name.empty();
  nlohmann::json config = {{"model",
                            {{"hidden", o.model.hidden},
                             {"ffn", o.model.ffn},
                             {"heads", o.model.heads},
                             {"kv_heads", o.model.kv_heads},
                             {"seq", o.model.seq},
                             {"micro_batch", o.model.micro_batch},
                             {"activation", engine::activation_name(o.model.activation)},
                             {"norm", engine::norm_name(o.model.norm)},
                             {"position", engine::position_name(o.model.position)},
                             {"bias", o.model.bias}}},
                           {"shapes", nlohmann::json::array()},
                           {"m_sweep", o.m_sweep},
                           {"iters", o.iters},
                           {"warmup", o.warmup},
                           {"steps", o.steps},
                           {"device", rep.device_name},
                           {"compute_capability", rep.compute_capability},
                           {"cache_bytes", rep.cache_bytes}};
  for (const engine::GemmShape& s : o.shapes) config["shapes"].push_back(s.str());
  // Every CPU figure is an emulation of what a GPU would run.
  const std::string cpu_label = cpu ? "CPU emulation" : "";

  // Ceilings: measured copy bandwidth and the bf16 GEMMs (the calibration for GPUs not in the
  // peak table: the best bf16 GEMM of the run).
  reports::ScenarioRecord ceil;
  ceil.name = "recipes.ceilings";
  ceil.recipe = "bf16";
  ceil.mesh = "single device";
  ceil.backend = backend;
  ceil.config = config;
  const double copy_gbps = gbps(rep.copy);
  BenchmarkFigure copy =
      with_range(figure(o.device.is_cpu() ? "copy host memcpy" : "copy cudaMemcpy d2d", "gbps",
                        copy_gbps, "GB/s", std::nullopt, ""),
                 rep.copy, rep.copy.bytes / 1e9);
  copy.samples = throughput_samples(rep.copy, rep.copy.bytes / 1e9);
  copy.emulated = cpu_label;
  ceil.benchmarks.push_back(copy);
  double bf16_best = 0;
  const std::optional<double> bf16_table = reports::table_peak_tflops(gpu_name, "bf16");
  if (!rep.recipes.empty()) {
    for (const engine::RoleFigure& r : rep.recipes.front().roles) {
      const double t = tflops(r.bf16);
      bf16_best = std::max(bf16_best, t);
      BenchmarkFigure f =
          with_range(figure(fmt::format("bf16 gemm {}", role_label(r.gemm)), "tflops", t, "TFLOP/s",
                            bf16_table, bf16_table ? "table:" + gpu_name + " bf16" : ""),
                     r.bf16, r.bf16.flops / 1e12);
      f.samples = throughput_samples(r.bf16, r.bf16.flops / 1e12);
      f.emulated = cpu_label;
      ceil.benchmarks.push_back(f);
    }
  }
  ceil.checks.push_back(measured_check(ceil));
  run.scenarios.push_back(std::move(ceil));

  const engine::RecipeBenchResult* bf16_result = nullptr;
  for (const engine::RecipeBenchResult& r : rep.recipes) {
    if (r.recipe == engine::RecipeKind::kBf16) bf16_result = &r;
  }

  for (const engine::RecipeBenchResult& r : rep.recipes) {
    reports::ScenarioRecord s;
    s.recipe = std::string(engine::recipe_name(r.recipe));
    s.name = "recipes." + s.recipe;
    s.mesh = "single device";
    s.backend = backend;
    s.config = config;
    s.config["gemm_dtype"] = r.gemm_dtype;
    s.config["emulated"] = r.emulation;
    s.notes = r.notes;
    if (!r.emulation.empty()) {
      s.notes.push_back(fmt::format("emulated: {} (every figure of this recipe)", r.emulation));
    }
    // MFU only on a GPU: the table's dense peak of the GEMM dtype, else the run's best bf16 GEMM.
    reports::PeakTflops peak;
    if (!cpu) {
      peak = reports::resolve_peak_tflops(gpu_name, r.gemm_dtype,
                                          bf16_best > 0 ? std::optional(bf16_best) : std::nullopt);
    }
    const std::string peak_source = peak.source == "calibration"
                                        ? "calibration:best bf16 gemm measured in this run"
                                        : peak.source;
    auto add = [&](BenchmarkFigure f, const std::string& emulated) {
      f.emulated = emulated;
      s.benchmarks.push_back(std::move(f));
    };
    auto add_roles = [&](const std::vector<engine::RoleFigure>& roles, const std::string& prefix) {
      for (const engine::RoleFigure& g : roles) {
        const std::string name = prefix + role_label(g.gemm);
        add(time_figure(name, "bf16_ms", g.bf16), cpu_label);
        add(time_figure(name, "gemm_ms", g.time), r.emulation);
        BenchmarkFigure tf = with_range(
            figure(name, "gemm_tflops", tflops(g.time), "TFLOP/s", peak.tflops, peak_source),
            g.time, g.time.flops / 1e12);
        tf.samples = throughput_samples(g.time, g.time.flops / 1e12);
        add(tf, r.emulation);
        if (!g.quantize.empty()) {
          engine::Measurement q;
          q.seconds = g.quantize_seconds();
          for (const engine::QuantizeFigure& qf : g.quantize) {
            q.min_seconds += qf.m.min_seconds;
            q.max_seconds += qf.m.max_seconds;
          }
          q.samples = summed_samples(g.quantize);
          add(time_figure(name, "quantize_ms", q), r.emulation);
        }
        const engine::Speedup sp = g.speedup();
        add(speedup_figure(name, "speedup_autocast", sp.autocast, g, true), r.emulation);
        add(speedup_figure(name, "speedup_prequantized", sp.prequantized, g, false), r.emulation);
      }
    };
    add_roles(r.roles, "");
    add_roles(r.sweep, "sweep ");
    // The grouped expert GEMM over an uneven split (docs/design.md section 27): its rows and
    // padded blocks in the scenario's config, its figures named "grouped experts fc1 rows ...".
    add_roles(r.grouped, "grouped ");
    s.config["grouped_split"] = {{"experts", r.split.rows.size()},
                                 {"rows", r.split.rows},
                                 {"alignment", r.split.alignment},
                                 {"padded_rows", r.split.padded}};
    // Quantizer throughput of each distinct (operand, copy) against the copy bandwidth.
    std::vector<std::string> seen;
    for (const engine::RoleFigure& g : r.roles) {
      for (const engine::QuantizeFigure& q : g.quantize) {
        const std::string name =
            fmt::format("quantize {} {} {} {}x{}", g.gemm.linear, q.operand,
                        q.columnwise ? "columnwise" : "rowwise", q.rows, q.cols);
        if (std::find(seen.begin(), seen.end(), name) != seen.end()) continue;
        seen.push_back(name);
        BenchmarkFigure f =
            with_range(figure(name, "gbps", gbps(q.m), "GB/s", copy_gbps, "measured:copy"), q.m,
                       q.m.bytes / 1e9);
        f.samples = throughput_samples(q.m, q.m.bytes / 1e9);
        add(f, r.emulation);
      }
    }
    if (r.layer) {
      const engine::LayerFigure& l = *r.layer;
      const reports::ModelShape shape{
          1,       o.model.hidden, o.model.ffn,
          l.vocab, o.model.seq,    o.model.activation == engine::Activation::kSwiGlu};
      reports::PerformanceFigures p;
      p.warmup_steps = o.warmup;
      p.steady_steps = o.iters;
      p.median_step_time_s = l.m.seconds;
      p.tokens_per_step = static_cast<double>(l.tokens);
      p.tokens_per_s = p.tokens_per_step / l.m.seconds;
      p.model_flops_per_step = reports::model_flops_per_step(shape, p.tokens_per_step);
      p.tflops_per_device = reports::tflops_per_device(p.model_flops_per_step, l.m.seconds, 1);
      p.num_devices = 1;
      p.gemm_dtype = r.gemm_dtype;
      p.peak_tflops = peak.tflops;
      p.peak_source = peak_source;
      if (peak.tflops) p.mfu = reports::mfu(p.tflops_per_device, *peak.tflops);
      s.performance = p;
      add(time_figure("layer step", "step_time_ms", l.m), r.emulation);
      BenchmarkFigure tok = with_range(
          figure("layer step", "tokens_per_s", p.tokens_per_s, "tokens/s", std::nullopt, ""), l.m,
          p.tokens_per_step);
      tok.samples = throughput_samples(l.m, p.tokens_per_step);
      add(tok, r.emulation);
      BenchmarkFigure tf = with_range(
          figure("layer step", "tflops", p.tflops_per_device, "TFLOP/s", peak.tflops, peak_source),
          l.m, p.model_flops_per_step / 1e12);
      tf.samples = throughput_samples(l.m, p.model_flops_per_step / 1e12);
      add(tf, r.emulation);
      if (bf16_result != nullptr && bf16_result->layer) {
        const engine::Measurement& b = bf16_result->layer->m;
        BenchmarkFigure sp =
            figure("layer step", "speedup_vs_bf16", b.seconds / l.m.seconds, "x", std::nullopt, "");
        sp.samples = paired_ratios(b.samples, l.m.samples);
        if (b.min_seconds > 0 && l.m.min_seconds > 0) {
          sp.min = b.min_seconds / l.m.max_seconds;  // as speedup_figure: holds the value
          sp.max = b.max_seconds / l.m.min_seconds;
        }
        add(sp, r.emulation);
      }
      BenchmarkFigure mem =
          figure("layer step", "peak_memory_mib", static_cast<double>(l.peak_bytes) / (1 << 20),
                 "MiB", std::nullopt, "");
      mem.higher_is_better = false;
      add(mem, r.emulation);
    }
    if (r.convergence && rep.bf16_curve && rep.fp32_curve && !r.convergence->loss.empty()) {
      const double last = r.convergence->loss.back();
      const double d_bf16 = last - rep.bf16_curve->loss.back();
      const double d_fp32 = last - rep.fp32_curve->loss.back();
      BenchmarkFigure fl = figure(fmt::format("train {} steps", r.convergence->loss.size()),
                                  "final_loss_nats", last, "nats", std::nullopt, "");
      fl.higher_is_better = false;
      add(fl, r.emulation);
      s.config["convergence"] = {{"loss", r.convergence->loss},
                                 {"bf16_loss", rep.bf16_curve->loss},
                                 {"fp32_loss", rep.fp32_curve->loss},
                                 {"final_diff_vs_bf16_nats", d_bf16},
                                 {"final_diff_vs_fp32_nats", d_fp32}};
      s.notes.push_back(fmt::format(
          "convergence: final loss {:.6f} nats after {} steps; minus bf16 {:+.6f} nats, minus fp32 "
          "{:+.6f} nats",
          last, r.convergence->loss.size(), d_bf16, d_fp32));
    }
    if (cpu) s.notes.push_back("MFU n/a on the CPU backend: its figures emulate a GPU's recipes");
    s.checks.push_back(measured_check(s));
    run.scenarios.push_back(std::move(s));
  }
  return run;
}

engine::BenchModel resolve_bench_model(const std::string& model, const std::string& activation) {
  const bool named = !model.empty() && !std::isdigit(static_cast<unsigned char>(model.front()));
  if (!named) {
    return engine::parse_bench_model(
        model, activation.empty() ? engine::Activation::kGelu
                                  : engine::parse_activation(activation, "--activation"));
  }
  const auto& names = kModelPresetNames;
  MP_CHECK_INPUT(std::find(std::begin(names), std::end(names), model) != std::end(names),
                 "--model '{}': not a model preset ({}) nor hidden,ffn,heads,kv_heads,seq,"
                 "micro_batch",
                 model, fmt::join(names, ", "));
  // The preset's values are key defaults of the scenario key table: load a scenario that names
  // only the preset, so the bench gets exactly what a scenario with `model.preset` gets.
  const std::vector<Scenario> loaded = load_scenario_text(
      fmt::format("name: bench_model\nmodel: {{preset: {}}}\n", model), "--model " + model);
  MP_CHECK(loaded.size() == 1, "model preset {} loaded {} scenarios", model, loaded.size());
  const engine::ModelConfig& m = loaded.front().model;
  engine::BenchModel b;  // seq and micro_batch: the bench's defaults
  b.hidden = m.hidden;
  b.ffn = m.ffn;
  b.heads = m.heads;
  b.kv_heads = engine::kv_heads_of(m);
  b.activation = m.activation;
  b.norm = m.norm;
  b.position = m.position;
  b.rope_theta = m.rope_theta;
  b.bias = m.bias;
  if (!activation.empty()) {
    const engine::Activation a = engine::parse_activation(activation, "--activation");
    MP_CHECK_INPUT(a == b.activation,
                   "--activation {} contradicts --model {}, whose activation is {} (leave "
                   "--activation out, or give the explicit form)",
                   activation, model, engine::activation_name(b.activation));
  }
  engine::check_bench_model(b, model);
  return b;
}

int bench_recipes(const BenchRecipesOptions& options, std::ostream& out) {
  const auto t0 = std::chrono::steady_clock::now();
  engine::RecipeBenchOptions o;
  o.model = resolve_bench_model(options.model, options.activation);
  if (!options.shapes.empty()) o.shapes = engine::parse_gemm_shapes(options.shapes);
  if (!options.m_sweep.empty()) o.m_sweep = engine::parse_m_sweep(options.m_sweep);
  if (!options.recipes.empty()) {
    o.recipes.clear();
    size_t pos = 0;
    while (true) {
      const size_t end = options.recipes.find(',', pos);
      o.recipes.push_back(engine::parse_recipe(
          std::string_view(options.recipes).substr(pos, end == std::string::npos ? end : end - pos),
          "--recipes"));
      if (end == std::string::npos) break;
      pos = end + 1;
    }
  }
  o.iters = options.iters;
  o.warmup = options.warmup;
  o.steps = options.steps;
  MP_CHECK_INPUT(o.iters >= 1, "--iters must be at least 1 (got {})", o.iters);
  MP_CHECK_INPUT(o.warmup >= 0, "--warmup must be non-negative (got {})", o.warmup);
  MP_CHECK_INPUT(o.steps >= 0, "--steps must be non-negative (got {})", o.steps);
  MP_CHECK_INPUT(!options.out_dir.empty(), "--out is empty");
  std::filesystem::path results_json, results_md;
  if (!options.results.empty()) {
    const std::filesystem::path p(options.results);
    MP_CHECK_INPUT(!p.filename().empty() && p.filename() != "." && p.filename() != "..",
                   "--results '{}': expected a path prefix such as reports/results/h100",
                   options.results);
    MP_CHECK_INPUT(p.parent_path().empty() || std::filesystem::is_directory(p.parent_path()),
                   "--results '{}': directory '{}' does not exist", options.results,
                   p.parent_path().string());
    results_json = p.string() + ".json";
    results_md = p.string() + ".md";
  }
  o.device = kernels::resolve_backend(options.backend);
  // Issue #46, before any benchmark: the report folder is created and writable, --results'
  // files are writable and neither is another output (--results out/report would be --out
  // out's report.json).
  {
    const std::filesystem::path out_dir(options.out_dir);
    std::vector<NamedPath> outputs = {{"--out", out_dir, OutputKind::kSharedFolder}};
    for (const std::string& name : reports::report_file_names())
      outputs.push_back({fmt::format("--out's {}", name), out_dir / name, OutputKind::kFile});
    if (!results_json.empty()) {
      outputs.push_back({"--results' .json", results_json, OutputKind::kFile});
      outputs.push_back({"--results' .md", results_md, OutputKind::kFile});
      check_output_file("bench recipes", outputs[outputs.size() - 2]);
      check_output_file("bench recipes", outputs.back());
    }
    check_outputs_apart("bench recipes", {}, outputs);
    prepare_output_folder("bench recipes", outputs.front(), reports::report_file_names());
  }

  kernels::RankContext ctx;
  ctx.device = o.device;
  kernels::ScopedRankContext scoped(ctx);
  const engine::RecipeBenchReport rep = engine::run_recipe_bench(o);
  const std::string gpu_name = o.device.is_cpu() ? "" : rep.device_name;

  reports::RunRecord run = bench_recipes_record(rep, o, o.device.str(), gpu_name);
  run.environment = collect_environment(kernels::cuda_status().usable);
  run.environment.active_backend = o.device.str();
  run.start_time = reports::format_utc(std::chrono::duration_cast<std::chrono::seconds>(
                                           std::chrono::system_clock::now().time_since_epoch())
                                           .count());
  run.command_line = {
      "meshproof",   "bench",         "recipes",
      "--backend",   options.backend, "--model",
      options.model, "--activation",  std::string(engine::activation_name(o.model.activation))};
  for (const auto& [flag, value] : {std::pair<const char*, std::string>{"--shapes", options.shapes},
                                    {"--m-sweep", options.m_sweep},
                                    {"--recipes", options.recipes}}) {
    if (value.empty()) continue;
    run.command_line.push_back(flag);
    run.command_line.push_back(value);
  }
  for (const std::string& a :
       {std::string("--iters"), std::to_string(options.iters), std::string("--warmup"),
        std::to_string(options.warmup), std::string("--steps"), std::to_string(options.steps),
        std::string("--out"), options.out_dir}) {
    run.command_line.push_back(a);
  }
  if (!options.results.empty()) {
    run.command_line.push_back("--results");
    run.command_line.push_back(options.results);
  }
  run.duration_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (reports::ScenarioRecord& s : run.scenarios) s.duration_s = run.duration_s;

  fmt::print(out, "# meshproof bench recipes on {} ({}), last-level cache {} MiB{}\n",
             rep.device_name, o.device.str(), rep.cache_bytes >> 20,
             o.device.is_cpu() ? "; every figure is a CPU emulation (no MFU)" : "");
  fmt::print(out, "# median of {} repetitions after {} warm-up; {} timing\n", o.iters, o.warmup,
             o.device.is_cpu() ? "steady_clock" : "cudaEvent");
  fmt::print(out, "{:<10} {:<36} {:<20} {:>12} {:<9} {:>10} {:>7}  {:<22} {}\n", "scenario",
             "benchmark", "metric", "value", "unit", "ceiling", "ratio", "ceiling source",
             "emulated");
  for (const reports::ScenarioRecord& s : run.scenarios) {
    const std::string scen = s.name.substr(s.name.find('.') + 1);
    for (const BenchmarkFigure& f : s.benchmarks) {
      fmt::print(out, "{:<10} {:<36} {:<20} {:>12.4g} {:<9} {:>10} {:>7}  {:<22} {}\n", scen,
                 f.name, f.metric, f.value, f.unit,
                 f.ceiling ? fmt::format("{:.4g}", *f.ceiling) : std::string("-"),
                 f.ratio ? fmt::format("{:.3f}", *f.ratio) : std::string("-"),
                 f.ceiling_source.empty() ? std::string("-") : f.ceiling_source,
                 f.emulated.empty() ? std::string("-") : "emulated (" + f.emulated + ")");
    }
    for (const std::string& n : s.notes) fmt::print(out, "{:<10} note: {}\n", scen, n);
  }
  try {
    const reports::ReportPaths paths = reports::write_reports(run, options.out_dir);
    fmt::print(out, "# wrote {}, {}, {}, {}\n", paths.json.string(), paths.markdown.string(),
               paths.junit.string(), paths.html.string());
    if (!results_json.empty()) {
      reports::write_file_atomically(results_json, reports::render_json(run));
      reports::write_file_atomically(results_md, reports::render_markdown(run));
      fmt::print(out, "# wrote results {}, {}\n", results_json.string(), results_md.string());
    }
  } catch (const reports::ReportError& e) {
    if (e.kind() == reports::ReportError::Kind::kInput)
      MP_FAIL_INPUT("bench recipes: {}", e.what());
    MP_FAIL("bench recipes: {}", e.what());
  }
  return reports::run_verdict(run) == reports::Verdict::kPass ? kExitOk : kExitCheckFailed;
}

void add_bench_recipes_command(CLI::App& app, std::ostream& out, int& exit_code) {
  // `bench` may already exist (bench comm registers it too).
  CLI::App* bench = nullptr;
  for (CLI::App* sub : app.get_subcommands([](CLI::App* a) { return a->get_name() == "bench"; })) {
    bench = sub;
  }
  if (bench == nullptr) {
    bench = app.add_subcommand("bench", "Benchmarks (comm: collectives; recipes: quantization)");
    bench->require_subcommand(1);
  }
  auto* cmd = bench->add_subcommand(
      "recipes",
      "Per recipe and per GEMM of a model's linears: BF16 vs recipe GEMM time, quantization time, "
      "autocast and pre-quantized speedups; M sweep; layer step, tokens/s, MFU, memory; loss "
      "after N steps; writes the reports");
  auto opts = std::make_shared<BenchRecipesOptions>();
  cmd->add_option("--backend", opts->backend, "cpu, cuda or auto")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}))
      ->capture_default_str();
  cmd->add_option("--model", opts->model,
                  fmt::format("model preset ({}: its sizes and architecture at seq 128, "
                              "micro-batch 4) or hidden,ffn,heads,kv_heads,seq,micro_batch",
                              fmt::join(kModelPresetNames, ", ")))
      ->capture_default_str();
  cmd->add_option("--activation", opts->activation,
                  "gelu, relu or swiglu (fc1_gate + fc1_up); default: the preset's, else gelu");
  cmd->add_option("--shapes", opts->shapes, "extra GEMM shapes MxNxK,... (multiples of 32)");
  cmd->add_option("--m-sweep", opts->m_sweep,
                  "tokens M for the forward sweep at the model's N, K (multiples of 16)");
  cmd->add_option("--recipes", opts->recipes, "recipes to measure, comma-separated (default all)");
  cmd->add_option("--iters", opts->iters, "timed repetitions per figure (median)")
      ->capture_default_str();
  cmd->add_option("--warmup", opts->warmup, "untimed repetitions before them")
      ->capture_default_str();
  cmd->add_option("--steps", opts->steps,
                  "train N steps per recipe (and bf16, fp32) from the same init and data")
      ->capture_default_str();
  cmd->add_option("--out", opts->out_dir, "directory for report.json/.md/junit.xml/.html")
      ->capture_default_str();
  cmd->add_option("--results", opts->results,
                  "also write PREFIX.json and PREFIX.md, e.g. reports/results/h100");
  cmd->callback([&out, &exit_code, opts] { exit_code = bench_recipes(*opts, out); });
}

}  // namespace meshproof::harness
