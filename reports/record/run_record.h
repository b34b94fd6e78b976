// The run record: plain data that the harness fills while it runs scenarios and that the report
// writers (report_writers.h) turn into report.json, report.md, junit.xml and report.html.
// Nothing here computes anything beyond small derived verdicts; performance figures are filled
// with the functions of perf_metrics.h. The JSON form is documented in docs/report-schema.md and
// reports/schema/report.schema.json; bump kReportSchemaVersion on any incompatible change.
#pragma once

#include <cstdint>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "reports/record/environment.h"

namespace meshproof::reports {

// Version of the report.json layout. Readers (report compare) refuse other major versions.
inline constexpr int kReportSchemaVersion = 1;

// ---- enums with stable string names (the JSON spelling) -------------------------------------

enum class Verdict { kPass, kFail, kSkipped, kError };
std::string_view verdict_name(Verdict v);      // "pass", "fail", "skipped", "error"
Verdict parse_verdict(std::string_view name);  // throws ReportError(kInput) on unknown names

// Collective kinds, named like nccl-tests' binaries (all_reduce_perf, ...).
enum class CollectiveKind {
  kAllReduce,
  kAllGather,
  kReduceScatter,
  kBroadcast,
  kReduce,
  kAllToAll
};
std::string_view collective_name(CollectiveKind k);      // "all_reduce", "all_gather", ...
CollectiveKind parse_collective(std::string_view name);  // throws ReportError(kInput)

// What a scenario must do: pass all its checks, or (fault-injection scenarios) be caught: one of
// its intended checks (ScenarioRecord::caught_by) must fail.
enum class Expectation { kPass, kCaught };
std::string_view expectation_name(Expectation e);  // "pass", "caught"

// ---- per step ---------------------------------------------------------------------------------

// Time spent on one collective kind during one step, summed over the step (seconds, wall clock
// of rank 0; exposed time only when the harness overlaps communication with compute).
struct CollectiveTime {
  CollectiveKind kind = CollectiveKind::kAllGather;
  double seconds = 0;
};

// Wall-clock breakdown of one training step, seconds. The parts need not add up to total_s: the
// remainder (data loading, host overhead, un-attributed gaps) is reported as "other".
struct StepTiming {
  double total_s = 0;                       // whole step, rank 0 wall clock
  double compute_s = 0;                     // forward + backward, collectives excluded
  std::vector<CollectiveTime> collectives;  // one entry per collective kind used in the step
  double optimizer_s = 0;                   // clipping + AdamW update (+ FP8 re-quantization)
  double checkpoint_s = 0;                  // checkpoint save in this step, 0 when none
};

// Metrics of one optimizer step, as rank 0 sees them after the step.
struct StepMetrics {
  int64_t step = 0;      // 1-based optimizer step index
  double loss = 0;       // mean cross-entropy over the global batch (NaN when diverged)
  double grad_norm = 0;  // global L2 norm of the gradients before clipping
  double lr = 0;         // learning rate used by this step
  int64_t tokens = 0;    // tokens processed by this step over the whole mesh (global batch B*S)
  StepTiming time;
};

// ---- golden reference and checks --------------------------------------------------------------

// One step of a golden reference (golden/<scenario>/<platform>.h5).
struct GoldenStep {
  int64_t step = 0;
  double loss = 0;
  double grad_norm = 0;
};

// Tolerance band of a golden comparison: a step passes when |x - golden| <= atol + rtol*|golden|.
// mode "exact" means bitwise comparison (rtol = atol = 0).
struct ToleranceBand {
  std::string mode = "tolerance";  // "exact" or "tolerance"
  double rtol = 0;
  double atol = 0;
  int64_t allowed_failing_steps = 0;
};

struct GoldenRecord {
  std::string source;             // the golden file, e.g. "golden/gpt_tiny_fsdp4/h100.h5"
  std::vector<GoldenStep> steps;  // per step; steps absent here are not compared
  ToleranceBand tolerance;
};

// Why a check failed: where the run first left the reference and by how much. Every field is
// optional because checks know different things (a determinism check knows the step but not a
// tensor unless tracing was on).
struct Evidence {
  std::optional<int64_t> first_diverging_step;
  std::string metric;                   // "loss", "grad_norm", "params", ... ("" unknown)
  std::string tensor;                   // first diverging tensor, e.g. "layers.0.mlp.fc2.weight"
  std::optional<double> expected;       // reference value at the diverging step/element
  std::optional<double> actual;         // observed value there
  std::optional<double> max_abs_err;    // max |actual - expected| over the compared elements
  std::optional<double> max_rel_err;    // max |actual - expected| / |expected|
  std::optional<int64_t> ulp_distance;  // max distance in units in the last place (of the dtype)
  int64_t failing_steps = 0;            // number of steps outside the band (golden checks)

