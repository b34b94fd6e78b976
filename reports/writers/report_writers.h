// The four report writers (docs/design.md section 9). Each render_* function is pure (record in,
// document out) so that tests can check the documents without touching the file system;
// write_reports renders all four first and then writes each atomically.
#pragma once

#include <filesystem>
#include <string>
#include <vector>

#include "reports/record/run_record.h"

namespace meshproof::reports {

// report.json: to_json(record) pretty-printed (schema: docs/report-schema.md).
std::string render_json(const RunRecord& record);
// report.md: a one-screen summary table (scenario, mesh, recipe, checks, verdict, step time,
// MFU), then per-scenario details (checks with evidence, performance, memory, collectives, notes).
std::string render_markdown(const RunRecord& record);
// junit.xml: one <testsuite> per scenario, one <testcase> per check (plus the synthetic cases
// described in docs/report-schema.md), <failure>/<error>/<skipped> carrying the evidence.
std::string render_junit(const RunRecord& record);
// report.html: one self-contained XHTML-compatible file with inline SVG plots, no scripts, no
// external references.
std::string render_html(const RunRecord& record);

struct ReportPaths {
  std::filesystem::path json;
  std::filesystem::path markdown;
  std::filesystem::path junit;
  std::filesystem::path html;
};

// Creates out_dir if needed and writes report.json, report.md, junit.xml and report.html. All
// four are rendered before anything is written (a bad record writes nothing); each file is
// written to a fresh temporary in out_dir (reports/writers/atomic_file.h: mkstemp, never through an
// existing name or symlink), fsynced, and renamed over its final name, so a reader never sees a
// half-written file. Throws ReportError(kInput) for an invalid record and
// ReportError(kIo) when a file cannot be written (temporaries are removed).
ReportPaths write_reports(const RunRecord& record, const std::filesystem::path& out_dir);

// The four file names write_reports writes (whose orphan temporaries a run may clean up).
const std::vector<std::string>& report_file_names();

}  // namespace meshproof::reports
