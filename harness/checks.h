// Parity checks (DESIGN.md sections 7 and 8) as pure comparisons of finished runs: each returns a
// reports::CheckResult with a verdict, a one-line message and, on failure, evidence (the first
// diverging step and metric; with tracing, the first diverging tensor with its max abs/rel error
// and ULP distance). The runner (harness/runner.h) produces the runs they compare.
#pragma once

#include <optional>
#include <string>
#include <vector>

#include "engine/params.h"
#include "engine/session.h"
#include "harness/golden.h"
#include "harness/scenario.h"
#include "reports/run_record.h"

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

// The first (step, tensor) whose digest differs between two traces: "grad/<param>" or
// "param/<param>" and the 1-based step. nullopt when the traces agree on their common steps.
struct DigestDiff {
  int64_t step = 0;
  std::string tensor;
};
std::optional<DigestDiff> first_diverging_digest(
    const std::vector<std::vector<engine::TensorDigest>>& actual,
    const std::vector<std::vector<engine::TensorDigest>>& expected);

// golden: `steps` against a golden file. `golden` nullopt means the file is missing: a failure
// whose message names `golden_file` and the `update_command` that creates it. On return
// `record` (when given) holds the golden steps and band for the report's plots.
reports::CheckResult check_golden(const std::vector<reports::StepMetrics>& steps,
                                  const std::optional<GoldenData>& golden, const GoldenCheck& cfg,
                                  const std::string& golden_file, const std::string& update_command,
                                  reports::GoldenRecord* record = nullptr);

// A finished run as the bitwise / tolerance comparisons see it.
struct RunView {
  const std::vector<reports::StepMetrics>* steps = nullptr;
  const engine::TensorMap* final_params = nullptr;  // may be null (metrics-only comparison)
  // Per-step per-tensor digests (runs made with tracing); may be null.
  const std::vector<std::vector<engine::TensorDigest>>* trace = nullptr;
};

// determinism and same-mesh resume: per-step loss and grad_norm and the final parameters must be
// bitwise equal. `what` names the two runs in the message ("rerun", "resumed run").
reports::CheckResult compare_bitwise(const std::string& name, const std::string& kind,
                                     const RunView& actual, const RunView& expected,
                                     const std::string& what, bool trace);

// reference and cross-mesh resume: per step and metric |a - e| <= rtol * |e| (rtol per metric;
// metrics absent from `rtol` are not compared).
reports::CheckResult compare_tolerance(const std::string& name, const std::string& kind,
                                       const RunView& actual, const RunView& expected,
                                       const std::map<Metric, double>& rtol,
                                       const std::string& what, bool trace);

// allgather_parity: passes iff at least one FP8 all-gathered weight was compared and no record has
// a mismatched byte. A failure names the first mismatching step (1-based) and tensor, its
// mismatched bytes out of the bytes compared, its scale_inv against the reference and the max abs
// error of the dequantized values, and counts the mismatching records; the evidence carries the
// same (metric "scale_inv": actual = gathered, expected = reference).
reports::CheckResult check_allgather_parity(const std::vector<engine::AllGatherParity>& records);

}  // namespace meshproof::harness