  bool empty() const;
};

// The outcome of one check of one scenario ("golden", "resume", "reference", ...).
struct CheckResult {
  std::string name;  // unique within the scenario, e.g. "golden" or "resume@step4"
  std::string kind;  // the check type: golden, resume, reference, allgather_parity, ...
  Verdict verdict = Verdict::kPass;
  std::string message;               // one line for people; required for fail/error/skipped
  double duration_s = 0;             // time the check itself took (not the training it compares)
  std::optional<Evidence> evidence;  // present for failures that located a divergence
};

// ---- performance ------------------------------------------------------------------------------

// Derived performance figures of one scenario; fill with compute_performance() (perf_metrics.h).
struct PerformanceFigures {
  int64_t warmup_steps = 0;           // leading steps excluded from the steady-state window
  int64_t steady_steps = 0;           // steps in the window
  double median_step_time_s = 0;      // median total_s over the window
  double tokens_per_step = 0;         // global tokens per step (median over the window)
  double tokens_per_s = 0;            // tokens_per_step / median_step_time_s, whole mesh
  double model_flops_per_step = 0;    // Megatron-style count, whole mesh (perf_metrics.h)
  double tflops_per_device = 0;       // model_flops_per_step / median_step_time_s / n / 1e12
  int num_devices = 1;                // physical devices the ranks ran on (virtual ranks: 1)
  std::string gemm_dtype;             // dtype the peak refers to: "bf16", "fp8", ...
  std::optional<double> peak_tflops;  // dense peak per device; absent when unknown
  std::string peak_source;            // "table:H100 fp8", "calibration", "" when unknown
  std::optional<double> mfu;          // tflops_per_device / peak_tflops, in [0, 1]
};

// Memory of one rank at the end of the run, bytes. The categories are what the engine accounts
// (kernels::MemoryTracker); peak_bytes is the tracker's high-water mark, not their sum. On a
// device, device_reserves adds what the tracker cannot see.
struct RankMemory {
  int rank = 0;
  int64_t params_bytes = 0;            // local parameter shards (fp32 master + FP8 copies)
  int64_t grads_bytes = 0;             // local gradient shards
  int64_t optimizer_bytes = 0;         // AdamW exp_avg + exp_avg_sq (+ FP8 scale state)
  int64_t gathered_weights_bytes = 0;  // transient all-gathered weights at their high-water mark
  int64_t activations_bytes = 0;       // saved activations at their high-water mark
  int64_t peak_bytes = 0;              // high-water mark of everything this rank allocated
  // Device memory held outside the tracker (kernels/core/device_reserve.h: "cuda_pool", "nccl",
  // "cublaslt", ...), by name; empty on the CPU backend (and then absent from the JSON).
  std::vector<std::pair<std::string, int64_t>> device_reserves;
  int64_t device_reserved_bytes() const;  // the sum of device_reserves
  int64_t device_total_bytes() const;     // peak_bytes + device_reserved_bytes()
};

// One optimizer step of one rank of a pipelined run (mesh.pp > 1), seconds of the rank's wall
// clock, disjoint parts (docs/design.md section 38): forward + backward + p2p_wait + reduction +
// optimizer <= step.
struct PipelinePhases {
  double forward_s = 0;    // the stage's forward passes (weight gathers, TP collectives in them)
  double backward_s = 0;   // the backward passes without the deferred gradient reduction
  double p2p_wait_s = 0;   // blocked in send/recv of activations and gradients: idle
  double reduction_s = 0;  // the deferred gradient reduction (reduce-scatter, HSDP all-reduce)
  double optimizer_s = 0;  // gradient norm (with its reductions), clipping, AdamW
  double step_s = 0;       // the whole step
};

// One pipeline stage of a run (mesh.pp > 1; absent with one stage): its phase times per step,
// averaged over the stage's ranks and the steady-state steps, its measured bubble beside the one
// its schedule predicts, and the peak memory of each of its ranks.
struct PipelineStageRecord {
  int stage = 0;
  std::vector<int> ranks;   // the stage's ranks, increasing
  int64_t first_layer = 0;  // the stage's layers [first_layer, first_layer + layers)
  int64_t layers = 0;
  int64_t warmup_steps = 0;              // leading steps left out (default_warmup_steps)
  int64_t steady_steps = 0;              // steps averaged
  PipelinePhases mean;                   // per step, mean over the ranks and the steady steps
  double bubble_fraction = 0;            // measured: mean.p2p_wait_s / mean.step_s
  double predicted_bubble_fraction = 0;  // the schedule in unit time (forward 1, backward 2)
  std::vector<int64_t> peak_bytes;       // per rank of `ranks`: the tracker's high-water mark
};

// Statistics of one collective kind on one process group over the whole run (rank 0's view).
// bytes follows nccl-tests' "size": the full buffer (all-gather: output, reduce-scatter: input,
// all-reduce: the buffer) summed over calls. Bandwidths are GB/s (1e9 bytes per second).
struct CollectiveStats {
  CollectiveKind kind = CollectiveKind::kAllGather;
  std::string group;      // mesh dims of the group, e.g. "dp_shard", "tp", "dp_replicate"
  int group_size = 1;     // ranks in the group (n in the busbw formulas)
  int64_t count = 0;      // number of calls
  int64_t bytes = 0;      // total bytes over all calls
  double time_s = 0;      // total time over all calls
  double algbw_gbps = 0;  // bytes / time_s / 1e9
  double busbw_gbps = 0;  // algbw scaled by the nccl-tests bus factor (perf_metrics.h)
};

// One figure of a benchmark (`meshproof bench recipes`): a measured median beside the ceiling
// that bounds it. (name, metric) is unique within a scenario; report compare matches on it.
struct BenchmarkFigure {
  std::string name;    // what was measured: "gemm fprop 256x256x256", "quantize weight 256x256"
  std::string metric;  // "tflops", "gbps", "step_time_ms", ...
  double value = 0;    // the median over the timed iterations, in `unit`
  // The least and greatest value over the timed iterations (the fastest and slowest one), in
  // `unit`: the measured noise of the figure; absent when not measured.
  std::optional<double> min;
  std::optional<double> max;
  std::string unit;               // "TFLOP/s", "GB/s", "ms"
  std::optional<double> ceiling;  // the bound in the same unit; absent when unknown
  std::string ceiling_source;     // "table:H100 fp8", "measured:copy", "measured:bf16 gemm", ""
  std::optional<double> ratio;    // value / ceiling (a time figure: ceiling / value)
  bool higher_is_better = true;   // false for times
  // Every timed repetition in `unit`, in order (bench recipes keeps them so that `report compare`
  // and readers see the whole noise); empty when not kept. Written to JSON only when non-empty.
  std::vector<double> samples;
  // Why the figure is an emulation ("CPU emulation", "MXFP8 as bf16 GEMMs below sm_100"), ""
  // when it ran natively. Every writer labels a non-empty one "emulated"; JSON only when set.
  std::string emulated;
};

// ---- scenario and run -------------------------------------------------------------------------

struct ScenarioRecord {
  std::string name;  // scenario name (file stem), unique within the run
  nlohmann::json config = nlohmann::json::object();  // resolved config (after --set), an object
  std::string mesh;                                  // "dp_replicate=1 dp_shard=4 tp=2"
  std::string recipe;   // fp32, bf16, delayed, current, mxfp8, block, nvfp4
  std::string backend;  // "cpu" or "cuda:0"
  Expectation expectation = Expectation::kPass;
  // Expectation kCaught: the check kinds (CheckResult::kind) whose failure counts as catching the
  // injected fault (the fault catalog's caught_by, restricted to the scenario's enabled checks).
  // A failure of any other check does not: a fault caught by the wrong check is a miss. Empty
  // for expectation kPass.
  std::vector<std::string> caught_by;
  double duration_s = 0;           // wall clock of the whole scenario, checks included
  std::vector<StepMetrics> steps;  // in step order
  // Entropy rate of the training data source, nats per token: the loss no model can beat (the
  // first positions of a sequence see less context and sit above it). Absent for records
  // without training data (benchmarks).
  std::optional<double> entropy_floor;
  std::optional<GoldenRecord> golden;
  std::vector<CheckResult> checks;
  std::optional<PerformanceFigures> performance;  // absent when the run did not train
  std::vector<RankMemory> memory;                 // one entry per rank, rank order
  // Pipelined runs (mesh.pp > 1): one entry per stage, stage order; empty otherwise (and then
  // absent from every report).
  std::vector<PipelineStageRecord> pipeline;
  std::vector<CollectiveStats> collectives;
  std::vector<BenchmarkFigure> benchmarks;  // benchmark verbs only; empty for training runs
  std::vector<std::string> notes;           // things the user must know, e.g. fallbacks taken
  std::string error;  // set when the scenario itself failed to run (runtime error)
};

struct RunRecord {
  int schema_version = kReportSchemaVersion;
  EnvironmentRecord environment;
  std::vector<std::string> command_line;  // argv as given
  std::string start_time;                 // ISO 8601 UTC, "2026-11-22T04:18:19Z"
  double duration_s = 0;                  // wall clock of the whole run
  std::vector<ScenarioRecord> scenarios;
};

// ---- derived verdicts -------------------------------------------------------------------------

// A scenario's verdict, the one rule every writer and the `meshproof run` exit code follow.
// Expectation kPass: error if the scenario has an error or any check errored, else fail if any
// check failed, else skipped if every check was skipped (or there are none), else pass.
// Expectation kCaught (fault injection): error as above, else skipped if there are checks and
// every one was skipped, else pass when a check whose kind is in caught_by failed (the fault was
// caught by a check meant to catch it), else fail.
Verdict scenario_verdict(const ScenarioRecord& s);
// Whether a check of an expectation-kCaught scenario caught the fault: it failed and its kind is
// one of the scenario's caught_by.
bool catches_fault(const ScenarioRecord& s, const CheckResult& c);
// One line saying why scenario_verdict is error or fail ("check golden failed: ...", "fault not
// caught: none of the intended checks (resume) failed; determinism failed instead"); "" for
// pass and skipped.
std::string verdict_reason(const ScenarioRecord& s);
// The run's verdict: error if any scenario errored, else fail if any failed, else pass (a run
// of only skipped scenarios is skipped).
Verdict run_verdict(const RunRecord& r);

// Formats a system_clock time as ISO 8601 UTC with a trailing Z, seconds resolution.
std::string format_utc(int64_t unix_seconds);

// Checks what the writers rely on: scenario names non-empty and unique, caught_by only on
// expectation-caught scenarios and without empty kinds, check names non-empty and unique within
// their scenario, configs JSON objects, ranks and steps non-negative, benchmark
// figures named with a unique (name, metric) and a unit. Throws
// ReportError(kInput) naming the scenario and field. write_reports calls it before writing.
void validate_record(const RunRecord& r);

// The report.json document (schema in docs/report-schema.md). Derived verdicts are included so
// that readers need not re-derive them.
nlohmann::json to_json(const RunRecord& r);

}  // namespace meshproof::reports
