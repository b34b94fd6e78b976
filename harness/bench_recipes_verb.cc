#include "harness/bench_recipes_verb.h"

#include <fmt/format.h>
#include <fmt/ostream.h>

#include <CLI/CLI.hpp>
#include <chrono>
#include <cmath>
#include <memory>

#include "harness/env_verb.h"
#include "harness/exit_codes.h"
#include "kernels/device.h"
#include "kernels/error.h"
#include "reports/perf_metrics.h"
#include "reports/report_error.h"
#include "reports/report_writers.h"

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
  nlohmann::json config = {{"shapes", nlohmann::json::array()},
                           {"layer",
                            {{"hidden", o.layer.hidden},
                             {"ffn", o.layer.ffn},
                             {"heads", o.layer.heads},
                             {"seq", o.layer.seq},
                             {"batch", o.layer.batch}}},
                           {"iters", o.iters},
                           {"warmup", o.warmup},
                           {"device", rep.device_name},
                           {"cache_bytes", rep.cache_bytes}};
  for (const engine::GemmShape& s : o.shapes) config["shapes"].push_back(s.str());

  // Ceilings: measured copy bandwidth and bf16 GEMMs (the calibration for GPUs not in the table).
  reports::ScenarioRecord ceil;
  ceil.name = "recipes.ceilings";
  ceil.recipe = "bf16";
  ceil.mesh = "single device";
  ceil.backend = backend;
  ceil.config = config;
  const double copy_gbps = gbps(rep.copy);
  ceil.benchmarks.push_back(
      with_range(figure(o.device.is_cpu() ? "copy host memcpy" : "copy cudaMemcpy d2d", "gbps",
                        copy_gbps, "GB/s", std::nullopt, ""),
                 rep.copy, rep.copy.bytes / 1e9));
  double bf16_best = 0;
  const std::optional<double> bf16_table = reports::table_peak_tflops(gpu_name, "bf16");
  for (const engine::GemmFigure& g : rep.bf16_gemms) {
    const double t = tflops(g.m);
    bf16_best = std::max(bf16_best, t);
    ceil.benchmarks.push_back(
        with_range(figure(fmt::format("bf16 gemm fprop {}", g.shape.str()), "tflops", t, "TFLOP/s",
                          bf16_table, gpu_name.empty() ? "" : "table:" + gpu_name + " bf16"),
                   g.m, g.m.flops / 1e12));
  }
  ceil.checks.push_back(measured_check(ceil));
  run.scenarios.push_back(std::move(ceil));

  for (const engine::RecipeBenchResult& r : rep.recipes) {
    reports::ScenarioRecord s;
    s.recipe = std::string(engine::recipe_name(r.recipe));
    s.name = "recipes." + s.recipe;
    s.mesh = "single device";
    s.backend = backend;
    s.config = config;
    s.config["gemm_dtype"] = r.gemm_dtype;
    s.notes = r.notes;
    const reports::PeakTflops peak = reports::resolve_peak_tflops(
        gpu_name, r.gemm_dtype, bf16_best > 0 ? std::optional(bf16_best) : std::nullopt);
    const std::string peak_source =
        peak.source == "calibration" ? "calibration:measured bf16 gemm" : peak.source;
    for (const engine::QuantizeFigure& q : r.quantize) {
      s.benchmarks.push_back(
          with_range(figure(fmt::format("{} {} {}x{}",
                                        r.recipe == engine::RecipeKind::kBf16 ? "cast" : "quantize",
                                        q.operand, q.rows, q.cols),
                            "gbps", gbps(q.m), "GB/s", copy_gbps, "measured:copy"),
                     q.m, q.m.bytes / 1e9));
    }
    for (const engine::GemmFigure& g : r.gemms) {
      s.benchmarks.push_back(with_range(
          figure(fmt::format("gemm {} {}", kernels::gemm_role_name(g.role), g.shape.str()),
                 "tflops", tflops(g.m), "TFLOP/s", peak.tflops, peak_source),
          g.m, g.m.flops / 1e12));
    }
    if (r.layer) {
      const engine::LayerFigure& l = *r.layer;
      const reports::ModelShape shape{1, o.layer.hidden, o.layer.ffn, l.vocab, o.layer.seq, false};
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
      BenchmarkFigure t = with_range(
          figure("layer step", "step_time_ms", l.m.seconds * 1e3, "ms", std::nullopt, ""), l.m, 0);
      t.higher_is_better = false;
      s.benchmarks.push_back(t);
      s.benchmarks.push_back(with_range(
          figure("layer step", "tokens_per_s", p.tokens_per_s, "tokens/s", std::nullopt, ""), l.m,
          p.tokens_per_step));
      s.benchmarks.push_back(with_range(
          figure("layer step", "tflops", p.tflops_per_device, "TFLOP/s", peak.tflops, peak_source),
          l.m, p.model_flops_per_step / 1e12));
    }
    s.checks.push_back(measured_check(s));
    run.scenarios.push_back(std::move(s));
  }
  return run;
}

