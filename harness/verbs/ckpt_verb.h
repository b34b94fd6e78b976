// `meshproof ckpt inspect|verify|diff` (docs/design.md sections 6 and 10, docs/design.md section
// 13): look into sharded checkpoints written by engine/checkpoint/checkpoint.h.
//   inspect DIR [--summary] [--key GLOB]...
//                 mesh, step, versions, the index checksum, files, scalars and per key the global
//                 shape, dtype, placements and chunks (file, dataset, global box, hash); with
//                 --summary one line per key group; --key keeps the matching keys and scalars.
//                 Exit 1 when the index checksum does not match.
//   verify DIR    everything a load checks, for every chunk (engine::verify_checkpoint); exit 1
//                 naming the key and file of every problem.
//   diff A B [--rtol R] [--atol A] [--key GLOB]...
//                 key by key after reassembling the global tensors: equal, within tolerance, or
//                 the max abs, max rel and max ULP distance; scalars, missing keys, shape and dtype
//                 changes; a chunk that fails its integrity checks is named and the rest compared;
//                 exit 1 if anything differs beyond the tolerance.
// A missing or malformed index (not a checkpoint, an incomplete save) is bad input: exit 2.
//
// Each verb also takes a PyTorch DCP folder (one holding `.metadata`, docs/design.md section 40),
// detected by that file: inspect shows its keys, dtypes, global shapes, the chunks per file and the
// placement they imply; verify checks the tiling, the items and their files (ckpt_dcp.cc); diff
// compares any pair of meshproof and DCP folders through CheckpointView.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "engine/checkpoint/checkpoint.h"
#include "kernels/core/tensor.h"

namespace CLI {
class App;
}

namespace meshproof::harness {

struct InspectOptions {
  bool summary = false;
  std::vector<std::string> key_globs;  // fnmatch patterns; empty: every key
};

struct DiffOptions {
  // Floating-point keys pass when every element has |a - b| <= atol + rtol * |b| (B is the
  // reference); integer keys and scalars must be equal. 0/0: bitwise.
  double rtol = 0;
  double atol = 0;
  std::vector<std::string> key_globs;  // fnmatch patterns; empty: every key and scalar
};

// One side of a diff: a checkpoint of either format as keys with their dtype, global shape and a
// reader of the reassembled tensor, plus the integer scalars (meshproof) and the bytes entries
// (DCP, compared bytewise).
struct CheckpointView {
  struct Key {
    std::string dtype;  // the format's own name ("bfloat16", "torch.bfloat16")
    kernels::Shape shape;
    std::function<kernels::Tensor()> read;  // tensors
    std::function<std::string()> bytes;     // bytes entries
  };
  std::string title;  // "step 4, mesh 1x2x1" or "DCP, 4 files"
  std::map<std::string, int64_t> scalars;
  std::map<std::string, Key> keys;
};
CheckpointView open_checkpoint_view(const std::string& dir);

// Prints verify's findings, or "OK, <what> and N chunk(s) of K key(s) match (<how>)"; returns the
// exit code.
int print_verify_report(const engine::VerifyReport& report, const std::string& dir,
                        std::ostream& out, std::string_view what, std::string_view how);
int dcp_inspect(const std::string& dir, std::ostream& out, const InspectOptions& options);
int dcp_verify(const std::string& dir, std::ostream& out);
bool matches_any(const std::vector<std::string>& globs, const std::string& name);

// Each returns the exit code (0, or 1 for findings); bad input throws kInput.
int ckpt_inspect(const std::string& dir, std::ostream& out, const InspectOptions& options = {});
int ckpt_verify(const std::string& dir, std::ostream& out);
int ckpt_diff(const std::string& a_dir, const std::string& b_dir, std::ostream& out,
              const DiffOptions& options = {});

// Registers `ckpt` and its subcommands; sets exit_code when a verb runs.
void add_ckpt_command(CLI::App& app, std::ostream& out, int& exit_code);

}  // namespace meshproof::harness
