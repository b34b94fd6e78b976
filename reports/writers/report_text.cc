#include "reports/writers/report_text.h"

#include <fmt/format.h>

#include <cmath>
#include <vector>

namespace meshproof::reports {

std::string evidence_summary(const Evidence& e) {
  std::vector<std::string> parts;
  if (e.first_diverging_step)
    parts.push_back(fmt::format("first diverging step {}", *e.first_diverging_step));
  if (!e.metric.empty()) parts.push_back(fmt::format("metric {}", e.metric));
  if (!e.tensor.empty()) parts.push_back(fmt::format("tensor {}", e.tensor));
  if (e.expected) parts.push_back(fmt::format("expected {:.6g}", *e.expected));
  if (e.actual) parts.push_back(fmt::format("actual {:.6g}", *e.actual));
  if (e.max_abs_err) parts.push_back(fmt::format("max abs err {:.6g}", *e.max_abs_err));
  if (e.max_rel_err) parts.push_back(fmt::format("max rel err {:.6g}", *e.max_rel_err));
  if (e.ulp_distance) parts.push_back(fmt::format("ULP distance {}", *e.ulp_distance));
  if (e.failing_steps > 0) parts.push_back(fmt::format("{} failing steps", e.failing_steps));
  std::string out;
  for (size_t i = 0; i < parts.size(); ++i) {
    if (i > 0) out += ", ";
    out += parts[i];
  }
  return out;
}

std::string checks_tally(const ScenarioRecord& s) {
  int n[4] = {0, 0, 0, 0};
  for (const CheckResult& c : s.checks) n[static_cast<int>(c.verdict)]++;
  std::string out;
  for (Verdict v : {Verdict::kPass, Verdict::kFail, Verdict::kError, Verdict::kSkipped}) {
    const int k = n[static_cast<int>(v)];
    if (k == 0) continue;
    if (!out.empty()) out += ", ";
    out += fmt::format("{} {}", k, verdict_name(v));
  }
  return out.empty() ? "none" : out;
}

std::string step_time_ms(const ScenarioRecord& s) {
  if (!s.performance || !std::isfinite(s.performance->median_step_time_s)) return "n/a";
  return fmt::format("{:.3f}", s.performance->median_step_time_s * 1e3);
}

std::string mfu_percent(const ScenarioRecord& s) {
  if (!s.performance || !s.performance->mfu || !std::isfinite(*s.performance->mfu)) return "n/a";
  return fmt::format("{:.1f}%", *s.performance->mfu * 100);
}

std::string format_bytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (std::abs(b) >= 1024.0 * 1024 * 1024)
    return fmt::format("{:.2f} GiB", b / (1024.0 * 1024 * 1024));
  if (std::abs(b) >= 1024.0 * 1024) return fmt::format("{:.1f} MiB", b / (1024.0 * 1024));
  if (std::abs(b) >= 1024.0) return fmt::format("{:.1f} KiB", b / 1024.0);
  return fmt::format("{} B", bytes);
}

std::string stage_ranks_text(const PipelineStageRecord& p) {
  std::string out;
  for (int r : p.ranks) out += fmt::format("{}{}", out.empty() ? "" : ", ", r);
  return out;
}

std::string stage_layers_text(const PipelineStageRecord& p) {
  if (p.layers == 1) return std::to_string(p.first_layer);
  return fmt::format("{}-{}", p.first_layer, p.first_layer + p.layers - 1);
}

std::string stage_peaks_text(const PipelineStageRecord& p) {
  std::string out;
  for (int64_t b : p.peak_bytes) out += (out.empty() ? "" : ", ") + format_bytes(b);
  return out;
}

std::string fraction_text(double v) {
  return std::isfinite(v) ? fmt::format("{:.3f}", v) : std::string("n/a");
}

std::string pipeline_caption(const ScenarioRecord& s) {
  if (s.pipeline.empty()) return {};
  const PipelineStageRecord& p = s.pipeline.front();
  return fmt::format(
      "Pipeline stages: milliseconds per step, the mean over each stage's ranks and steps {}..{} "
      "(after {} warm-up steps); bubble = p2p wait / step (measured), predicted = the schedule "
      "played in unit time (forward 1, backward 2)",
      p.warmup_steps + 1, p.warmup_steps + p.steady_steps, p.warmup_steps);
}

std::string check_headline(const CheckResult& c) {
  std::string out = c.message;
  if (c.evidence && !c.evidence->empty()) {
    if (!out.empty()) out += " ";
    out += fmt::format("({})", evidence_summary(*c.evidence));
  }
  return out;
}

std::string join_names(const std::vector<std::string>& names) {
  std::string out;
  for (const std::string& n : names) out += (out.empty() ? "" : ", ") + n;
  return out.empty() ? "none" : out;
}

std::string config_text(const ScenarioRecord& s) {
  return s.config.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
}

}  // namespace meshproof::reports
