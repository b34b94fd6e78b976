#include "reports/writers/report_writers.h"

#include <fmt/format.h>

#include <system_error>
#include <vector>

#include "reports/record/report_error.h"
#include "reports/writers/atomic_file.h"

namespace meshproof::reports {
namespace {

[[noreturn]] void io_error(const std::string& what) {
  throw ReportError(ReportError::Kind::kIo, what);
}

}  // namespace

std::string render_json(const RunRecord& record) {
  // Invalid UTF-8 in a record string becomes U+FFFD instead of failing the whole report.
  return to_json(record).dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
}

const std::vector<std::string>& report_file_names() {
  static const std::vector<std::string> names = {"report.json", "report.md", "junit.xml",
                                                 "report.html"};
  return names;
}

ReportPaths write_reports(const RunRecord& record, const std::filesystem::path& out_dir) {
  // Validate and render everything first: an invalid record throws here, before any file is
  // touched.
  validate_record(record);
  const std::pair<std::string, std::string> docs[] = {
      {"report.json", render_json(record)},
      {"report.md", render_markdown(record)},
      {"junit.xml", render_junit(record)},
      {"report.html", render_html(record)},
  };
  std::error_code ec;
  std::filesystem::create_directories(out_dir, ec);
  if (ec || !std::filesystem::is_directory(out_dir)) {
    io_error(fmt::format("cannot create report directory {}: {}", out_dir.string(),
                         ec ? ec.message() : "not a directory"));
  }
  // Stage all four under fresh temporary names (reports/writers/atomic_file.h: mkstemp in out_dir,
  // so a planted symlink or a concurrent writer is never written through), then rename: a failure
  // while staging leaves the previous reports (if any) untouched and removes the temporaries.
  std::vector<std::filesystem::path> tmps;
  try {
    for (const auto& [name, text] : docs) {
      StagedFile staged = create_temporary(out_dir / name);
      tmps.push_back(staged.path);
      write_and_sync(staged, text);
    }
    for (size_t i = 0; i < tmps.size(); ++i) publish(tmps[i], out_dir / docs[i].first);
  } catch (...) {
    for (const std::filesystem::path& t : tmps) std::filesystem::remove(t, ec);
    throw;
  }
  return {out_dir / "report.json", out_dir / "report.md", out_dir / "junit.xml",
          out_dir / "report.html"};
}

}  // namespace meshproof::reports
