// Builders the runner's unit tests share (tests/harness/runner/*_test.cc): per-step metrics,
// goldens, traced steps and allgather_parity records as the checks receive them from a run.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "engine/session/session.h"
#include "harness/checks/checks.h"
#include "harness/checks/golden.h"
#include "kernels/core/tensor.h"
#include "reports/record/run_record.h"

namespace meshproof::harness::test {

// Steps 1..n with these losses and gradient norms.
inline std::vector<reports::StepMetrics> steps_of(const std::vector<double>& loss,
                                                  const std::vector<double>& grad_norm) {
  std::vector<reports::StepMetrics> out;
  for (size_t i = 0; i < loss.size(); ++i) {
    reports::StepMetrics m;
    m.step = static_cast<int64_t>(i) + 1;
    m.loss = loss[i];
    m.grad_norm = grad_norm[i];
    out.push_back(m);
  }
  return out;
}

// A golden holding these per-step losses and gradient norms.
inline GoldenData golden_of(const std::vector<double>& loss, const std::vector<double>& grad_norm) {
  GoldenData g;
  g.metrics["loss"] = loss;
  g.metrics["grad_norm"] = grad_norm;
  return g;
}

// A traced step: gradient and weight digests with the values first_diverging_traced compares.
inline std::vector<engine::TensorDigest> traced_step(const std::vector<float>& grad,
                                                     const std::vector<float>& weight) {
  std::vector<engine::TensorDigest> out;
  for (const auto& [name, v] : {std::pair{"grad/w", grad}, std::pair{"param/w", weight}}) {
    engine::TensorDigest d;
    d.name = name;
    d.shape = kernels::Shape({static_cast<int64_t>(v.size())});
    d.values = v;
    out.push_back(d);
  }
  return out;
}

// One allgather_parity record of engine step `step` (0-based): the reference's bytes and scale,
// or `mismatched` bytes off with a smaller scale_inv (each shard's own amax).
inline engine::AllGatherParity parity_record(int64_t step, const std::string& tensor,
                                             int64_t mismatched) {
  engine::AllGatherParity p;
  p.step = step;
  p.tensor = tensor;
  p.bytes = 2 * 98336;
  p.mismatched_bytes = mismatched;
  p.max_abs_error = mismatched > 0 ? 0.0175 : 0.0;
  p.scale_inv = mismatched > 0 ? 0.000168936589 : 0.000183105469;
  p.reference_scale_inv = 0.000183105469;
  return p;
}

}  // namespace meshproof::harness::test
