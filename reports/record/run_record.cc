#include "reports/record/run_record.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <set>

#include "reports/record/report_error.h"

namespace meshproof::reports {
namespace {

// Non-finite numbers (a diverged loss) become JSON null: JSON has no NaN/inf.
nlohmann::json num(double v) {
  if (!std::isfinite(v)) return nullptr;
  return v;
}

template <typename T>
nlohmann::json opt(const std::optional<T>& v) {
  if (!v) return nullptr;
  if constexpr (std::is_floating_point_v<T>) {
    return num(*v);
  } else {
    return *v;
  }
}

nlohmann::json to_json(const StepTiming& t) {
  nlohmann::json coll = nlohmann::json::object();
  double attributed = t.compute_s + t.optimizer_s + t.checkpoint_s;
  for (const CollectiveTime& c : t.collectives) {
    const std::string key(collective_name(c.kind));
    coll[key] = coll.value(key, 0.0) + c.seconds;
    attributed += c.seconds;
  }
  return {{"total_s", num(t.total_s)},
          {"compute_s", num(t.compute_s)},
          {"collectives_s", coll},
          {"optimizer_s", num(t.optimizer_s)},
          {"checkpoint_s", num(t.checkpoint_s)},
          {"other_s", num(std::max(0.0, t.total_s - attributed))}};
}

nlohmann::json to_json(const Evidence& e) {
  return {{"first_diverging_step", opt(e.first_diverging_step)},
          {"metric", e.metric},
          {"tensor", e.tensor},
          {"expected", opt(e.expected)},
          {"actual", opt(e.actual)},
          {"max_abs_err", opt(e.max_abs_err)},
          {"max_rel_err", opt(e.max_rel_err)},
          {"ulp_distance", opt(e.ulp_distance)},
          {"failing_steps", e.failing_steps}};
}

nlohmann::json to_json(const ScenarioRecord& s) {
  nlohmann::json steps = nlohmann::json::array();
  for (const StepMetrics& m : s.steps) {
    steps.push_back({{"step", m.step},
                     {"loss", num(m.loss)},
                     {"grad_norm", num(m.grad_norm)},
                     {"lr", num(m.lr)},
                     {"tokens", m.tokens},
                     {"time", to_json(m.time)}});
  }
  nlohmann::json golden = nullptr;
  if (s.golden) {
    nlohmann::json gsteps = nlohmann::json::array();
    for (const GoldenStep& g : s.golden->steps) {
      gsteps.push_back({{"step", g.step}, {"loss", num(g.loss)}, {"grad_norm", num(g.grad_norm)}});
    }
    const ToleranceBand& t = s.golden->tolerance;
    golden = {{"source", s.golden->source},
              {"tolerance",
               {{"mode", t.mode},
                {"rtol", t.rtol},
                {"atol", t.atol},
                {"allowed_failing_steps", t.allowed_failing_steps}}},
              {"steps", gsteps}};
  }
  nlohmann::json checks = nlohmann::json::array();
  for (const CheckResult& c : s.checks) {
    checks.push_back({{"name", c.name},
                      {"kind", c.kind},
                      {"verdict", verdict_name(c.verdict)},
                      {"message", c.message},
                      {"duration_s", num(c.duration_s)},
                      {"evidence", c.evidence ? to_json(*c.evidence) : nlohmann::json(nullptr)}});
  }
  nlohmann::json perf = nullptr;
  if (s.performance) {
    const PerformanceFigures& p = *s.performance;
    perf = {{"warmup_steps", p.warmup_steps},
            {"steady_steps", p.steady_steps},
            {"median_step_time_s", num(p.median_step_time_s)},
            {"tokens_per_step", num(p.tokens_per_step)},
            {"tokens_per_s", num(p.tokens_per_s)},
            {"model_flops_per_step", num(p.model_flops_per_step)},
            {"tflops_per_device", num(p.tflops_per_device)},
            {"num_devices", p.num_devices},
            {"gemm_dtype", p.gemm_dtype},
            {"peak_tflops", opt(p.peak_tflops)},
            {"peak_source", p.peak_source},
            {"mfu", opt(p.mfu)}};
  }
  nlohmann::json memory = nlohmann::json::array();
  for (const RankMemory& m : s.memory) {
    memory.push_back({{"rank", m.rank},
                      {"params_bytes", m.params_bytes},
                      {"grads_bytes", m.grads_bytes},
                      {"optimizer_bytes", m.optimizer_bytes},
                      {"gathered_weights_bytes", m.gathered_weights_bytes},
                      {"activations_bytes", m.activations_bytes},
                      {"peak_bytes", m.peak_bytes}});
    if (!m.device_reserves.empty()) {
      nlohmann::json r = nlohmann::json::object();
      for (const auto& [name, bytes] : m.device_reserves) r[name] = bytes;
      memory.back()["device_reserves"] = r;
      memory.back()["device_reserved_bytes"] = m.device_reserved_bytes();
      memory.back()["device_total_bytes"] = m.device_total_bytes();
    }
  }
  nlohmann::json colls = nlohmann::json::array();
  for (const CollectiveStats& c : s.collectives) {
    colls.push_back({{"kind", collective_name(c.kind)},
                     {"group", c.group},
                     {"group_size", c.group_size},
                     {"count", c.count},
                     {"bytes", c.bytes},
                     {"time_s", num(c.time_s)},
                     {"algbw_gbps", num(c.algbw_gbps)},
                     {"busbw_gbps", num(c.busbw_gbps)}});
  }
  nlohmann::json benchmarks = nlohmann::json::array();
  for (const BenchmarkFigure& b : s.benchmarks) {
    nlohmann::json& j = benchmarks.emplace_back();
    j = {{"name", b.name},
         {"metric", b.metric},
         {"value", num(b.value)},
         {"min", opt(b.min)},
         {"max", opt(b.max)},
         {"unit", b.unit},
         {"ceiling", opt(b.ceiling)},
         {"ceiling_source", b.ceiling_source},
         {"ratio", opt(b.ratio)},
         {"higher_is_better", b.higher_is_better}};
    if (!b.samples.empty()) {
      nlohmann::json samples = nlohmann::json::array();
      for (double v : b.samples) samples.push_back(num(v));
      j["samples"] = samples;
    }
    if (!b.emulated.empty()) j["emulated"] = b.emulated;
  }
  nlohmann::json pipeline = nlohmann::json::array();
  for (const PipelineStageRecord& p : s.pipeline) {
    pipeline.push_back({{"stage", p.stage},
                        {"ranks", p.ranks},
                        {"first_layer", p.first_layer},
                        {"layers", p.layers},
                        {"warmup_steps", p.warmup_steps},
                        {"steady_steps", p.steady_steps},
                        {"forward_s", num(p.mean.forward_s)},
                        {"backward_s", num(p.mean.backward_s)},
                        {"p2p_wait_s", num(p.mean.p2p_wait_s)},
                        {"reduction_s", num(p.mean.reduction_s)},
                        {"optimizer_s", num(p.mean.optimizer_s)},
                        {"step_s", num(p.mean.step_s)},
                        {"bubble_fraction", num(p.bubble_fraction)},
                        {"predicted_bubble_fraction", num(p.predicted_bubble_fraction)},
                        {"peak_bytes", p.peak_bytes}});
  }
  nlohmann::json out = {{"name", s.name},
                        {"verdict", verdict_name(scenario_verdict(s))},
                        {"expectation", expectation_name(s.expectation)},
                        {"caught_by", s.caught_by},
                        {"mesh", s.mesh},
                        {"recipe", s.recipe},
                        {"backend", s.backend},
                        {"duration_s", num(s.duration_s)},
                        {"error", s.error},
                        {"config", s.config},
                        {"steps", steps},
                        {"entropy_floor", opt(s.entropy_floor)},
                        {"golden", golden},
                        {"checks", checks},
                        {"performance", perf},
                        {"memory", memory},
                        {"collectives", colls},
                        {"benchmarks", benchmarks},
                        {"notes", s.notes}};
  // Pipelined runs only: a one-stage scenario's JSON is what it was.
  if (!s.pipeline.empty()) out["pipeline"] = pipeline;
  return out;
}

}  // namespace

int64_t RankMemory::device_reserved_bytes() const {
  int64_t total = 0;
  for (const auto& [name, bytes] : device_reserves) total += bytes;
  return total;
}

int64_t RankMemory::device_total_bytes() const { return peak_bytes + device_reserved_bytes(); }

std::string_view verdict_name(Verdict v) {
  switch (v) {
    case Verdict::kPass:
      return "pass";
    case Verdict::kFail:
      return "fail";
    case Verdict::kSkipped:
      return "skipped";
    case Verdict::kError:
      return "error";
  }
  return "error";
}

Verdict parse_verdict(std::string_view name) {
  for (Verdict v : {Verdict::kPass, Verdict::kFail, Verdict::kSkipped, Verdict::kError}) {
    if (verdict_name(v) == name) return v;
  }
  throw ReportError(
      ReportError::Kind::kInput,
      fmt::format("unknown verdict '{}' (expected pass, fail, skipped or error)", name));
}

std::string_view collective_name(CollectiveKind k) {
  switch (k) {
    case CollectiveKind::kAllReduce:
      return "all_reduce";
    case CollectiveKind::kAllGather:
      return "all_gather";
    case CollectiveKind::kReduceScatter:
      return "reduce_scatter";
    case CollectiveKind::kBroadcast:
      return "broadcast";
    case CollectiveKind::kReduce:
      return "reduce";
    case CollectiveKind::kAllToAll:
      return "all_to_all";
  }
  return "all_reduce";
}

CollectiveKind parse_collective(std::string_view name) {
  for (CollectiveKind k :
       {CollectiveKind::kAllReduce, CollectiveKind::kAllGather, CollectiveKind::kReduceScatter,
        CollectiveKind::kBroadcast, CollectiveKind::kReduce, CollectiveKind::kAllToAll}) {
    if (collective_name(k) == name) return k;
  }
  throw ReportError(ReportError::Kind::kInput,
                    fmt::format("unknown collective kind '{}' (expected all_reduce, all_gather, "
                                "reduce_scatter, broadcast, reduce or all_to_all)",
                                name));
}

std::string_view expectation_name(Expectation e) {
  return e == Expectation::kCaught ? "caught" : "pass";
}

bool Evidence::empty() const {
  return !first_diverging_step && metric.empty() && tensor.empty() && !expected && !actual &&
         !max_abs_err && !max_rel_err && !ulp_distance && failing_steps == 0;
}

bool catches_fault(const ScenarioRecord& s, const CheckResult& c) {
  return s.expectation == Expectation::kCaught && c.verdict == Verdict::kFail &&
         std::find(s.caught_by.begin(), s.caught_by.end(), c.kind) != s.caught_by.end();
}

Verdict scenario_verdict(const ScenarioRecord& s) {
  if (!s.error.empty()) return Verdict::kError;
  bool any_fail = false, all_skipped = true, caught = false;
  for (const CheckResult& c : s.checks) {
    if (c.verdict == Verdict::kError) return Verdict::kError;
    if (c.verdict == Verdict::kFail) any_fail = true;
    if (c.verdict != Verdict::kSkipped) all_skipped = false;
    caught = caught || catches_fault(s, c);
  }
  if (s.expectation == Expectation::kCaught) {
    if (all_skipped && !s.checks.empty()) return Verdict::kSkipped;
    return caught ? Verdict::kPass : Verdict::kFail;
  }
  if (any_fail) return Verdict::kFail;
  return all_skipped ? Verdict::kSkipped : Verdict::kPass;
}

std::string verdict_reason(const ScenarioRecord& s) {
  if (!s.error.empty()) return "runtime error: " + s.error;
  for (const CheckResult& c : s.checks) {
    if (c.verdict == Verdict::kError) return fmt::format("check {} errored: {}", c.name, c.message);
  }
  if (scenario_verdict(s) != Verdict::kFail) return "";
  if (s.expectation == Expectation::kPass) {
    for (const CheckResult& c : s.checks) {
      if (c.verdict == Verdict::kFail) return fmt::format("check {} failed: {}", c.name, c.message);
    }
    return "";
  }
  std::string intended, others;
  for (const std::string& k : s.caught_by) intended += (intended.empty() ? "" : ", ") + k;
  for (const CheckResult& c : s.checks) {
    if (c.verdict == Verdict::kFail) others += (others.empty() ? "" : ", ") + c.name;
  }
  std::string why =
      intended.empty()
          ? std::string(
                "fault not caught: the scenario enables none of the checks meant to "
                "catch it")
          : fmt::format("fault not caught: none of the intended checks ({}) failed", intended);
  if (!others.empty()) why += fmt::format("; {} failed instead", others);
  return why;
}

Verdict run_verdict(const RunRecord& r) {
  bool any_fail = false, all_skipped = !r.scenarios.empty();
  for (const ScenarioRecord& s : r.scenarios) {
    const Verdict v = scenario_verdict(s);
    if (v == Verdict::kError) return Verdict::kError;
    if (v == Verdict::kFail) any_fail = true;
    if (v != Verdict::kSkipped) all_skipped = false;
  }
  if (any_fail) return Verdict::kFail;
  return all_skipped ? Verdict::kSkipped : Verdict::kPass;
}

std::string format_utc(int64_t unix_seconds) {
  const std::time_t t = static_cast<std::time_t>(unix_seconds);
  std::tm tm{};
  gmtime_r(&t, &tm);
  return fmt::format("{:04}-{:02}-{:02}T{:02}:{:02}:{:02}Z", tm.tm_year + 1900, tm.tm_mon + 1,
                     tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec);
}

void validate_record(const RunRecord& r) {
  auto fail = [](const std::string& m) { throw ReportError(ReportError::Kind::kInput, m); };
  std::set<std::string> names;
  for (size_t i = 0; i < r.scenarios.size(); ++i) {
    const ScenarioRecord& s = r.scenarios[i];
    if (s.name.empty()) fail(fmt::format("scenarios[{}]: empty scenario name", i));
    if (!names.insert(s.name).second) fail(fmt::format("scenario '{}' appears twice", s.name));
    if (!s.config.is_object()) {
      fail(fmt::format("scenario '{}': config must be a JSON object, got {}", s.name,
                       s.config.type_name()));
    }
    if (s.expectation == Expectation::kPass && !s.caught_by.empty()) {
      fail(fmt::format("scenario '{}': caught_by is set but the expectation is pass", s.name));
    }
    for (const std::string& k : s.caught_by) {
      if (k.empty()) fail(fmt::format("scenario '{}': caught_by has an empty check kind", s.name));
    }
    std::set<std::string> checks;
    for (size_t k = 0; k < s.checks.size(); ++k) {
      const std::string& c = s.checks[k].name;
      if (c.empty()) fail(fmt::format("scenario '{}': checks[{}] has an empty name", s.name, k));
      if (!checks.insert(c).second) {
        fail(fmt::format("scenario '{}': check '{}' appears twice", s.name, c));
      }
    }
    for (const StepMetrics& m : s.steps) {
      if (m.step < 0 || m.tokens < 0) {
        fail(fmt::format("scenario '{}': step {} has negative step or tokens ({})", s.name, m.step,
                         m.tokens));
      }
    }
    for (const PipelineStageRecord& p : s.pipeline) {
      if (p.stage < 0 || p.ranks.empty() || p.ranks.size() != p.peak_bytes.size())
        fail(fmt::format("scenario '{}': pipeline stage {} with {} ranks and {} peak figures",
                         s.name, p.stage, p.ranks.size(), p.peak_bytes.size()));
    }
    for (const RankMemory& m : s.memory) {
      if (m.rank < 0) fail(fmt::format("scenario '{}': memory of rank {}", s.name, m.rank));
    }
    std::set<std::string> figures;
    for (size_t k = 0; k < s.benchmarks.size(); ++k) {
      const BenchmarkFigure& b = s.benchmarks[k];
      if (b.name.empty() || b.metric.empty() || b.unit.empty()) {
        fail(fmt::format("scenario '{}': benchmarks[{}] needs a name, a metric and a unit", s.name,
                         k));
      }
      if (!figures.insert(b.name + "\n" + b.metric).second) {
        fail(fmt::format("scenario '{}': benchmark '{}' metric '{}' appears twice", s.name, b.name,
                         b.metric));
      }
    }
  }
}

nlohmann::json to_json(const RunRecord& r) {
  validate_record(r);
  nlohmann::json scenarios = nlohmann::json::array();
  int counts[4] = {0, 0, 0, 0};
  int check_counts[4] = {0, 0, 0, 0};
  for (const ScenarioRecord& s : r.scenarios) {
    scenarios.push_back(to_json(s));
    counts[static_cast<int>(scenario_verdict(s))]++;
    for (const CheckResult& c : s.checks) check_counts[static_cast<int>(c.verdict)]++;
  }
  auto tally = [](const int* c) {
    return nlohmann::json{{"pass", c[0]}, {"fail", c[1]}, {"skipped", c[2]}, {"error", c[3]}};
  };
  return {{"schema", "meshproof.report"},
          {"schema_version", r.schema_version},
          {"verdict", verdict_name(run_verdict(r))},
          {"start_time", r.start_time},
          {"duration_s", num(r.duration_s)},
          {"command_line", r.command_line},
          {"environment", to_json(r.environment)},
          {"summary", {{"scenarios", tally(counts)}, {"checks", tally(check_counts)}}},
          {"scenarios", scenarios}};
}

}  // namespace meshproof::reports
