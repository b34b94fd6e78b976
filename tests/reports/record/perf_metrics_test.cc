// Derived performance figures against hand-computed values (the arithmetic is in the comments).
#include "reports/record/perf_metrics.h"

#include <gtest/gtest.h>

#include <cmath>

#include "reports/record/report_error.h"

namespace meshproof::reports {
namespace {

std::vector<StepMetrics> steps_with_times(const std::vector<double>& t, int64_t tokens = 1000) {
  std::vector<StepMetrics> out;
  for (size_t i = 0; i < t.size(); ++i) {
    StepMetrics m;
    m.step = static_cast<int64_t>(i) + 1;
    m.tokens = tokens;
    m.time.total_s = t[i];
    out.push_back(m);
  }
  return out;
}

TEST(PerfMetricsTest, DefaultWarmupIsCeilOfOneFifthAndLeavesOneStep) {
  EXPECT_EQ(default_warmup_steps(0), 0);
  EXPECT_EQ(default_warmup_steps(1), 0);   // the only step is kept
  EXPECT_EQ(default_warmup_steps(2), 1);   // ceil(2/5) = 1
  EXPECT_EQ(default_warmup_steps(5), 1);   // ceil(5/5) = 1
  EXPECT_EQ(default_warmup_steps(6), 2);   // ceil(6/5) = 2
  EXPECT_EQ(default_warmup_steps(20), 4);  // ceil(20/5) = 4
  EXPECT_EQ(default_warmup_steps(21), 5);
}

TEST(PerfMetricsTest, MedianOddEvenAndEmpty) {
  EXPECT_DOUBLE_EQ(median({3, 1, 2}), 2);
  EXPECT_DOUBLE_EQ(median({4, 1, 3, 2}), 2.5);  // (2 + 3) / 2
  EXPECT_DOUBLE_EQ(median({7}), 7);
  EXPECT_THROW(median({}), ReportError);
  EXPECT_THROW(median({1.0, std::nan("")}), ReportError);
}

TEST(PerfMetricsTest, SteadyStateMedianExcludesWarmup) {
  // 10 steps, default warm-up ceil(10/5) = 2 excludes 9.0 and 5.0; the rest sorted:
  // 1.0 1.1 1.2 1.2 1.3 1.4 1.5 8.0 -> median (1.2 + 1.3) / 2 = 1.25.
  const auto s = steps_with_times({9.0, 5.0, 1.2, 1.0, 1.4, 1.3, 8.0, 1.1, 1.5, 1.2});
  EXPECT_DOUBLE_EQ(steady_state_median_step_time(s), 1.25);
  // Explicit warm-up 0 includes them: sorted 1.0 1.1 1.2 1.2 1.3 1.4 1.5 5.0 8.0 9.0 -> 1.35.
  EXPECT_DOUBLE_EQ(steady_state_median_step_time(s, 0), 1.35);
  // A warm-up covering every step is clamped to keep the last one.
  EXPECT_DOUBLE_EQ(steady_state_median_step_time(s, 50), 1.2);
  EXPECT_THROW(steady_state_median_step_time({}), ReportError);
}

TEST(PerfMetricsTest, PipelineBubbleIsIdleOverStep) {
  EXPECT_DOUBLE_EQ(bubble_fraction(0.025, 0.1), 0.25);
  EXPECT_DOUBLE_EQ(bubble_fraction(0, 0.1), 0);
  EXPECT_DOUBLE_EQ(bubble_fraction(0.1, 0.1), 1);
  EXPECT_THROW(bubble_fraction(0.2, 0.1), ReportError);  // idle longer than the step
  EXPECT_THROW(bubble_fraction(-0.01, 0.1), ReportError);
  EXPECT_THROW(bubble_fraction(0, 0), ReportError);
  EXPECT_THROW(bubble_fraction(std::nan(""), 0.1), ReportError);
}

TEST(PerfMetricsTest, PipelinePhasesAreTheMeanOverRanksAndSteadySteps) {
  // Two ranks, three steps each; the default warm-up of 3 steps is 1, so steps 1 and 2 count.
  const auto ph = [](double f, double w, double step) {
    return PipelinePhases{f, 2 * f, w, 0.5 * f, 0.25 * f, step};
  };
  const std::vector<std::vector<PipelinePhases>> ranks = {
      {ph(100, 100, 1000), ph(1, 2, 10), ph(3, 4, 20)},
      {ph(100, 100, 1000), ph(5, 6, 30), ph(7, 8, 40)}};
  const PipelinePhases m = mean_pipeline_phases(ranks);
  // (1 + 3 + 5 + 7) / 4 = 4; waits (2 + 4 + 6 + 8) / 4 = 5; steps (10 + 20 + 30 + 40) / 4 = 25.
  EXPECT_DOUBLE_EQ(m.forward_s, 4);
  EXPECT_DOUBLE_EQ(m.backward_s, 8);
  EXPECT_DOUBLE_EQ(m.p2p_wait_s, 5);
  EXPECT_DOUBLE_EQ(m.reduction_s, 2);
  EXPECT_DOUBLE_EQ(m.optimizer_s, 1);
  EXPECT_DOUBLE_EQ(m.step_s, 25);
  EXPECT_DOUBLE_EQ(bubble_fraction(m.p2p_wait_s, m.step_s), 0.2);
  // An explicit warm-up of 0 keeps the first step; one past the end is clamped to the last step.
  EXPECT_DOUBLE_EQ(mean_pipeline_phases(ranks, 0).step_s, (1000 + 10 + 20 + 1000 + 30 + 40) / 6.0);
  EXPECT_DOUBLE_EQ(mean_pipeline_phases(ranks, 7).step_s, 30);  // (20 + 40) / 2
  EXPECT_THROW(mean_pipeline_phases({}), ReportError);
  EXPECT_THROW(mean_pipeline_phases({{}}), ReportError);
  EXPECT_THROW(mean_pipeline_phases({{ph(1, 1, 2)}, {ph(1, 1, 2), ph(1, 1, 2)}}), ReportError);
  EXPECT_THROW(mean_pipeline_phases({{ph(-1, 1, 2)}}), ReportError);
}

TEST(PerfMetricsTest, MatmulParametersAndMegatronFlops) {
  // L=2, H=4, F=16, V=10, S=8.
  // P = 2 * (3*16 + 16 + 2*4*16) + 10*4 = 2 * (48 + 16 + 128) + 40 = 424.
  const ModelShape m{2, 4, 16, 10, 8, false};
  EXPECT_EQ(matmul_parameters(m), 424);
  // T = 32 tokens: 6*32*424 + 12*2*8*4*32 = 81408 + 24576 = 105984.
  EXPECT_DOUBLE_EQ(model_flops_per_step(m, 32), 105984.0);
  // SwiGLU: MLP has 3 H x F matmuls: 2 * (48 + 16 + 192) + 40 = 552.
  EXPECT_EQ(matmul_parameters({2, 4, 16, 10, 8, true}), 552);
  EXPECT_THROW(matmul_parameters({2, 0, 16, 10, 8, false}), ReportError);
}

TEST(PerfMetricsTest, FlopsMatchNarayananClosedFormWhenFfnIs4H) {
  // 72*B*S*L*H^2*(1 + S/(6H) + V/(12*H*L)) with F = 4H, as in Megatron-LM's paper.
  const int64_t L = 24, H = 2048, S = 2048, V = 50304, B = 8;
  const ModelShape m{L, H, 4 * H, V, S, false};
  const double closed =
      72.0 * B * S * L * double(H) * H * (1.0 + double(S) / (6.0 * H) + double(V) / (12.0 * H * L));
  EXPECT_NEAR(model_flops_per_step(m, double(B * S)) / closed, 1.0, 1e-12);
}

TEST(PerfMetricsTest, TflopsPerDevice) {
  // 8e15 FLOPs in 2 s over 4 devices = 1e15 FLOP/s per device = 1000 TFLOP/s.
  EXPECT_DOUBLE_EQ(tflops_per_device(8e15, 2.0, 4), 1000.0);
  EXPECT_THROW(tflops_per_device(1, 0, 1), ReportError);
  EXPECT_THROW(tflops_per_device(1, 1, 0), ReportError);
}

TEST(PerfMetricsTest, PeakTableAndCalibration) {
  // Every row and dtype of the table against the data-sheet values (dense TFLOP/s), as device
  // names report them. Table constants: exact comparisons.
  struct Row {
    const char* name;
    double fp32, bf16, fp8, fp4;  // 0: not in the table
  };
  const Row rows[] = {
      {"NVIDIA H100 80GB HBM3", 67, 989, 1979, 0},    {"NVIDIA H100 PCIe", 51.2, 756, 1513, 0},
      {"NVIDIA H100 NVL", 60, 835, 1671, 0},          {"NVIDIA H200", 67, 989, 1979, 0},
      {"nvidia b200", 75, 2250, 4500, 9000},          {"NVIDIA GB200", 80, 2500, 5000, 10000},
      {"NVIDIA B300 SXM6 AC", 75, 2250, 4500, 13500},
  };
  for (const Row& r : rows) {
    SCOPED_TRACE(r.name);
    const std::pair<const char*, double> dts[] = {
        {"fp32", r.fp32}, {"bf16", r.bf16}, {"fp8", r.fp8}, {"fp4", r.fp4}};
    for (const auto& [dt, v] : dts) {
      if (v > 0) {
        EXPECT_EQ(table_peak_tflops(r.name, dt), v) << dt;
      } else {
        EXPECT_FALSE(table_peak_tflops(r.name, dt)) << dt;
      }
    }
  }
  EXPECT_FALSE(table_peak_tflops("NVIDIA A100-SXM4-80GB", "bf16"));
  EXPECT_FALSE(table_peak_tflops("NVIDIA H100", "fp16"));
  EXPECT_FALSE(table_peak_tflops("cpu", "fp32"));

  const PeakTflops t = resolve_peak_tflops("NVIDIA H100 PCIe", "fp8", 123.0);
  EXPECT_EQ(t.tflops, 1513.0);  // the table wins over a calibration for known GPUs
  EXPECT_EQ(t.source, "table:H100 PCIe fp8");
  // "B200" starts no word of "GB200": the GB200 row, not B200's.
  EXPECT_EQ(resolve_peak_tflops("NVIDIA GB200", "bf16", std::nullopt).source, "table:GB200 bf16");
  EXPECT_EQ(resolve_peak_tflops("NVIDIA H100 80GB HBM3", "fp8", 1.0).source, "table:H100 fp8");
  const PeakTflops c = resolve_peak_tflops("NVIDIA L40S", "bf16", 362.0);
  EXPECT_EQ(c.tflops, 362.0);
  EXPECT_EQ(c.source, "calibration");
  const PeakTflops u = resolve_peak_tflops("", "bf16", std::nullopt);
  EXPECT_FALSE(u.tflops);
  EXPECT_EQ(u.source, "");
  EXPECT_THROW(resolve_peak_tflops("cpu", "bf16", -1.0), ReportError);

  EXPECT_DOUBLE_EQ(mfu(494.5, 989.0), 0.5);
  EXPECT_THROW(mfu(1, 0), ReportError);
}

TEST(PerfMetricsTest, NcclTestsBusBandwidth) {
  // 8 GB in 0.1 s = 80 GB/s algbw.
  EXPECT_DOUBLE_EQ(algbw_gbps(8'000'000'000, 0.1), 80.0);
  EXPECT_DOUBLE_EQ(algbw_gbps(1, 0), 0.0);
  // all-reduce 2(n-1)/n: n=8 -> 1.75; all-gather / reduce-scatter (n-1)/n: n=8 -> 0.875.
  EXPECT_DOUBLE_EQ(busbw_factor(CollectiveKind::kAllReduce, 8), 1.75);
  EXPECT_DOUBLE_EQ(busbw_factor(CollectiveKind::kAllGather, 8), 0.875);
  EXPECT_DOUBLE_EQ(busbw_factor(CollectiveKind::kReduceScatter, 4), 0.75);
  EXPECT_DOUBLE_EQ(busbw_factor(CollectiveKind::kAllReduce, 1), 0.0);  // no bus traffic
  EXPECT_DOUBLE_EQ(busbw_factor(CollectiveKind::kBroadcast, 8), 1.0);
  EXPECT_THROW(busbw_factor(CollectiveKind::kAllReduce, 0), ReportError);

  CollectiveStats c;
  c.kind = CollectiveKind::kAllReduce;
  c.group_size = 4;
  c.bytes = 2'000'000'000;
  c.time_s = 0.05;
  fill_bandwidths(c);
  EXPECT_DOUBLE_EQ(c.algbw_gbps, 40.0);  // 2e9 / 0.05 / 1e9
  EXPECT_DOUBLE_EQ(c.busbw_gbps, 60.0);  // 40 * 2 * 3 / 4
}

TEST(PerfMetricsTest, ComputePerformanceEndToEnd) {
  // 5 steps, warm-up ceil(5/5) = 1: window times 0.5 0.4 0.6 0.5 -> median 0.5 s.
  const auto s = steps_with_times({3.0, 0.5, 0.4, 0.6, 0.5}, 32);
  PerformanceInputs in;
  in.model = {2, 4, 16, 10, 8, false};  // 105984 FLOPs per step at 32 tokens (see above)
  in.num_devices = 2;
  in.gpu_name = "some CPU";
  in.gemm_dtype = "bf16";
  in.calibration_tflops = 1e-9;  // 1000 FLOP/s
  const PerformanceFigures p = compute_performance(s, in);
  EXPECT_EQ(p.warmup_steps, 1);
  EXPECT_EQ(p.steady_steps, 4);
  EXPECT_DOUBLE_EQ(p.median_step_time_s, 0.5);
  EXPECT_DOUBLE_EQ(p.tokens_per_step, 32);
  EXPECT_DOUBLE_EQ(p.tokens_per_s, 64);  // 32 / 0.5
  EXPECT_DOUBLE_EQ(p.model_flops_per_step, 105984.0);
  // 105984 / 0.5 / 2 / 1e12 = 1.05984e-7 TFLOP/s.
  EXPECT_DOUBLE_EQ(p.tflops_per_device, 1.05984e-7);
  EXPECT_EQ(p.peak_source, "calibration");
  ASSERT_TRUE(p.mfu);
  EXPECT_NEAR(*p.mfu, 105.984, 1e-9);  // 1.05984e-7 / 1e-9: above 1 flags a wrong calibration

  in.calibration_tflops.reset();
  EXPECT_FALSE(compute_performance(s, in).mfu);
  EXPECT_THROW(compute_performance({}, in), ReportError);
}

}  // namespace
}  // namespace meshproof::reports
