// The parity checks over finished runs (golden, bitwise and tolerance comparisons, with the trace
// evidence of the first diverging tensor). The checks over collectives are in
// harness/checks/collective_checks.cc, the state check in harness/checks/state_check.cc.
#include "harness/checks/checks.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <set>

#include "kernels/core/error.h"

namespace meshproof::harness {
namespace {

// Maps float bits onto a monotonic integer line so that adjacent floats differ by 1.
int64_t ordered(float v) {
  const int32_t i = std::bit_cast<int32_t>(v);
  return i < 0 ? static_cast<int64_t>(std::numeric_limits<int32_t>::min()) - i : i;
}
int64_t ordered(double v) {
  const int64_t i = std::bit_cast<int64_t>(v);
  // Same mirroring as for float; |i| < 2^63 so the subtraction cannot overflow for i < 0.
  return i < 0 ? std::numeric_limits<int64_t>::min() - i : i;
}

double metric_value(const reports::StepMetrics& s, Metric m) {
  return m == Metric::kLoss ? s.loss : s.grad_norm;
}

bool same_bits(double a, double b) {
  return std::bit_cast<uint64_t>(a) == std::bit_cast<uint64_t>(b) || (a == 0 && b == 0);
}

const char* golden_key(Metric m) { return m == Metric::kLoss ? "loss" : "grad_norm"; }

// Distance of two per-step metrics in fp32 ULP: the metrics are fp32 quantities (a loss and a
// norm of fp32 tensors) carried in doubles, so the distance of the values rounded to fp32; two
// values that differ by less than one fp32 ULP (the double sums' last bits) count as 1, never as
// equal.
int64_t metric_ulp(double a, double b) {
  if (same_bits(a, b)) return 0;
  return std::max<int64_t>(1, ulp_distance(static_cast<float>(a), static_cast<float>(b)));
}

// One golden metric's misses: first failing step with its values, and the max errors over its
// failing steps.
struct MetricMiss {
  int64_t failing_steps = 0;
  int64_t first_step = 0;
  double expected = 0, actual = 0;
  double max_abs = 0, max_rel = 0;
  int64_t max_ulp = 0;
  void add(double x, double g) {
    const double abs = std::fabs(x - g);
    if (std::isnan(abs)) {
      max_abs = std::numeric_limits<double>::infinity();
      max_rel = std::numeric_limits<double>::infinity();
    } else {
      max_abs = std::max(max_abs, abs);
      if (g != 0) max_rel = std::max(max_rel, abs / std::fabs(g));
    }
    max_ulp = std::max(max_ulp, metric_ulp(x, g));
  }
};

// Max abs error, max relative error (over elements with a nonzero reference) and max ULP
// distance of a against e (n elements each).
TensorDiff diff_values(const std::string& name, const float* a, const float* e, size_t n) {
  TensorDiff d;
  d.tensor = name;
  for (size_t i = 0; i < n; ++i) {
    const double abs = std::fabs(static_cast<double>(a[i]) - e[i]);
    if (std::isnan(abs)) {
      d.max_abs_err = std::numeric_limits<double>::infinity();
    } else {
      d.max_abs_err = std::max(d.max_abs_err, abs);
      if (e[i] != 0) d.max_rel_err = std::max(d.max_rel_err, abs / std::fabs(e[i]));
    }
    d.ulp = std::max(d.ulp, ulp_distance(a[i], e[i]));
  }
  return d;
}

// A tensor that cannot be compared element by element (missing, or another shape).
TensorDiff incomparable(const std::string& what) {
  TensorDiff d;
  d.tensor = what;
  d.max_abs_err = std::numeric_limits<double>::infinity();
  d.max_rel_err = std::numeric_limits<double>::infinity();
  d.ulp = std::numeric_limits<int64_t>::max();
  return d;
}

// ||a - e||_2 / ||e||_2 (infinite when e is zero and a is not, 0 when both are zero).
double relative_l2(const std::vector<float>& a, const std::vector<float>& e) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double d = static_cast<double>(a[i]) - e[i];
    num += d * d;
    den += static_cast<double>(e[i]) * e[i];
  }
  if (std::isnan(num)) return std::numeric_limits<double>::infinity();
  if (den == 0) return num == 0 ? 0 : std::numeric_limits<double>::infinity();
  return std::sqrt(num / den);
}

