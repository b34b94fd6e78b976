// Sharded checkpoints in HDF5 (docs/design.md section 6).
//
// On disk a checkpoint is a directory `step_NNNNNNN/` holding
//   rank_RRRRR.h5  one file per rank of the saving mesh with the chunks that rank is the
//                  designated writer of (mesh::Layout::chunks(): every distinct box once, written
//                  by the lowest rank holding it, so replicated tensors are stored once; with
//                  pipeline stages a key is held by one stage and written by that stage's ranks,
//                  docs/design.md section 33). Dataset
//                  path = "/" + key; raw low-precision bits are uint8/uint16 datasets; every
//                  dataset has the attributes `dtype` (kernels::dtype_name), `key` and
//                  `global_offset`; the file root has `checkpoint_id`.
//   index.json     written last: per key the global shape, dtype, placements and every chunk (file,
//                  dataset, global offset, extent, chunk_xxh64), plus the mesh, step, scalars,
//                  scenario hash, the meshproof version/commit, the checkpoint id and the index's
//                  own checksum (see "The index" below).
//
// Save is atomic: everything goes to `step_NNNNNNN.partial/`, files and the directory are fsynced,
// rank 0 writes the index last, renames the directory to `step_NNNNNNN/` and fsyncs the parent.
// A save that fails (an error on any rank, e.g. a full disk, reported with the errno text) removes
// its `.partial` directory; one left by a crash is never read and is removed by the next save. Only
// the newest `keep_last` complete checkpoints are kept. A complete checkpoint is never overwritten.
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
// Key conventions (docs/design.md section 6; the names are constants in
// engine/checkpoint/state_keys.h): `model/<param>`, `optim/<param>/exp_avg`,
// `optim/<param>/exp_avg_sq`, `fp8/<linear>/<input|weight|grad_output>/{scale,amax_history}`
// (delayed scaling), `fp8/params/<param>/{rowwise_data,scale_inv}` (FP8 primary weights; mxfp8:
// rowwise_data, rowwise_scale_inv, columnwise_data, columnwise_scale_inv). Integer state travels as
// ShardedState::scalars, which the index stores: `optim/step`, `data/cursor`, `rng/offset`,
// `lr/step`.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/checkpoint/sharded_state.h"
#include "engine/faults/faults.h"
#include "kernels/core/tensor.h"
#include "kernels/core/units.h"
#include "mesh/core/communicator.h"
#include "mesh/core/layout.h"

