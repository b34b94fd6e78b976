// `meshproof report compare A.json B.json`: per-metric ratios B/A of two report.json files.
#pragma once

#include <filesystem>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <vector>

namespace meshproof::reports {

struct CompareRow {
  std::string scenario;
  std::string metric;  // "step_time_ms", "tokens_per_s", "tflops_per_device", "mfu",
                       // "busbw_gbps all_gather dp_shard", ...
  std::optional<double> a;
  std::optional<double> b;
  std::optional<double> ratio;   // b / a; absent when either is missing or a == 0
  bool higher_is_better = true;  // false for step time
};

struct CompareTable {
  std::vector<CompareRow> rows;        // scenarios in A's order, metrics in a fixed order
  std::vector<std::string> only_in_a;  // scenario names missing from B
  std::vector<std::string> only_in_b;  // scenario names missing from A
};

// Reads and parses a report.json. Throws ReportError(kInput) naming the path when the file is
// missing, is not JSON, or is not a meshproof report of schema version kReportSchemaVersion.
nlohmann::json load_report(const std::filesystem::path& path);

// Compares two parsed reports scenario by scenario (matched by name). Throws ReportError(kInput)
// naming the key path when a report lacks a field the comparison needs.
CompareTable compare_reports(const nlohmann::json& a, const nlohmann::json& b);

// The table as fixed-width text for the terminal, with a header naming A and B.
std::string format_compare_table(const CompareTable& t, const std::string& a_name,
                                 const std::string& b_name);

}  // namespace meshproof::reports
