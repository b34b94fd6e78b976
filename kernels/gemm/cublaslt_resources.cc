// Host bookkeeping of the cuBLASLt resources (kernels/gemm/cublaslt_resources.h); the entry points
// that touch CUDA are defined in gemm_cublaslt.cc, or below for a build without CUDA.
#include "kernels/gemm/cublaslt_resources.h"

#include <algorithm>

#include "kernels/core/error.h"

namespace meshproof::kernels {
namespace lt {

StreamResources* StreamResourceTable::find(int device, void* stream) {
  for (StreamResources& e : entries_) {
    if (e.device == device && e.stream == stream) return &e;
  }
  return nullptr;
}

StreamResources& StreamResourceTable::insert(const StreamResources& r) {
  MP_CHECK(find(r.device, r.stream) == nullptr,
           "cuBLASLt resources: stream {} on device {} already has a handle and workspace",
           r.stream, r.device);
  entries_.push_back(r);
  return entries_.back();
}

std::vector<StreamResources> StreamResourceTable::take(void* stream) {
  std::vector<StreamResources> out;
  auto keep =
      std::stable_partition(entries_.begin(), entries_.end(),
                            [stream](const StreamResources& e) { return e.stream != stream; });
  out.assign(keep, entries_.end());
  entries_.erase(keep, entries_.end());
  return out;
}

int64_t StreamResourceTable::bytes(int device) const {
  int64_t b = 0;
  for (const StreamResources& e : entries_) {
    if (e.device == device) b += e.bytes;
  }
  return b;
}

std::optional<AlgoBlob> AlgoCache::find(const AlgoKey& key) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = map_.find(key);
  if (it == map_.end()) {
    ++misses_;
    return std::nullopt;
  }
  ++hits_;
  return it->second;
}

void AlgoCache::store(const AlgoKey& key, const AlgoBlob& algo) {
  std::lock_guard<std::mutex> lock(mu_);
  map_.insert_or_assign(key, algo);
}

LtAlgoCacheStats AlgoCache::stats() const {
  std::lock_guard<std::mutex> lock(mu_);
  return LtAlgoCacheStats{hits_, misses_, static_cast<int64_t>(map_.size())};
}

}  // namespace lt

#if !MESHPROOF_HAVE_CUDA
int64_t cublaslt_reserved_bytes(Device) { return 0; }
void release_stream_resources(void*) noexcept {}
int cublaslt_runtime_version() { return 0; }
LtAlgoCacheStats cublaslt_algo_cache_stats() { return {}; }
int64_t cublaslt_stream_count() { return 0; }
#endif

}  // namespace meshproof::kernels
