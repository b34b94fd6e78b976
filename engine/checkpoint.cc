#include "engine/checkpoint.h"

#include <H5Cpp.h>
#include <fcntl.h>
#include <fmt/ranges.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <bit>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cstring>
#include <exception>
#include <fstream>
#include <memory>
#include <mutex>
#include <nlohmann/json.hpp>
#include <random>
#include <regex>
#include <set>
#include <sstream>

#include "engine/fault_hooks.h"
#include "kernels/build_info.h"
#include "kernels/error.h"
#include "kernels/formats.h"
#include "kernels/hdf5_check.h"
#include "kernels/runtime.h"

namespace meshproof::engine {
namespace fs = std::filesystem;
using json = nlohmann::json;
using kernels::DType;
using kernels::Elements;
using kernels::ErrorKind;
using kernels::Shape;
using kernels::Tensor;

namespace {

constexpr const char* kIndexName = "index.json";
constexpr const char* kPartialSuffix = ".partial";

// The HDF5 C++ wrapper keeps global state that is not thread-safe, and virtual ranks are threads
// of one process: every HDF5 call of this module runs under this lock (hashing and copies do not).
std::mutex& hdf5_mutex() {
  static std::mutex m;
  return m;
}

bool ends_with(std::string_view s, std::string_view p) {
  return s.size() >= p.size() && s.substr(s.size() - p.size()) == p;
}

std::string rank_file_name(int rank) { return fmt::format("rank_{:05d}.h5", rank); }
std::string sidecar_name(int rank) { return fmt::format("rank_{:05d}.json", rank); }
std::string hash_hex(uint64_t h) { return fmt::format("{:016x}", h); }

// Bytes per element of a dtype a checkpoint can hold (packed e2m1 cannot be cut into boxes).
int64_t element_bytes(DType t, std::string_view key) {
  MP_CHECK_INPUT(kernels::dtype_bits(t) % 8 == 0,
                 "checkpoint key '{}': dtype {} is packed below one byte per element and cannot "
                 "be stored as chunks of global boxes",
                 key, kernels::dtype_name(t));
  return kernels::dtype_bits(t) / 8;
}

// The HDF5 type a dtype is stored as: floats and integers natively, low-precision bit patterns as
// unsigned integers of their width (the `dtype` attribute says how to read them).
const H5::PredType& storage_type(DType t, std::string_view key) {
  switch (t) {
    case DType::kFloat32:
      return H5::PredType::NATIVE_FLOAT;
    case DType::kFloat64:
      return H5::PredType::NATIVE_DOUBLE;
    case DType::kInt32:
      return H5::PredType::NATIVE_INT32;
    case DType::kInt64:
      return H5::PredType::NATIVE_INT64;
    case DType::kBFloat16:
    case DType::kFloat16:
      return H5::PredType::NATIVE_UINT16;
    case DType::kE4M3:
    case DType::kE5M2:
    case DType::kE8M0:
    case DType::kUInt8:
      return H5::PredType::NATIVE_UINT8;
    case DType::kE2M1:
      break;
  }
  MP_FAIL_INPUT("checkpoint key '{}': dtype {} cannot be stored in a checkpoint", key,
                kernels::dtype_name(t));
}

H5::DataSpace dataspace_for(const Shape& shape) {
  if (shape.rank() == 0) return H5::DataSpace(H5S_SCALAR);
  std::vector<hsize_t> dims(shape.dims().begin(), shape.dims().end());
  return H5::DataSpace(static_cast<int>(dims.size()), dims.data());
}

Tensor to_host(const Tensor& t) { return t.device().is_cpu() ? t : t.to(kernels::Device::cpu()); }

// errno's text for a message, or "" when errno is 0. Called inside MP_HDF5's catch block (its
// message arguments are evaluated there), right after the failing call set errno.
std::string errno_note() {
  const int e = errno;
  return e == 0 ? std::string() : fmt::format(" (system error: {})", std::strerror(e));
}

void fsync_path(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  MP_CHECK(fd >= 0, "opening {} to fsync it: {}", p.string(), std::strerror(errno));
  const int rc = ::fsync(fd);
  const int saved = errno;
  ::close(fd);
  MP_CHECK(rc == 0, "fsync {}: {}", p.string(), std::strerror(saved));
}

// Writes and fsyncs `p` (text or a rank file's bytes) with POSIX calls, so that a failure (ENOSPC,
// EFBIG, EIO) reaches the message as the system's reason.
void write_text_file(const fs::path& p, const std::string& text) {
  const int fd = ::open(p.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  MP_CHECK(fd >= 0, "creating {}: {}", p.string(), std::strerror(errno));
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      const int saved = n < 0 ? errno : EIO;
      ::close(fd);
      MP_FAIL("writing {} failed after {} of {} bytes: {}", p.string(), done, text.size(),
              std::strerror(saved));
    }
    done += static_cast<size_t>(n);
  }
  const int rc = ::fsync(fd);
  const int fsync_errno = errno;
  const int closed = ::close(fd);
  const int close_errno = errno;
  MP_CHECK(rc == 0, "fsync {}: {}", p.string(), std::strerror(fsync_errno));
  MP_CHECK(closed == 0, "closing {}: {}", p.string(), std::strerror(close_errno));
}

// An index larger than this is not one meshproof wrote (a 1000-key model with 64 chunks per key
// needs about 15 MB).
constexpr uintmax_t kMaxIndexBytes = uintmax_t{1} << 30;

std::string read_text_file(const fs::path& p, std::string_view what) {
  std::error_code ec;
  const uintmax_t size = fs::file_size(p, ec);
  MP_CHECK_INPUT(!ec, "{} {} cannot be read: {}", what, p.string(), ec.message());
  MP_CHECK_INPUT(size <= kMaxIndexBytes, "{} {} has {} bytes (more than {})", what, p.string(),
                 size, kMaxIndexBytes);
  std::ifstream f(p, std::ios::binary);
  MP_CHECK_INPUT(f.good(), "{} {} cannot be opened", what, p.string());
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

json parse_json_text(std::string_view text, std::string_view where);

json read_json_file(const fs::path& p, std::string_view what) {
  return parse_json_text(read_text_file(p, what), p.string());
}

// ---- Strict JSON (index.json): duplicate fields, exact field sets, typed values. ----

// json::parse keeps the last of duplicate object fields silently; this rejects them.
json parse_json_text(std::string_view text, std::string_view where) {
  std::vector<std::set<std::string>> seen;  // one per open object (arrays push an empty marker)
  std::string duplicate;
  auto cb = [&](int /*depth*/, json::parse_event_t ev, json& parsed) {
    switch (ev) {
      case json::parse_event_t::object_start:
      case json::parse_event_t::array_start:
        seen.emplace_back();
        break;
      case json::parse_event_t::object_end:
      case json::parse_event_t::array_end:
        if (!seen.empty()) seen.pop_back();
        break;
      case json::parse_event_t::key:
        if (!seen.empty() && !seen.back().insert(parsed.get<std::string>()).second &&
            duplicate.empty()) {
          duplicate = parsed.get<std::string>();
        }
        break;
      case json::parse_event_t::value:
        break;
    }
    return true;
  };
  json j;
  try {
    j = json::parse(text.begin(), text.end(), cb);
  } catch (const json::exception& e) {
    MP_FAIL_INPUT("{} is not valid JSON: {}", where, e.what());
  }
  MP_CHECK_INPUT(duplicate.empty(), "{}: field \"{}\" appears twice in one object", where,
                 duplicate);
  return j;
}

// A short rendering of a JSON value for messages.
std::string shown(const json& j) {
  std::string s = j.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

// `j` must be an object with exactly the fields `names`.
void expect_fields(const json& j, std::string_view where, std::string_view what,
                   std::initializer_list<std::string_view> names) {
  MP_CHECK_INPUT(j.is_object(), "{}: {} must be a JSON object, got {}", where, what, shown(j));
  for (std::string_view n : names) {
    MP_CHECK_INPUT(j.contains(std::string(n)), "{}: {} has no field \"{}\"", where, what, n);
  }
  for (const auto& [name, v] : j.items()) {
    MP_CHECK_INPUT(std::find(names.begin(), names.end(), name) != names.end(),
                   "{}: {} has an unknown field \"{}\"", where, what, name);
  }
}

// A JSON integer (never a float, never wrapped) in [lo, hi].
int64_t get_int(const json& j, std::string_view where, std::string_view what, int64_t lo,
                int64_t hi) {
  bool ok = false;
  int64_t v = 0;
  if (j.is_number_unsigned()) {
    const uint64_t u = j.get<uint64_t>();
    ok = u <= static_cast<uint64_t>(INT64_MAX);
    v = static_cast<int64_t>(u);
  } else if (j.is_number_integer()) {
    v = j.get<int64_t>();
    ok = true;
  }
  MP_CHECK_INPUT(ok && lo <= v && v <= hi, "{}: {} must be an integer in [{}, {}], got {}", where,
                 what, lo, hi, shown(j));
  return v;
}

// Printable ASCII of at most `max_len` characters.
std::string get_string(const json& j, std::string_view where, std::string_view what,
                       size_t max_len = 256) {
  MP_CHECK_INPUT(j.is_string(), "{}: {} must be a string, got {}", where, what, shown(j));
  const std::string s = j.get<std::string>();
  const bool printable =
      std::all_of(s.begin(), s.end(), [](char c) { return c >= 0x20 && c < 0x7f; });
  MP_CHECK_INPUT(s.size() <= max_len && printable,
                 "{}: {} must be printable ASCII of at most {} characters, got {}", where, what,
                 max_len, shown(j));
  return s;
}

// Exactly 16 lowercase hex digits (as hash_hex writes them): no "0x", spaces, signs or junk.
uint64_t get_hash(const json& j, std::string_view where, std::string_view what) {
  const bool ok =
      j.is_string() && j.get<std::string>().size() == 16 &&
      std::all_of(j.get_ref<const std::string&>().begin(), j.get_ref<const std::string&>().end(),
                  [](char c) { return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'); });
  MP_CHECK_INPUT(ok, "{}: {} must be 16 lowercase hex digits, got {}", where, what, shown(j));
  return std::stoull(j.get<std::string>(), nullptr, 16);
}

std::vector<int64_t> get_int_array(const json& j, std::string_view where, std::string_view what,
                                   size_t size, int64_t lo, int64_t hi) {
  MP_CHECK_INPUT(j.is_array() && j.size() == size, "{}: {} must be an array of {} integers, got {}",
                 where, what, size, shown(j));
  std::vector<int64_t> out;
  for (size_t i = 0; i < j.size(); ++i) {
    out.push_back(get_int(j[i], where, fmt::format("{}[{}]", what, i), lo, hi));
  }
  return out;
}

// Checkpoint keys and scalar names: path components of [A-Za-z0-9._+-] separated by single '/',
// none of them "." or ".." (a key is also an HDF5 dataset path, "/" + key).
bool valid_key(std::string_view k) {
  if (k.empty() || k.size() > 1024) return false;
  size_t start = 0;
  while (start <= k.size()) {
    size_t slash = k.find('/', start);
    if (slash == std::string_view::npos) slash = k.size();
    const std::string_view part = k.substr(start, slash - start);
    if (part.empty() || part == "." || part == "..") return false;
    for (char c : part) {
      if (!std::isalnum(static_cast<unsigned char>(c)) && c != '.' && c != '_' && c != '-' &&
          c != '+') {
        return false;
      }
    }
    start = slash + 1;
  }
  return true;
}

// A plain file name: no directory part, not "." or "..", no control characters.
bool plain_file_name(std::string_view n) {
  return !n.empty() && n != "." && n != ".." && n.find('/') == std::string_view::npos &&
         n.find('\\') == std::string_view::npos &&
         std::all_of(n.begin(), n.end(), [](char c) { return c >= 0x20 && c < 0x7f; });
}

// Mesh sizes a checkpoint may record (rank file names have five digits).
constexpr int64_t kMaxWorld = 65536;
constexpr size_t kMaxTensorRank = 16;

json placement_json(const mesh::Placement& p) {
  switch (p.kind) {
    case mesh::Placement::Kind::kReplicate:
      return json{{"kind", "replicate"}};
    case mesh::Placement::Kind::kShard:
      return json{{"kind", "shard"}, {"dim", p.dim}};
    case mesh::Placement::Kind::kStridedShard:
      return json{{"kind", "strided_shard"}, {"dim", p.dim}, {"split_factor", p.split_factor}};
  }
  return {};
}

mesh::Placement placement_from_json(const json& j, std::string_view where, const std::string& what,
                                    int tensor_rank) {
  MP_CHECK_INPUT(j.is_object() && j.contains("kind"), "{}: {} must be an object with a \"kind\"",
                 where, what);
  const std::string kind = get_string(j.at("kind"), where, what + ".kind");
  const int64_t max_dim = std::max(tensor_rank - 1, 0);
  if (kind == "replicate") {
    expect_fields(j, where, what, {"kind"});
    return mesh::Placement::replicate();
  }
  if (kind == "shard") {
    expect_fields(j, where, what, {"kind", "dim"});
    return mesh::Placement::shard(
        static_cast<int>(get_int(j.at("dim"), where, what + ".dim", 0, max_dim)));
  }
  if (kind == "strided_shard") {
    expect_fields(j, where, what, {"kind", "dim", "split_factor"});
    return mesh::Placement::strided_shard(
        static_cast<int>(get_int(j.at("dim"), where, what + ".dim", 0, max_dim)),
        static_cast<int>(
            get_int(j.at("split_factor"), where, what + ".split_factor", 1, kMaxWorld)));
  }
  MP_FAIL_INPUT("{}: {} has unknown kind '{}' (replicate, shard, strided_shard)", where, what,
                kind);
}

std::vector<int64_t> elems(const std::vector<Elements>& v) {
  std::vector<int64_t> out;
  for (const Elements& e : v) out.push_back(e.value);
  return out;
}

std::vector<Elements> to_elems(const std::vector<int64_t>& v) {
  std::vector<Elements> out;
  for (int64_t e : v) out.emplace_back(e);
  return out;
}

json index_to_json(const CheckpointIndex& index, bool with_checksum) {
  json j;
  j["format"] = "meshproof-checkpoint";
  j["format_version"] = index.format_version;
  j["checkpoint_id"] = hash_hex(index.checkpoint_id);
  j["meshproof_version"] = index.meshproof_version;
  j["git_commit"] = index.git_commit;
  j["step"] = index.step;
  j["scenario_hash"] = index.scenario_hash;
  // The model the state belongs to (field -> value; empty when the saver recorded none).
  j["model"] = json::object();
  for (const auto& [field, value] : index.model) j["model"][field] = value;
  j["mesh"] = {{"dp_replicate", index.mesh.size(mesh::MeshDim::kDpReplicate)},
               {"dp_shard", index.mesh.size(mesh::MeshDim::kDpShard)},
               {"tp", index.mesh.size(mesh::MeshDim::kTp)}};
  json files = json::array();
  for (size_t i = 0; i < index.files.size(); ++i) {
    files.push_back({{"name", index.files[i]}, {"bytes", index.file_bytes[i]}});
  }
  j["files"] = files;
  j["scalars"] = index.scalars;
  json keys = json::object();
  for (const auto& [name, k] : index.keys) {
    json placements = json::array();
    for (const auto& p : k.placements) placements.push_back(placement_json(p));
    json chunks = json::array();
    for (const ChunkRecord& c : k.chunks) {
      chunks.push_back({{"file", c.file},
                        {"dataset", c.dataset},
                        {"offset", elems(c.box.offset)},
                        {"extent", elems(c.box.extent)},
                        {"xxh64", hash_hex(c.xxh64)}});
    }
    keys[name] = {{"shape", k.shape.dims()},
                  {"dtype", std::string(kernels::dtype_name(k.dtype))},
                  {"placements", placements},
                  {"chunks", chunks}};
  }
  j["keys"] = keys;
  if (with_checksum) j["index_xxh64"] = hash_hex(compute_index_xxh64(index));
  return j;
}

// Agreement step of a collective save/load: every rank reports whether its phase failed; when
// any did, every rank throws (the failing rank its own error, the others the message of the lowest
// rank among those with the gravest kind, broadcast to them), so no rank moves on alone and every
// process can tell the user the cause. Kinds travel as 1 = input, 2 = integrity, 3 = runtime,
// packed with the rank into one MAX-reduced value: kind * (n + 1) + (n - rank), exact in a float
// for n <= kMaxWorld.
void agree(mesh::RankComms& comms, std::exception_ptr error, std::string_view phase) {
  int code = 0;
  std::string message;
  if (error) {
    code = 3;
    try {
      std::rethrow_exception(error);
    } catch (const kernels::Error& e) {
      if (e.kind() == ErrorKind::kInput) code = 1;
      if (e.kind() == ErrorKind::kIntegrity) code = 2;
      message = e.message();
    } catch (const std::exception& e) {
      message = e.what();
    } catch (...) {
      message = "unknown error";
    }
  }
  mesh::Communicator& world =
      comms.group({mesh::MeshDim::kDpReplicate, mesh::MeshDim::kDpShard, mesh::MeshDim::kTp});
  const kernels::Device device = kernels::current_context().device;
  const int n = world.size();
  const float mine = error ? static_cast<float>(code * (n + 1) + (n - world.rank())) : 0.0f;
  Tensor flags = Tensor::from_vector<float>(Shape{1}, {mine});
  if (!device.is_cpu()) flags = flags.to(device);
  world.all_reduce(flags, mesh::ReduceOp::kMax);
  const auto got = static_cast<int>(flags.to_vector<float>()[0]);
  if (got == 0) return;
  const int kind = got / (n + 1);
  const int root = n - got % (n + 1);
  constexpr int64_t kMaxMessage = 2048;
  Tensor text = Tensor::zeros(Shape{kMaxMessage}, DType::kUInt8, kernels::Device::cpu());
  if (world.rank() == root) {
    std::memcpy(text.raw_data(), message.data(), std::min<size_t>(message.size(), kMaxMessage - 1));
  }
  if (!device.is_cpu()) text = text.to(device);
  world.broadcast(text, root);
  if (error) std::rethrow_exception(error);
  const std::vector<uint8_t> bytes = text.to_vector<uint8_t>();
  const std::string root_message(reinterpret_cast<const char*>(bytes.data()));
  const int who = world.ranks()[static_cast<size_t>(root)];
  if (kind == 1) MP_FAIL_INPUT("checkpoint {} failed on rank {}: {}", phase, who, root_message);
  MP_CHECK_INTEGRITY(kind != 2, "checkpoint {} failed on rank {}: {}", phase, who, root_message);
  MP_FAIL("checkpoint {} failed on rank {}: {}", phase, who, root_message);
}

// A random checkpoint id from rank 0, the same on every rank.
uint64_t agree_checkpoint_id(mesh::RankComms& comms) {
  mesh::Communicator& world =
      comms.group({mesh::MeshDim::kDpReplicate, mesh::MeshDim::kDpShard, mesh::MeshDim::kTp});
  uint64_t id = 0;
  if (world.rank() == 0) {
    std::random_device rd;
    id = (static_cast<uint64_t>(rd()) << 32) ^ static_cast<uint64_t>(rd());
  }
  Tensor buf = Tensor::zeros(Shape{8}, DType::kUInt8, kernels::Device::cpu());
  std::memcpy(buf.raw_data(), &id, 8);
  const kernels::Device device = kernels::current_context().device;
  if (!device.is_cpu()) buf = buf.to(device);
  world.broadcast(buf, 0);
  const std::vector<uint8_t> bytes = buf.to_vector<uint8_t>();
  std::memcpy(&id, bytes.data(), 8);
  return id;
}

template <typename Fn>
std::exception_ptr capture(Fn&& fn) {
  try {
    fn();
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

void check_live_state(const ShardedState& state, const mesh::RankComms& comms) {
  std::set<std::string> seen;
  for (const StateEntry& e : state.entries) {
    MP_CHECK_INPUT(valid_key(e.key),
                   "checkpoint: state key '{}' is not a checkpoint key (path components of "
                   "[A-Za-z0-9._+-] separated by '/', none '.' or '..')",
                   e.key);
    MP_CHECK_INPUT(seen.insert(e.key).second, "checkpoint: key '{}' appears twice in the state",
                   e.key);
    MP_CHECK_INPUT(e.layout.mesh() == comms.mesh(),
                   "checkpoint key '{}': layout mesh {} differs from the run's mesh {}", e.key,
                   e.layout.mesh().str(), comms.mesh().str());
    MP_CHECK_INPUT(e.local.defined() && e.local.shape() == e.layout.local_shape(comms.rank()),
                   "checkpoint key '{}': local tensor {} does not match its layout box {} on "
                   "rank {}",
                   e.key, e.local.defined() ? e.local.describe() : std::string("(undefined)"),
                   e.layout.box(comms.rank()).str(), comms.rank());
    element_bytes(e.local.dtype(), e.key);
  }
  for (const auto& [name, v] : state.scalars) {
    MP_CHECK_INPUT(valid_key(name), "checkpoint: scalar name '{}' is not a checkpoint key", name);
    MP_CHECK_INPUT(v >= 0,
                   "checkpoint: scalar '{}' is {}; scalars are counters and positions (>= 0)", name,
                   v);
  }
}

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

Tensor read_chunk_cached(FileCache& cache, const CheckpointIndex& index, const KeyRecord& key,
                         const ChunkRecord& chunk) {
  const fs::path file = cache.dir() / chunk.file;
  Tensor out;
  {
    std::lock_guard<std::mutex> lock(hdf5_mutex());
    H5::H5File& f = cache.open(chunk.file);
    H5::DataSet ds =
        MP_HDF5(kIntegrity, f.openDataSet(chunk.dataset), "checkpoint key '{}': dataset {} in {}",
                key.key, chunk.dataset, file.string());
    const std::string stored_dtype = MP_HDF5(kIntegrity, read_string_attr(ds, "dtype"),
                                             "checkpoint key '{}': `dtype` attribute of {} in {}",
                                             key.key, chunk.dataset, file.string());
    MP_CHECK_INTEGRITY(stored_dtype == kernels::dtype_name(key.dtype),
                       "checkpoint key '{}': dataset {} in {} holds dtype {}, the index says {}",
                       key.key, chunk.dataset, file.string(), stored_dtype,
                       kernels::dtype_name(key.dtype));
    const std::string stored_key = MP_HDF5(kIntegrity, read_string_attr(ds, "key"),
                                           "checkpoint key '{}': `key` attribute of {} in {}",
                                           key.key, chunk.dataset, file.string());
    MP_CHECK_INTEGRITY(stored_key == key.key,
                       "checkpoint key '{}': dataset {} in {} is the chunk of key '{}' (its `key` "
                       "attribute)",
                       key.key, chunk.dataset, file.string(), stored_key);
    const auto rank = static_cast<size_t>(chunk.box.rank());
    std::vector<int64_t> stored_offset;
    auto read_offset = [&] {
      if (!ds.attrExists("global_offset")) return 0;
      H5::Attribute a = ds.openAttribute("global_offset");
      H5::DataSpace sp = a.getSpace();
      const hssize_t n = sp.getSimpleExtentNpoints();
      MP_CHECK_INTEGRITY(
          a.getTypeClass() == H5T_INTEGER && n >= 1 && static_cast<size_t>(n) == rank,
          "checkpoint key '{}': `global_offset` attribute of {} in {} is not {} "
          "integers",
          key.key, chunk.dataset, file.string(), rank);
      stored_offset.resize(rank);
      a.read(H5::PredType::NATIVE_INT64, stored_offset.data());
      return 0;
    };
    MP_HDF5(kIntegrity, read_offset(), "checkpoint key '{}': `global_offset` attribute of {} in {}",
            key.key, chunk.dataset, file.string());
    MP_CHECK_INTEGRITY(stored_offset == elems(chunk.box.offset),
                       "checkpoint key '{}': dataset {} in {} holds global offset [{}], the index "
                       "says [{}]",
                       key.key, chunk.dataset, file.string(), fmt::join(stored_offset, ", "),
                       fmt::join(elems(chunk.box.offset), ", "));
    // Type and shape before allocating: the index's extents are bounded by the recorded file
    // sizes, and the dataset must hold exactly the extent.
    const H5::DataType stored_type =
        MP_HDF5(kIntegrity, ds.getDataType(), "checkpoint key '{}': datatype of {} in {}", key.key,
                chunk.dataset, file.string());
    MP_CHECK_INTEGRITY(stored_type == storage_type(key.dtype, key.key),
                       "checkpoint key '{}': dataset {} in {} is not stored as {} bits", key.key,
                       chunk.dataset, file.string(), kernels::dtype_name(key.dtype));
    H5::DataSpace space = ds.getSpace();
    const int nd = space.getSimpleExtentNdims();
    std::vector<hsize_t> dims(static_cast<size_t>(std::max(nd, 0)));
    if (nd > 0) space.getSimpleExtentDims(dims.data());
    const std::vector<int64_t> want = elems(chunk.box.extent);
    const bool same_shape =
        dims.size() == want.size() &&
        std::equal(dims.begin(), dims.end(), want.begin(),
                   [](hsize_t d, int64_t w) { return static_cast<int64_t>(d) == w && w >= 0; });
    MP_CHECK_INTEGRITY(
        same_shape, "checkpoint key '{}': dataset {} in {} has shape [{}], the index says [{}]",
        key.key, chunk.dataset, file.string(), fmt::join(dims, ", "), fmt::join(want, ", "));
    out = Tensor::empty(chunk.box.shape(), key.dtype, kernels::Device::cpu());
    if (out.numel().value > 0) {
      errno = 0;
      MP_HDF5(kIntegrity, ds.read(out.raw_data(), storage_type(key.dtype, key.key)),
              "checkpoint key '{}': reading dataset {} from {} (truncated or corrupt?){}", key.key,
              chunk.dataset, file.string(), errno_note());
    }
  }
  const uint64_t h = chunk_xxh64(index.checkpoint_id, key.key, key.dtype, chunk.box, out);
  MP_CHECK_INTEGRITY(h == chunk.xxh64,
                     "checkpoint key '{}': checksum mismatch in dataset {} of {} (xxh64 {}, the "
                     "index records {})",
                     key.key, chunk.dataset, file.string(), hash_hex(h), hash_hex(chunk.xxh64));
  return out;
}

// Kinds of file-level problem found before any chunk is read (integrity).
std::optional<std::string> file_size_problem(const fs::path& dir, const CheckpointIndex& index,
                                             size_t i) {
  const fs::path p = dir / index.files[i];
  std::error_code ec;
  const fs::file_status st = fs::symlink_status(p, ec);
  if (!fs::exists(st)) return fmt::format("rank file {} is missing", p.string());
  MP_CHECK_INPUT(fs::is_regular_file(st),
                 "checkpoint {}: rank file {} is not a regular file (a symlink or other): chunk "
                 "files must be plain files inside the checkpoint directory",
                 dir.string(), p.string());
  const auto size = static_cast<int64_t>(fs::file_size(p));
  if (size != index.file_bytes[i]) {
    return fmt::format(
        "rank file {} has {} bytes, the index records {} (truncated or overwritten?)", p.string(),
        size, index.file_bytes[i]);
  }
  return std::nullopt;
}

}  // namespace

std::string_view save_point_name(SavePoint p) {
  switch (p) {
    case SavePoint::kDatasetWritten:
      return "dataset_written";
    case SavePoint::kRankFileWritten:
      return "rank_file_written";
    case SavePoint::kBeforeIndex:
      return "before_index";
    case SavePoint::kBeforeRename:
      return "before_rename";
  }
  return "?";
}

std::string checkpoint_dir_name(int64_t step) { return fmt::format("step_{:07d}", step); }

uint64_t chunk_xxh64(uint64_t checkpoint_id, std::string_view key, DType dtype,
                     const mesh::Box& box, const Tensor& data) {
  const Tensor host = to_host(data);
  static_assert(std::endian::native == std::endian::little, "headers are hashed little-endian");
  std::string header;
  auto put = [&header](const void* p, size_t n) { header.append(static_cast<const char*>(p), n); };
  auto put_u64 = [&put](uint64_t v) { put(&v, 8); };
  const std::string_view dt = kernels::dtype_name(dtype);
  put_u64(checkpoint_id);
  put_u64(key.size());
  put(key.data(), key.size());
  put_u64(dt.size());
  put(dt.data(), dt.size());
  put_u64(static_cast<uint64_t>(box.rank()));
  for (const Elements& o : box.offset) put(&o.value, 8);
  for (const Elements& e : box.extent) put(&e.value, 8);
  XXH64_state_t* st = XXH64_createState();
  MP_CHECK(st != nullptr, "XXH64_createState failed");
  XXH64_reset(st, 0);
  XXH64_update(st, header.data(), header.size());
  XXH64_update(st, host.raw_data(), static_cast<size_t>(host.nbytes().value));
  const uint64_t h = XXH64_digest(st);
  XXH64_freeState(st);
  return h;
}

std::string canonical_index_text(const CheckpointIndex& index) {
  return index_to_json(index, /*with_checksum=*/false).dump();
}

uint64_t compute_index_xxh64(const CheckpointIndex& index) {
  const std::string text = canonical_index_text(index);
  return XXH64(text.data(), text.size(), 0);
}

std::string index_json_text(const CheckpointIndex& index) {
  return index_to_json(index, /*with_checksum=*/true).dump(1) + "\n";
}

CheckpointIndex parse_checkpoint_index(std::string_view text, std::string_view where) {
  const json j = parse_json_text(text, where);
  MP_CHECK_INPUT(j.is_object(), "{}: a checkpoint index is a JSON object", where);
  MP_CHECK_INPUT(j.contains("format") && j.at("format") == "meshproof-checkpoint",
                 "{}: not a meshproof checkpoint index (no \"format\": \"meshproof-checkpoint\")",
                 where);
  MP_CHECK_INPUT(j.contains("format_version"), "{}: no format_version", where);
  CheckpointIndex index;
  index.format_version =
      static_cast<int>(get_int(j.at("format_version"), where, "format_version", 0, INT32_MAX));
  MP_CHECK_INPUT(index.format_version != 1,
                 "{}: format_version 1 was written by a meshproof without checkpoint integrity "
                 "records (no index checksum; chunk hashes that do not cover key and offset) and "
                 "is not read by this build (format_version {}): save the checkpoint again",
                 where, kCheckpointFormatVersion);
  MP_CHECK_INPUT(index.format_version == kCheckpointFormatVersion,
                 "{}: format_version {} (this build reads {})", where, index.format_version,
                 kCheckpointFormatVersion);
  expect_fields(
      j, where, "the index",
      {"format", "format_version", "checkpoint_id", "meshproof_version", "git_commit", "step",
       "scenario_hash", "model", "mesh", "files", "scalars", "keys", "index_xxh64"});
  index.checkpoint_id = get_hash(j.at("checkpoint_id"), where, "checkpoint_id");
  index.index_xxh64 = get_hash(j.at("index_xxh64"), where, "index_xxh64");
  index.step = get_int(j.at("step"), where, "step", 0, INT64_MAX);
  index.scenario_hash = get_string(j.at("scenario_hash"), where, "scenario_hash");
  const json& model = j.at("model");
  MP_CHECK_INPUT(model.is_object(), "{}: model must be a JSON object (field -> value), got {}",
                 where, shown(model));
  for (const auto& [field, value] : model.items()) {
    index.model[field] = get_string(value, where, "model." + field);
  }
  index.meshproof_version = get_string(j.at("meshproof_version"), where, "meshproof_version");
  index.git_commit = get_string(j.at("git_commit"), where, "git_commit");

  const json& m = j.at("mesh");
  expect_fields(m, where, "mesh", {"dp_replicate", "dp_shard", "tp"});
  const int64_t dr = get_int(m.at("dp_replicate"), where, "mesh.dp_replicate", 1, kMaxWorld);
  const int64_t ds = get_int(m.at("dp_shard"), where, "mesh.dp_shard", 1, kMaxWorld);
  const int64_t tp = get_int(m.at("tp"), where, "mesh.tp", 1, kMaxWorld);
  MP_CHECK_INPUT(dr * ds * tp <= kMaxWorld, "{}: mesh {}x{}x{} has more than {} ranks", where, dr,
                 ds, tp, kMaxWorld);
  index.mesh = mesh::DeviceMesh(static_cast<int>(dr), static_cast<int>(ds), static_cast<int>(tp));
  const int world = index.mesh.world_size();

  const json& files = j.at("files");
  MP_CHECK_INPUT(files.is_array() && static_cast<int64_t>(files.size()) == world,
                 "{}: files must list one rank file per rank of the {}-rank mesh", where, world);
  for (int r = 0; r < world; ++r) {
    const json& f = files[static_cast<size_t>(r)];
    const std::string what = fmt::format("files[{}]", r);
    expect_fields(f, where, what, {"name", "bytes"});
    const std::string name = get_string(f.at("name"), where, what + ".name");
    MP_CHECK_INPUT(plain_file_name(name),
                   "{}: {} '{}' is not a plain file name inside the checkpoint directory", where,
                   what, name);
    MP_CHECK_INPUT(name == rank_file_name(r), "{}: {} is '{}', rank {}'s file is '{}'", where, what,
                   name, r, rank_file_name(r));
    index.files.push_back(name);
    index.file_bytes.push_back(get_int(f.at("bytes"), where, what + ".bytes", 0, INT64_MAX));
  }

  const json& scalars = j.at("scalars");
  MP_CHECK_INPUT(scalars.is_object(), "{}: scalars must be an object", where);
  for (const auto& [name, v] : scalars.items()) {
    MP_CHECK_INPUT(valid_key(name), "{}: scalar name '{}' is not a checkpoint key", where, name);
    // Scalars are counters and positions (optimizer and LR steps, the data cursor, RNG offsets).
    index.scalars[name] = get_int(v, where, fmt::format("scalar '{}'", name), 0, INT64_MAX);
  }

  const json& keys = j.at("keys");
  MP_CHECK_INPUT(keys.is_object(), "{}: keys must be an object", where);
  std::vector<int64_t> bytes_in_file(static_cast<size_t>(world), 0);
  for (const auto& [name, kj] : keys.items()) {
    MP_CHECK_INPUT(valid_key(name),
                   "{}: key '{}' is not a checkpoint key (path components of [A-Za-z0-9._+-] "
                   "separated by '/', none '.' or '..')",
                   where, name);
    const std::string what = fmt::format("key '{}'", name);
    expect_fields(kj, where, what, {"shape", "dtype", "placements", "chunks"});
    KeyRecord k;
    k.key = name;
    const json& sj = kj.at("shape");
    MP_CHECK_INPUT(sj.is_array() && sj.size() <= kMaxTensorRank,
                   "{}: {} shape must be an array of at most {} integers", where, what,
                   kMaxTensorRank);
    k.shape = Shape(get_int_array(sj, where, what + " shape", sj.size(), 0, INT64_MAX));
    k.dtype = kernels::parse_dtype(get_string(kj.at("dtype"), where, what + " dtype"),
                                   fmt::format("{} {} dtype", where, what));
    const int64_t esize = element_bytes(k.dtype, name);
    int64_t numel = 1;
    int64_t nbytes = 0;
    for (int64_t d : k.shape.dims()) {
      MP_CHECK_INPUT(!__builtin_mul_overflow(numel, d, &numel),
                     "{}: {} shape {} has more elements than an int64 counts", where, what,
                     k.shape.str());
    }
    MP_CHECK_INPUT(!__builtin_mul_overflow(numel, esize, &nbytes),
                   "{}: {} shape {} has more bytes than an int64 counts", where, what,
                   k.shape.str());
    const json& pj = kj.at("placements");
    MP_CHECK_INPUT(pj.is_array() && static_cast<int>(pj.size()) == mesh::kNumMeshDims,
                   "{}: {} placements must list one placement per mesh dim ({})", where, what,
                   mesh::kNumMeshDims);
    for (size_t i = 0; i < pj.size(); ++i) {
      k.placements.push_back(placement_from_json(
          pj[i], where, fmt::format("{} placements[{}]", what, i), k.shape.rank()));
    }
    std::optional<mesh::Layout> layout;
    try {
      layout.emplace(index.mesh, k.shape, k.placements);
    } catch (const kernels::Error& e) {
      if (e.kind() != ErrorKind::kInput) throw;
      MP_FAIL_INPUT("{}: {}: {}", where, what, e.message());
    }
    // The chunks are exactly the layout's: each distinct box once, in its owner's rank file.
    const std::vector<mesh::Chunk>& expected = layout->chunks();
    const json& cj = kj.at("chunks");
    MP_CHECK_INPUT(cj.is_array() && cj.size() == expected.size(),
                   "{}: {} must have {} chunks (its layout {}), got {}", where, what,
                   expected.size(), layout->str(), cj.is_array() ? shown(cj.size()) : shown(cj));
    for (size_t i = 0; i < cj.size(); ++i) {
      const json& c = cj[i];
      const std::string cw = fmt::format("{} chunks[{}]", what, i);
      expect_fields(c, where, cw, {"file", "dataset", "offset", "extent", "xxh64"});
      ChunkRecord rec;
      rec.file = get_string(c.at("file"), where, cw + ".file", 4096);
      MP_CHECK_INPUT(plain_file_name(rec.file),
                     "{}: {} file '{}' is not a plain file name inside the checkpoint directory",
                     where, cw, rec.file);
      const int owner = expected[i].owner;
      MP_CHECK_INPUT(rec.file == rank_file_name(owner),
                     "{}: {} is in file '{}'; its writer, rank {}, writes '{}'", where, cw,
                     rec.file, owner, rank_file_name(owner));
      rec.dataset = get_string(c.at("dataset"), where, cw + ".dataset", 2048);
      MP_CHECK_INPUT(rec.dataset == "/" + name, "{}: {} (file {}) has dataset '{}', expected '/{}'",
                     where, cw, rec.file, rec.dataset, name);
      const size_t rank = static_cast<size_t>(k.shape.rank());
      rec.box.offset =
          to_elems(get_int_array(c.at("offset"), where, cw + ".offset", rank, 0, INT64_MAX));
      rec.box.extent =
          to_elems(get_int_array(c.at("extent"), where, cw + ".extent", rank, 0, INT64_MAX));
      MP_CHECK_INPUT(rec.box == expected[i].box,
                     "{}: {} (file {}) has box {}, the layout {} gives {}", where, cw, rec.file,
                     rec.box.str(), layout->str(), expected[i].box.str());
      rec.xxh64 = get_hash(c.at("xxh64"), where, cw + ".xxh64");
      int64_t& in_file = bytes_in_file[static_cast<size_t>(owner)];
      MP_CHECK_INPUT(!__builtin_add_overflow(in_file, rec.box.numel().value * esize, &in_file),
                     "{}: chunk bytes of {} overflow int64", where, rec.file);
      k.chunks.push_back(std::move(rec));
    }
    index.keys.emplace(name, std::move(k));
  }
  // Chunks are stored contiguously and uncompressed: a file holds at least its chunks' bytes.
  // This bounds every allocation a reader makes by the recorded (and, when checked, actual) sizes.
  for (int r = 0; r < world; ++r) {
    const auto i = static_cast<size_t>(r);
    MP_CHECK_INPUT(bytes_in_file[i] <= index.file_bytes[i],
                   "{}: the chunks in {} hold {} bytes, more than its recorded {} bytes", where,
                   index.files[i], bytes_in_file[i], index.file_bytes[i]);
  }
  return index;
}

std::vector<fs::path> list_checkpoints(const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> found;
  if (!fs::is_directory(root)) return {};
  static const std::regex re("step_([0-9]{7,18})");
  for (const auto& d : fs::directory_iterator(root)) {
    std::smatch m;
    const std::string name = d.path().filename().string();
    if (d.is_directory() && std::regex_match(name, m, re) && fs::exists(d.path() / kIndexName)) {
      found.emplace_back(std::stoll(m[1].str()), d.path());
    }
  }
  std::sort(found.begin(), found.end());
  std::vector<fs::path> out;
  for (auto& [s, p] : found) out.push_back(p);
  return out;
}

std::optional<fs::path> latest_checkpoint(const fs::path& root) {
  auto all = list_checkpoints(root);
  if (all.empty()) return std::nullopt;
  return all.back();
}

fs::path save_checkpoint(const fs::path& root, int64_t step, const ShardedState& state,
                         mesh::RankComms& comms, const CheckpointOptions& options) {
  const int rank = comms.rank();
  const int world = comms.mesh().world_size();
  const fs::path final_dir = root / checkpoint_dir_name(step);
  const fs::path partial = root / (checkpoint_dir_name(step) + kPartialSuffix);
  // Checkpoint-side faults act through the checkpoint_save point (engine/fault_hooks.h).
  const FaultHooks faults = make_fault_hooks(options.faults);

  // Phase 1 (rank 0): prepare the partial directory; stale partial directories are removed.
  agree(comms, capture([&] {
          MP_CHECK_INPUT(step >= 0, "checkpoint step {} is negative", step);
          MP_CHECK_INPUT(world <= kMaxWorld, "checkpoint: a mesh of {} ranks (at most {})", world,
                         kMaxWorld);
          check_live_state(state, comms);
          const bool printable =
              std::all_of(options.scenario_hash.begin(), options.scenario_hash.end(),
                          [](char c) { return c >= 0x20 && c < 0x7f; });
          MP_CHECK_INPUT(printable && options.scenario_hash.size() <= 256,
                         "checkpoint: scenario hash '{}' is not printable ASCII of at most 256 "
                         "characters",
                         options.scenario_hash);
          if (rank != 0) return;
          std::error_code ec;
          fs::create_directories(root, ec);
          MP_CHECK(!ec, "cannot create checkpoint root {}: {}", root.string(), ec.message());
          MP_CHECK_INPUT(!fs::exists(final_dir),
                         "checkpoint {} already exists; a complete checkpoint is never "
                         "overwritten",
                         final_dir.string());
          // Only meshproof's own leftovers (step_NNNNNNN.partial of a killed save) are removed;
          // any other folder in the root is not ours to touch.
          static const std::regex stale_partial("step_[0-9]{7,18}\\.partial");
          for (const auto& d : fs::directory_iterator(root)) {
            if (d.is_directory() && !d.is_symlink() &&
                std::regex_match(d.path().filename().string(), stale_partial)) {
              fs::remove_all(d.path(), ec);
              MP_CHECK(!ec, "cannot remove stale {}: {}", d.path().string(), ec.message());
            }
          }
          fs::create_directory(partial, ec);
          MP_CHECK(!ec, "cannot create {}: {}", partial.string(), ec.message());
        }),
        "save (prepare)");
  const uint64_t checkpoint_id = agree_checkpoint_id(comms);

  // From here on the save owns `partial`: when any rank fails, rank 0 removes it after the
  // agreement (no rank writes into it any more), so a failed save leaves nothing behind.
  auto remove_partial_on_failure = [&](auto&& phase) {
    try {
      phase();
    } catch (...) {
      if (rank == 0) {
        std::error_code ec;
        fs::remove_all(partial, ec);
      }
      throw;
    }
  };

  // Phase 2 (every rank): write the chunks this rank is the designated writer of, then a sidecar
  // with their records for rank 0.
  remove_partial_on_failure([&] {
    agree(
        comms, capture([&] {
          const std::string file_name = rank_file_name(rank);
          const fs::path file_path = partial / file_name;
          json records = json::array();
          std::vector<std::pair<std::string, Tensor>> to_write;  // dataset, host data
          for (const StateEntry& e : state.entries) {
            if (!faults.checkpoint_keeps(e.key, step)) continue;
            for (const mesh::Chunk& c : e.layout.chunks()) {
              if (c.owner != rank) continue;
              const Tensor host = faults.checkpoint_bytes(e.key, step, to_host(e.local));
              const std::string dataset = "/" + e.key;
              records.push_back({{"key", e.key},
                                 {"dataset", dataset},
                                 {"offset", elems(c.box.offset)},
                                 {"extent", elems(c.box.extent)},
                                 {"xxh64", hash_hex(chunk_xxh64(checkpoint_id, e.key, host.dtype(),
                                                                c.box, host))}});
              to_write.emplace_back(dataset, host);
            }
          }
          std::string image;  // the rank file's bytes
          {
            std::lock_guard<std::mutex> lock(hdf5_mutex());
            kernels::silence_hdf5_errors();
            // The rank file is built in memory (HDF5's core driver, no backing store) and
            // written with write_text_file: HDF5 1.10 never touches the disk, so a full disk
            // fails in our write with errno's reason. (On the sec2 driver an ENOSPC inside
            // H5Fclose leaves the library with a half-closed file that crashes the process at
            // exit.) Costs one in-memory copy of this rank's chunks during the save.
            int64_t data_bytes = 0;
            for (const auto& [dataset, host] : to_write) data_bytes += host.nbytes().value;
            H5::FileAccPropList fapl;
            fapl.setCore(static_cast<size_t>(data_bytes) + (size_t{1} << 16), false);
            H5::H5File f = MP_HDF5(
                kRuntime,
                H5::H5File(file_path.string(), H5F_ACC_TRUNC, H5::FileCreatPropList::DEFAULT, fapl),
                "creating checkpoint rank file {} in memory", file_path.string());
            auto write_id = [&] {
              const std::string id = hash_hex(checkpoint_id);
              H5::StrType t(H5::PredType::C_S1, id.size());
              f.createAttribute("checkpoint_id", t, H5::DataSpace(H5S_SCALAR)).write(t, id);
              return 0;
            };
            MP_HDF5(kRuntime, write_id(), "writing the checkpoint id to rank file {}",
                    file_path.string());
            H5::LinkCreatPropList lcpl;
            lcpl.setCreateIntermediateGroup(true);
            for (size_t i = 0; i < to_write.size(); ++i) {
              // References, not a structured binding: clang before 16 cannot capture a binding in
              // the lambda below, and the sanitizer/fuzz build (design.md section 17) is clang 14.
              const std::string& dataset = to_write[i].first;
              const Tensor& host = to_write[i].second;
              const json& rec = records[i];
              const std::string key = rec.at("key").get<std::string>();
              auto write_dataset = [&] {
                H5::DataSet ds = f.createDataSet(
                    dataset, storage_type(host.dtype(), key), dataspace_for(host.shape()),
                    H5::DSetCreatPropList::DEFAULT, H5::DSetAccPropList::DEFAULT, lcpl);
                if (host.numel().value > 0) {
                  ds.write(host.raw_data(), storage_type(host.dtype(), key));
                }
                const std::string dt(kernels::dtype_name(host.dtype()));
                H5::StrType str_type(H5::PredType::C_S1, dt.size());
                ds.createAttribute("dtype", str_type, H5::DataSpace(H5S_SCALAR))
                    .write(str_type, dt);
                H5::StrType key_type(H5::PredType::C_S1, key.size());
                ds.createAttribute("key", key_type, H5::DataSpace(H5S_SCALAR)).write(key_type, key);
                const std::vector<int64_t> off = rec.at("offset").get<std::vector<int64_t>>();
                const hsize_t n = off.size();
                if (n > 0) {
                  ds.createAttribute("global_offset", H5::PredType::NATIVE_INT64,
                                     H5::DataSpace(1, &n))
                      .write(H5::PredType::NATIVE_INT64, off.data());
                }
                return 0;
              };
              MP_HDF5(kRuntime, write_dataset(), "writing dataset {} to checkpoint rank file {}",
                      dataset, file_path.string());
              if (options.fault_hook) {
                options.fault_hook(SavePoint::kDatasetWritten, rank, static_cast<int64_t>(i));
              }
            }
            auto image_of = [&] {
              f.flush(H5F_SCOPE_LOCAL);
              const ssize_t n = H5Fget_file_image(f.getId(), nullptr, 0);
              if (n < 0) throw H5::FileIException("H5Fget_file_image", "no file image");
              std::string bytes(static_cast<size_t>(n), '\0');
              if (H5Fget_file_image(f.getId(), bytes.data(), bytes.size()) != n) {
                throw H5::FileIException("H5Fget_file_image", "short file image");
              }
              f.close();
              return bytes;
            };
            image = MP_HDF5(kRuntime, image_of(), "building checkpoint rank file {}",
                            file_path.string());
          }
          write_text_file(file_path, image);
          image.clear();
          image.shrink_to_fit();
          fsync_path(file_path);
          json side = {{"rank", rank}, {"file", file_name}, {"chunks", records}};
          side["keys"] = json::array();
          for (const StateEntry& e : state.entries) side["keys"].push_back(e.key);
          side["scalars"] = state.scalars;
          write_text_file(partial / sidecar_name(rank), side.dump());
          if (options.fault_hook) options.fault_hook(SavePoint::kRankFileWritten, rank, -1);
        }),
        "save (rank files)");
  });

  // Phase 3 (rank 0): assemble and write the index last, then commit by renaming.
  remove_partial_on_failure([&] {
    agree(comms, capture([&] {
            if (rank != 0) return;
            CheckpointIndex index;
            index.checkpoint_id = checkpoint_id;
            index.step = step;
            index.mesh = comms.mesh();
            index.scenario_hash = options.scenario_hash;
            index.model = options.model;
            index.meshproof_version = std::string(kernels::version());
            index.git_commit = std::string(kernels::git_commit());
            index.scalars = state.scalars;
            std::vector<std::string> key_names;
            for (const StateEntry& e : state.entries) {
              key_names.push_back(e.key);
              if (!faults.checkpoint_keeps(e.key, step)) continue;
              KeyRecord k;
              k.key = e.key;
              k.shape = e.layout.global_shape();
              k.dtype = e.local.dtype();
              k.placements = e.layout.placements();
              index.keys.emplace(e.key, std::move(k));
            }
            for (int r = 0; r < world; ++r) {
              const json side = read_json_file(partial / sidecar_name(r), "checkpoint sidecar");
              MP_CHECK(side.at("keys").get<std::vector<std::string>>() == key_names,
                       "checkpoint save: rank {} saved keys that differ from rank 0's", r);
              using ScalarMap = std::map<std::string, int64_t>;
              MP_CHECK(side.at("scalars").get<ScalarMap>() == state.scalars,
                       "checkpoint save: rank {} has scalars that differ from rank 0's", r);
              for (const json& c : side.at("chunks")) {
                const std::string key = c.at("key").get<std::string>();
                ChunkRecord rec;
                rec.file = side.at("file").get<std::string>();
                rec.dataset = c.at("dataset").get<std::string>();
                rec.box.offset = to_elems(c.at("offset").get<std::vector<int64_t>>());
                rec.box.extent = to_elems(c.at("extent").get<std::vector<int64_t>>());
                rec.xxh64 = std::stoull(c.at("xxh64").get<std::string>(), nullptr, 16);
                index.keys.at(key).chunks.push_back(std::move(rec));
              }
              index.files.push_back(rank_file_name(r));
              index.file_bytes.push_back(
                  static_cast<int64_t>(fs::file_size(partial / rank_file_name(r))));
            }
            const std::string text = index_json_text(index);
            // The saver never writes an index its own reader rejects (chunks equal to the
            // layouts' chunks, file names, ranges).
            parse_checkpoint_index(text, "checkpoint save: the index being written");
            if (options.fault_hook) options.fault_hook(SavePoint::kBeforeIndex, rank, -1);
            write_text_file(partial / kIndexName, text);
            for (int r = 0; r < world; ++r) fs::remove(partial / sidecar_name(r));
            fsync_path(partial);
            if (options.fault_hook) options.fault_hook(SavePoint::kBeforeRename, rank, -1);
            std::error_code ec;
            fs::rename(partial, final_dir, ec);
            MP_CHECK(!ec, "renaming {} to {}: {}", partial.string(), final_dir.string(),
                     ec.message());
            fsync_path(root);
            if (options.keep_last > 0) {
              auto all = list_checkpoints(root);
              for (size_t i = 0; i + static_cast<size_t>(options.keep_last) < all.size(); ++i) {
                fs::remove_all(all[i], ec);
                MP_CHECK(!ec, "removing old checkpoint {}: {}", all[i].string(), ec.message());
              }
              fsync_path(root);
            }
          }),
          "save (commit)");
  });
  return final_dir;
}

CheckpointIndex read_checkpoint_index(const fs::path& dir, IndexChecks checks) {
  MP_CHECK_INPUT(!ends_with(dir.filename().string(), kPartialSuffix),
                 "checkpoint {} is an incomplete (.partial) save and cannot be loaded",
                 dir.string());
  MP_CHECK_INPUT(fs::is_directory(dir), "checkpoint directory {} does not exist", dir.string());
  const fs::path index_path = dir / kIndexName;
  MP_CHECK_INPUT(fs::exists(index_path),
                 "checkpoint {} has no {} (an incomplete save, or not a checkpoint)", dir.string(),
                 kIndexName);
  CheckpointIndex index =
      parse_checkpoint_index(read_text_file(index_path, "checkpoint index"), index_path.string());
  // A directory named step_N holds step N (listing and keep-last-N go by the name).
  static const std::regex re("step_([0-9]{7,18})");
  std::smatch m;
  const std::string name = dir.filename().string();
  if (std::regex_match(name, m, re)) {
    MP_CHECK_INPUT(std::stoll(m[1].str()) == index.step,
                   "checkpoint {}: the directory name says step {}, {} says step {}", dir.string(),
                   m[1].str(), index_path.string(), index.step);
  }
  if (checks.checksum) {
    const uint64_t h = compute_index_xxh64(index);
    MP_CHECK_INTEGRITY(h == index.index_xxh64,
                       "{}: index checksum mismatch (xxh64 of the content {}, recorded {}): the "
                       "index was edited or damaged after the save",
                       index_path.string(), hash_hex(h), hash_hex(index.index_xxh64));
  }
  if (checks.file_sizes) {
    for (size_t i = 0; i < index.files.size(); ++i) {
      const std::optional<std::string> problem = file_size_problem(dir, index, i);
      MP_CHECK_INTEGRITY(!problem, "checkpoint {}: {}", dir.string(), problem.value_or(""));
    }
  }
  return index;
}

Tensor read_chunk(const fs::path& dir, const CheckpointIndex& index, const KeyRecord& key,
                  const ChunkRecord& chunk) {
  FileCache cache(dir, index.checkpoint_id);
  return read_chunk_cached(cache, index, key, chunk);
}

Tensor read_global(const fs::path& dir, const CheckpointIndex& index, const KeyRecord& key) {
  Tensor global = Tensor::zeros(key.shape, key.dtype, kernels::Device::cpu());
  const mesh::Box whole = mesh::Box::whole(key.shape);
  FileCache cache(dir, index.checkpoint_id);
  for (const ChunkRecord& c : key.chunks) {
    Tensor t = read_chunk_cached(cache, index, key, c);
    mesh::copy_region(t, c.box, global, whole, c.box);
  }
  return global;
}

VerifyReport verify_checkpoint(const fs::path& dir) {
  {
    std::lock_guard<std::mutex> lock(hdf5_mutex());
    kernels::silence_hdf5_errors();
  }
  const CheckpointIndex index =
      read_checkpoint_index(dir, {.checksum = false, .file_sizes = false});
  VerifyReport report;
  report.keys = static_cast<int64_t>(index.keys.size());
  const uint64_t h = compute_index_xxh64(index);
  if (h != index.index_xxh64) {
    report.findings.push_back(
        {"", kIndexName,
         fmt::format("index checksum mismatch (xxh64 of the content {}, recorded {}): the index "
                     "was edited or damaged after the save",
                     hash_hex(h), hash_hex(index.index_xxh64))});
  }
  FileCache cache(dir, index.checkpoint_id);
  std::set<std::string> bad_files;
  for (size_t i = 0; i < index.files.size(); ++i) {
    std::optional<std::string> problem = file_size_problem(dir, index, i);
    if (!problem) {
      try {
        std::lock_guard<std::mutex> lock(hdf5_mutex());
        cache.open(index.files[i]);
      } catch (const kernels::Error& e) {
        if (e.kind() != ErrorKind::kIntegrity) throw;
        problem = e.message();
      }
    }
    if (problem) {
      report.findings.push_back({"", index.files[i], *problem});
      bad_files.insert(index.files[i]);
    }
  }
  for (const auto& [name, k] : index.keys) {
    for (const ChunkRecord& c : k.chunks) {
      ++report.chunks;
      if (bad_files.count(c.file)) {
        report.findings.push_back({name, c.file,
                                   fmt::format("chunk {} {} is in the bad rank file {}", c.dataset,
                                               c.box.str(), c.file)});
        continue;
      }
      try {
        read_chunk_cached(cache, index, k, c);
      } catch (const kernels::Error& e) {
        if (e.kind() != ErrorKind::kIntegrity) throw;
        report.findings.push_back({name, c.file, e.message()});
      }
    }
  }
  return report;
}

LoadStats load_checkpoint(const fs::path& dir, ShardedState& state, mesh::RankComms& comms,
                          const CheckpointOptions& options) {
  const int rank = comms.rank();
  LoadStats stats;
  CheckpointIndex index;
  std::vector<Tensor> staged(state.entries.size());  // undefined: keep the live tensor
  std::map<std::string, int64_t> staged_scalars;
  std::optional<FileCache> cache;

  // Stage everything: read, verify and assemble into buffers; the live state is untouched.
  std::exception_ptr error = capture([&] {
    check_live_state(state, comms);
    {
      std::lock_guard<std::mutex> lock(hdf5_mutex());
      kernels::silence_hdf5_errors();
    }
    index = read_checkpoint_index(dir);
    cache.emplace(dir, index.checkpoint_id);
    // Load-side faults act through the checkpoint_restore point; a key the checkpoint_save point
    // leaves out of a checkpoint of this step may be missing (engine/fault_hooks.h).
    const FaultHooks faults = make_fault_hooks(options.faults);
    std::set<std::string> live_keys;
    for (size_t i = 0; i < state.entries.size(); ++i) {
      const StateEntry& e = state.entries[i];
      live_keys.insert(e.key);
      auto it = index.keys.find(e.key);
      if (it == index.keys.end()) {
        MP_CHECK_INPUT(!faults.checkpoint_keeps(e.key, index.step),
                       "checkpoint {}: key '{}' of the live state is missing from the checkpoint",
                       dir.string(), e.key);
        continue;  // the fault dropped it: the live value stays
      }
      const KeyRecord& k = it->second;
      MP_CHECK_INPUT(k.shape == e.layout.global_shape(),
                     "checkpoint {}: key '{}' has global shape {}, the live state {}", dir.string(),
                     e.key, k.shape.str(), e.layout.global_shape().str());
      MP_CHECK_INPUT(k.dtype == e.local.dtype(),
                     "checkpoint {}: key '{}' has dtype {}, the live state {}", dir.string(), e.key,
                     kernels::dtype_name(k.dtype), kernels::dtype_name(e.local.dtype()));
      const mesh::Box target = e.layout.box(rank);
      Tensor buf = Tensor::empty(target.shape(), k.dtype, kernels::Device::cpu());
      int64_t covered = 0;
      for (const ChunkRecord& c : k.chunks) {
        const mesh::Box region = c.box.intersect(target);
        if (region.empty()) continue;
        // Verified even when a load-side fault leaves the key unrestored below.
        Tensor chunk = read_chunk_cached(*cache, index, k, c);
        ++stats.chunks_read;
        stats.bytes_read += chunk.nbytes();
        mesh::copy_region(chunk, c.box, buf, target, region);
        covered += region.numel().value;
      }
      MP_CHECK(covered == target.numel().value,
               "checkpoint {}: key '{}' chunks cover {} of rank {}'s {} elements", dir.string(),
               e.key, covered, rank, target.numel().value);
      if (faults.restores(e.key, index.step)) staged[i] = buf;
    }
    for (const auto& [name, k] : index.keys) {
      MP_CHECK_INPUT(live_keys.count(name) > 0,
                     "checkpoint {}: key '{}' has no tensor in the live state (a different model "
                     "or recipe?)",
                     dir.string(), name);
    }
    for (const auto& [name, v] : state.scalars) {
      auto it = index.scalars.find(name);
      MP_CHECK_INPUT(it != index.scalars.end(),
                     "checkpoint {}: scalar '{}' of the live state is missing from the checkpoint",
                     dir.string(), name);
      if (faults.restores(name, index.step)) staged_scalars[name] = it->second;
    }
    for (const auto& [name, v] : index.scalars) {
      MP_CHECK_INPUT(state.scalars.count(name) > 0,
                     "checkpoint {}: scalar '{}' has no counterpart in the live state",
                     dir.string(), name);
    }
  });
  if (cache) stats.files_opened = cache->names();
  cache.reset();
  agree(comms, error, "load");

  // Commit: every rank staged everything.
  for (size_t i = 0; i < state.entries.size(); ++i) {
    if (staged[i].defined() && staged[i].numel().value > 0) {
      state.entries[i].local.copy_from(staged[i]);
    }
  }
  for (const auto& [name, v] : staged_scalars) state.scalars[name] = v;
  return stats;
}

}  // namespace meshproof::engine
