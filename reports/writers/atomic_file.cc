#include "reports/writers/atomic_file.h"

#include <fcntl.h>
#include <fmt/format.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <system_error>

#include "reports/record/report_error.h"

namespace meshproof::reports {
namespace fs = std::filesystem;
namespace {

[[noreturn]] void io_error(const std::string& what) {
  throw ReportError(ReportError::Kind::kIo, what);
}

fs::path folder_of(const fs::path& target) {
  return target.has_parent_path() ? target.parent_path() : fs::path(".");
}

}  // namespace

StagedFile create_temporary(const fs::path& target) {
  const fs::path dir = folder_of(target);
  std::string templ =
      (dir / fmt::format(".{}.tmp.{}.XXXXXX", target.filename().string(), ::getpid())).string();
  const int fd = ::mkostemp(templ.data(), O_CLOEXEC);
  if (fd < 0) {
    io_error(fmt::format("cannot create a temporary file in {} for {}: {}", dir.string(),
                         target.filename().string(), std::strerror(errno)));
  }
  // mkstemp creates 0600; these files are meant to be read by others like any output.
  ::fchmod(fd, 0644);
  return {fs::path(templ), fd};
}

void write_and_sync(StagedFile& staged, std::string_view bytes) {
  auto fail = [&](const char* what, int err) {
    ::close(staged.fd);
    staged.fd = -1;
    std::error_code ec;
    fs::remove(staged.path, ec);
    io_error(fmt::format("cannot {} {}: {}", what, staged.path.string(), std::strerror(err)));
  };
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t w = ::write(staged.fd, bytes.data() + done, bytes.size() - done);
    if (w < 0) {
      if (errno == EINTR) continue;
      fail("write", errno);
    }
    done += static_cast<size_t>(w);
  }
  if (::fsync(staged.fd) != 0) fail("flush", errno);
  const int fd = staged.fd;
  staged.fd = -1;
  if (::close(fd) != 0) {
    const int err = errno;
    std::error_code ec;
    fs::remove(staged.path, ec);
    io_error(fmt::format("cannot close {}: {}", staged.path.string(), std::strerror(err)));
  }
}

void publish(const fs::path& temporary, const fs::path& target) {
  if (::rename(temporary.c_str(), target.c_str()) != 0) {
    const int err = errno;
    std::error_code ec;
    fs::remove(temporary, ec);
    io_error(fmt::format("cannot rename {} to {}: {}", temporary.string(), target.string(),
                         std::strerror(err)));
  }
  // The rename is durable once the folder's entry is on disk.
  const int dfd = ::open(folder_of(target).c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

void write_file_atomically(const fs::path& target, std::string_view bytes) {
  StagedFile staged = create_temporary(target);
  write_and_sync(staged, bytes);
  publish(staged.path, target);
}

void write_path_atomically(const fs::path& target,
                           const std::function<void(const fs::path&)>& write) {
  (void)remove_orphan_temporaries(folder_of(target), {target.filename().string()});
  StagedFile staged = create_temporary(target);
  ::close(staged.fd);
  staged.fd = -1;
  try {
    write(staged.path);
    // The writer closed its handle; the bytes are durable once this descriptor's fsync returns.
    const int fd = ::open(staged.path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0 || ::fsync(fd) != 0) {
      const int err = errno;
      if (fd >= 0) ::close(fd);
      io_error(fmt::format("cannot flush {}: {}", staged.path.string(), std::strerror(err)));
    }
    ::close(fd);
  } catch (...) {
    std::error_code ec;
    fs::remove(staged.path, ec);
    throw;
  }
  publish(staged.path, target);
}

bool is_temporary_of(std::string_view name, std::string_view target, long* pid) {
  const std::string prefix = fmt::format(".{}.tmp.", target);
  if (name.substr(0, prefix.size()) != prefix) return false;
  std::string_view rest = name.substr(prefix.size());
  size_t digits = 0;
  while (digits < rest.size() && std::isdigit(static_cast<unsigned char>(rest[digits]))) ++digits;
  if (digits == 0 || digits > 10) return false;
  const std::string_view tail = rest.substr(digits);
  if (!tail.empty()) {
    // ".XXXXXX": mkstemp's six characters of [A-Za-z0-9].
    if (tail.size() != 7 || tail[0] != '.') return false;
    for (char c : tail.substr(1))
      if (!std::isalnum(static_cast<unsigned char>(c))) return false;
  }
  *pid = std::strtol(std::string(rest.substr(0, digits)).c_str(), nullptr, 10);
  return *pid > 0;
}

std::vector<fs::path> remove_orphan_temporaries(const fs::path& dir,
                                                const std::vector<std::string>& target_names) {
  std::vector<fs::path> removed;
  std::error_code ec;
  fs::directory_iterator it(dir, ec);
  if (ec) return removed;
  for (const fs::directory_entry& e : it) {
    const std::string name = e.path().filename().string();
    for (const std::string& target : target_names) {
      long pid = 0;
      if (!is_temporary_of(name, target, &pid)) continue;
      // Alive (or not ours to signal: EPERM) means it may still be writing.
      if (::kill(static_cast<pid_t>(pid), 0) == 0 || errno != ESRCH) break;
      std::error_code rm;
      if (e.is_symlink(rm) || e.is_regular_file(rm)) {
        if (fs::remove(e.path(), rm)) removed.push_back(e.path());
      }
      break;
    }
  }
  return removed;
}

}  // namespace meshproof::reports