namespace meshproof::engine {

// 2: index checksum, chunk hashes over key/offset/extent, checkpoint id (version 1 is rejected).
inline constexpr int kCheckpointFormatVersion = 2;

// Named points of a save at which CheckpointOptions::fault_hook is called (crash-safety tests):
//   kDatasetWritten   inside the write loop of this rank's HDF5 file, after its dataset number
//                     `dataset` (0-based, in write order) is written, while the file is still
//                     being built (in memory, HDF5's core driver): a crash here leaves the partial
//                     directory without this rank file
//   kRankFileWritten  after this rank's HDF5 file is written to disk and fsynced
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
  // Checkpoint-side faults, acting through the checkpoint_save and checkpoint_restore points of
  // engine/faults/fault_hooks.h: fp8_state_dropped_from_checkpoint and scale_inv_saved_bf16 on
  // save; data_cursor_not_restored and optimizer_state_not_restored on load.
  FaultInjection faults;
  // Called on the calling rank at each SavePoint (`dataset` is the dataset number at
  // kDatasetWritten, -1 elsewhere); a hook that throws fails the save there (its partial directory
  // is removed), and one that kills the process (crash tests fork a child for it) is a real crash
  // (the partial directory stays behind): either way the previous checkpoint stays intact.
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
// returns the committed directory. Every rank passes its own state with the same scalars and with
// the same keys and layouts (on comms.mesh()) as the other ranks of its pipeline stage; with
// stages each key is held by one stage (a key on two stages is kInput), and the index is the
// union of the stages' keys. A failure on any rank fails the save on every rank.
std::filesystem::path save_checkpoint(const std::filesystem::path& root, int64_t step,
                                      const ShardedState& state, mesh::RankComms& comms,
                                      const CheckpointOptions& options = {});

// Collective: loads checkpoint directory `dir` (a step_NNNNNNN/ directory) into `state`, whose
// entries keep their live layouts (any mesh, any pipeline stages and split: each rank reads its
// own entries) and whose local tensors are overwritten in place. With stages on the live mesh
// every checkpoint key must be held by exactly one stage (kInput otherwise).
// Input errors (kInput) name the key and file: missing or malformed index, missing/extra key,
// global shape or dtype mismatch. Integrity errors (kIntegrity) name the key and file: index or
// chunk checksum mismatch, truncated, missing, corrupt or foreign rank file, attributes that
// disagree with the index. Every chunk is verified (each by the ranks that read it; together the
// ranks read every chunk), also those of keys a load-side fault leaves unrestored. Nothing is
// modified on failure.
LoadStats load_checkpoint(const std::filesystem::path& dir, ShardedState& state,
                          mesh::RankComms& comms, const CheckpointOptions& options = {});

// ---- The index, for tools (ckpt inspect/verify/diff), tests and fuzzers. ----
//
// Integrity (docs/design.md section 13): index.json carries `index_xxh64`, the XXH64 of its
// canonical content (canonical_index_text); every chunk's `xxh64` is chunk_xxh64, which covers the
// checkpoint id, key, dtype, global offset and extent besides the bytes; each rank file carries the
// checkpoint id as a root attribute and each dataset its `key`, `dtype` and `global_offset`, all
// cross-checked against the index on load and by verify_checkpoint. Error classes: a malformed or
// unsupported index, a path outside the checkpoint folder, out-of-range values, a live state that
// does not match: kInput (exit 2); stored data that contradicts its integrity record (checksums,
// sizes, attributes, missing or foreign files): kIntegrity (exit 1).

struct ChunkRecord {
  std::string file;     // "rank_00003.h5": a plain name inside the checkpoint directory
  std::string dataset;  // "/model/embed.tok" ("/" + key)
  mesh::Box box;        // global offset and extent
  uint64_t xxh64 = 0;   // chunk_xxh64 of the chunk
};

struct KeyRecord {
  std::string key;
  kernels::Shape shape;
  kernels::DType dtype = kernels::DType::kFloat32;
  std::vector<mesh::Placement> placements;  // one per mesh dim of the saving mesh
  std::vector<ChunkRecord> chunks;          // exactly the layout's chunks, in owner order
};

struct CheckpointIndex {
  int format_version = kCheckpointFormatVersion;
  uint64_t checkpoint_id = 0;  // random per save; binds rank files and chunk hashes to this save
  int64_t step = 0;
  mesh::DeviceMesh mesh{1, 1, 1};
  std::string scenario_hash;
  std::map<std::string, std::string> model;  // CheckpointOptions::model (empty when not recorded)
  std::string meshproof_version;
  std::string git_commit;
  std::vector<std::string> files;          // one per saving rank: files[r] == "rank_<r:05d>.h5"
  std::vector<int64_t> file_bytes;         // their sizes when saved (truncation check)
  std::map<std::string, int64_t> scalars;  // each >= 0 (counters and positions)
  std::map<std::string, KeyRecord> keys;
  uint64_t index_xxh64 = 0;  // as recorded in the file (compute_index_xxh64 recomputes it)
};

// Strictly parses and validates index.json text (`where` names it in messages): exact field sets
// (no unknown or duplicate fields), integers that are JSON integers in range (no floats, no
// wrapping), hashes as exactly 16 lowercase hex digits, the format version, plain rank file names,
// shapes whose element and byte counts fit int64, chunks equal to the chunks of the layout the
// placements give on the saved mesh, and per rank file at most its recorded bytes of chunk data.
// Every violation is kInput naming the key and file. Touches no file and does not compare
// index_xxh64 (read_checkpoint_index does).
CheckpointIndex parse_checkpoint_index(std::string_view text, std::string_view where);
// The canonical text `index_xxh64` covers: the index as JSON without index_xxh64, compact, object
// fields sorted. compute_index_xxh64 is its XXH64 (seed 0).
std::string canonical_index_text(const CheckpointIndex& index);
uint64_t compute_index_xxh64(const CheckpointIndex& index);
// index.json as save writes it, with index_xxh64 computed from the content.
std::string index_json_text(const CheckpointIndex& index);

struct IndexChecks {
  bool checksum = true;    // index_xxh64 must match the content (else kIntegrity)
  bool file_sizes = true;  // each rank file must exist with its recorded size (else kIntegrity)
};
// Reads `dir`/index.json: parse_checkpoint_index, then the checks selected. Also kInput when `dir`
// is a .partial directory, has no index, or is named step_N with N other than the index's step.
CheckpointIndex read_checkpoint_index(const std::filesystem::path& dir, IndexChecks checks = {});

// The chunk hash: XXH64 (seed 0) of a header, then the chunk's row-major bytes. The header is, as
// little-endian integers: checkpoint_id (u64), key length (u64) and the key's bytes, dtype name
// length (u64) and its bytes, the box rank (u64), each global offset (i64), each extent (i64).
uint64_t chunk_xxh64(uint64_t checkpoint_id, std::string_view key, kernels::DType dtype,
                     const mesh::Box& box, const kernels::Tensor& data);

// Reads one chunk (dense, host, the key's dtype, the chunk's extent), after checking the rank
// file's checkpoint id and the dataset's type, shape and `dtype`/`key`/`global_offset` attributes
// against the index (before allocating), and always verifies its hash: kIntegrity naming the key,
// dataset and file on any mismatch.
kernels::Tensor read_chunk(const std::filesystem::path& dir, const CheckpointIndex& index,
                           const KeyRecord& key, const ChunkRecord& chunk);
// The global tensor of `key` reassembled from all its chunks (each verified as by read_chunk).
kernels::Tensor read_global(const std::filesystem::path& dir, const CheckpointIndex& index,
                            const KeyRecord& key);

// One integrity problem found by verify_checkpoint.
struct VerifyFinding {
  std::string key;   // the key, or "" for a file-level problem
  std::string file;  // "index.json" or the rank file
  std::string message;
};
struct VerifyReport {
  int64_t keys = 0;
  int64_t chunks = 0;  // chunks checked
  std::vector<VerifyFinding> findings;
  bool ok() const { return findings.empty(); }
};
// Everything a load checks, for every chunk of every key, collecting integrity problems (index
// checksum, missing/resized/foreign rank files, attribute, shape and hash mismatches) instead of
// stopping at the first. A malformed index or a path outside the directory throws kInput.
VerifyReport verify_checkpoint(const std::filesystem::path& dir);

}  // namespace meshproof::engine
