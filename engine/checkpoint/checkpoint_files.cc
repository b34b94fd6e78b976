// Checkpoint rank files (engine/checkpoint/checkpoint_files.h): HDF5 storage, POSIX writes, chunk
// reads.
#include "engine/checkpoint/checkpoint_files.h"

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

#include "engine/checkpoint/checkpoint.h"
#include "engine/faults/fault_hooks.h"
#include "kernels/core/build_info.h"
#include "kernels/core/error.h"
#include "kernels/core/formats.h"
#include "kernels/core/hdf5_check.h"
#include "kernels/core/runtime.h"

namespace meshproof::engine {
namespace ckpt_detail {

std::mutex& hdf5_mutex() {
  static std::mutex m;
  return m;
}

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

}  // namespace ckpt_detail

using namespace ckpt_detail;  // NOLINT(google-build-using-namespace): the module's helpers

uint64_t chunk_xxh64(uint64_t checkpoint_id, std::string_view key, DType dtype,
                     const mesh::Box& box, const Tensor& data) {
  const Tensor host = data.on(kernels::Device::cpu());
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

}  // namespace meshproof::engine
