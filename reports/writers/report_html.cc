// report.html: one self-contained XHTML-compatible page. Plots are inline SVG from svg.h; there
// are no scripts and no external references (fonts, styles, images), so the file opens offline
// and can be attached to a CI run as is.
#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <map>
#include <set>

#include "reports/writers/report_text.h"
#include "reports/writers/report_writers.h"
#include "reports/writers/svg.h"
#include "reports/writers/xml_text.h"

namespace meshproof::reports {
namespace {

constexpr const char* kStyle =
    "body{font-family:sans-serif;margin:24px;color:#222;max-width:1400px}"
    "table{border-collapse:collapse;margin:8px 0 16px 0}"
    "th,td{border:1px solid #ccc;padding:4px 8px;text-align:left;vertical-align:top}"
    "td.num{text-align:right;font-variant-numeric:tabular-nums}"
    "th{background:#f3f3f3}"
    ".pass{background:#d9f2d9}.fail{background:#f8d0d0}.error{background:#f5c08a}"
    ".skipped{background:#e6e6e6}"
    ".plots{display:flex;flex-wrap:wrap;gap:12px}"
    ".plot{border:1px solid #ddd}"
    "code{background:#f6f6f6;padding:1px 3px;word-break:break-all}"
    "section{border-top:2px solid #999;margin-top:24px}";

std::string esc(std::string_view s) { return xml_escape(s); }

const std::string& part_color(const std::string& part) {
  static const std::map<std::string, std::string> kColors = {
      {"compute", "#1f77b4"},    {"all_gather", "#ff7f0e"}, {"reduce_scatter", "#2ca02c"},
      {"all_reduce", "#d62728"}, {"broadcast", "#bcbd22"},  {"reduce", "#17becf"},
      {"all_to_all", "#e377c2"}, {"optimizer", "#9467bd"},  {"checkpoint", "#8c564b"},
      {"other", "#7f7f7f"}};
  static const std::string kDefault = "#000000";
  const auto it = kColors.find(part);
  return it == kColors.end() ? kDefault : it->second;
}

std::string verdict_cell(Verdict v) {
  const std::string_view n = verdict_name(v);
  return fmt::format(R"(<td class="{0}">{0}</td>)", n);
}

// `bench recipes` plots of one recipe scenario (docs/design.md section 26), from its benchmark
// figures and config: the speedup over BF16 per GEMM (bars: autocast, ticks: pre-quantized), the
// forward M sweep's autocast speedup per linear (lines over M), and the loss difference against
// bf16 and fp32 per training step (config.convergence). Scenarios without them get none.
std::vector<std::string> bench_plots(const ScenarioRecord& s) {
  std::vector<std::string> plots;
  const std::string emulated = [&] {
    for (const BenchmarkFigure& b : s.benchmarks) {
      if (!b.emulated.empty()) return " (emulated: " + b.emulated + ")";
    }
    return std::string();
  }();
  svg::StackedBars bars;
  bars.title = "Speedup over BF16 at the same shape: " + s.name + emulated;
  bars.x_label = "GEMM";
  bars.y_label = "speedup (x)";
  bars.segment_labels = {"autocast (GEMM + quantization)"};
  bars.segment_colors = {svg::palette(0)};
  bars.values.assign(1, {});
  bars.marker_label = "pre-quantized (GEMM only)";
  // The sweep: linear -> (M, autocast speedup).
  std::map<std::string, std::vector<std::pair<double, double>>> sweep;
  std::vector<std::string> sweep_order;
  for (const BenchmarkFigure& b : s.benchmarks) {
    if (b.metric != "speedup_autocast") continue;
    if (b.name.rfind("sweep ", 0) == 0) {
      // "sweep qkv fprop 16x768x256"
      const size_t a = b.name.find(' ', 6);
      const size_t d = b.name.rfind(' ');
      if (a == std::string::npos || d == std::string::npos) continue;
      const std::string linear = b.name.substr(6, a - 6);
      const double m = std::strtod(b.name.c_str() + d + 1, nullptr);
      if (!sweep.count(linear)) sweep_order.push_back(linear);
      sweep[linear].emplace_back(m, b.value);
      continue;
    }
    double pre = std::nan("");
    for (const BenchmarkFigure& q : s.benchmarks) {
      if (q.name == b.name && q.metric == "speedup_prequantized") pre = q.value;
    }
    bars.categories.push_back(b.name.substr(0, b.name.rfind(' ')));  // "qkv fprop"
    bars.values[0].push_back(b.value);
    bars.markers.push_back(pre);
  }
  if (!bars.categories.empty()) {
    bars.width = std::max(660, 40 * static_cast<int>(bars.categories.size()) + 120);
    plots.push_back(svg::render_stacked_bars(bars));
  }
  if (!sweep.empty()) {
    svg::LinePlot line;
    line.title = "Small-M sweep (fprop): " + s.name + emulated;
    line.x_label = "M (tokens)";
    line.y_label = "autocast speedup over BF16 (x)";
    for (size_t i = 0; i < sweep_order.size(); ++i) {
      svg::Series series{sweep_order[i], {}, {}, svg::palette(i), false, true};
      for (const auto& [m, v] : sweep[sweep_order[i]]) {
        series.x.push_back(m);
        series.y.push_back(v);
      }
      line.series.push_back(std::move(series));
    }
    plots.push_back(svg::render_line_plot(line));
  }
  if (s.config.is_object() && s.config.contains("convergence")) {
    const nlohmann::json& c = s.config.at("convergence");
    auto values = [&](const char* key) {
      std::vector<double> v;
      if (c.contains(key) && c.at(key).is_array()) {
        for (const nlohmann::json& x : c.at(key)) v.push_back(x.is_number() ? x.get<double>() : 0);
      }
      return v;
    };
    const std::vector<double> loss = values("loss"), bf16 = values("bf16_loss"),
                              fp32 = values("fp32_loss");
    if (!loss.empty() && loss.size() == bf16.size() && loss.size() == fp32.size()) {
      svg::LinePlot diff;
      diff.title = "Loss difference per step: " + s.name + emulated;
      diff.x_label = "step";
      diff.y_label = "loss difference (nats)";
      svg::Series vb{"minus bf16", {}, {}, svg::palette(0), false, true};
      svg::Series vf{"minus fp32", {}, {}, svg::palette(1), true, true};
      for (size_t i = 0; i < loss.size(); ++i) {
        vb.x.push_back(static_cast<double>(i + 1));
        vb.y.push_back(loss[i] - bf16[i]);
        vf.x.push_back(static_cast<double>(i + 1));
        vf.y.push_back(loss[i] - fp32[i]);
      }
      diff.series = {std::move(vb), std::move(vf)};
      plots.push_back(svg::render_line_plot(diff));
    }
  }
  return plots;
}

// Plots of one scenario, in the order documented in docs/report-schema.md.
std::vector<std::string> scenario_plots(const ScenarioRecord& s) {
  std::vector<std::string> plots;
  if (!s.steps.empty()) {
    svg::LinePlot loss;
    loss.title = s.golden ? "Loss vs golden: " + s.name : "Loss: " + s.name;
    loss.x_label = "step";
    loss.y_label = "loss";
    svg::Series run{"this run", {}, {}, svg::palette(0), false, true};
    for (const StepMetrics& m : s.steps) {
      run.x.push_back(static_cast<double>(m.step));
      run.y.push_back(m.loss);
    }
    loss.series.push_back(run);
    if (s.golden) {
      // Golden drawn last, dashed, so that it stays visible where the two lines coincide.
      svg::Series gold{"golden", {}, {}, svg::palette(1), true, false};
      for (const GoldenStep& g : s.golden->steps) {
        gold.x.push_back(static_cast<double>(g.step));
        gold.y.push_back(g.loss);
      }
      loss.series.push_back(gold);
    }
    if (s.entropy_floor) {
      // The data's entropy rate, the loss no model beats: a labelled dashed horizontal line, but
      // only where it lies inside the axis range the loss curves give on their own. Far below
      // them (early training) it would squash the curves into a flat line at the top; then the
      // title says where it is instead.
      double lo = std::numeric_limits<double>::infinity(), hi = -lo;
      for (const svg::Series& c : loss.series) {
        for (double y : c.y) {
          if (!std::isfinite(y)) continue;
          lo = std::min(lo, y);
          hi = std::max(hi, y);
        }
      }
      const svg::Ticks axis = svg::nice_ticks(lo, hi);
      const double f = *s.entropy_floor;
      if (std::isfinite(lo) && f >= axis.lo && f <= axis.hi) {
        svg::Series floor_line{
            fmt::format("entropy floor {:.4g}", f), {}, {}, svg::palette(3), true, false};
        floor_line.x = {static_cast<double>(s.steps.front().step),
                        static_cast<double>(s.steps.back().step)};
        floor_line.y = {f, f};
        loss.series.push_back(floor_line);
      } else {
        loss.title += fmt::format(" (entropy floor {:.4g}, {} the range)", f,
                                  std::isfinite(lo) && f < axis.lo ? "below" : "outside");
      }
    }
    plots.push_back(svg::render_line_plot(loss));

    if (s.golden) {
      // Relative difference (x - g)/|g| and the band |x - g| <= atol + rtol*|g| in the same units.
      std::map<int64_t, double> golden_loss;
      for (const GoldenStep& g : s.golden->steps) golden_loss[g.step] = g.loss;
      const ToleranceBand& t = s.golden->tolerance;
      svg::LinePlot rel;
      rel.title = "Relative difference of loss vs golden: " + s.name;
      rel.x_label = "step";
      rel.y_label = "(loss - golden) / |golden|";
      svg::Band band{fmt::format("tolerance (rtol {:g}, atol {:g})", t.rtol, t.atol),
                     {},
                     {},
                     {},
                     svg::palette(2)};
      svg::Series diff{"relative difference", {}, {}, svg::palette(3), false, true};
      for (const StepMetrics& m : s.steps) {
        const auto it = golden_loss.find(m.step);
        if (it == golden_loss.end() || it->second == 0 || !std::isfinite(it->second)) continue;
        const double g = it->second;
        const double half = t.rtol + t.atol / std::abs(g);
        band.x.push_back(static_cast<double>(m.step));
        band.lo.push_back(-half);
        band.hi.push_back(half);
        diff.x.push_back(static_cast<double>(m.step));
        diff.y.push_back((m.loss - g) / std::abs(g));
      }
      rel.bands.push_back(band);
      rel.series.push_back(diff);
      plots.push_back(svg::render_line_plot(rel));
    }

    // grad_norm of this run against the golden's (when the golden has one): the second metric
    // the golden check compares.
    bool golden_norm = false;
    if (s.golden) {
      for (const GoldenStep& g : s.golden->steps) golden_norm = golden_norm || g.grad_norm != 0;
    }
    svg::LinePlot norm;
    norm.title = golden_norm ? "Grad norm vs golden: " + s.name : "Grad norm: " + s.name;
    norm.x_label = "step";
    norm.y_label = "grad_norm";
    svg::Series run_norm{"this run", {}, {}, svg::palette(0), false, true};
    for (const StepMetrics& m : s.steps) {
      run_norm.x.push_back(static_cast<double>(m.step));
      run_norm.y.push_back(m.grad_norm);
    }
    norm.series.push_back(run_norm);
    if (golden_norm) {
      svg::Series gold{"golden", {}, {}, svg::palette(1), true, false};
      for (const GoldenStep& g : s.golden->steps) {
        gold.x.push_back(static_cast<double>(g.step));
        gold.y.push_back(g.grad_norm);
      }
      norm.series.push_back(gold);
    }
    plots.push_back(svg::render_line_plot(norm));

    // Step-time breakdown, milliseconds, stacked: compute, each collective kind, optimizer,
    // checkpoint, other (the unattributed remainder).
    std::set<CollectiveKind> kinds;
    for (const StepMetrics& m : s.steps) {
      for (const CollectiveTime& c : m.time.collectives) kinds.insert(c.kind);
    }
    svg::StackedBars bars;
    bars.title = "Step time breakdown: " + s.name;
    bars.x_label = "step";
    bars.y_label = "time (ms)";
    bars.segment_labels.push_back("compute");
    for (CollectiveKind k : kinds) bars.segment_labels.push_back(std::string(collective_name(k)));
    bars.segment_labels.push_back("optimizer");
    bars.segment_labels.push_back("checkpoint");
    bars.segment_labels.push_back("other");
    // Fixed colour per part, so that the same part has the same colour in every scenario.
    for (const std::string& label : bars.segment_labels)
      bars.segment_colors.push_back(part_color(label));
    bars.values.assign(bars.segment_labels.size(), {});
    for (const StepMetrics& m : s.steps) {
      bars.categories.push_back(std::to_string(m.step));
      size_t seg = 0;
      double attributed = m.time.compute_s + m.time.optimizer_s + m.time.checkpoint_s;
      bars.values[seg++].push_back(m.time.compute_s * 1e3);
      for (CollectiveKind k : kinds) {
        double sum = 0;
        for (const CollectiveTime& c : m.time.collectives) {
          if (c.kind == k) sum += c.seconds;
        }
        attributed += sum;
        bars.values[seg++].push_back(sum * 1e3);
      }
      bars.values[seg++].push_back(m.time.optimizer_s * 1e3);
      bars.values[seg++].push_back(m.time.checkpoint_s * 1e3);
      bars.values[seg++].push_back(std::max(0.0, m.time.total_s - attributed) * 1e3);
    }
    plots.push_back(svg::render_stacked_bars(bars));
  }

  if (!s.memory.empty()) {
    int64_t max_bytes = 0;
    for (const RankMemory& m : s.memory) {
      max_bytes = std::max({max_bytes, m.peak_bytes,
                            m.params_bytes + m.grads_bytes + m.optimizer_bytes +
                                m.gathered_weights_bytes + m.activations_bytes});
    }
    const bool gib = max_bytes >= (int64_t{1} << 30);
    const double unit = gib ? 1024.0 * 1024 * 1024 : 1024.0 * 1024;
    svg::StackedBars mem;
    mem.title = "Memory per rank: " + s.name;
    mem.x_label = "rank";
    mem.y_label = gib ? "GiB" : "MiB";
    mem.segment_labels = {"params", "grads", "optimizer", "gathered weights", "activations"};
    for (size_t i = 0; i < mem.segment_labels.size(); ++i)
      mem.segment_colors.push_back(svg::palette(i));
    mem.values.assign(mem.segment_labels.size(), {});
    mem.marker_label = "peak";
    for (const RankMemory& m : s.memory) {
      mem.categories.push_back(std::to_string(m.rank));
      mem.values[0].push_back(static_cast<double>(m.params_bytes) / unit);
      mem.values[1].push_back(static_cast<double>(m.grads_bytes) / unit);
      mem.values[2].push_back(static_cast<double>(m.optimizer_bytes) / unit);
      mem.values[3].push_back(static_cast<double>(m.gathered_weights_bytes) / unit);
      mem.values[4].push_back(static_cast<double>(m.activations_bytes) / unit);
      mem.markers.push_back(static_cast<double>(m.peak_bytes) / unit);
    }
    plots.push_back(svg::render_stacked_bars(mem));
  }
  for (std::string& p : bench_plots(s)) plots.push_back(std::move(p));
  return plots;
}

std::string summary_table(const RunRecord& r) {
  std::string out =
      "<table id=\"summary\"><thead><tr><th>scenario</th><th>mesh</th><th>recipe</th>"
      "<th>checks</th><th>verdict</th><th>step time (ms)</th><th>MFU</th></tr></thead><tbody>\n";
  for (size_t i = 0; i < r.scenarios.size(); ++i) {
    const ScenarioRecord& s = r.scenarios[i];
    out += fmt::format(
        R"(<tr><td><a href="#scenario-{}">{}</a></td><td>{}</td><td>{}</td><td>{}</td>{}<td class="num">{}</td><td class="num">{}</td></tr>)"
        "\n",
        i, esc(s.name), esc(s.mesh), esc(s.recipe), esc(checks_tally(s)),
        verdict_cell(scenario_verdict(s)), step_time_ms(s), mfu_percent(s));
  }
  return out + "</tbody></table>\n";
}

std::string scenario_section(const ScenarioRecord& s, size_t index) {
  std::string out = fmt::format(R"(<section id="scenario-{}"><h2>{}: {}</h2>)", index, esc(s.name),
                                verdict_name(scenario_verdict(s)));
  out += "\n<table><tbody>";
  auto row = [&](std::string_view k, const std::string& v) {
    out += fmt::format("<tr><th>{}</th><td>{}</td></tr>", k, v);
  };
  row("expectation", std::string(expectation_name(s.expectation)));
  if (s.expectation == Expectation::kCaught) row("caught by", esc(join_names(s.caught_by)));
  if (const std::string why = verdict_reason(s); !why.empty()) row("why", esc(why));
  row("mesh", esc(s.mesh));
  row("recipe", esc(s.recipe));
  row("backend", esc(s.backend));
  row("steps", fmt::format("{} in {:.2f} s", s.steps.size(), s.duration_s));
  if (s.golden) {
    const ToleranceBand& t = s.golden->tolerance;
    row("golden",
        fmt::format("<code>{}</code> ({}, rtol {:g}, atol {:g}, {} failing steps allowed)",
                    esc(s.golden->source), esc(t.mode), t.rtol, t.atol, t.allowed_failing_steps));
  }
  if (s.entropy_floor) {
    row("data entropy floor", fmt::format("{:.6f} nats/token", *s.entropy_floor));
  }
  if (!s.error.empty()) row("error", esc(s.error));
  row("config", "<code>" + esc(config_text(s)) + "</code>");
  out += "</tbody></table>\n";

  if (!s.checks.empty()) {
    out +=
        "<h3>Checks</h3><table class=\"checks\"><thead><tr><th>check</th><th>kind</th>"
        "<th>verdict</th><th>message</th><th>evidence</th></tr></thead><tbody>\n";
    for (const CheckResult& c : s.checks) {
      out += fmt::format("<tr><td>{}</td><td>{}</td>{}<td>{}</td><td>{}</td></tr>\n", esc(c.name),
                         esc(c.kind), verdict_cell(c.verdict), esc(c.message),
                         c.evidence ? esc(evidence_summary(*c.evidence)) : std::string());
    }
    out += "</tbody></table>\n";
  }
  if (s.performance) {
    const PerformanceFigures& p = *s.performance;
    out += "<h3>Performance</h3><table><tbody>";
    row("steady-state window",
        fmt::format("steps {}..{} ({} warm-up steps excluded)", p.warmup_steps + 1,
                    p.warmup_steps + p.steady_steps, p.warmup_steps));
    row("median step time", fmt::format("{:.3f} ms", p.median_step_time_s * 1e3));
    row("tokens/s", fmt::format("{:.4g}", p.tokens_per_s));
    row("model TFLOP/s per device",
        fmt::format("{:.4g} ({} devices)", p.tflops_per_device, p.num_devices));
    row("peak", p.peak_tflops ? fmt::format("{:g} TFLOP/s {} ({})", *p.peak_tflops,
                                            esc(p.gemm_dtype), esc(p.peak_source))
                              : std::string("unknown"));
    row("MFU", mfu_percent(s));
    out += "</tbody></table>\n";
  }

  const std::vector<std::string> plots = scenario_plots(s);
  if (!plots.empty()) {
    out += "<h3>Plots</h3><div class=\"plots\">\n";
    for (const std::string& p : plots) out += "<div class=\"plot\">" + p + "</div>\n";
    out += "</div>\n";
  }

  if (!s.memory.empty()) {
    out +=
        "<h3>Memory per rank</h3><table><thead><tr><th>rank</th><th>params</th><th>grads</th>"
        "<th>optimizer</th><th>gathered weights</th><th>activations</th><th>peak</th></tr>"
        "</thead><tbody>\n";
    for (const RankMemory& m : s.memory) {
      out += fmt::format(
          R"(<tr><td class="num">{}</td><td class="num">{}</td><td class="num">{}</td><td class="num">{}</td><td class="num">{}</td><td class="num">{}</td><td class="num">{}</td></tr>)"
          "\n",
          m.rank, format_bytes(m.params_bytes), format_bytes(m.grads_bytes),
          format_bytes(m.optimizer_bytes), format_bytes(m.gathered_weights_bytes),
          format_bytes(m.activations_bytes), format_bytes(m.peak_bytes));
    }
    out += "</tbody></table>\n";
  }
  if (!s.pipeline.empty()) {
    out += fmt::format(
        "<h3>Pipeline stages</h3><p>{}.</p><table><thead><tr><th>stage</th><th>ranks</th>"
        "<th>layers</th><th>forward (ms)</th><th>backward (ms)</th><th>p2p wait (ms)</th>"
        "<th>reduction (ms)</th><th>optimizer (ms)</th><th>step (ms)</th><th>bubble</th>"
        "<th>predicted bubble</th><th>peak memory per rank</th></tr></thead><tbody>\n",
        esc(pipeline_caption(s)));
    for (const PipelineStageRecord& p : s.pipeline) {
      const PipelinePhases& m = p.mean;
      out += fmt::format(
          R"(<tr><td class="num">{}</td><td>{}</td><td>{}</td><td class="num">{:.3f}</td><td class="num">{:.3f}</td><td class="num">{:.3f}</td><td class="num">{:.3f}</td><td class="num">{:.3f}</td><td class="num">{:.3f}</td><td class="num">{}</td><td class="num">{}</td><td>{}</td></tr>)"
          "\n",
          p.stage, esc(stage_ranks_text(p)), esc(stage_layers_text(p)), m.forward_s * 1e3,
          m.backward_s * 1e3, m.p2p_wait_s * 1e3, m.reduction_s * 1e3, m.optimizer_s * 1e3,
          m.step_s * 1e3, fraction_text(p.bubble_fraction),
          fraction_text(p.predicted_bubble_fraction), esc(stage_peaks_text(p)));
    }
    out += "</tbody></table>\n";
  }
  if (!s.collectives.empty()) {
    out +=
        "<h3>Collectives</h3><table><thead><tr><th>kind</th><th>group</th><th>n</th>"
        "<th>calls</th><th>bytes</th><th>time (ms)</th><th>algbw (GB/s)</th>"
        "<th>busbw (GB/s)</th></tr></thead><tbody>\n";
    for (const CollectiveStats& c : s.collectives) {
      out += fmt::format(
          R"(<tr><td>{}</td><td>{}</td><td class="num">{}</td><td class="num">{}</td><td class="num">{}</td><td class="num">{:.3f}</td><td class="num">{:.2f}</td><td class="num">{:.2f}</td></tr>)"
          "\n",
          collective_name(c.kind), esc(c.group), c.group_size, c.count, format_bytes(c.bytes),
          c.time_s * 1e3, c.algbw_gbps, c.busbw_gbps);
    }
    out += "</tbody></table>\n";
  }
  if (!s.benchmarks.empty()) {
    out +=
        "<h3>Benchmarks</h3><table><thead><tr><th>benchmark</th><th>metric</th><th>value</th>"
        "<th>unit</th><th>ceiling</th><th>ceiling source</th><th>ratio</th></tr></thead><tbody>\n";
    auto opt = [](const std::optional<double>& v, const char* f) {
      return v ? fmt::format(fmt::runtime(f), *v) : std::string("n/a");
    };
    for (const BenchmarkFigure& b : s.benchmarks) {
      out += fmt::format(
          R"(<tr><td>{}</td><td>{}</td><td class="num">{:.4g}</td><td>{}</td><td class="num">{}</td><td>{}</td><td class="num">{}</td></tr>)"
          "\n",
          esc(b.emulated.empty() ? b.name : b.name + " (emulated: " + b.emulated + ")"),
          esc(b.metric), b.value, esc(b.unit), opt(b.ceiling, "{:.4g}"), esc(b.ceiling_source),
          opt(b.ratio, "{:.3f}"));
    }
    out += "</tbody></table>\n";
  }
  if (!s.notes.empty()) {
    out += "<h3>Notes</h3><ul>\n";
    for (const std::string& n : s.notes) out += "<li>" + esc(n) + "</li>\n";
    out += "</ul>\n";
  }
  return out + "</section>\n";
}

}  // namespace

std::string render_html(const RunRecord& r) {
  const Verdict v = run_verdict(r);
  std::string cmd;
  for (const std::string& a : r.command_line) cmd += (cmd.empty() ? "" : " ") + a;
  std::string out = fmt::format(
      "<!DOCTYPE html>\n<html xmlns=\"http://www.w3.org/1999/xhtml\" lang=\"en\">\n<head>\n"
      "<meta charset=\"utf-8\"/>\n<title>meshproof report: {}</title>\n<style>{}</style>\n"
      "</head>\n<body>\n<h1>meshproof report: <span class=\"{}\">{}</span></h1>\n",
      verdict_name(v), kStyle, verdict_name(v), verdict_name(v));
  const EnvironmentRecord& e = r.environment;
  out += fmt::format(
      "<p>Started {}, {:.1f} s. meshproof {} ({}, {}), host {}, backend {}, CUDA runtime {}, "
      "driver {}, NCCL {}.</p>\n",
      esc(r.start_time), r.duration_s, esc(e.meshproof_version), esc(e.git_commit),
      esc(e.build_type), esc(e.host), esc(e.active_backend), esc(e.cuda_runtime),
      esc(e.cuda_driver), esc(e.nccl));
  for (const GpuRecord& g : e.gpus) {
    out +=
        fmt::format("<p>GPU {}: {} (compute capability {}, {}, {} SMs)</p>\n", g.index, esc(g.name),
                    esc(g.compute_capability), format_bytes(g.memory_bytes), g.sm_count);
  }
  if (!cmd.empty()) out += "<p>Command: <code>" + esc(cmd) + "</code></p>\n";
  out += "<h2>Summary</h2>\n" + summary_table(r);
  for (size_t i = 0; i < r.scenarios.size(); ++i) out += scenario_section(r.scenarios[i], i);
  return out + "</body>\n</html>\n";
}

}  // namespace meshproof::reports
