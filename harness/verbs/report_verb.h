// `meshproof report compare A.json B.json`: per-scenario ratios B/A of step time, tokens/s,
// TFLOP/s per device, MFU and per-collective bus bandwidth of two report.json files.
#pragma once

#include <ostream>
#include <string>

namespace CLI {
class App;
}

namespace meshproof::harness {

// Prints the comparison table to `out`. Bad input (missing file, not a meshproof report,
// another schema version, a missing field) throws kernels::Error of kind kInput (exit 2).
// `min_change`: the relative floor below which no change is flagged (reports/record/compare.h).
void report_compare(const std::string& a_path, const std::string& b_path, double min_change,
                    std::ostream& out);

// Registers `report` and its `compare` subcommand; sets exit_code when the verb runs.
void add_report_command(CLI::App& app, std::ostream& out, int& exit_code);

}  // namespace meshproof::harness
