// Sharded checkpoints in HDF5 (DESIGN.md section 6).
//
// On disk a checkpoint is a directory `step_NNNNNNN/` holding
//   rank_RRRRR.h5  one file per rank of the saving mesh with the chunks that rank is the
//                  designated writer of (mesh::Layout::chunks(): every distinct box once, written
//                  by the lowest rank holding it, so replicated tensors are stored once). Dataset
//                  path = "/" + key; raw low-precision bits are uint8/uint16 datasets; every
//                  dataset has the attributes `dtype` (kernels::dtype_name), `key` and
//                  `global_offset`.
//   index.json     written last: per key the global shape, dtype, placements and every chunk (file,
//                  dataset, global offset, extent, xxhash64 of the chunk's row-major bytes), plus
//                  the mesh, step, scalars, scenario hash and the meshproof version/commit.
//
// Save is atomic: everything goes to `step_NNNNNNN.partial/`, files and the directory are fsynced,
// rank 0 writes the index last, renames the directory to `step_NNNNNNN/` and fsyncs the parent.
// A leftover `.partial` directory is never read and is removed by the next save. Only the newest
// `keep_last` complete checkpoints are kept. A complete checkpoint is never overwritten.
// Ranks coordinate through the mesh communicator: each phase ends with an agreement (a MAX
// all-reduce of an error flag, then a broadcast of the first failing rank's message), so a failure
// on one rank fails the save or load on all of them with the cause. Chunk records reach rank 0 as
// per-rank sidecar files (rank_RRRRR.json, removed before the commit): all ranks must see the
// same checkpoint filesystem (true for local virtual ranks and for MPI ranks on a shared disk).
//
// Load reshards: each rank reads only the saved chunks that overlap the box its live layout gives
// it, verifies their checksums, and assembles its local tensors in staging buffers. Only when every
// rank has staged every key without error is the live state overwritten, so a failed load leaves
// the state untouched on all ranks.
//
// Key conventions (DESIGN.md section 6): `model/<param>`, `optim/<param>/exp_avg`,
// `optim/<param>/exp_avg_sq`, `optim/step`, `fp8/<layer>/<tensor>/{scale,scale_inv,amax_history}`,
// `fp8_params/<param>/{data,scale_inv}`, `rng/...`, `data/cursor`, `lr/step`. Integer state
// (RNG counters, cursor, steps) may travel as ShardedState::scalars, which the index stores.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/faults.h"
#include "engine/sharded_state.h"
#include "kernels/tensor.h"
#include "kernels/units.h"
#include "mesh/communicator.h"
#include "mesh/layout.h"

