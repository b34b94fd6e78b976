#include "engine/checkpoint.h"

#include <H5Cpp.h>
#include <fcntl.h>
#include <unistd.h>
#include <xxhash.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <exception>
#include <fstream>
#include <mutex>
#include <nlohmann/json.hpp>
#include <regex>
#include <set>
#include <sstream>

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

bool starts_with(std::string_view s, std::string_view p) { return s.substr(0, p.size()) == p; }
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

void fsync_path(const fs::path& p) {
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  MP_CHECK(fd >= 0, "opening {} to fsync it: {}", p.string(), std::strerror(errno));
  const int rc = ::fsync(fd);
  const int saved = errno;
  ::close(fd);
  MP_CHECK(rc == 0, "fsync {}: {}", p.string(), std::strerror(saved));
}

void write_text_file(const fs::path& p, const std::string& text) {
  {
    std::ofstream f(p, std::ios::binary | std::ios::trunc);
    MP_CHECK(f.good(), "cannot create {}", p.string());
    f << text;
    f.close();
    MP_CHECK(!f.fail(), "writing {} failed", p.string());
  }
  fsync_path(p);
}

json read_json_file(const fs::path& p, std::string_view what) {
  std::ifstream f(p, std::ios::binary);
  MP_CHECK_INPUT(f.good(), "{} {} is missing", what, p.string());
  std::stringstream ss;
  ss << f.rdbuf();
  try {
    return json::parse(ss.str());
  } catch (const json::exception& e) {
    MP_FAIL_INPUT("{} {} is not valid JSON: {}", what, p.string(), e.what());
  }
}

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