// With --trace: the first diverging traced (step, tensor) into `ev` (tensor "<name> at step S";
// max abs/rel error and ULP distance of that tensor at that step) and a clause for the message.
std::string add_trace_evidence(reports::Evidence& ev, const RunView& a, const RunView& b,
                               double rtol, const NoiseFloors* floors = nullptr) {
  if (!a.trace || !b.trace || a.trace->empty() || b.trace->empty()) {
    return "; no per-tensor trace of both runs to compare";
  }
  const std::optional<TraceDiff> d = first_diverging_traced(*a.trace, *b.trace, rtol, floors);
  if (!d) {
    return fmt::format("; every traced gradient and weight is bitwise equal over {} steps",
                       std::min(a.trace->size(), b.trace->size()));
  }
  ev.tensor = fmt::format("{} at step {}", d->diff.tensor, d->step);
  ev.max_abs_err = d->diff.max_abs_err;
  ev.max_rel_err = d->diff.max_rel_err;
  ev.ulp_distance = d->diff.ulp;
  const std::string numbers = fmt::format("max abs {:.3g}, max rel {:.3g}, {} ULP",
                                          d->diff.max_abs_err, d->diff.max_rel_err, d->diff.ulp);
  if (d->floor) {
    if (d->beyond_rtol) {
      return fmt::format(
          "; first tensor beyond its noise floor (step order; {}x the fault-free control's "
          "relative L2 difference): {} at step {} (rel L2 {:.3g}, floor {:.3g}): {}",
          kNoiseFloorFactor, d->diff.tensor, d->step, d->rel_l2, *d->floor, numbers);
    }
    return fmt::format(
        "; no traced tensor exceeds {}x its noise floor; the furthest above it is {} at step {} "
        "(rel L2 {:.3g}, floor {:.3g}): {}",
        kNoiseFloorFactor, d->diff.tensor, d->step, d->rel_l2, *d->floor, numbers);
  }
  if (rtol <= 0) {
    return fmt::format("; first diverging tensor {} at step {}: {}", d->diff.tensor, d->step,
                       numbers);
  }
  if (d->beyond_rtol) {
    return fmt::format(
        "; first tensor beyond rtol {:.3g} (relative L2 difference): {} at step {} (rel L2 "
        "{:.3g}): {}",
        rtol, d->diff.tensor, d->step, d->rel_l2, numbers);
  }
  return fmt::format(
      "; no traced tensor's relative L2 difference exceeds rtol {:.3g}; the largest is {} at step "
      "{} (rel L2 {:.3g}): {}",
      rtol, d->diff.tensor, d->step, d->rel_l2, numbers);
}

}  // namespace

int64_t ulp_distance(float a, float b) {
  if (std::isnan(a) || std::isnan(b)) {
    return std::bit_cast<uint32_t>(a) == std::bit_cast<uint32_t>(b)
               ? 0
               : std::numeric_limits<int64_t>::max();
  }
  const int64_t d = ordered(a) - ordered(b);
  return d < 0 ? -d : d;
}

int64_t ulp_distance(double a, double b) {
  if (std::isnan(a) || std::isnan(b)) {
    return std::bit_cast<uint64_t>(a) == std::bit_cast<uint64_t>(b)
               ? 0
               : std::numeric_limits<int64_t>::max();
  }
  const int64_t oa = ordered(a), ob = ordered(b);
  // Values of opposite sign far apart could overflow the difference: saturate.
  if ((oa > 0 && ob < 0 && oa > std::numeric_limits<int64_t>::max() + ob) ||
      (oa < 0 && ob > 0 && ob > std::numeric_limits<int64_t>::max() + oa)) {
    return std::numeric_limits<int64_t>::max();
  }
  const int64_t d = oa - ob;
  return d < 0 ? -d : d;
}

std::optional<TensorDiff> first_diverging_tensor(const engine::TensorMap& actual,
                                                 const engine::TensorMap& expected) {
  for (const std::string& name : expected.names()) {
    if (!actual.contains(name)) {
      TensorDiff d;
      d.tensor = name + " (missing)";
      return d;
    }
    const std::vector<float> a = actual.at(name).to_vector<float>();
    const std::vector<float> e = expected.at(name).to_vector<float>();
    MP_CHECK(a.size() == e.size(), "tensor {}: {} vs {} elements", name, a.size(), e.size());
    if (std::memcmp(a.data(), e.data(), a.size() * sizeof(float)) == 0) continue;
    return diff_values(name, a.data(), e.data(), a.size());
  }
  return std::nullopt;
}

