// Parity checks (docs/design.md sections 7 and 8) as pure comparisons of finished runs: each
// returns a reports::CheckResult with a verdict, a one-line message and, on failure, evidence (the
// first diverging step and metric; with tracing, the first diverging tensor with its max abs/rel
// error and ULP distance). The runner (harness/run/runner.h) produces the runs they compare.
#pragma once

#include <filesystem>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "engine/model/params.h"
#include "engine/session/session.h"
#include "harness/checks/golden.h"
#include "harness/scenario/scenario.h"
#include "mesh/core/collective_recorder.h"
#include "reports/record/run_record.h"

namespace meshproof::harness {

// Distance in units in the last place between two floats (0 when bitwise equal; +-0 count as
// equal; a NaN on either side gives INT64_MAX unless both are the same NaN bits).
int64_t ulp_distance(float a, float b);
int64_t ulp_distance(double a, double b);

// The first tensor (canonical order) whose bits differ between a and b, with its max abs error,
// max relative error (over elements with a nonzero reference) and max ULP distance.
struct TensorDiff {
  std::string tensor;
  double max_abs_err = 0;
  double max_rel_err = 0;
  int64_t ulp = 0;
};
std::optional<TensorDiff> first_diverging_tensor(const engine::TensorMap& actual,
                                                 const engine::TensorMap& expected);

// Per-step traces of a run (engine::RunResult::trace): [step][tensor], step 0 = optimizer step 1.
using Trace = std::vector<std::vector<engine::TensorDigest>>;

// The first diverging (step, tensor) of two traces, measured on that tensor at that step:
// TensorDiff's max abs/rel error and ULP distance over its elements, and its relative L2
// difference ||actual - expected||_2 / ||expected||_2. Steps in order, tensors in step order
// (below).
//   rtol == 0 (bitwise checks): the first tensor whose bits differ.
//   rtol > 0 (tolerance checks, where every tensor may differ in its last bits): the first tensor
//     whose relative L2 difference exceeds rtol; when none does, the tensor with the largest
//     relative L2 difference, with beyond_rtol false.
// nullopt when the traces are bitwise equal on their common steps. A tensor missing on one side
// or of another shape is a divergence (named "<tensor> (missing)" / "<tensor> (shape A vs B)",
// errors infinite).
//
// Noise floors (`floors`, from noise_floors): each tensor at each step is judged against the
// relative L2 difference the same comparison shows between two fault-free runs (the control),
// not against rtol: it is beyond when its rel L2 exceeds kNoiseFloorFactor times its floor (a
// tensor bitwise equal in the control: any difference).
// Every mode visits a step's tensors in the order the step computes them: gradients in backward
// order (the reverse of the canonical parameter order), then the weights the optimizer update
// produced.
struct TraceDiff {
  int64_t step = 0;  // 1-based
  TensorDiff diff;   // tensor "grad/<param>" or "param/<param>"
  double rel_l2 = 0;
  bool beyond_rtol = true;      // beyond rtol, or beyond its noise floor when judged by floors
  std::optional<double> floor;  // the tensor's noise floor at that step (judged by floors)
};
// [step][tensor name] -> relative L2 difference between the two runs of a fault-free control.
using NoiseFloors = std::vector<std::map<std::string, double>>;
NoiseFloors noise_floors(const Trace& control_actual, const Trace& control_expected);
// How far above its fault-free floor a tensor's difference must be to count: the control and the
// checked comparison reorder the same reductions, so their fault-free differences are of one
// size; a factor 4 leaves room for that size to vary between runs, while the faults' effects
// are far above it (measured with --trace on the library's fault scenarios, first named tensor:
// hsdp_replicas_not_reduced rel L2 0.76 over a floor of 4.8e-8, tp_fsdp_left_to_right 0.58 over
// 2.4e-7, uneven_shard_padding_leak 1.3e-3 over 2.9e-7).
inline constexpr double kNoiseFloorFactor = 4.0;
std::optional<TraceDiff> first_diverging_traced(const Trace& actual, const Trace& expected,
                                                double rtol = 0,
                                                const NoiseFloors* floors = nullptr);

// golden: `steps` against a golden file. `golden` nullopt means the file is missing: a failure
// whose message names `golden_file` and the `update_command` that creates it. On return
// `record` (when given) holds the golden steps and band for the report's plots. With `trace`
// (--trace) a failure says that it has no per-tensor evidence: goldens store per-step metrics only.
// When `scenario_hash` (this run's, harness::scenario_hash_hex) is given and differs from the
// golden's recorded scenario_hash, a failure says so: the golden may be stale (recorded for
// another configuration), with the command that updates it.
reports::CheckResult check_golden(const std::vector<reports::StepMetrics>& steps,
                                  const std::optional<GoldenData>& golden, const GoldenCheck& cfg,
                                  const std::string& golden_file, const std::string& update_command,
                                  reports::GoldenRecord* record = nullptr, bool trace = false,
                                  const std::string& scenario_hash = "");

// A finished run as the bitwise / tolerance comparisons see it.
struct RunView {
  const std::vector<reports::StepMetrics>* steps = nullptr;
  const engine::TensorMap* final_params = nullptr;  // may be null (metrics-only comparison)
  // Per-step per-tensor digests and values (runs made with tracing); may be null.
  const Trace* trace = nullptr;
};

// determinism and same-mesh resume: per-step loss and grad_norm and the final parameters must be
// bitwise equal. `what` names the two runs in the message ("rerun", "resumed run"). With `trace`
// a failure also names the first diverging traced tensor and its step (first_diverging_traced,
// rtol 0); the evidence's max_abs_err, max_rel_err and ulp_distance are then that tensor's.
reports::CheckResult compare_bitwise(const std::string& name, const std::string& kind,
                                     const RunView& actual, const RunView& expected,
                                     const std::string& what, bool trace);

// reference and cross-mesh resume: per step and metric |a - e| <= rtol * |e| (rtol per metric;
// metrics absent from `rtol` are not compared). With `trace` a failure also names the first
// traced tensor beyond the largest of the rtols (first_diverging_traced) and its step; the
// evidence's max_abs_err, max_rel_err and ulp_distance are then that tensor's.
// With `floors` (a fault-free control of the same comparison, runner.cc) the traced tensors are
// judged against their noise floors instead of the rtols.
reports::CheckResult compare_tolerance(const std::string& name, const std::string& kind,
                                       const RunView& actual, const RunView& expected,
                                       const std::map<Metric, double>& rtol,
                                       const std::string& what, bool trace,
                                       const NoiseFloors* floors = nullptr);

// allgather_parity: passes iff at least one FP8 all-gathered weight was compared and no record has
// a mismatched byte. A failure names the first mismatching step (1-based) and tensor, its
// mismatched bytes out of the bytes compared, its scale_inv against the reference and the max abs
// error of the dequantized values, and counts the mismatching records; the evidence carries the
// same (metric "scale_inv": actual = gathered, expected = reference).
reports::CheckResult check_allgather_parity(const std::vector<engine::AllGatherParity>& records);

// collectives (docs/design.md section 29): one rank's parameter collectives, the plan's
// (engine::expected_collectives) and the recorded ones (mesh::CollectiveRecorder).
struct RankCollectives {
  int rank = 0;
  std::vector<mesh::CollectiveCall> expected, ran;
};
// Passes iff, for every rank and step, the recorded collectives equal the expected ones as
// multisets of (kind, reduction, group, tensor, dtype, bytes). A failure names the first
// difference in (rank, step, group, kind, tensor) order: the step (1-based), the rank, the
// group, the kind, the tensor, and the dtype and bytes expected against those that ran, or that
// the collective is extra or missing, and counts the differing collectives; the evidence's
// tensor is the parameter, its metric "collectives".
reports::CheckResult check_collectives(const std::vector<RankCollectives>& ranks);

// state (docs/design.md section 22): checkpoint `after` (the state a fresh engine holds right
// after loading) against `before` (the state the run held when it saved), reassembled to global
// tensors: every scalar equal, the same keys, and per key the same dtype, global shape and bytes.
// A failure names the first differing key (scalars first, then keys in name order) and, for a
// tensor, its first differing element (global index and both values) and how many differ; the
// evidence carries the same (tensor = key, actual = after, expected = before). The message of a
// pass counts the keys and scalars compared and lists the state groups the checkpoint holds
// (model/, optim/, fp8/, fp8/params/, scalars).
// First, the model/ keys of `before` reassembled must equal `params`, the masters the saving
// run's engine gathers (global fp32): a checkpoint whose layouts put shards at the wrong global
// offsets fails there even when a load on the same mesh undoes it.
// Before all that (issue #46), every key and scalar of `before` must be in `saved`, the
// checkpoint under test (a save-side fault that drops one fails there, "not in the checkpoint",
// with the key named); a value difference names the key, its first differing element and the
// ULP distance there (evidence.ulp_distance).
reports::CheckResult compare_checkpoint_state(const std::filesystem::path& after,
                                              const std::filesystem::path& saved,
                                              const std::filesystem::path& before,
                                              const engine::TensorMap& params,
                                              const std::string& what);

}  // namespace meshproof::harness