mesh::Placement placement_from_json(const json& j) {
  const std::string kind = j.at("kind").get<std::string>();
  if (kind == "replicate") return mesh::Placement::replicate();
  if (kind == "shard") return mesh::Placement::shard(j.at("dim").get<int>());
  if (kind == "strided_shard") {
    return mesh::Placement::strided_shard(j.at("dim").get<int>(), j.at("split_factor").get<int>());
  }
  MP_FAIL_INPUT("unknown placement kind '{}'", kind);
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

json index_to_json(const CheckpointIndex& index) {
  json j;
  j["format"] = "meshproof-checkpoint";
  j["format_version"] = index.format_version;
  j["meshproof_version"] = index.meshproof_version;
  j["git_commit"] = index.git_commit;
  j["step"] = index.step;
  j["scenario_hash"] = index.scenario_hash;
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
  return j;
}

// Input error naming `where` unless the chunks of `k` tile its global shape exactly once.
void check_tiling(const KeyRecord& k, std::string_view where) {
  const mesh::Box whole = mesh::Box::whole(k.shape);
  int64_t covered = 0;
  for (size_t i = 0; i < k.chunks.size(); ++i) {
    const mesh::Box& b = k.chunks[i].box;
    MP_CHECK_INPUT(b.rank() == k.shape.rank() && whole.contains(b),
                   "{}: key '{}' chunk {} box {} lies outside the global shape {}", where, k.key,
                   k.chunks[i].dataset, b.str(), k.shape.str());
    for (size_t m = 0; m < i; ++m) {
      MP_CHECK_INPUT(k.chunks[m].box.intersect(b).empty(), "{}: key '{}' chunks {} and {} overlap",
                     where, k.key, k.chunks[m].box.str(), b.str());
    }
    covered += b.numel().value;
  }
  MP_CHECK_INPUT(covered == whole.numel().value,
                 "{}: key '{}' chunks cover {} of its {} elements (shape {})", where, k.key,
                 covered, whole.numel().value, k.shape.str());
}

// Agreement step of a collective save/load: every rank reports whether its phase failed; when
// any did, every rank throws (the failing rank its own error, the others the message of the lowest
// failing rank, broadcast to them), so no rank moves on alone and every process can tell the user
// the cause. Error kinds travel as 1 = input, 2 = runtime (MAX-reduced).
void agree(mesh::RankComms& comms, std::exception_ptr error, std::string_view phase) {
  float code = 0.0f;
  std::string message;
  if (error) {
    code = 2.0f;
    try {
      std::rethrow_exception(error);
    } catch (const kernels::Error& e) {
      if (e.kind() == ErrorKind::kInput) code = 1.0f;
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
  // [kind code, n - index of a failing rank]: MAX gives the worst kind and the lowest failing rank.
  Tensor flags = Tensor::from_vector<float>(
      Shape{2}, {code, error ? static_cast<float>(n - world.rank()) : 0.0f});
  if (!device.is_cpu()) flags = flags.to(device);
  world.all_reduce(flags, mesh::ReduceOp::kMax);
  const std::vector<float> got = flags.to_vector<float>();
  if (got[0] == 0.0f) return;
  const int root = n - static_cast<int>(got[1]);
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
  if (got[0] == 1.0f) {
    MP_FAIL_INPUT("checkpoint {} failed on rank {}: {}", phase, world.ranks()[root], root_message);
  }
  MP_FAIL("checkpoint {} failed on rank {}: {}", phase, world.ranks()[root], root_message);
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

// Rounds fp32 values through bf16 (round to nearest even) in place: the scale_inv_saved_bf16 fault.
void round_through_bf16(Tensor& t) {
  float* p = t.data<float>();
  for (int64_t i = 0; i < t.numel().value; ++i) {
    p[i] = kernels::fmt8::bf16_to_float(kernels::fmt8::float_to_bf16(p[i]));
  }
}

bool is_fp8_state_key(std::string_view key) { return starts_with(key, "fp8/"); }

// Whether the optimizer_state_not_restored fault skips `key` (tensor or scalar).
bool optimizer_fault_skips(const FaultInjection& f, std::string_view key) {
  if (!starts_with(key, "optim/")) return false;
  const std::string& part = f.optimizer_state_part;
  if (part == "all") return true;
  if (part == "exp_avg") return ends_with(key, "/exp_avg");
  if (part == "exp_avg_sq") return ends_with(key, "/exp_avg_sq");
  if (part == "step") return key == "optim/step";
  MP_FAIL_INPUT(
      "fault optimizer_state_not_restored: unknown part '{}' (all, exp_avg, exp_avg_sq, "
      "step)",
      part);
}

bool load_skips(const FaultInjection& f, int64_t step, std::string_view key) {
  if (!f.active(step)) return false;
  if (f.data_cursor_not_restored && key == "data/cursor") return true;
  if (f.optimizer_state_not_restored && optimizer_fault_skips(f, key)) return true;
  return false;
}

void check_live_state(const ShardedState& state, const mesh::RankComms& comms) {
  std::set<std::string> seen;
  for (const StateEntry& e : state.entries) {
    MP_CHECK_INPUT(!e.key.empty(), "checkpoint: a state entry has an empty key");
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
}

// Opened rank files of one load/verify, reused across chunks.
class FileCache {
 public:
  explicit FileCache(fs::path dir) : dir_(std::move(dir)) {}
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
    const fs::path p = dir_ / name;
    MP_CHECK_INPUT(fs::exists(p), "checkpoint {}: rank file {} is missing", dir_.string(),
                   p.string());
    H5::H5File f = MP_HDF5(kInput, H5::H5File(p.string(), H5F_ACC_RDONLY),
                           "opening checkpoint rank file {} (truncated or corrupt?)", p.string());
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
  std::map<std::string, H5::H5File> files_;
};

Tensor read_chunk_cached(FileCache& cache, const KeyRecord& key, const ChunkRecord& chunk,
                         bool verify) {
  const Shape shape = chunk.box.shape();
  Tensor out = Tensor::empty(shape, key.dtype, kernels::Device::cpu());
  const fs::path file = cache.dir() / chunk.file;
  {
    std::lock_guard<std::mutex> lock(hdf5_mutex());
    H5::H5File& f = cache.open(chunk.file);
    H5::DataSet ds =
        MP_HDF5(kInput, f.openDataSet(chunk.dataset), "checkpoint key '{}': dataset {} in {}",
                key.key, chunk.dataset, file.string());
    std::string stored_dtype;
    auto read_dtype_attr = [&] {
      H5::Attribute a = ds.openAttribute("dtype");
      a.read(a.getStrType(), stored_dtype);
      return 0;
    };
    MP_HDF5(kInput, read_dtype_attr(), "checkpoint key '{}': `dtype` attribute of {} in {}",
            key.key, chunk.dataset, file.string());
    MP_CHECK_INPUT(stored_dtype == kernels::dtype_name(key.dtype),
                   "checkpoint key '{}': dataset {} in {} holds dtype {}, the index says {}",
                   key.key, chunk.dataset, file.string(), stored_dtype,
                   kernels::dtype_name(key.dtype));
    H5::DataSpace space = ds.getSpace();
    const int nd = space.getSimpleExtentNdims();
    std::vector<hsize_t> dims(static_cast<size_t>(std::max(nd, 0)));
    if (nd > 0) space.getSimpleExtentDims(dims.data());
    std::vector<int64_t> got(dims.begin(), dims.end());
    MP_CHECK_INPUT(got == shape.dims(),
                   "checkpoint key '{}': dataset {} in {} has shape {}, the index says {}", key.key,
                   chunk.dataset, file.string(), Shape(got).str(), shape.str());
    if (out.numel().value > 0) {
      MP_HDF5(kInput, ds.read(out.raw_data(), storage_type(key.dtype, key.key)),
              "checkpoint key '{}': reading dataset {} from {} (truncated or corrupt?)", key.key,
              chunk.dataset, file.string());
    }
  }
  if (verify) {
    const uint64_t h = tensor_xxh64(out);
    MP_CHECK_INPUT(h == chunk.xxh64,
                   "checkpoint key '{}': checksum mismatch in dataset {} of {} (xxh64 {}, the "
                   "index records {})",
                   key.key, chunk.dataset, file.string(), hash_hex(h), hash_hex(chunk.xxh64));
  }
  return out;
}

void check_file_sizes(const fs::path& dir, const CheckpointIndex& index) {
  for (size_t i = 0; i < index.files.size(); ++i) {
    const fs::path p = dir / index.files[i];
    if (!fs::exists(p)) continue;  // named when a chunk of it is read
    const auto size = static_cast<int64_t>(fs::file_size(p));
    const int64_t expected = index.file_bytes[i];
    MP_CHECK_INPUT(size == expected,
                   "checkpoint {}: rank file {} has {} bytes, the index records {} (truncated or "
                   "overwritten?)",
                   dir.string(), p.string(), size, expected);
  }
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

uint64_t tensor_xxh64(const Tensor& t) {
  const Tensor host = to_host(t);
  return XXH64(host.raw_data(), static_cast<size_t>(host.nbytes().value), 0);
}

std::vector<fs::path> list_checkpoints(const fs::path& root) {
  std::vector<std::pair<int64_t, fs::path>> found;
  if (!fs::is_directory(root)) return {};
  static const std::regex re("step_([0-9]{7,})");
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
  const FaultInjection& faults = options.faults;
  const bool drop_fp8 = faults.fp8_state_dropped_from_checkpoint && faults.active(step);
  const bool bf16_scales = faults.scale_inv_saved_bf16 && faults.active(step);

  // Phase 1 (rank 0): prepare the partial directory; stale partial directories are removed.
  agree(comms, capture([&] {
          MP_CHECK_INPUT(step >= 0, "checkpoint step {} is negative", step);
          check_live_state(state, comms);
          if (rank != 0) return;
          std::error_code ec;
          fs::create_directories(root, ec);
          MP_CHECK(!ec, "cannot create checkpoint root {}: {}", root.string(), ec.message());
          MP_CHECK_INPUT(!fs::exists(final_dir),
                         "checkpoint {} already exists; a complete checkpoint is never "
                         "overwritten",
                         final_dir.string());
          for (const auto& d : fs::directory_iterator(root)) {
            if (d.is_directory() && ends_with(d.path().filename().string(), kPartialSuffix)) {
              fs::remove_all(d.path(), ec);
              MP_CHECK(!ec, "cannot remove stale {}: {}", d.path().string(), ec.message());
            }
          }
          fs::create_directory(partial, ec);
          MP_CHECK(!ec, "cannot create {}: {}", partial.string(), ec.message());
        }),
        "save (prepare)");

  // Phase 2 (every rank): write the chunks this rank is the designated writer of, then a sidecar
  // with their records for rank 0.
  agree(
      comms, capture([&] {
        const std::string file_name = rank_file_name(rank);
        const fs::path file_path = partial / file_name;
        json records = json::array();
        std::vector<std::pair<std::string, Tensor>> to_write;  // dataset, host data
        for (const StateEntry& e : state.entries) {
          if (drop_fp8 && is_fp8_state_key(e.key)) continue;
          for (const mesh::Chunk& c : e.layout.chunks()) {
            if (c.owner != rank) continue;
            Tensor host = to_host(e.local);
            if (bf16_scales && e.local.dtype() == DType::kFloat32 &&
                (ends_with(e.key, "/scale") || ends_with(e.key, "/scale_inv"))) {
              host = host.clone();
              round_through_bf16(host);
            }
            const std::string dataset = "/" + e.key;
            records.push_back({{"key", e.key},
                               {"dataset", dataset},
                               {"offset", elems(c.box.offset)},
                               {"extent", elems(c.box.extent)},
                               {"xxh64", hash_hex(tensor_xxh64(host))}});
            to_write.emplace_back(dataset, host);
          }
        }
        {
          std::lock_guard<std::mutex> lock(hdf5_mutex());
          kernels::silence_hdf5_errors();
          H5::H5File f = MP_HDF5(kRuntime, H5::H5File(file_path.string(), H5F_ACC_TRUNC),
                                 "creating checkpoint rank file {}", file_path.string());
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
              ds.createAttribute("dtype", str_type, H5::DataSpace(H5S_SCALAR)).write(str_type, dt);
              H5::StrType key_type(H5::PredType::C_S1, key.size());
              ds.createAttribute("key", key_type, H5::DataSpace(H5S_SCALAR)).write(key_type, key);
              const std::vector<int64_t> off = rec.at("offset").get<std::vector<int64_t>>();
              const hsize_t n = off.size();
              H5::DataSpace off_space = n == 0 ? H5::DataSpace(H5S_SCALAR) : H5::DataSpace(1, &n);
              if (n > 0) {
                ds.createAttribute("global_offset", H5::PredType::NATIVE_INT64, off_space)
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
          MP_HDF5(kRuntime, (f.close(), 0), "closing checkpoint rank file {}", file_path.string());
        }
        fsync_path(file_path);
        json side = {{"rank", rank}, {"file", file_name}, {"chunks", records}};
        side["keys"] = json::array();
        for (const StateEntry& e : state.entries) side["keys"].push_back(e.key);
        side["scalars"] = state.scalars;
        write_text_file(partial / sidecar_name(rank), side.dump());
        if (options.fault_hook) options.fault_hook(SavePoint::kRankFileWritten, rank, -1);
      }),
      "save (rank files)");

  // Phase 3 (rank 0): assemble and write the index last, then commit by renaming.
  agree(comms, capture([&] {
          if (rank != 0) return;
          CheckpointIndex index;
          index.step = step;
          index.mesh = comms.mesh();
          index.scenario_hash = options.scenario_hash;
          index.meshproof_version = std::string(kernels::version());
          index.git_commit = std::string(kernels::git_commit());
          index.scalars = state.scalars;
          std::vector<std::string> key_names;
          for (const StateEntry& e : state.entries) {
            key_names.push_back(e.key);
            if (drop_fp8 && is_fp8_state_key(e.key)) continue;
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
          for (const auto& [name, k] : index.keys) check_tiling(k, "checkpoint save");
          if (options.fault_hook) options.fault_hook(SavePoint::kBeforeIndex, rank, -1);
          write_text_file(partial / kIndexName, index_to_json(index).dump(1));
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
  return final_dir;
}

CheckpointIndex read_checkpoint_index(const fs::path& dir, bool check_file_sizes_too) {
  MP_CHECK_INPUT(!ends_with(dir.filename().string(), kPartialSuffix),
                 "checkpoint {} is an incomplete (.partial) save and cannot be loaded",
                 dir.string());
  MP_CHECK_INPUT(fs::is_directory(dir), "checkpoint directory {} does not exist", dir.string());
  const fs::path index_path = dir / kIndexName;
  MP_CHECK_INPUT(fs::exists(index_path),
                 "checkpoint {} has no {} (an incomplete save, or not a checkpoint)", dir.string(),
                 kIndexName);
  const json j = read_json_file(index_path, "checkpoint index");
  CheckpointIndex index;
  try {
    MP_CHECK_INPUT(j.at("format").get<std::string>() == "meshproof-checkpoint",
                   "{}: not a meshproof checkpoint index", index_path.string());
    index.format_version = j.at("format_version").get<int>();
    MP_CHECK_INPUT(index.format_version == kCheckpointFormatVersion,
                   "{}: format_version {} (this build reads {})", index_path.string(),
                   index.format_version, kCheckpointFormatVersion);
    index.step = j.at("step").get<int64_t>();
    index.scenario_hash = j.at("scenario_hash").get<std::string>();
    index.meshproof_version = j.at("meshproof_version").get<std::string>();
    index.git_commit = j.at("git_commit").get<std::string>();
    const json& m = j.at("mesh");
    index.mesh = mesh::DeviceMesh(m.at("dp_replicate").get<int>(), m.at("dp_shard").get<int>(),
                                  m.at("tp").get<int>());
    for (const json& f : j.at("files")) {
      index.files.push_back(f.at("name").get<std::string>());
      index.file_bytes.push_back(f.at("bytes").get<int64_t>());
    }
    index.scalars = j.at("scalars").get<decltype(index.scalars)>();
    for (const auto& [name, kj] : j.at("keys").items()) {
      KeyRecord k;
      k.key = name;
      k.shape = Shape(kj.at("shape").get<std::vector<int64_t>>());
      k.dtype = kernels::parse_dtype(kj.at("dtype").get<std::string>(),
                                     fmt::format("{} key '{}' dtype", index_path.string(), name));
      for (const json& p : kj.at("placements")) k.placements.push_back(placement_from_json(p));
      for (const json& c : kj.at("chunks")) {
        ChunkRecord rec;
        rec.file = c.at("file").get<std::string>();
        rec.dataset = c.at("dataset").get<std::string>();
        rec.box.offset = to_elems(c.at("offset").get<std::vector<int64_t>>());
        rec.box.extent = to_elems(c.at("extent").get<std::vector<int64_t>>());
        MP_CHECK_INPUT(rec.box.offset.size() == rec.box.extent.size(),
                       "{}: key '{}' chunk {} has offset and extent of different ranks",
                       index_path.string(), name, rec.dataset);
        rec.xxh64 = std::stoull(c.at("xxh64").get<std::string>(), nullptr, 16);
        k.chunks.push_back(std::move(rec));
      }
      check_tiling(k, index_path.string());
      index.keys.emplace(name, std::move(k));
    }
  } catch (const json::exception& e) {
    MP_FAIL_INPUT("{}: malformed checkpoint index: {}", index_path.string(), e.what());
  } catch (const std::invalid_argument& e) {
    MP_FAIL_INPUT("{}: malformed checksum in checkpoint index: {}", index_path.string(), e.what());
  }
  if (check_file_sizes_too) check_file_sizes(dir, index);
  return index;
}

Tensor read_chunk(const fs::path& dir, const KeyRecord& key, const ChunkRecord& chunk,
                  bool verify) {
  FileCache cache(dir);
  return read_chunk_cached(cache, key, chunk, verify);
}

Tensor read_global(const fs::path& dir, const KeyRecord& key) {
  Tensor global = Tensor::zeros(key.shape, key.dtype, kernels::Device::cpu());
  const mesh::Box whole = mesh::Box::whole(key.shape);
  FileCache cache(dir);
  for (const ChunkRecord& c : key.chunks) {
    Tensor t = read_chunk_cached(cache, key, c, /*verify=*/true);
    mesh::copy_region(t, c.box, global, whole, c.box);
  }
  return global;
}

LoadStats load_checkpoint(const fs::path& dir, ShardedState& state, mesh::RankComms& comms,
                          const CheckpointOptions& options) {
  const int rank = comms.rank();
  LoadStats stats;
  CheckpointIndex index;
  std::vector<Tensor> staged(state.entries.size());  // undefined: keep the live tensor
  std::map<std::string, int64_t> staged_scalars;
  FileCache cache(dir);

  // Stage everything: read, verify and assemble into buffers; the live state is untouched.
  std::exception_ptr error = capture([&] {
    check_live_state(state, comms);
    {
      std::lock_guard<std::mutex> lock(hdf5_mutex());
      kernels::silence_hdf5_errors();
    }
    index = read_checkpoint_index(dir);
    const FaultInjection& faults = options.faults;
    const bool fp8_may_be_missing =
        faults.fp8_state_dropped_from_checkpoint && faults.active(index.step);
    std::set<std::string> live_keys;
    for (size_t i = 0; i < state.entries.size(); ++i) {
      const StateEntry& e = state.entries[i];
      live_keys.insert(e.key);
      auto it = index.keys.find(e.key);
      if (it == index.keys.end()) {
        MP_CHECK_INPUT(fp8_may_be_missing && is_fp8_state_key(e.key),
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
      if (load_skips(faults, index.step, e.key)) continue;
      const mesh::Box target = e.layout.box(rank);
      Tensor buf = Tensor::empty(target.shape(), k.dtype, kernels::Device::cpu());
      int64_t covered = 0;
      for (const ChunkRecord& c : k.chunks) {
        const mesh::Box region = c.box.intersect(target);
        if (region.empty()) continue;
        Tensor chunk = read_chunk_cached(cache, k, c, /*verify=*/true);
        ++stats.chunks_read;
        stats.bytes_read += chunk.nbytes();
        mesh::copy_region(chunk, c.box, buf, target, region);
        covered += region.numel().value;
      }
      MP_CHECK(covered == target.numel().value,
               "checkpoint {}: key '{}' chunks cover {} of rank {}'s {} elements", dir.string(),
               e.key, covered, rank, target.numel().value);
      staged[i] = buf;
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
      if (!load_skips(faults, index.step, name)) staged_scalars[name] = it->second;
    }
    for (const auto& [name, v] : index.scalars) {
      MP_CHECK_INPUT(state.scalars.count(name) > 0,
                     "checkpoint {}: scalar '{}' has no counterpart in the live state",
                     dir.string(), name);
    }
  });
  stats.files_opened = cache.names();
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