NoiseFloors noise_floors(const Trace& control_actual, const Trace& control_expected) {
  NoiseFloors out;
  const size_t steps = std::min(control_actual.size(), control_expected.size());
  for (size_t i = 0; i < steps; ++i) {
    std::map<std::string, const engine::TensorDigest*> by_name;
    for (const engine::TensorDigest& d : control_actual[i]) by_name[d.name] = &d;
    std::map<std::string, double> floors;
    for (const engine::TensorDigest& e : control_expected[i]) {
      const auto it = by_name.find(e.name);
      if (it == by_name.end() || it->second->values.size() != e.values.size()) continue;
      floors[e.name] = relative_l2(it->second->values, e.values);
    }
    out.push_back(std::move(floors));
  }
  return out;
}

namespace {

// The order the step computes a step's traced tensors in: the forward's FP8 state ("fp8/...",
// the scales, amax histories and FP8 weights the forward reads) as traced, then gradients in
// backward order (the reverse of their canonical order), then everything else as traced (the
// weights of the optimizer update, then the FP8 state after the step, "updated/fp8/...").
std::vector<const engine::TensorDigest*> step_order(const std::vector<engine::TensorDigest>& t) {
  std::vector<const engine::TensorDigest*> fp8, grads, rest;
  for (const engine::TensorDigest& d : t)
    (d.name.starts_with("fp8/") ? fp8 : d.name.starts_with("grad/") ? grads : rest).push_back(&d);
  std::vector<const engine::TensorDigest*> out = fp8;
  out.insert(out.end(), grads.rbegin(), grads.rend());
  out.insert(out.end(), rest.begin(), rest.end());
  return out;
}

}  // namespace

std::optional<TraceDiff> first_diverging_traced(const Trace& actual, const Trace& expected,
                                                double rtol, const NoiseFloors* floors) {
  std::optional<TraceDiff> largest;  // tolerance mode: the largest (relative) difference so far
  const size_t steps = std::min(actual.size(), expected.size());
  for (size_t i = 0; i < steps; ++i) {
    const int64_t step = static_cast<int64_t>(i) + 1;
    std::map<std::string, const engine::TensorDigest*> by_name;
    for (const engine::TensorDigest& d : actual[i]) by_name[d.name] = &d;
    for (const engine::TensorDigest* ep : step_order(expected[i])) {
      const engine::TensorDigest& e = *ep;
      const auto it = by_name.find(e.name);
      if (it == by_name.end()) {
        return TraceDiff{step, incomparable(e.name + " (missing)"),
                         std::numeric_limits<double>::infinity(), true, std::nullopt};
      }
      const engine::TensorDigest& a = *it->second;
      if (a.shape != e.shape) {
        return TraceDiff{
            step,
            incomparable(fmt::format("{} (shape {} vs {})", e.name, a.shape.str(), e.shape.str())),
            std::numeric_limits<double>::infinity(), true, std::nullopt};
      }
      const auto numel = static_cast<size_t>(e.shape.numel().value);
      MP_CHECK(a.values.size() == numel && e.values.size() == numel,
               "traced {} at step {}: {} and {} values for shape {}", e.name, step, a.values.size(),
               e.values.size(), e.shape.str());
      if (std::memcmp(a.values.data(), e.values.data(), numel * sizeof(float)) == 0) continue;
      TraceDiff d{step, diff_values(e.name, a.values.data(), e.values.data(), a.values.size()),
                  relative_l2(a.values, e.values), true, std::nullopt};
      if (floors) {
        double floor = 0;  // no control value (a step the control lacks): bitwise expected
        if (i < floors->size()) {
          const auto f = (*floors)[i].find(e.name);
          if (f != (*floors)[i].end()) floor = f->second;
        }
        d.floor = floor;
        if (d.rel_l2 > kNoiseFloorFactor * floor) return d;
        // Within its floor: keep the one furthest above its floor (relative to it).
        const auto excess = [](const TraceDiff& x) {
          return *x.floor > 0 ? x.rel_l2 / *x.floor : std::numeric_limits<double>::infinity();
        };
        if (!largest || excess(d) > excess(*largest)) largest = d;
        continue;
      }
      if (rtol <= 0 || d.rel_l2 > rtol) return d;
      if (!largest || d.rel_l2 > largest->rel_l2) largest = d;
    }
  }
  if (largest) largest->beyond_rtol = false;
  return largest;
}

