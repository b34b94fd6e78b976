#include "reports/report_writers.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <system_error>

#include "reports/report_error.h"

namespace meshproof::reports {
namespace {

[[noreturn]] void io_error(const std::string& what) {
  throw ReportError(ReportError::Kind::kIo, what);
}

// Writes `text` to `tmp` and fsyncs it, so that the rename publishes complete contents.
void write_synced(const std::filesystem::path& tmp, const std::string& text) {
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) io_error(fmt::format("cannot create {}: {}", tmp.string(), std::strerror(errno)));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t w = ::write(fd, text.data() + done, text.size() - done);
    if (w < 0) {
      if (errno == EINTR) continue;
      const int err = errno;
      ::close(fd);
      io_error(fmt::format("cannot write {}: {}", tmp.string(), std::strerror(err)));
    }
    done += static_cast<size_t>(w);
  }
  if (::fsync(fd) != 0 || ::close(fd) != 0) {
    io_error(fmt::format("cannot flush {}: {}", tmp.string(), std::strerror(errno)));
  }
}

}  // namespace

std::string render_json(const RunRecord& record) {
  // Invalid UTF-8 in a record string becomes U+FFFD instead of failing the whole report.
  return to_json(record).dump(2, ' ', false, nlohmann::json::error_handler_t::replace) + "\n";
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
  // Stage all four under temporary names, then rename: a failure while staging leaves the
  // previous reports (if any) untouched and removes the temporaries.
  std::vector<std::filesystem::path> tmps;
  try {
    for (const auto& [name, text] : docs) {
      const std::filesystem::path tmp = out_dir / fmt::format(".{}.tmp.{}", name, ::getpid());
      tmps.push_back(tmp);
      write_synced(tmp, text);
    }
    for (size_t i = 0; i < tmps.size(); ++i) {
      std::filesystem::rename(tmps[i], out_dir / docs[i].first, ec);
      if (ec)
        io_error(fmt::format("cannot rename {} to {}: {}", tmps[i].string(), docs[i].first,
                             ec.message()));
    }
  } catch (...) {
    for (const std::filesystem::path& t : tmps) std::filesystem::remove(t, ec);
    throw;
  }
  return {out_dir / "report.json", out_dir / "report.md", out_dir / "junit.xml",
          out_dir / "report.html"};
}

}  // namespace meshproof::reports
