// Files that appear whole or not at all, and only where they are meant to (issues #18.6, #18.12):
// the report writers and the golden store write through here.
//
// A file is staged under a temporary name of the project's pattern in the target's own folder,
//   .<target file name>.tmp.<pid>.<6 random characters>
// created by mkstemp (O_CREAT|O_EXCL: never an existing name, never through a planted symlink;
// two writers of one target never share a temporary), written, fsynced, renamed over the target
// (atomic within a file system) and the folder fsynced, so that a crash leaves the old file or
// the new one. A writer killed between staging and renaming leaves its temporary behind; the
// pid in the name lets the next writer that owns the folder remove it once that process is gone
// (remove_orphan_temporaries), and nothing else: only names of that exact pattern whose process
// no longer exists.
#pragma once

#include <filesystem>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace meshproof::reports {

// Creates a new, empty temporary for `target` (pattern above, mode 0644) and returns its path
// and open descriptor. Throws ReportError(kIo) naming the folder and the reason.
struct StagedFile {
  std::filesystem::path path;
  int fd = -1;
};
StagedFile create_temporary(const std::filesystem::path& target);

// Writes all of `bytes` to the staged file, fsyncs and closes it. On failure removes it and
// throws ReportError(kIo) naming the temporary and errno's reason ("No space left on device").
void write_and_sync(StagedFile& staged, std::string_view bytes);

// Renames a complete temporary over `target` and fsyncs the folder; removes the temporary and
// throws ReportError(kIo) on failure.
void publish(const std::filesystem::path& temporary, const std::filesystem::path& target);

// create_temporary + write_and_sync + publish.
void write_file_atomically(const std::filesystem::path& target, std::string_view bytes);

// For writers that open a file by name (HDF5): removes the target's orphan temporaries, stages
// a fresh temporary (create_temporary, closed again), hands its path to `write`, which fills it
// (e.g. H5F_ACC_TRUNC), then fsyncs it and publishes it over `target`. Whatever `write` throws,
// the temporary is removed and rethrown: the target keeps its old bytes or stays absent, and a
// kill at any point leaves the old target (plus a temporary the next writer removes).
void write_path_atomically(const std::filesystem::path& target,
                           const std::function<void(const std::filesystem::path&)>& write);

// Whether `file_name` is a temporary of this pattern for a target named `target_name`; sets
// *pid to the writer's pid. Also accepts the pre-mkstemp pattern ".<target>.tmp.<pid>" that
// earlier versions left behind.
bool is_temporary_of(std::string_view file_name, std::string_view target_name, long* pid);

// Removes, in `dir`, the temporaries of the given target names whose writer process no longer
// exists on this host (kill(pid, 0) fails with ESRCH). Returns the removed paths; never throws
// (a folder that cannot be listed has nothing to clean).
std::vector<std::filesystem::path> remove_orphan_temporaries(
    const std::filesystem::path& dir, const std::vector<std::string>& target_names);

}  // namespace meshproof::reports
