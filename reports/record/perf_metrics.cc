#include "reports/record/perf_metrics.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>

#include "reports/record/report_error.h"

namespace meshproof::reports {
namespace {

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

// `needle` in `hay` (case-insensitive) starting a word: not preceded by a letter or digit, so that
// "B200" does not match "NVIDIA GB200".
bool contains_word_ci(std::string_view hay, std::string_view needle) {
  const std::string h = lower(hay), n = lower(needle);
  for (size_t pos = h.find(n); pos != std::string::npos; pos = h.find(n, pos + 1)) {
    if (pos == 0 || !std::isalnum(static_cast<unsigned char>(h[pos - 1]))) return true;
  }
  return false;
}

// The one table of dense peaks (TFLOP/s per GPU, without sparsity); 0: the GPU has no such
// tensor-core format. fp32 is the non-tensor (CUDA core) FP32 rate: the fp32 GEMMs of the fp32
// and block recipes run without TF32. First match wins, so variants precede their family.
// Sources (NVIDIA data sheets; sparse figures halved, multi-GPU systems divided per GPU):
//   H100 SXM / PCIe / NVL: "NVIDIA H100 Tensor Core GPU" datasheet (FP32 67 / 51 / 60; BF16
//     1979 / 1513 / 1671 sparse; FP8 3958 / 3026 / 3341 sparse).
//   H200 SXM: "NVIDIA H200 Tensor Core GPU" datasheet (same SM configuration as H100 SXM).
//   B200, B300: "NVIDIA HGX B200" / "HGX B300" datasheets, 8 GPUs (FP32 600 TF; BF16 36 PF,
//     FP8 72 PF sparse; FP4 144 PF sparse (B200), 108 PF dense (B300)).
//   GB200: "NVIDIA GB200 NVL72" datasheet, 72 GPUs (FP32 5760 TF; BF16 360 PF, FP8 720 PF,
//     FP4 1440 PF sparse).
struct PeakEntry {
  const char* gpu;  // word-start substring of the device name ("NVIDIA H100 80GB HBM3")
  double fp32;
  double bf16;
  double fp8;
  double fp4;
};

constexpr PeakEntry kPeaks[] = {
    {"H100 PCIe", 51.2, 756.0, 1513.0, 0},  {"H100 NVL", 60.0, 835.0, 1671.0, 0},
    {"H100", 67.0, 989.0, 1979.0, 0},  // SXM (HBM3)
    {"H200", 67.0, 989.0, 1979.0, 0},       {"GB200", 80.0, 2500.0, 5000.0, 10000.0},
    {"B200", 75.0, 2250.0, 4500.0, 9000.0}, {"B300", 75.0, 2250.0, 4500.0, 13500.0},
};

const PeakEntry* find_peak(std::string_view gpu_name) {
  for (const PeakEntry& e : kPeaks) {
    if (contains_word_ci(gpu_name, e.gpu)) return &e;
  }
  return nullptr;
}

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

double bubble_fraction(double idle_s, double step_s) {
  if (!std::isfinite(idle_s) || !std::isfinite(step_s) || step_s <= 0 || idle_s < 0 ||
      idle_s > step_s) {
    input_error(
        fmt::format("pipeline bubble of {} s idle in a step of {} s (needs 0 <= idle <= "
                    "step, step > 0)",
                    idle_s, step_s));
  }
  return idle_s / step_s;
}

PipelinePhases mean_pipeline_phases(const std::vector<std::vector<PipelinePhases>>& per_rank,
                                    int64_t warmup) {
  if (per_rank.empty()) input_error("pipeline phases of a stage with no ranks");
  const int64_t n = static_cast<int64_t>(per_rank.front().size());
  if (n == 0) input_error("pipeline phases of a stage with no steps");
  if (warmup < 0) warmup = default_warmup_steps(n);
  warmup = std::min(warmup, n - 1);
  PipelinePhases sum;
  for (size_t r = 0; r < per_rank.size(); ++r) {
    if (static_cast<int64_t>(per_rank[r].size()) != n) {
      input_error(fmt::format("pipeline phases: rank {} of the stage has {} steps, rank 0 {}", r,
                              per_rank[r].size(), n));
    }
    for (int64_t i = warmup; i < n; ++i) {
      const PipelinePhases& p = per_rank[r][static_cast<size_t>(i)];
      for (double v :
           {p.forward_s, p.backward_s, p.p2p_wait_s, p.reduction_s, p.optimizer_s, p.step_s}) {
        if (!std::isfinite(v) || v < 0) {
          input_error(
              fmt::format("pipeline phases: rank {} of the stage, step {}: time {} s", r, i, v));
        }
      }
      sum.forward_s += p.forward_s;
      sum.backward_s += p.backward_s;
      sum.p2p_wait_s += p.p2p_wait_s;
      sum.reduction_s += p.reduction_s;
      sum.optimizer_s += p.optimizer_s;
      sum.step_s += p.step_s;
    }
  }
  // A mean, not a median: the means of the parts add up as the parts of each step do.
  const double k = static_cast<double>(per_rank.size()) * static_cast<double>(n - warmup);
  return {sum.forward_s / k,   sum.backward_s / k,  sum.p2p_wait_s / k,
          sum.reduction_s / k, sum.optimizer_s / k, sum.step_s / k};
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
  const PeakEntry* e = find_peak(gpu_name);
  if (e == nullptr) return std::nullopt;
  double v = 0;
  if (gemm_dtype == "fp32") v = e->fp32;
  if (gemm_dtype == "bf16") v = e->bf16;
  if (gemm_dtype == "fp8") v = e->fp8;
  if (gemm_dtype == "fp4") v = e->fp4;
  if (v > 0) return v;
  return std::nullopt;
}

PeakTflops resolve_peak_tflops(std::string_view gpu_name, std::string_view gemm_dtype,
                               std::optional<double> calibration_tflops) {
  if (auto t = table_peak_tflops(gpu_name, gemm_dtype)) {
    return {t, fmt::format("table:{} {}", find_peak(gpu_name)->gpu, gemm_dtype)};
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
