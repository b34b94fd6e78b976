// cuBLASLt resources (docs/design.md section 31): one handle and one workspace per stream, their
// lifetime ended by release_stream_resources before the stream is destroyed, the bytes they hold
// per device for memory accounting, and the process-wide cache of the algorithm the heuristic
// chose per problem. The bookkeeping (StreamResourceTable, AlgoCache) is host-only and tested on
// the CPU; the CUDA calls that fill and empty it are in gemm_cublaslt.cc.
#pragma once

#include <array>
#include <cstdint>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "kernels/core/device.h"
#include "kernels/gemm/cublaslt_plan.h"

namespace meshproof::kernels {

// Bytes of cuBLASLt workspace currently held for streams on `device` (0 on the CPU and in a build
// without CUDA): what the per-rank memory figures add for the GEMM library.
int64_t cublaslt_reserved_bytes(Device device);

// Destroys the cuBLASLt handle and frees the workspace made for `stream` (a cudaStream_t; nothing
// when none was made). Call it before cudaStreamDestroy(stream): the workspace is freed after the
// stream's queued work (a stream synchronisation first). Never throws (it runs on error paths and
// in destructors); a CUDA failure while releasing is reported on stderr and the entry is dropped.
void release_stream_resources(void* stream) noexcept;

// cublasLtGetVersion() of the library (major*10000 + minor*100 + patch), opening it if this
// process has not yet (kernels/gemm/cublaslt_api.h); 0 in a build without CUDA or when it cannot be
// opened. Needs no device.
int cublaslt_runtime_version();

// The algorithm cache's counters since process start (every GEMM that reached cuBLASLt counts one
// hit or one miss; a miss ran the heuristic once for a new key).
struct LtAlgoCacheStats {
  int64_t hits = 0;
  int64_t misses = 0;
  int64_t entries = 0;
};
LtAlgoCacheStats cublaslt_algo_cache_stats();

// Number of streams holding cuBLASLt resources now (for the release tests).
int64_t cublaslt_stream_count();

namespace lt {

// One stream's resources: `handle` is a cublasLtHandle_t, `workspace` a device allocation of
// `bytes` bytes on `device`.
struct StreamResources {
  int device = 0;
  void* stream = nullptr;
  void* handle = nullptr;
  void* workspace = nullptr;
  int64_t bytes = 0;
};

// Per-(device, stream) entries; not thread-safe by itself (the CUDA side locks around it).
class StreamResourceTable {
 public:
  StreamResources* find(int device, void* stream);
  // Adds an entry; an internal error when (device, stream) already has one.
  StreamResources& insert(const StreamResources& r);
  // Removes and returns every entry of `stream` (the null stream has one per device).
  std::vector<StreamResources> take(void* stream);
  int64_t bytes(int device) const;
  size_t size() const { return entries_.size(); }

 private:
  std::vector<StreamResources> entries_;  // a handful: one per rank stream
};

// The chosen algorithm (cublasLtMatmulAlgo_t's 64 opaque bytes) per AlgoKey. Thread-safe.
using AlgoBlob = std::array<uint64_t, 8>;
class AlgoCache {
 public:
  // The cached algorithm of `key` (a hit), or nullopt (a miss: the caller runs the heuristic and
  // stores its answer).
  std::optional<AlgoBlob> find(const AlgoKey& key);
  void store(const AlgoKey& key, const AlgoBlob& algo);
  LtAlgoCacheStats stats() const;

 private:
  mutable std::mutex mu_;
  std::unordered_map<AlgoKey, AlgoBlob, AlgoKeyHash> map_;
  int64_t hits_ = 0;
  int64_t misses_ = 0;
};

}  // namespace lt
}  // namespace meshproof::kernels
