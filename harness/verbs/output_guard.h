// Outputs that never reach an input (issue #46): every verb that writes names its inputs and the
// paths it will write, and this refuses, before anything is opened for writing, an output that
// is an input, lies inside an input folder, or is a folder that the verb fills and that holds an
// input; and two outputs that are one file. Paths are compared as the file system sees them, not
// as they are spelled: each is resolved through its symlinks (std::filesystem::weakly_canonical)
// and every existing folder on the way is identified by device and inode, so "x.h5", "./x.h5",
// a symlink to it, a hard link to it and a path through a symlinked or bind-mounted folder are
// all the same file. A refusal is an input error (exit 2) naming both paths and the options
// that gave them.
//
// The files themselves are then written through reports::write_file_atomically /
// write_path_atomically (a fresh temporary beside the target, renamed into place when
// complete), so that a failure or a kill leaves the old output or none.
#pragma once

#include <filesystem>
#include <span>
#include <string>
#include <string_view>

namespace meshproof::harness {

// What an output path is to the verb that writes it.
enum class OutputKind {
  kFile,          // one file the verb replaces whole (quantize --out, a golden, report.json)
  kOwnedFolder,   // a folder the verb creates, fills and prunes (a checkpoint folder): it must not
                  // hold an input either
  kSharedFolder,  // a folder the verb writes named files into and leaves the rest alone (run
                  // --out): it may hold inputs (a scenario next to its reports), never be one
};

// One path a verb reads or writes, with the option or argument that named it ("--in",
// "scenario", "--out", "checkpoint.dir of scenario quickstart").
struct NamedPath {
  std::string what;
  std::filesystem::path path;
  OutputKind kind = OutputKind::kFile;  // outputs only
};

// Throws an input error (exit 2) for the first output that is, lies inside or (an owned folder)
// holds an input, or that is another output (or lies inside or holds another output's owned
// folder). `verb` starts the message ("quantize", "run"). Inputs that do not exist are skipped
// (the verb reports them itself, with its own message).
void check_outputs_apart(std::string_view verb, std::span<const NamedPath> inputs,
                         std::span<const NamedPath> outputs);

// An output file path before any work: not an existing folder, its folder exists (or, with
// `folders_created`, the deepest existing folder on its way is one: the verb creates the rest)
// and this process can create a file in it (proved with a probe temporary: access(2) says
// nothing about root or a read-only mount). Input errors naming `out.what` and the path.
void check_output_file(std::string_view verb, const NamedPath& out, bool folders_created = false);

// An output folder, after every input check and before any work: not an existing file; created
// when missing (with its parents); writable as above. Then removes the orphan temporaries of
// `file_names` (and of the probe) that killed writers left there (reports/writers/atomic_file.h).
void prepare_output_folder(std::string_view verb, const NamedPath& out,
                           std::span<const std::string> file_names);

}  // namespace meshproof::harness
