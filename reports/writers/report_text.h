// Formatting shared by the Markdown, JUnit and HTML writers, so that the same figure or the same
// evidence reads identically in every format.
#pragma once

#include <string>
#include <vector>

#include "reports/record/run_record.h"

namespace meshproof::reports {

// "first diverging step 7, metric loss, tensor layers.0.mlp.fc2.weight, expected 2.5,
// actual 2.51, max abs err 0.0125, max rel err 0.005, ULP distance 12, 3 failing steps"; only
// the known parts, numbers as %.6g. Empty when the evidence is empty.
std::string evidence_summary(const Evidence& e);
// "3 pass, 1 fail" (only nonzero counts, in the order pass, fail, error, skipped); "none".
std::string checks_tally(const ScenarioRecord& s);
// Median steady-state step time in milliseconds, "%.3f", or "n/a" without performance figures.
std::string step_time_ms(const ScenarioRecord& s);
// MFU as a percentage "%.1f%%", or "n/a" when the peak is unknown.
std::string mfu_percent(const ScenarioRecord& s);
// Bytes with a binary unit: "1.50 GiB", "12.0 MiB", "512 B".
std::string format_bytes(int64_t bytes);
// The headline of a check for people: its message, followed by the evidence summary in
// parentheses when there is evidence.
std::string check_headline(const CheckResult& c);
// "golden, reference"; "none" for an empty list.
std::string join_names(const std::vector<std::string>& names);
// The JSON config of a scenario, compact.
std::string config_text(const ScenarioRecord& s);

// Pipeline stages (ScenarioRecord::pipeline), the cells every writer shows: the ranks "0, 1", the
// layers "0-1" (one layer: "2"), the peak memory of each rank "1.2 MiB, 1.3 MiB", a fraction as
// "%.3f" ("n/a" when not finite), and the sentence that says what the table's figures are.
std::string stage_ranks_text(const PipelineStageRecord& p);
std::string stage_layers_text(const PipelineStageRecord& p);
std::string stage_peaks_text(const PipelineStageRecord& p);
std::string fraction_text(double v);
std::string pipeline_caption(const ScenarioRecord& s);

}  // namespace meshproof::reports
