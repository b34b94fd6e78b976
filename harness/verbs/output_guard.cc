#include "harness/verbs/output_guard.h"

#include <fmt/format.h>
#include <sys/stat.h>

#include <optional>
#include <vector>

#include "kernels/core/error.h"
#include "reports/record/report_error.h"
#include "reports/writers/atomic_file.h"

namespace meshproof::harness {
namespace fs = std::filesystem;
namespace {

// The name of the probe file the writability checks create (and of its orphan temporaries).
constexpr const char* kWriteProbe = "meshproof-write-probe";

struct FileId {
  dev_t dev = 0;
  ino_t ino = 0;
  bool operator==(const FileId&) const = default;
};

// A path as the file system resolves it: the identity of every existing folder from the root
// down to the deepest existing component (the path itself when it exists), and the components
// past it that do not exist yet.
struct Resolved {
  fs::path canonical;
  std::vector<FileId> chain;
  std::vector<std::string> rest;  // empty: the path exists and chain.back() is its own identity
  bool exists() const { return rest.empty(); }
};

Resolved resolve(const fs::path& p) {
  std::error_code ec;
  fs::path abs = fs::absolute(p, ec);
  if (ec) abs = p;
  // Symlinks in the existing part resolved (a final symlink too), the rest normalized.
  fs::path c = fs::weakly_canonical(abs, ec);
  if (ec) c = abs.lexically_normal();
  Resolved r;
  r.canonical = c;
  fs::path prefix;
  bool missing = false;
  for (const fs::path& part : c) {
    if (part.empty()) continue;
    prefix /= part;
    struct stat st {};
    if (!missing && ::stat(prefix.c_str(), &st) == 0) {
      r.chain.push_back({st.st_dev, st.st_ino});
    } else {
      missing = true;
      r.rest.push_back(part.string());
    }
  }
  return r;
}

// Whether `a` is `b` or lies inside it.
bool within(const Resolved& a, const Resolved& b) {
  if (b.chain.empty()) return false;
  if (b.exists()) {
    for (const FileId& id : a.chain)
      if (id == b.chain.back()) return true;
    return false;
  }
  // `b` does not exist, so neither does anything inside it: `a` shares b's deepest existing
  // folder and continues b's missing components.
  if (a.chain.empty() || a.chain.back() != b.chain.back() || a.rest.size() < b.rest.size())
    return false;
  for (size_t i = 0; i < b.rest.size(); ++i)
    if (a.rest[i] != b.rest[i]) return false;
  return true;
}

bool same(const Resolved& a, const Resolved& b) { return within(a, b) && within(b, a); }

std::string identity(const Resolved& r) {
  if (!r.exists()) return r.canonical.string();
  return fmt::format("{}, device {} inode {}", r.canonical.string(), r.chain.back().dev,
                     r.chain.back().ino);
}

std::string kind_name(OutputKind k) {
  switch (k) {
    case OutputKind::kFile:
      return "file";
    case OutputKind::kOwnedFolder:
      return "folder";
    case OutputKind::kSharedFolder:
      return "folder";
  }
  return "path";
}

// Input error for output `o` against `other` (an input or another output).
[[noreturn]] void refuse(std::string_view verb, const NamedPath& o, const Resolved& ro,
                         std::string_view relation, const NamedPath& other, const Resolved& rother,
                         std::string_view consequence) {
  MP_FAIL_INPUT("{}: {} {} {} {} {} ({}); {}; nothing was written: choose another {}", verb, o.what,
                o.path.string(), relation, other.what, other.path.string(),
                identity(same(ro, rother) ? ro : rother), consequence, o.what);
}

}  // namespace

void check_outputs_apart(std::string_view verb, std::span<const NamedPath> inputs,
                         std::span<const NamedPath> outputs) {
  std::vector<Resolved> in, out;
  for (const NamedPath& p : inputs) in.push_back(resolve(p.path));
  for (const NamedPath& p : outputs) out.push_back(resolve(p.path));
  for (size_t i = 0; i < outputs.size(); ++i) {
    const NamedPath& o = outputs[i];
    for (size_t j = 0; j < inputs.size(); ++j) {
      if (!in[j].exists()) continue;
      if (same(out[i], in[j])) {
        refuse(verb, o, out[i], "is the same file as the input", inputs[j], in[j],
               "writing it would destroy the input");
      }
      if (within(out[i], in[j])) {
        refuse(verb, o, out[i], "lies inside the input", inputs[j], in[j],
               "writing it would change the input");
      }
      if (o.kind == OutputKind::kOwnedFolder && within(in[j], out[i])) {
        refuse(verb, o, out[i], "holds the input", inputs[j], in[j],
               fmt::format("the {} is the verb's own and may be replaced or pruned",
                           kind_name(o.kind)));
      }
    }
    for (size_t j = i + 1; j < outputs.size(); ++j) {
      const NamedPath& p = outputs[j];
      // Two folders the verb only adds named files to may be one (a checkpoint.dir that is
      // --out); a file, or a folder the verb prunes, may not be another output.
      const bool shared =
          o.kind == OutputKind::kSharedFolder && p.kind == OutputKind::kSharedFolder;
      if (!shared && same(out[i], out[j])) {
        refuse(verb, o, out[i], "is the same path as", p, out[j],
               "one output would overwrite the other");
      }
      const bool o_in_p = p.kind == OutputKind::kOwnedFolder && within(out[i], out[j]);
      const bool p_in_o = o.kind == OutputKind::kOwnedFolder && within(out[j], out[i]);
      if (o_in_p || p_in_o) {
        refuse(verb, o, out[i], o_in_p ? "lies inside the output folder" : "holds the output", p,
               out[j], "one output would overwrite or prune the other");
      }
    }
  }
}

void check_output_file(std::string_view verb, const NamedPath& out, bool folders_created) {
  std::error_code ec;
  MP_CHECK_INPUT(!out.path.empty(), "{}: {} is empty", verb, out.what);
  MP_CHECK_INPUT(!fs::is_directory(out.path, ec), "{}: {} {}: is a folder; {} writes a file there",
                 verb, out.what, out.path.string(), verb);
  fs::path folder = out.path.has_parent_path() ? out.path.parent_path() : fs::path(".");
  if (folders_created) {
    while (!fs::exists(folder, ec) && folder.has_parent_path() && folder != folder.parent_path())
      folder = folder.parent_path();
  }
  MP_CHECK_INPUT(fs::is_directory(folder, ec), "{}: {} {}: {} {}", verb, out.what,
                 out.path.string(), folder.string(),
                 fs::exists(folder, ec) ? "is not a folder" : "does not exist");
  try {
    reports::StagedFile probe = reports::create_temporary(folder / kWriteProbe);
    reports::write_and_sync(probe, "meshproof checks that it can write here\n");
    fs::remove(probe.path, ec);
  } catch (const reports::ReportError& e) {
    MP_FAIL_INPUT("{}: {} {}: the folder is not writable: {}", verb, out.what, out.path.string(),
                  e.what());
  }
  (void)reports::remove_orphan_temporaries(folder, {kWriteProbe});
}

void prepare_output_folder(std::string_view verb, const NamedPath& out,
                           std::span<const std::string> file_names) {
  std::error_code ec;
  MP_CHECK_INPUT(!out.path.empty(), "{}: {} is empty", verb, out.what);
  const fs::file_status st = fs::status(out.path, ec);
  MP_CHECK_INPUT(!fs::exists(st) || fs::is_directory(st),
                 "{}: {} {}: exists and is not a directory (the reports need a folder)", verb,
                 out.what, out.path.string());
  if (!fs::exists(st)) {
    fs::create_directories(out.path, ec);
    MP_CHECK_INPUT(!ec, "{}: {} {}: cannot create the folder: {}", verb, out.what,
                   out.path.string(), ec.message());
  }
  try {
    reports::StagedFile probe = reports::create_temporary(out.path / kWriteProbe);
    reports::write_and_sync(probe, "meshproof checks that it can write here\n");
    fs::remove(probe.path, ec);
  } catch (const reports::ReportError& e) {
    MP_FAIL_INPUT("{}: {} {}: the folder is not writable: {}", verb, out.what, out.path.string(),
                  e.what());
  }
  std::vector<std::string> names(file_names.begin(), file_names.end());
  names.emplace_back(kWriteProbe);
  (void)reports::remove_orphan_temporaries(out.path, names);
}

}  // namespace meshproof::harness