namespace meshproof::engine {

inline constexpr int kCheckpointFormatVersion = 1;

// Named points of a save at which CheckpointOptions::fault_hook is called (crash-safety tests):
//   kDatasetWritten   inside the write loop of this rank's HDF5 file, after its dataset number
//                     `dataset` (0-based, in write order) is written, while the file is still open
//                     and not fsynced: a crash here leaves a half-written rank file
//   kRankFileWritten  after this rank's HDF5 file is written and fsynced
//   kBeforeIndex      on rank 0, after every rank file exists, before index.json is written
//   kBeforeRename     on rank 0, after index.json is written, before the directory is renamed
enum class SavePoint { kDatasetWritten, kRankFileWritten, kBeforeIndex, kBeforeRename };
std::string_view save_point_name(SavePoint p);

struct CheckpointOptions {
  // Complete checkpoints kept under the root after a save (the newest ones); 0 keeps all.
  int keep_last = 3;
  // Recorded in the index (the harness passes a hash of the resolved scenario).
  std::string scenario_hash;
  // Recorded in the index: the model the state belongs to, field -> value as JSON text (the
  // harness passes its scenario's `model` mapping, so a load onto another model names the field
  // that differs before reading any chunk). Empty: none recorded.
  std::map<std::string, std::string> model;
  // Checkpoint-side faults: fp8_state_dropped_from_checkpoint and scale_inv_saved_bf16 act on
  // save; data_cursor_not_restored and optimizer_state_not_restored act on load.
  FaultInjection faults;
  // Called on the calling rank at each SavePoint (`dataset` is the dataset number at
  // kDatasetWritten, -1 elsewhere); a hook that throws aborts the save there, and one that kills
  // the process (crash tests fork a child for it) is a real crash: either way the partial
  // directory stays behind and the previous checkpoint stays intact.
  std::function<void(SavePoint point, int rank, int64_t dataset)> fault_hook;
};

// What one rank read during a load (the resharding test counts them).
struct LoadStats {
  int64_t chunks_read = 0;
  kernels::Bytes bytes_read;
  std::vector<std::string> files_opened;  // distinct rank files this rank opened
};

// "step_0000042"
std::string checkpoint_dir_name(int64_t step);
// The newest complete checkpoint under `root` (ignores .partial directories), if any.
std::optional<std::filesystem::path> latest_checkpoint(const std::filesystem::path& root);
// Every complete checkpoint under `root`, oldest first.
std::vector<std::filesystem::path> list_checkpoints(const std::filesystem::path& root);

// Collective over every rank of `comms.mesh()`: saves `state` as step `step` under `root` and
// returns the committed directory. Every rank passes its own state with the same keys, layouts and
// scalars (layouts on comms.mesh()). A failure on any rank fails the save on every rank.
std::filesystem::path save_checkpoint(const std::filesystem::path& root, int64_t step,
                                      const ShardedState& state, mesh::RankComms& comms,
                                      const CheckpointOptions& options = {});

// Collective: loads checkpoint directory `dir` (a step_NNNNNNN/ directory) into `state`, whose
// entries keep their live layouts (any mesh) and whose local tensors are overwritten in place.
// Input errors (kInput) name the key and file: missing index, missing/extra key, global shape or
// dtype mismatch, checksum mismatch, truncated or corrupt file. Nothing is modified on failure.
LoadStats load_checkpoint(const std::filesystem::path& dir, ShardedState& state,
                          mesh::RankComms& comms, const CheckpointOptions& options = {});

// ---- The index, for tools (ckpt inspect/verify/diff) and tests. ----

struct ChunkRecord {
  std::string file;     // "rank_00003.h5", relative to the checkpoint directory
  std::string dataset;  // "/model/embed.tok"
  mesh::Box box;        // global offset and extent
  uint64_t xxh64 = 0;   // XXH64 (seed 0) of the chunk's row-major bytes
};

struct KeyRecord {
  std::string key;
  kernels::Shape shape;
  kernels::DType dtype = kernels::DType::kFloat32;
  std::vector<mesh::Placement> placements;  // one per mesh dim of the saving mesh
  std::vector<ChunkRecord> chunks;
};

struct CheckpointIndex {
  int format_version = kCheckpointFormatVersion;
  int64_t step = 0;
  mesh::DeviceMesh mesh{1, 1, 1};
  std::string scenario_hash;
  std::map<std::string, std::string> model;  // CheckpointOptions::model (empty when not recorded)
  std::string meshproof_version;
  std::string git_commit;
  std::vector<std::string> files;   // one per saving rank
  std::vector<int64_t> file_bytes;  // their sizes when saved (truncation check)
  std::map<std::string, int64_t> scalars;
  std::map<std::string, KeyRecord> keys;
};

// Reads and validates `dir`/index.json (kInput naming the file on a missing or malformed index).
// With `check_file_sizes`, a rank file whose size differs from the recorded one is a kInput error.
CheckpointIndex read_checkpoint_index(const std::filesystem::path& dir,
                                      bool check_file_sizes = true);
// Reads one chunk (dense, host, the key's dtype, the chunk's extent). With `verify` a checksum
// mismatch is a kInput error naming the key, dataset and file.
kernels::Tensor read_chunk(const std::filesystem::path& dir, const KeyRecord& key,
                           const ChunkRecord& chunk, bool verify);
// The global tensor of `key` reassembled from all its chunks (checksums verified).
kernels::Tensor read_global(const std::filesystem::path& dir, const KeyRecord& key);
// XXH64 (seed 0) of a dense host tensor's bytes.
uint64_t tensor_xxh64(const kernels::Tensor& t);

}  // namespace meshproof::engine