namespace {

// check_golden without the staleness note.
reports::CheckResult check_golden_metrics(const std::vector<reports::StepMetrics>& steps,
                                          const std::optional<GoldenData>& golden,
                                          const GoldenCheck& cfg, const std::string& golden_file,
                                          const std::string& update_command,
                                          reports::GoldenRecord* record, bool trace) {
  reports::CheckResult r;
  r.name = "golden";
  r.kind = "golden";
  if (!golden) {
    r.verdict = reports::Verdict::kFail;
    r.message = fmt::format("no golden at {}; create it with: {}", golden_file, update_command);
    return r;
  }
  const bool exact = cfg.mode == GoldenMode::kExact;
  reports::ToleranceBand band;
  band.mode = exact ? "exact" : "tolerance";
  band.rtol = exact ? 0 : cfg.rtol;
  band.atol = exact ? 0 : cfg.atol;
  band.allowed_failing_steps = exact ? 0 : cfg.allowed_failing_steps;

  const bool imported = golden_is_imported(*golden);
  if (imported && exact) {
    r.verdict = reports::Verdict::kFail;
    r.message = fmt::format(
        "golden {} was imported from {}: another tool's curve carries no bitwise claim; compare "
        "it with checks.golden.mode: tolerance and the rtol the two runs are expected to meet",
        golden_file,
        golden->provenance.count("imported_from") ? golden->provenance.at("imported_from")
                                                  : "elsewhere");
    return r;
  }
  for (Metric m : cfg.metrics) {
    if (golden->metrics.count(golden_key(m)) == 0) {
      r.verdict = reports::Verdict::kFail;
      r.message = imported ? fmt::format(
                                 "golden {} (imported) has no {}: list only the metrics it "
                                 "holds in checks.golden.metrics",
                                 golden_file, golden_key(m))
                           : fmt::format("golden {} has no /metrics/{}; regenerate it with: {}",
                                         golden_file, golden_key(m), update_command);
      return r;
    }
  }
  const std::vector<double>& gloss = golden->metrics.at("loss");
  if (record) {
    record->source = golden_file;
    record->tolerance = band;
    record->steps.clear();
    const auto gn = golden->metrics.find("grad_norm");
    for (size_t i = 0; i < gloss.size(); ++i) {
      reports::GoldenStep g;
      g.step = golden->steps.empty() ? static_cast<int64_t>(i) + 1 : golden->steps[i];
      g.loss = gloss[i];
      g.grad_norm = gn != golden->metrics.end() && i < gn->second.size() ? gn->second[i] : 0.0;
      record->steps.push_back(g);
    }
  }
  // The (run, golden) index pairs compared: every step of a golden meshproof wrote, in order; an
  // imported golden's steps that fall in the run (it may hold every 5th step, or start later).
  std::vector<std::pair<size_t, size_t>> pairs;
  if (golden->steps.empty()) {
    if (gloss.size() != steps.size()) {
      r.verdict = reports::Verdict::kFail;
      r.message = fmt::format("golden {} has {} steps, the run has {}; regenerate it with: {}",
                              golden_file, gloss.size(), steps.size(), update_command);
      return r;
    }
    for (size_t i = 0; i < steps.size(); ++i) pairs.emplace_back(i, i);
  } else {
    std::map<int64_t, size_t> run_index;
    for (size_t i = 0; i < steps.size(); ++i) run_index[steps[i].step] = i;
    const int64_t first = steps.empty() ? 1 : steps.front().step;
    for (size_t j = 0; j < golden->steps.size(); ++j) {
      const int64_t s = golden->steps[j];
      if (s < first) continue;
      const auto it = run_index.find(s);
      if (it == run_index.end()) {
        r.verdict = reports::Verdict::kFail;
        r.message = fmt::format("golden {} has step {}, which the run (steps {}..{}) does not",
                                golden_file, s, first, steps.empty() ? 0 : steps.back().step);
        return r;
      }
      pairs.emplace_back(it->second, j);
    }
    if (pairs.empty()) {
      r.verdict = reports::Verdict::kFail;
      r.message = fmt::format("golden {} has no step among the run's", golden_file);
      return r;
    }
  }

  // Per metric its own failing steps and errors: the evidence carries the metric that failed
  // first (earliest step, then cfg.metrics order) with that metric's errors only, and the message
  // lists every failing metric with its own.
  std::map<Metric, MetricMiss> misses;
  reports::Evidence ev;
  for (const auto& [i, j] : pairs) {
    bool step_failed = false;
    for (Metric m : cfg.metrics) {
      const double g = golden->metrics.at(golden_key(m))[j];
      const double x = metric_value(steps[i], m);
      const bool ok =
          exact ? same_bits(x, g) : std::fabs(x - g) <= band.atol + band.rtol * std::fabs(g);
      if (ok) continue;
      step_failed = true;
      MetricMiss& miss = misses[m];
      if (miss.failing_steps == 0) {
        miss.first_step = steps[i].step;
        miss.expected = g;
        miss.actual = x;
      }
      ++miss.failing_steps;
      miss.add(x, g);
      if (!ev.first_diverging_step) {
        ev.first_diverging_step = steps[i].step;
        ev.metric = golden_key(m);
      }
    }
    if (step_failed) ++ev.failing_steps;
  }
  if (ev.first_diverging_step) {
    const MetricMiss& first = misses.at(ev.metric == "loss" ? Metric::kLoss : Metric::kGradNorm);
    ev.expected = first.expected;
    ev.actual = first.actual;
    ev.max_abs_err = first.max_abs;
    ev.max_rel_err = first.max_rel;
    ev.ulp_distance = first.max_ulp;
  }
  if (ev.failing_steps > band.allowed_failing_steps) {
    r.verdict = reports::Verdict::kFail;
    r.message = fmt::format(
        "{} of {} steps outside the {} band (allowed {}); first at step {}: {} = {:.9g}, golden "
        "{:.9g} ({})",
        ev.failing_steps, pairs.size(), band.mode, band.allowed_failing_steps,
        *ev.first_diverging_step, ev.metric, *ev.actual, *ev.expected, golden_file);
    for (Metric m : cfg.metrics) {
      const auto it = misses.find(m);
      if (it == misses.end()) continue;
      r.message += fmt::format(
          "; {}: {} failing steps from step {}, max abs {:.3g}, max rel {:.3g}, "
          "{} fp32 ULP",
          golden_key(m), it->second.failing_steps, it->second.first_step, it->second.max_abs,
          it->second.max_rel, it->second.max_ulp);
    }
    if (trace) {
      r.message +=
          "; no per-tensor evidence: goldens store per-step metrics only (the reference and "
          "determinism checks compare traced runs)";
    }
    r.evidence = ev;
  } else if (ev.failing_steps > 0) {
    r.message =
        fmt::format("{} of {} steps outside the band, within the {} allowed ({})", ev.failing_steps,
                    pairs.size(), band.allowed_failing_steps, golden_file);
  } else {
    r.message = fmt::format("{} steps match {} ({}{})", pairs.size(), golden_file, band.mode,
                            imported ? ", imported" : "");
  }
  return r;
}

}  // namespace

