#include "kernels/tensor.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdlib>
#include <cstring>
#include <unordered_map>
#include <vector>

#include "kernels/cuda_check.h"

namespace meshproof::kernels {

namespace {

#if defined(__SANITIZE_ADDRESS__)
#define MESHPROOF_HOST_BLOCK_CACHE 0
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define MESHPROOF_HOST_BLOCK_CACHE 0
#endif
#endif
#ifndef MESHPROOF_HOST_BLOCK_CACHE
#define MESHPROOF_HOST_BLOCK_CACHE 1
#endif

// Per-thread cache of freed host blocks by exact (64-byte rounded) size (docs/design.md section
// 21). A training step allocates and frees the same activation and gradient shapes every step and
// every virtual rank is a thread: reusing the thread's own freed blocks takes malloc's arena locks,
// chunk consolidation, heap trimming and the page faults of re-mapped memory out of the step. It
// caches blocks up to kMaxBlock bytes and at most kMaxCached bytes per thread (the rest go back to
// malloc); the memory tracker counts tensors, not the cache, so every reported figure is
// unchanged. Off under AddressSanitizer, which must see every free to catch a use after it.
class HostBlockCache {
 public:
  static constexpr size_t kMaxBlock = size_t{8} << 20;    // 8 MiB
  static constexpr size_t kMaxCached = size_t{32} << 20;  // 32 MiB per thread

  ~HostBlockCache() {
    alive_ = false;
    for (auto& [size, blocks] : free_)
      for (void* p : blocks) std::free(p);
  }

  // A block of `bytes` (a multiple of 64), from the cache when it holds one of that size.
  static void* take(size_t bytes) {
    if (MESHPROOF_HOST_BLOCK_CACHE && alive_ && bytes <= kMaxBlock) {
      HostBlockCache& c = instance();
      const auto it = c.free_.find(bytes);
      if (it != c.free_.end() && !it->second.empty()) {
        void* p = it->second.back();
        it->second.pop_back();
        c.cached_ -= bytes;
        ++c.hits_;
        return p;
      }
    }
    return std::aligned_alloc(64, bytes);
  }

  static void give(void* p, size_t bytes) {
    if (MESHPROOF_HOST_BLOCK_CACHE && alive_ && bytes <= kMaxBlock) {
      HostBlockCache& c = instance();
      if (c.cached_ + bytes <= kMaxCached) {
        c.free_[bytes].push_back(p);
        c.cached_ += bytes;
        return;
      }
    }
    std::free(p);
  }

  static HostBlockCache& instance() {
    thread_local HostBlockCache c;
    return c;
  }

  size_t cached() const { return cached_; }
  int64_t hits() const { return hits_; }

 private:
  // False once this thread's cache is destroyed (thread exit): later frees go to malloc.
  static thread_local bool alive_;
  std::unordered_map<size_t, std::vector<void*>> free_;
  size_t cached_ = 0;
  int64_t hits_ = 0;
};
thread_local bool HostBlockCache::alive_ = true;

}  // namespace

namespace detail {
HostBlockCacheStats host_block_cache_stats() {
  const HostBlockCache& c = HostBlockCache::instance();
  return {MESHPROOF_HOST_BLOCK_CACHE != 0, static_cast<int64_t>(c.cached()), c.hits(),
          static_cast<int64_t>(HostBlockCache::kMaxBlock),
          static_cast<int64_t>(HostBlockCache::kMaxCached)};
}
}  // namespace detail

Elements Shape::numel() const {
  int64_t n = 1;
  for (int64_t d : dims_) n *= d;
  return Elements(n);
}

int64_t Shape::leading() const {
  int64_t n = 1;
  for (size_t i = 0; i + 1 < dims_.size(); ++i) n *= dims_[i];
  return n;
}

std::string Shape::str() const { return fmt::format("[{}]", fmt::join(dims_, ", ")); }

// Owns one allocation; frees it and un-accounts it from the allocating rank's tracker.
class Storage {
 public:
  Storage(Device device, Bytes size) : device_(device), size_(size) {
    tracker_ = current_context().memory;
    // Allocate at least one byte so that empty tensors still have a distinct, valid pointer.
    const size_t n = static_cast<size_t>(std::max<int64_t>(size.value, 1));
    if (device.is_cpu()) {
      // 64-byte alignment: vector loads and HDF5/MPI transfers never straddle a cache line start.
      ptr_ = HostBlockCache::take((n + 63) / 64 * 64);
      MP_CHECK(ptr_ != nullptr, "host allocation of {} bytes failed", n);
    } else {
#if MESHPROOF_HAVE_CUDA
      stream_ = current_context().stream;
      MP_CUDA_CHECK(cudaMallocAsync(&ptr_, n, static_cast<cudaStream_t>(stream_)));
#else
      MP_FAIL("allocation on {} requested but meshproof was built without CUDA", device.str());
#endif
    }
    if (tracker_ != nullptr) tracker_->on_alloc(device_, size_);
  }

