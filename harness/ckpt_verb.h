// `meshproof ckpt inspect|verify|diff` (DESIGN.md sections 6 and 10): look into sharded
// checkpoints written by engine/checkpoint.h.
//   inspect DIR   mesh, step, versions, files, scalars and per key the global shape, dtype,
//                 placements and chunks (file, dataset, global box, checksum).
//   verify DIR    re-reads every chunk and re-hashes it; exit 1 naming the key and file of every
//                 mismatch, missing dataset, missing or truncated file.
//   diff A B      key by key after reassembling the global tensors: equal, or the max abs, max
//                 rel and max ULP distance; scalars, missing keys, shape and dtype changes; exit 1
//                 if anything differs (a continuous run against a resumed one).
// A missing or malformed index (not a checkpoint, an incomplete save) is bad input: exit 2.
#pragma once

#include <ostream>
#include <string>

namespace CLI {
class App;
}

namespace meshproof::harness {

// Each returns the exit code (0, or 1 for verify/diff findings); bad input throws kInput.
int ckpt_inspect(const std::string& dir, std::ostream& out);
int ckpt_verify(const std::string& dir, std::ostream& out);
int ckpt_diff(const std::string& a_dir, const std::string& b_dir, std::ostream& out);

// Registers `ckpt` and its subcommands; sets exit_code when a verb runs.
void add_ckpt_command(CLI::App& app, std::ostream& out, int& exit_code);

}  // namespace meshproof::harness
