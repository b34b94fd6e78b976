// Goldens from runs meshproof did not make (docs/design.md section 41): a loss curve from a
// Megatron-LM or PyTorch run becomes golden/<scenario>/<platform>.h5, compared with the
// scenario's tolerance, never bitwise.
//   Megatron-LM functional-test golden values (JSON):
//     {"lm loss": {"start_step": 1, "end_step": 50, "step_interval": 5,
//                  "values": {"1": 10.84, "6": 10.81, ...}}, "num-zeros": {...}, ...}
//     "values" may also be a list (the older format, indexed from 0 over the logged iterations:
//     value i is step start_step + i * step_interval + 1). "lm loss" becomes loss,
//     "grad norm" grad_norm, "learning-rate" lr; other metrics are listed as ignored.
//   A JSON-lines loss log: one object per line, {"step": n, "loss": x} with optional
//     "grad_norm" and "lr" (present on every line or on none).
// The imported golden holds the steps it has (GoldenData::steps, ascending, >= 1) and its
// provenance: origin "imported", source_format, imported_from (the absolute path), source_bytes,
// date, meshproof version and commit, command. Bad input (not JSON, a missing "lm loss", a value
// that is not a finite number, a step below 1 or repeated, metrics over different steps) is an
// input error naming the file, and the line or key and step.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "harness/checks/golden.h"

namespace meshproof::harness {

enum class GoldenSourceFormat { kMegatron, kJsonLines };

struct ImportedGolden {
  GoldenData data;
  GoldenSourceFormat format = GoldenSourceFormat::kMegatron;
  std::vector<std::string> ignored;  // Megatron metrics not imported ("num-zeros", ...)
};

// Reads `path` in `format`, or detects it ("auto": a file that is one JSON object without a
// "step" key is Megatron, anything else JSON lines).
ImportedGolden read_golden_source(const std::filesystem::path& path, const std::string& format);

// The golden as Megatron-LM golden values JSON: "lm loss" (and "grad norm", "learning-rate" where
// the golden has them) with "values" keyed by step, start_step / end_step / step_interval from
// its steps (step_interval 1 unless the steps are evenly spaced by more).
std::string golden_as_megatron_json(const GoldenData& golden);

}  // namespace meshproof::harness
