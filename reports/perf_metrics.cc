#include "reports/perf_metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>

#include "reports/report_error.h"

namespace meshproof::reports {
namespace {

[[noreturn]] void input_error(std::string message) {
  throw ReportError(ReportError::Kind::kInput, message);
}

bool contains_ci(std::string_view hay, std::string_view needle) {
  auto lower = [](std::string_view s) {
    std::string out(s);
    for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    return out;
  };
  return lower(hay).find(lower(needle)) != std::string::npos;
}

struct PeakEntry {
  const char* gpu;  // substring of the device name
  double bf16;
  double fp8;
};

// Dense tensor-core peaks (TFLOP/s) from NVIDIA's data sheets (SXM parts, without sparsity).
constexpr PeakEntry kPeaks[] = {
    {"H100", 989.0, 1979.0},
    {"H200", 989.0, 1979.0},
    {"B200", 2250.0, 4500.0},
};

}  // namespace

int64_t default_warmup_steps(int64_t num_steps) {
  if (num_steps <= 1) return 0;
  const int64_t w = std::max<int64_t>(1, (num_steps + 4) / 5);  // ceil(n/5), at least 1
  return std::min(w, num_steps - 1);
}

double median(std::vector<double> values) {
  if (values.empty()) input_error("median of an empty sample");
  for (double v : values) {
    // NaN would break the ordering nth_element relies on; a step time is never infinite.
    if (!std::isfinite(v)) input_error(fmt::format("median of a sample holding {}", v));
  }
  const size_t n = values.size();
  std::nth_element(values.begin(), values.begin() + n / 2, values.end());
  const double hi = values[n / 2];
  if (n % 2 == 1) return hi;
  const double lo = *std::max_element(values.begin(), values.begin() + n / 2);
  return 0.5 * (lo + hi);
}

double steady_state_median_step_time(const std::vector<StepMetrics>& steps, int64_t warmup) {
  const int64_t n = static_cast<int64_t>(steps.size());
  if (n == 0) input_error("steady-state step time of a scenario with no steps");
  if (warmup < 0) warmup = default_warmup_steps(n);
  warmup = std::min(warmup, n - 1);
  std::vector<double> t;
  for (int64_t i = warmup; i < n; ++i) t.push_back(steps[i].time.total_s);
  return median(std::move(t));
}

int64_t matmul_parameters(const ModelShape& m) {
  if (m.layers < 0 || m.hidden <= 0 || m.ffn < 0 || m.vocab < 0) {
    input_error(fmt::format("model shape L={} H={} F={} V={} is not a model", m.layers, m.hidden,
                            m.ffn, m.vocab));
  }
  const int64_t mlp = (m.swiglu ? 3 : 2) * m.hidden * m.ffn;
  return m.layers * (3 * m.hidden * m.hidden + m.hidden * m.hidden + mlp) + m.vocab * m.hidden;
}

double model_flops_per_step(const ModelShape& m, double tokens) {
  const double p = static_cast<double>(matmul_parameters(m));
  return 6.0 * tokens * p + 12.0 * static_cast<double>(m.layers) * static_cast<double>(m.seq_len) *
                                static_cast<double>(m.hidden) * tokens;
}

double tflops_per_device(double flops_per_step, double step_time_s, int num_devices) {
  if (step_time_s <= 0 || num_devices < 1) {
    input_error(fmt::format("TFLOP/s needs step time > 0 and devices >= 1 (got {} s, {} devices)",
                            step_time_s, num_devices));
  }
  return flops_per_step / step_time_s / num_devices / 1e12;
}

std::optional<double> table_peak_tflops(std::string_view gpu_name, std::string_view gemm_dtype) {
  for (const PeakEntry& e : kPeaks) {
    if (!contains_ci(gpu_name, e.gpu)) continue;
    if (gemm_dtype == "bf16") return e.bf16;
    if (gemm_dtype == "fp8") return e.fp8;
    return std::nullopt;
  }
  return std::nullopt;
}

PeakTflops resolve_peak_tflops(std::string_view gpu_name, std::string_view gemm_dtype,
                               std::optional<double> calibration_tflops) {
  if (auto t = table_peak_tflops(gpu_name, gemm_dtype)) {
    for (const PeakEntry& e : kPeaks) {
      if (contains_ci(gpu_name, e.gpu)) return {t, fmt::format("table:{} {}", e.gpu, gemm_dtype)};
    }
  }
  if (calibration_tflops) {
    if (!(*calibration_tflops > 0)) {
      input_error(fmt::format("calibration peak must be > 0 TFLOP/s, got {}", *calibration_tflops));
    }
    return {calibration_tflops, "calibration"};
  }
  return {std::nullopt, ""};
}

double mfu(double achieved_tflops_per_device, double peak_tflops) {
  if (!(peak_tflops > 0)) input_error(fmt::format("MFU needs a peak > 0, got {}", peak_tflops));
  return achieved_tflops_per_device / peak_tflops;
}

double algbw_gbps(int64_t bytes, double time_s) {
  if (time_s <= 0) return 0;
  return static_cast<double>(bytes) / time_s / 1e9;
}

double busbw_factor(CollectiveKind kind, int n) {
  if (n < 1) input_error(fmt::format("collective group size must be >= 1, got {}", n));
  const double nn = n;
  switch (kind) {
    case CollectiveKind::kAllReduce:
      return 2.0 * (nn - 1) / nn;
    case CollectiveKind::kAllGather:
    case CollectiveKind::kReduceScatter:
    case CollectiveKind::kAllToAll:
      return (nn - 1) / nn;
    case CollectiveKind::kBroadcast:
    case CollectiveKind::kReduce:
      return 1.0;
  }
  return 1.0;
}

void fill_bandwidths(CollectiveStats& c) {
  c.algbw_gbps = algbw_gbps(c.bytes, c.time_s);
  c.busbw_gbps = c.algbw_gbps * busbw_factor(c.kind, c.group_size);
}

PerformanceFigures compute_performance(const std::vector<StepMetrics>& steps,
                                       const PerformanceInputs& in) {
  const int64_t n = static_cast<int64_t>(steps.size());
  if (n == 0) input_error("performance figures of a scenario with no steps");
  PerformanceFigures p;
  p.warmup_steps = std::min(in.warmup_steps < 0 ? default_warmup_steps(n) : in.warmup_steps, n - 1);
  p.steady_steps = n - p.warmup_steps;
  p.median_step_time_s = steady_state_median_step_time(steps, p.warmup_steps);
  std::vector<double> tokens;
  for (int64_t i = p.warmup_steps; i < n; ++i)
    tokens.push_back(static_cast<double>(steps[i].tokens));
  p.tokens_per_step = median(std::move(tokens));
  p.num_devices = in.num_devices;
  p.model_flops_per_step = model_flops_per_step(in.model, p.tokens_per_step);
  if (p.median_step_time_s > 0) {
    p.tokens_per_s = p.tokens_per_step / p.median_step_time_s;
    p.tflops_per_device =
        tflops_per_device(p.model_flops_per_step, p.median_step_time_s, in.num_devices);
  }
  p.gemm_dtype = in.gemm_dtype;
  const PeakTflops peak = resolve_peak_tflops(in.gpu_name, in.gemm_dtype, in.calibration_tflops);
  p.peak_tflops = peak.tflops;
  p.peak_source = peak.source;
  if (peak.tflops && p.median_step_time_s > 0) p.mfu = mfu(p.tflops_per_device, *peak.tflops);
  return p;
}

}  // namespace meshproof::reports
