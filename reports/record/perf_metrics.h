// Derived performance figures (docs/design.md section 9). Pure functions of the run record's plain
// data; each formula is written out here and in docs/report-schema.md.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "reports/record/run_record.h"

namespace meshproof::reports {

// ---- steady-state step time -------------------------------------------------------------------

// Default warm-up rule: the first ceil(n/5) steps (at least 1) are excluded, but at least one
// step always remains (n = 1 keeps its only step). Warm-up covers allocator growth, cuBLASLt
// heuristics, NCCL/communicator setup and the delayed-scaling first step with scale 1.
int64_t default_warmup_steps(int64_t num_steps);

// Median of total_s over steps[warmup, n) (mean of the two middle values for an even count).
// warmup < 0 selects default_warmup_steps(n); a warm-up >= n is clamped to n - 1. Throws
// ReportError(kInput) when there are no steps.
double steady_state_median_step_time(const std::vector<StepMetrics>& steps, int64_t warmup = -1);

// Median of an unsorted sample (mean of the two middle values for an even count). Throws
// ReportError(kInput) for an empty sample or a non-finite value.
double median(std::vector<double> values);

// ---- pipeline stages (docs/design.md section 38) --------------------------------------------

// The measured pipeline bubble of a stage: idle_s / step_s, the share of the step the stage
// spent waiting for a neighbour. Throws ReportError(kInput) unless 0 <= idle_s <= step_s and
// step_s > 0 (finite).
double bubble_fraction(double idle_s, double step_s);

// The mean per step of each phase over a stage's ranks and the steps [warmup, n) of each:
// per_rank[r][i] is rank r's step i; every rank has the same n >= 1 steps. warmup < 0 selects
// default_warmup_steps(n); a warm-up >= n is clamped to n - 1 (as steady_state_median_step_time).
// Throws ReportError(kInput) for no ranks, no steps, unequal step counts or a negative time.
PipelinePhases mean_pipeline_phases(const std::vector<std::vector<PipelinePhases>>& per_rank,
                                    int64_t warmup = -1);

// ---- model FLOPs (Megatron-style) -------------------------------------------------------------

// The dimensions that the FLOP count needs.
struct ModelShape {
  int64_t layers = 0;   // L
  int64_t hidden = 0;   // H
  int64_t ffn = 0;      // F
  int64_t vocab = 0;    // V
  int64_t seq_len = 0;  // S
  bool swiglu = false;  // fc1 split into fc1_gate and fc1_up: three H x F matmuls per MLP
};

// Parameters that take part in matrix multiplies, per the model of docs/design.md section 3:
//   P_matmul = L * (3H*H [qkv] + H*H [proj] + m*H*F [fc1 (+gate), fc2]) + V*H [logits]
// with m = 2 (GELU/ReLU) or 3 (SwiGLU). Biases, norms and the embedding lookups are not
// matmuls; the logits GEMM counts V*H whether or not the embeddings are tied.
int64_t matmul_parameters(const ModelShape& m);

// Model FLOPs of one training step over the whole mesh, without activation recompute:
//   flops = 6 * T * P_matmul + 12 * L * S * H * T
// T = tokens in the step (global batch B*S). 6 = 2 (multiply-add) x 3 (forward, dgrad, wgrad).
// The attention term is q*k^T and attn*v: 2 GEMMs x 2*S*H FLOPs per token per layer forward,
// times 3 for forward + backward; the causal mask is not discounted (Megatron convention, so
// figures compare with Megatron-LM / TE reports). This equals Narayanan et al. (2021)
// 72*B*S*L*H^2*(1 + S/(6H) + V/(12*H*L)) when F = 4H.
double model_flops_per_step(const ModelShape& m, double tokens);

// Achieved model TFLOP/s per device: flops_per_step / step_time_s / num_devices / 1e12.
double tflops_per_device(double flops_per_step, double step_time_s, int num_devices);

// ---- MFU --------------------------------------------------------------------------------------

// Dense (no sparsity) peak per device, TFLOP/s, from the one table in perf_metrics.cc (vendor
// data sheets, cited there): H100 SXM / PCIe / NVL, H200, B200, B300 and GB200, each with fp32
// (non-tensor), bf16, fp8 and fp4 where the GPU has the format. gemm_dtype is "fp32", "bf16",
// "fp8" or "fp4" (the dtype the recipe's GEMMs run in on that GPU: MXFP8 on Hopper is emulated
// with bf16 GEMMs, so the harness passes "bf16" there). Matching is by case-insensitive
// substring starting a word of the device name ("NVIDIA H100 80GB HBM3"; "B200" does not match
// "GB200"), first table row first. Returns nullopt for GPUs or dtypes not in the table.
std::optional<double> table_peak_tflops(std::string_view gpu_name, std::string_view gemm_dtype);

struct PeakTflops {
  std::optional<double> tflops;  // nullopt when neither the table nor a calibration knows it
  std::string source;            // "table:H100 fp8", "calibration", ""
};

// The table value when the GPU is in it, otherwise the measured calibration value (e.g. a
// bench-measured dense GEMM rate for unknown GPUs or the CPU backend), otherwise unknown.
PeakTflops resolve_peak_tflops(std::string_view gpu_name, std::string_view gemm_dtype,
                               std::optional<double> calibration_tflops);

// Model FLOPs utilisation: achieved / peak. Throws ReportError(kInput) if peak <= 0.
double mfu(double achieved_tflops_per_device, double peak_tflops);

// ---- collectives (nccl-tests formulas) --------------------------------------------------------

// algbw = bytes / time_s / 1e9 (GB/s); 0 when time_s <= 0.
double algbw_gbps(int64_t bytes, double time_s);
// The nccl-tests bus bandwidth factor for n ranks: all_reduce 2(n-1)/n; all_gather,
// reduce_scatter and all_to_all (n-1)/n; broadcast and reduce 1. Throws ReportError(kInput) for
// n < 1.
double busbw_factor(CollectiveKind kind, int n);
// Fills algbw_gbps and busbw_gbps of a CollectiveStats from its bytes, time_s and group_size.
void fill_bandwidths(CollectiveStats& c);

// ---- all together -----------------------------------------------------------------------------

struct PerformanceInputs {
  ModelShape model;
  int num_devices = 1;                       // physical devices (virtual ranks share one)
  std::string gpu_name;                      // "" on the CPU backend
  std::string gemm_dtype = "bf16";           // see table_peak_tflops
  std::optional<double> calibration_tflops;  // measured peak for GPUs not in the table
  int64_t warmup_steps = -1;                 // -1: default_warmup_steps
};

// Steady-state figures of a scenario from its steps: median step time over the window,
// tokens/s, model FLOPs and TFLOP/s per device, peak and MFU (absent when the peak is unknown).
PerformanceFigures compute_performance(const std::vector<StepMetrics>& steps,
                                       const PerformanceInputs& in);

}  // namespace meshproof::reports