reports::CheckResult check_golden(const std::vector<reports::StepMetrics>& steps,
                                  const std::optional<GoldenData>& golden, const GoldenCheck& cfg,
                                  const std::string& golden_file, const std::string& update_command,
                                  reports::GoldenRecord* record, bool trace,
                                  const std::string& scenario_hash) {
  reports::CheckResult r =
      check_golden_metrics(steps, golden, cfg, golden_file, update_command, record, trace);
  if (r.verdict != reports::Verdict::kFail || !golden || scenario_hash.empty()) return r;
  const auto recorded = golden->provenance.find("scenario_hash");
  const std::string theirs =
      recorded == golden->provenance.end() ? std::string("(none)") : recorded->second;
  if (theirs != scenario_hash) {
    r.message +=
        fmt::format("; golden recorded for scenario hash {}, this run has {}; update with: {}",
                    theirs, scenario_hash, update_command);
  }
  return r;
}

reports::CheckResult compare_bitwise(const std::string& name, const std::string& kind,
                                     const RunView& actual, const RunView& expected,
                                     const std::string& what, bool trace) {
  reports::CheckResult r;
  r.name = name;
  r.kind = kind;
  const auto& a = *actual.steps;
  const auto& e = *expected.steps;
  reports::Evidence ev;
  if (a.size() != e.size()) {
    r.verdict = reports::Verdict::kFail;
    r.message = fmt::format("{} has {} steps, expected {}", what, a.size(), e.size());
    return r;
  }
  for (size_t i = 0; i < a.size(); ++i) {
    for (Metric m : {Metric::kLoss, Metric::kGradNorm}) {
      const double x = metric_value(a[i], m), y = metric_value(e[i], m);
      if (same_bits(x, y)) continue;
      ++ev.failing_steps;
      if (!ev.first_diverging_step) {
        ev.first_diverging_step = a[i].step;
        ev.metric = golden_key(m);
        ev.actual = x;
        ev.expected = y;
        ev.max_abs_err = std::fabs(x - y);
        if (y != 0) ev.max_rel_err = std::fabs(x - y) / std::fabs(y);
        ev.ulp_distance = metric_ulp(x, y);
      }
      break;
    }
  }
  std::optional<TensorDiff> params_diff;
  if (actual.final_params && expected.final_params) {
    params_diff = first_diverging_tensor(*actual.final_params, *expected.final_params);
  }
  if (!ev.first_diverging_step && !params_diff) {
    r.message = fmt::format("{} bitwise equal: {} steps of loss and grad_norm{}", what, a.size(),
                            actual.final_params ? " and the final parameters" : "");
    return r;
  }
  r.verdict = reports::Verdict::kFail;
  if (ev.first_diverging_step) {
    r.message = fmt::format("{} diverges at step {}: {} = {:.9g}, expected {:.9g} ({} fp32 ULP)",
                            what, *ev.first_diverging_step, ev.metric, *ev.actual, *ev.expected,
                            *ev.ulp_distance);
  } else {
    ev.metric = "params";
    r.message = fmt::format("{}: metrics equal but the final parameters differ (first: {})", what,
                            params_diff->tensor);
    ev.tensor = params_diff->tensor;
    ev.max_abs_err = params_diff->max_abs_err;
    ev.max_rel_err = params_diff->max_rel_err;
    ev.ulp_distance = params_diff->ulp;
  }
  if (trace) r.message += add_trace_evidence(ev, actual, expected, 0);
  r.evidence = ev;
  return r;
}