int bench_recipes(const BenchRecipesOptions& options, std::ostream& out) {
  const auto t0 = std::chrono::steady_clock::now();
  engine::RecipeBenchOptions o;
  o.shapes = engine::parse_gemm_shapes(options.shapes);
  o.layer = engine::parse_layer_shape(options.layer);
  o.iters = options.iters;
  o.warmup = options.warmup;
  MP_CHECK_INPUT(o.iters >= 1, "--iters must be at least 1 (got {})", o.iters);
  MP_CHECK_INPUT(o.warmup >= 0, "--warmup must be non-negative (got {})", o.warmup);
  MP_CHECK_INPUT(!options.out_dir.empty(), "--out is empty");
  o.device = kernels::resolve_backend(options.backend);

  kernels::RankContext ctx;
  ctx.device = o.device;
  kernels::ScopedRankContext scoped(ctx);
  const engine::RecipeBenchReport rep = engine::run_recipe_bench(o);
  const std::string gpu_name = o.device.is_cpu() ? "" : rep.device_name;

  reports::RunRecord run = bench_recipes_record(rep, o, o.device.str(), gpu_name);
  run.environment = collect_environment();
  run.environment.active_backend = o.device.str();
  run.start_time = reports::format_utc(std::chrono::duration_cast<std::chrono::seconds>(
                                           std::chrono::system_clock::now().time_since_epoch())
                                           .count());
  run.command_line = {"meshproof",
                      "bench",
                      "recipes",
                      "--backend",
                      options.backend,
                      "--shapes",
                      options.shapes,
                      "--layer",
                      options.layer,
                      "--iters",
                      std::to_string(options.iters),
                      "--warmup",
                      std::to_string(options.warmup),
                      "--out",
                      options.out_dir};
  run.duration_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (reports::ScenarioRecord& s : run.scenarios) s.duration_s = run.duration_s;

  fmt::print(out, "# meshproof bench recipes on {} ({}), last-level cache {} MiB\n",
             rep.device_name, o.device.str(), rep.cache_bytes >> 20);
  fmt::print(out, "# median of {} iterations after {} warm-up; {} timing\n", o.iters, o.warmup,
             o.device.is_cpu() ? "steady_clock" : "cudaEvent");
  fmt::print(out, "{:<10} {:<32} {:<13} {:>12} {:<9} {:>10} {:>7}  {}\n", "scenario", "benchmark",
             "metric", "value", "unit", "ceiling", "ratio", "ceiling source");
  for (const reports::ScenarioRecord& s : run.scenarios) {
    const std::string scen = s.name.substr(s.name.find('.') + 1);
    for (const BenchmarkFigure& f : s.benchmarks) {
      fmt::print(out, "{:<10} {:<32} {:<13} {:>12.4g} {:<9} {:>10} {:>7}  {}\n", scen, f.name,
                 f.metric, f.value, f.unit,
                 f.ceiling ? fmt::format("{:.4g}", *f.ceiling) : std::string("-"),
                 f.ratio ? fmt::format("{:.3f}", *f.ratio) : std::string("-"), f.ceiling_source);
    }
    for (const std::string& n : s.notes) fmt::print(out, "{:<10} note: {}\n", scen, n);
  }
  try {
    const reports::ReportPaths paths = reports::write_reports(run, options.out_dir);
    fmt::print(out, "# wrote {}, {}, {}, {}\n", paths.json.string(), paths.markdown.string(),
               paths.junit.string(), paths.html.string());
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
      "Per recipe: quantizer GB/s, GEMM TFLOP/s per role and one transformer layer's step time, "
      "beside the copy-bandwidth and GEMM ceilings; writes the reports");
  auto opts = std::make_shared<BenchRecipesOptions>();
  cmd->add_option("--backend", opts->backend, "cpu, cuda or auto")
      ->check(CLI::IsMember({"cpu", "cuda", "auto"}))
      ->capture_default_str();
  cmd->add_option("--shapes", opts->shapes, "GEMM shapes MxNxK,... (multiples of 32)")
      ->capture_default_str();
  cmd->add_option("--layer", opts->layer, "layer hidden,ffn,heads,seq,batch")
      ->capture_default_str();
  cmd->add_option("--iters", opts->iters, "timed iterations per figure (median)")
      ->capture_default_str();
  cmd->add_option("--warmup", opts->warmup, "untimed iterations before them")
      ->capture_default_str();
  cmd->add_option("--out", opts->out_dir, "directory for report.json/.md/junit.xml/.html")
      ->capture_default_str();
  cmd->callback([&out, &exit_code, opts] { exit_code = bench_recipes(*opts, out); });
}

}  // namespace meshproof::harness
