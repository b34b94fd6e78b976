// Internal to the checkpoint module (engine/checkpoint/checkpoint.h): the helpers its parts share.
//   checkpoint.cc         collective save and load: state assembly, agreement, commit
//   checkpoint_index.cc   the index file format: strict JSON, parse, canonical text, checksum
//   checkpoint_files.cc   rank files: HDF5 storage types, POSIX writes, chunk reads and hashes
//   checkpoint_verify.cc  `ckpt verify`: every problem of a checkpoint, without loading it
// Not included outside engine/checkpoint*.cc.
#pragma once

#include <H5Cpp.h>
#include <fmt/format.h>

#include <cstdint>
#include <filesystem>
#include <map>
#include <mutex>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/checkpoint/checkpoint.h"
#include "kernels/core/error.h"
#include "kernels/core/hdf5_check.h"
#include "kernels/core/tensor.h"
#include "kernels/core/units.h"

namespace meshproof::engine::ckpt_detail {

namespace fs = std::filesystem;
using json = nlohmann::json;
using kernels::DType;
using kernels::Elements;
using kernels::ErrorKind;
using kernels::Shape;
using kernels::Tensor;

inline constexpr const char* kIndexName = "index.json";
inline constexpr const char* kPartialSuffix = ".partial";
// Mesh sizes a checkpoint may record (rank file names have five digits).
inline constexpr int64_t kMaxWorld = 65536;

// The HDF5 C++ wrapper keeps global state that is not thread-safe, and virtual ranks are threads
// of one process: every HDF5 call of this module runs under this lock (hashing and copies do not).
std::mutex& hdf5_mutex();

inline bool ends_with(std::string_view s, std::string_view p) {
  return s.size() >= p.size() && s.substr(s.size() - p.size()) == p;
}

inline std::string rank_file_name(int rank) { return fmt::format("rank_{:05d}.h5", rank); }
inline std::string sidecar_name(int rank) { return fmt::format("rank_{:05d}.json", rank); }
inline std::string hash_hex(uint64_t h) { return fmt::format("{:016x}", h); }

// Bytes per element of a dtype a checkpoint can hold (packed e2m1 cannot be cut into boxes).
int64_t element_bytes(DType t, std::string_view key);
// The HDF5 type a dtype is stored as: floats and integers natively, low-precision bit patterns as
// unsigned integers of their width (the `dtype` attribute says how to read them).
const H5::PredType& storage_type(DType t, std::string_view key);
H5::DataSpace dataspace_for(const Shape& shape);
// errno's text for a message, or "" when errno is 0.
std::string errno_note();
void fsync_path(const fs::path& p);
// Writes and fsyncs `p` with POSIX calls, so that a failure reaches the message with its reason.
void write_text_file(const fs::path& p, const std::string& text);
std::string read_text_file(const fs::path& p, std::string_view what);
// Strict JSON: duplicate object fields are input errors.
json parse_json_text(std::string_view text, std::string_view where);
json read_json_file(const fs::path& p, std::string_view what);
// Checkpoint keys and scalar names: path components of [A-Za-z0-9._+-] separated by single '/',
// none of them "." or "..".
bool valid_key(std::string_view k);
// A plain file name: no directory part, not "." or "..", no control characters.
bool plain_file_name(std::string_view n);
std::vector<int64_t> elems(const std::vector<Elements>& v);
std::vector<Elements> to_elems(const std::vector<int64_t>& v);
json index_to_json(const CheckpointIndex& index, bool with_checksum);
// A placement as the index writes it, and back (kInput naming `where` and `what`; a shard dim
// must lie inside a tensor of rank `tensor_rank`).
json placement_json(const mesh::Placement& p);
mesh::Placement placement_from_json(const json& j, std::string_view where, const std::string& what,
                                    int tensor_rank);

// Reads a string attribute `name` of `obj` (caller holds the HDF5 lock).
template <typename Obj>
std::string read_string_attr(const Obj& obj, const char* name) {
  H5::Attribute a = obj.openAttribute(name);
  std::string v;
  a.read(a.getStrType(), v);
  return v;
}

// Opened rank files of one load/verify, reused across chunks: each is a regular file inside the
// checkpoint directory whose `checkpoint_id` attribute is the index's.
class FileCache {
 public:
  FileCache(fs::path dir, uint64_t checkpoint_id)
      : dir_(std::move(dir)), checkpoint_id_(checkpoint_id) {}
  FileCache(const FileCache&) = delete;
  FileCache& operator=(const FileCache&) = delete;
  // Closes the files under the HDF5 lock (the caller must not hold it).
  ~FileCache() {
    std::lock_guard<std::mutex> lock(hdf5_mutex());
    files_.clear();
  }
  // Caller holds hdf5_mutex().
  H5::H5File& open(const std::string& name) {
    auto it = files_.find(name);
    if (it != files_.end()) return it->second;
    MP_CHECK_INPUT(plain_file_name(name),
                   "checkpoint {}: chunk file '{}' is not a plain file name inside the checkpoint "
                   "directory",
                   dir_.string(), name);
    const fs::path p = dir_ / name;
    std::error_code ec;
    const fs::file_status st = fs::symlink_status(p, ec);
    MP_CHECK_INTEGRITY(fs::exists(st), "checkpoint {}: rank file {} is missing", dir_.string(),
                       p.string());
    MP_CHECK_INPUT(fs::is_regular_file(st),
                   "checkpoint {}: rank file {} is not a regular file (a symlink or other): chunk "
                   "files must be plain files inside the checkpoint directory",
                   dir_.string(), p.string());
    H5::H5File f = MP_HDF5(kIntegrity, H5::H5File(p.string(), H5F_ACC_RDONLY),
                           "opening checkpoint rank file {} (truncated or corrupt?)", p.string());
    const std::string id =
        MP_HDF5(kIntegrity, read_string_attr(f, "checkpoint_id"),
                "checkpoint rank file {}: no readable `checkpoint_id` attribute", p.string());
    MP_CHECK_INTEGRITY(
        id == hash_hex(checkpoint_id_),
        "checkpoint {}: rank file {} belongs to checkpoint id {}, the index is {} (a "
        "rank file from another checkpoint)",
        dir_.string(), p.string(), id, hash_hex(checkpoint_id_));
    return files_.emplace(name, std::move(f)).first->second;
  }
  const fs::path& dir() const { return dir_; }
  std::vector<std::string> names() const {
    std::vector<std::string> out;
    for (const auto& [n, f] : files_) out.push_back(n);
    return out;
  }

 private:
  fs::path dir_;
  uint64_t checkpoint_id_;
  std::map<std::string, H5::H5File> files_;
};

// Reads and verifies one chunk through `cache` (attributes, shape, checksum).
Tensor read_chunk_cached(FileCache& cache, const CheckpointIndex& index, const KeyRecord& key,
                         const ChunkRecord& chunk);
// Kinds of file-level problem found before any chunk is read (integrity).
std::optional<std::string> file_size_problem(const fs::path& dir, const CheckpointIndex& index,
                                             size_t i);

}  // namespace meshproof::engine::ckpt_detail