  ~Storage() {
    if (tracker_ != nullptr) tracker_->on_free(device_, size_);
    if (device_.is_cpu()) {
      const size_t n = static_cast<size_t>(std::max<int64_t>(size_.value, 1));
      HostBlockCache::give(ptr_, (n + 63) / 64 * 64);
    } else {
#if MESHPROOF_HAVE_CUDA
      // Stream-ordered free on the allocating rank's stream; errors here cannot be thrown.
      cudaFreeAsync(ptr_, static_cast<cudaStream_t>(stream_));
#endif
    }
  }

  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;

  void* ptr() const { return ptr_; }
  Device device() const { return device_; }
  Bytes size() const { return size_; }

 private:
  Device device_;
  Bytes size_;
  void* ptr_ = nullptr;
  void* stream_ = nullptr;
  MemoryTracker* tracker_ = nullptr;
};

Tensor Tensor::empty(const Shape& shape, DType dtype, Device device) {
  for (int64_t d : shape.dims()) MP_CHECK(d >= 0, "negative dimension in shape {}", shape.str());
  Tensor t;
  t.storage_ = std::make_shared<Storage>(device, storage_bytes(dtype, shape.numel()));
  t.dtype_ = dtype;
  t.shape_ = shape;
  return t;
}

Tensor Tensor::zeros(const Shape& shape, DType dtype, Device device) {
  Tensor t = empty(shape, dtype, device);
  t.zero_();
  return t;
}

Device Tensor::device() const {
  MP_CHECK(defined(), "device() of an undefined tensor");
  return storage_->device();
}

void* Tensor::raw_data() {
  MP_CHECK(defined(), "data access on an undefined tensor");
  return static_cast<char*>(storage_->ptr()) + byte_offset_;
}

const void* Tensor::raw_data() const {
  MP_CHECK(defined(), "data access on an undefined tensor");
  return static_cast<const char*>(storage_->ptr()) + byte_offset_;
}

void Tensor::check_dtype(DType expected) const {
  MP_CHECK(dtype_ == expected, "tensor is {} but was accessed as {}", describe(),
           dtype_name(expected));
}

Tensor Tensor::view(const Shape& shape) const {
  MP_CHECK(shape.numel() == numel(), "view {} of {}: element counts differ", shape.str(),
           describe());
  Tensor t = *this;
  t.shape_ = shape;
  return t;
}

Tensor Tensor::slice_rows(int64_t begin, int64_t end) const {
  MP_CHECK(shape_.rank() >= 1 && 0 <= begin && begin <= end && end <= shape_[0],
           "slice_rows({}, {}) of {}", begin, end, describe());
  const int64_t row_elems = shape_[0] == 0 ? 0 : numel().value / shape_[0];
  MP_CHECK((row_elems * dtype_bits(dtype_)) % 8 == 0, "slice_rows of {} splits a byte", describe());
  Tensor t = *this;
  std::vector<int64_t> dims = shape_.dims();
  dims[0] = end - begin;
  t.shape_ = Shape(dims);
  t.byte_offset_ += storage_bytes(dtype_, Elements(begin * row_elems)).value;
  return t;
}

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, Bytes n) {
  if (n.value == 0) return;
  if (dst_device.is_cpu() && src_device.is_cpu()) {
    std::memcpy(dst, src, static_cast<size_t>(n.value));
    return;
  }
#if MESHPROOF_HAVE_CUDA
  auto stream = static_cast<cudaStream_t>(current_context().stream);
  MP_CUDA_CHECK(cudaMemcpyAsync(dst, src, static_cast<size_t>(n.value), cudaMemcpyDefault, stream));
  if (dst_device.is_cpu() || src_device.is_cpu()) MP_CUDA_CHECK(cudaStreamSynchronize(stream));
#else
  MP_FAIL("copy between {} and {} needs CUDA, which this build does not have", dst_device.str(),
          src_device.str());
#endif
}

Tensor Tensor::to(Device device) const {
  Tensor t = empty(shape_, dtype_, device);
  copy_bytes(t.raw_data(), device, raw_data(), this->device(), nbytes());
  return t;
}

void Tensor::copy_from(const Tensor& src) {
  MP_CHECK(src.dtype_ == dtype_ && src.numel() == numel(), "copy_from {} into {}", src.describe(),
           describe());
  copy_bytes(raw_data(), device(), src.raw_data(), src.device(), nbytes());
}

void Tensor::zero_() {
  if (device().is_cpu()) {
    std::memset(raw_data(), 0, static_cast<size_t>(nbytes().value));
    return;
  }
#if MESHPROOF_HAVE_CUDA
  MP_CUDA_CHECK(cudaMemsetAsync(raw_data(), 0, static_cast<size_t>(nbytes().value),
                                static_cast<cudaStream_t>(current_context().stream)));
#endif
}

std::string Tensor::describe() const {
  if (!defined()) return "undefined tensor";
  return fmt::format("{}{} on {}", dtype_name(dtype_), shape_.str(), device().str());
}

}  // namespace meshproof::kernels
