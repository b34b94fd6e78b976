// report.md: a one-screen summary table, then per-scenario details.
#include <fmt/format.h>

#include <cmath>

#include "reports/writers/report_text.h"
#include "reports/writers/report_writers.h"
#include "reports/writers/xml_text.h"

namespace meshproof::reports {
namespace {

// A table cell: pipes escaped, line breaks flattened, so one record field is one cell.
std::string cell(std::string_view s) {
  std::string out;
  for (char c : s) {
    if (c == '|') {
      out += "\\|";
    } else if (c == '\n' || c == '\r') {
      out += ' ';
    } else {
      out += c;
    }
  }
  return out;
}

std::string fmt_opt(const std::optional<double>& v, const char* f = "{:.4g}") {
  return v && std::isfinite(*v) ? fmt::format(fmt::runtime(f), *v) : std::string("n/a");
}

}  // namespace

std::string render_markdown(const RunRecord& r) {
  std::string out;
  out += fmt::format("# meshproof report: {}\n\n", verdict_name(run_verdict(r)));
  std::string cmd;
  for (const std::string& a : r.command_line) cmd += (cmd.empty() ? "" : " ") + a;
  out += fmt::format("Started {}, {:.1f} s, meshproof {} ({}), backend {}, host {}.\n\n",
                     r.start_time, r.duration_s, r.environment.meshproof_version,
                     r.environment.git_commit, r.environment.active_backend, r.environment.host);
  if (!cmd.empty()) out += fmt::format("Command: `{}`\n\n", cmd);

  out += "| scenario | mesh | recipe | checks | verdict | step time (ms) | MFU |\n";
  out += "| --- | --- | --- | --- | --- | ---: | ---: |\n";
  for (const ScenarioRecord& s : r.scenarios) {
    out += fmt::format("| {} | {} | {} | {} | {} | {} | {} |\n", cell(s.name), cell(s.mesh),
                       cell(s.recipe), cell(checks_tally(s)), verdict_name(scenario_verdict(s)),
                       step_time_ms(s), mfu_percent(s));
  }

  for (const ScenarioRecord& s : r.scenarios) {
    out += fmt::format("\n## {}\n\n", s.name);
    out += fmt::format("- verdict: **{}** (expected: {})\n", verdict_name(scenario_verdict(s)),
                       expectation_name(s.expectation));
    if (s.expectation == Expectation::kCaught) {
      out += fmt::format("- caught by (intended checks): {}\n", cell(join_names(s.caught_by)));
    }
    if (const std::string why = verdict_reason(s); !why.empty()) {
      out += fmt::format("- why: {}\n", cell(why));
    }
    out += fmt::format("- mesh: {}; recipe: {}; backend: {}; {} steps in {:.2f} s\n", s.mesh,
                       s.recipe, s.backend, s.steps.size(), s.duration_s);
    if (!s.error.empty()) out += fmt::format("- error: {}\n", cell(s.error));
    if (s.golden) {
      const ToleranceBand& t = s.golden->tolerance;
      out += fmt::format("- golden: `{}` ({}, rtol {:g}, atol {:g}, {} failing steps allowed)\n",
                         s.golden->source, t.mode, t.rtol, t.atol, t.allowed_failing_steps);
    }
    if (s.entropy_floor) {
      out += fmt::format("- data entropy floor: {:.6f} nats/token (the loss no model can beat){}\n",
                         *s.entropy_floor,
                         s.steps.empty() ? std::string()
                                         : fmt::format("; final loss {:.6f}", s.steps.back().loss));
    }
    out += fmt::format("- config: `{}`\n", config_text(s));

    if (!s.checks.empty()) {
      out += "\n| check | kind | verdict | message | evidence |\n| --- | --- | --- | --- | --- |\n";
      for (const CheckResult& c : s.checks) {
        out += fmt::format("| {} | {} | {} | {} | {} |\n", cell(c.name), cell(c.kind),
                           verdict_name(c.verdict), cell(c.message),
                           c.evidence ? cell(evidence_summary(*c.evidence)) : std::string());
      }
    }
    if (s.performance) {
      const PerformanceFigures& p = *s.performance;
      out += fmt::format(
          "\nPerformance (median of steps {}..{} after {} warm-up steps): step time {:.3f} ms, "
          "{:.4g} tokens/s, {:.4g} model TFLOP/s per device over {} devices, peak {} TFLOP/s "
          "({} {}), MFU {}.\n",
          p.warmup_steps + 1, p.warmup_steps + p.steady_steps, p.warmup_steps,
          p.median_step_time_s * 1e3, p.tokens_per_s, p.tflops_per_device, p.num_devices,
          fmt_opt(p.peak_tflops, "{:g}"), p.gemm_dtype,
          p.peak_source.empty() ? "unknown peak" : p.peak_source, mfu_percent(s));
    }
    if (!s.memory.empty()) {
      out += "\n| rank | params | grads | optimizer | gathered weights | activations | peak |\n";
      out += "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |\n";
      for (const RankMemory& m : s.memory) {
        out += fmt::format("| {} | {} | {} | {} | {} | {} | {} |\n", m.rank,
                           format_bytes(m.params_bytes), format_bytes(m.grads_bytes),
                           format_bytes(m.optimizer_bytes), format_bytes(m.gathered_weights_bytes),
                           format_bytes(m.activations_bytes), format_bytes(m.peak_bytes));
      }
      // Device memory the tracker cannot see (CUDA pool reserve, NCCL buffers, cuBLASLt
      // workspaces): only on a device backend, so CPU reports are unchanged.
      for (const RankMemory& m : s.memory) {
        if (m.device_reserves.empty()) continue;
        std::string parts;
        for (const auto& [name, bytes] : m.device_reserves)
          parts += fmt::format("{}{} {}", parts.empty() ? "" : ", ", name, format_bytes(bytes));
        out += fmt::format("\nrank {} device: peak {} + reserves {} ({}) = {}\n", m.rank,
                           format_bytes(m.peak_bytes), format_bytes(m.device_reserved_bytes()),
                           parts, format_bytes(m.device_total_bytes()));
      }
    }
    if (!s.pipeline.empty()) {
      out += fmt::format("\n{}:\n\n", pipeline_caption(s));
      out +=
          "| stage | ranks | layers | forward (ms) | backward (ms) | p2p wait (ms) | reduction "
          "(ms) "
          "| optimizer (ms) | step (ms) | bubble | predicted bubble | peak memory per rank |\n";
      out += "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- |\n";
      for (const PipelineStageRecord& p : s.pipeline) {
        const PipelinePhases& m = p.mean;
        out += fmt::format(
            "| {} | {} | {} | {:.3f} | {:.3f} | {:.3f} | {:.3f} | {:.3f} | {:.3f} | {} | {} | {} "
            "|\n",
            p.stage, stage_ranks_text(p), stage_layers_text(p), m.forward_s * 1e3,
            m.backward_s * 1e3, m.p2p_wait_s * 1e3, m.reduction_s * 1e3, m.optimizer_s * 1e3,
            m.step_s * 1e3, fraction_text(p.bubble_fraction),
            fraction_text(p.predicted_bubble_fraction), stage_peaks_text(p));
      }
    }
    if (!s.collectives.empty()) {
      out +=
          "\n| collective | group | n | calls | bytes | time (ms) | algbw (GB/s) | busbw (GB/s) "
          "|\n";
      out += "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |\n";
      for (const CollectiveStats& c : s.collectives) {
        out += fmt::format("| {} | {} | {} | {} | {} | {:.3f} | {:.2f} | {:.2f} |\n",
                           collective_name(c.kind), cell(c.group), c.group_size, c.count,
                           format_bytes(c.bytes), c.time_s * 1e3, c.algbw_gbps, c.busbw_gbps);
      }
    }
    if (!s.benchmarks.empty()) {
      out += "\n| benchmark | metric | value | unit | ceiling | ceiling source | ratio |\n";
      out += "| --- | --- | ---: | --- | ---: | --- | ---: |\n";
      for (const BenchmarkFigure& b : s.benchmarks) {
        out += fmt::format(
            "| {} | {} | {:.4g} | {} | {} | {} | {} |\n",
            cell(b.emulated.empty() ? b.name : b.name + " (emulated: " + b.emulated + ")"),
            cell(b.metric), b.value, cell(b.unit), fmt_opt(b.ceiling), cell(b.ceiling_source),
            fmt_opt(b.ratio, "{:.3f}"));
      }
    }
    if (!s.notes.empty()) {
      out += "\nNotes:\n\n";
      for (const std::string& n : s.notes) out += fmt::format("- {}\n", cell(n));
    }
  }
  // Record strings may hold anything (paths, compiler output): keep the file valid UTF-8.
  return sanitize_text(out);
}

}  // namespace meshproof::reports
