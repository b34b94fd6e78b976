#include "harness/verbs/report_verb.h"

#include <CLI/CLI.hpp>
#include <memory>

#include "harness/verbs/exit_codes.h"
#include "kernels/core/error.h"
#include "reports/record/compare.h"
#include "reports/record/report_error.h"

namespace meshproof::harness {

void report_compare(const std::string& a_path, const std::string& b_path, double min_change,
                    std::ostream& out) {
  try {
    const reports::CompareTable t = reports::compare_reports(
        reports::load_report(a_path), reports::load_report(b_path), min_change);
    out << reports::format_compare_table(t, a_path, b_path);
  } catch (const reports::ReportError& e) {
    // reports/ cannot throw kernels::Error (it depends on nothing of ours): map its kinds here.
    if (e.kind() == reports::ReportError::Kind::kInput)
      MP_FAIL_INPUT("report compare: {}", e.what());
    MP_FAIL("report compare: {}", e.what());
  }
}

void add_report_command(CLI::App& app, std::ostream& out, int& exit_code) {
  auto* report = app.add_subcommand("report", "Work with written reports (report.json)");
  report->require_subcommand(1);
  auto* compare = report->add_subcommand(
      "compare",
      "Compare two report.json files: B/A ratios of step time, tokens/s, TFLOP/s, MFU and bus "
      "bandwidth per collective, scenario by scenario");
  auto a = std::make_shared<std::string>();
  auto b = std::make_shared<std::string>();
  compare->add_option("A", *a, "Baseline report.json")->required();
  compare->add_option("B", *b, "Report to compare with the baseline")->required();
  auto min_change = std::make_shared<double>(reports::kDefaultMinChange);
  compare
      ->add_option("--min-change", *min_change,
                   "Smallest relative change |B/A - 1| flagged better/worse, beside disjoint "
                   "noise ranges (default 0.05: run-to-run drift, reports/record/compare.h)")
      ->check(CLI::Range(0.0, 10.0));
  compare->callback([&out, &exit_code, a, b, min_change] {
    report_compare(*a, *b, *min_change, out);
    exit_code = kExitOk;
  });
}

}  // namespace meshproof::harness