reports::CheckResult compare_tolerance(const std::string& name, const std::string& kind,
                                       const RunView& actual, const RunView& expected,
                                       const std::map<Metric, double>& rtol,
                                       const std::string& what, bool trace,
                                       const NoiseFloors* floors) {
  reports::CheckResult r;
  r.name = name;
  r.kind = kind;
  const auto& a = *actual.steps;
  const auto& e = *expected.steps;
  if (a.size() != e.size()) {
    r.verdict = reports::Verdict::kFail;
    r.message = fmt::format("{} has {} steps, expected {}", what, a.size(), e.size());
    return r;
  }
  reports::Evidence ev;
  double worst_rel = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    bool step_failed = false;
    for (const auto& [m, tol] : rtol) {
      const double x = metric_value(a[i], m), y = metric_value(e[i], m);
      const double rel = std::fabs(x - y) / std::max(std::fabs(y), 1e-300);
      if (!std::isnan(rel)) worst_rel = std::max(worst_rel, rel);
      if (std::fabs(x - y) <= tol * std::fabs(y)) continue;
      if (!ev.first_diverging_step) {
        ev.first_diverging_step = a[i].step;
        ev.metric = golden_key(m);
        ev.actual = x;
        ev.expected = y;
        ev.max_rel_err = rel;
        ev.max_abs_err = std::fabs(x - y);
      }
      step_failed = true;
    }
    if (step_failed) ++ev.failing_steps;
  }
  if (!ev.first_diverging_step) {
    r.message = fmt::format("{} within tolerance over {} steps (max rel diff {:.3g})", what,
                            a.size(), worst_rel);
    return r;
  }
  r.verdict = reports::Verdict::kFail;
  r.message = fmt::format(
      "{} leaves the tolerance at step {}: {} = {:.9g}, expected {:.9g} (rel {:.3g} > rtol {:.3g}; "
      "{} failing steps)",
      what, *ev.first_diverging_step, ev.metric, *ev.actual, *ev.expected, *ev.max_rel_err,
      rtol.at(ev.metric == "loss" ? Metric::kLoss : Metric::kGradNorm), ev.failing_steps);
  if (trace) {
    double tensor_rtol = 0;
    for (const auto& [m, tol] : rtol) tensor_rtol = std::max(tensor_rtol, tol);
    r.message += add_trace_evidence(ev, actual, expected, tensor_rtol, floors);
  }
  r.evidence = ev;
  return r;
}

}  // namespace meshproof::harness
