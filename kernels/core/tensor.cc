#include "kernels/core/tensor.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cstdlib>
#include <cstring>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "kernels/core/copy_plan.h"
#include "kernels/core/cuda_check.h"

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
  static constexpr size_t kMaxBlock = size_t{64} << 20;    // 64 MiB
  static constexpr size_t kMaxCached = size_t{256} << 20;  // 256 MiB per thread

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

Shape Shape::with_dim(int d, int64_t extent) const {
  MP_CHECK(0 <= d && d < rank(), "dimension {} of a rank-{} shape", d, rank());
  Shape s = *this;
  s.dims_[static_cast<size_t>(d)] = extent;
  return s;
}

Elements Shape::numel() const {
  int64_t n = 1;
  for (int64_t d : dims()) n *= d;
  return Elements(n);
}

int64_t Shape::leading() const {
  int64_t n = 1;
  for (int i = 0; i + 1 < rank(); ++i) n *= dims_[static_cast<size_t>(i)];
  return n;
}

std::string Shape::str() const { return fmt::format("[{}]", fmt::join(dims(), ", ")); }

#if MESHPROOF_HAVE_CUDA
// Makes `index` the calling thread's current CUDA device for the guard's lifetime (a no-op when
// it already is). Throws only from the constructor; the destructor restores without throwing.
class DeviceGuard {
 public:
  explicit DeviceGuard(int index) {
    MP_CUDA_CHECK(cudaGetDevice(&saved_));
    if (saved_ != index) MP_CUDA_CHECK(cudaSetDevice(index));
    switched_ = saved_ != index;
  }
  ~DeviceGuard() {
    if (switched_) cudaSetDevice(saved_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int saved_ = 0;
  bool switched_ = false;
};

// The stream-ordered allocator returns freed memory to the OS at every synchronisation unless
// the pool's release threshold says to keep it; a training step synchronises (collectives,
// scalars), so each step would re-map its activations. The threshold is raised to "never
// trim" once per device, before its first allocation (the memory stays the process's pool).
void keep_pool_memory(int index) {
  constexpr int kMaxDevices = 64;
  static std::mutex mu;
  static bool done[kMaxDevices] = {};
  MP_CHECK(0 <= index && index < kMaxDevices, "CUDA device index {} outside [0, {})", index,
           kMaxDevices);
  std::lock_guard<std::mutex> lk(mu);
  if (done[index]) return;
  cudaMemPool_t pool = nullptr;
  MP_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, index));
  uint64_t threshold = UINT64_MAX;
  MP_CUDA_CHECK(cudaMemPoolSetAttribute(pool, cudaMemPoolAttrReleaseThreshold, &threshold));
  // Pool memory is not opened to other GPUs by cudaDeviceEnablePeerAccess. NCCL between GPUs of
  // one process (run_nccl_single_process) reads and writes peers' user buffers directly, so every
  // GPU that can reach this one gets read/write access to its pool.
  int count = 0;
  MP_CUDA_CHECK(cudaGetDeviceCount(&count));
  for (int peer = 0; peer < count; ++peer) {
    if (peer == index) continue;
    int can = 0;
    MP_CUDA_CHECK(cudaDeviceCanAccessPeer(&can, peer, index));
    if (can == 0) continue;
    cudaMemAccessDesc access{};
    access.location.type = cudaMemLocationTypeDevice;
    access.location.id = peer;
    access.flags = cudaMemAccessFlagsProtReadWrite;
    MP_CUDA_CHECK(cudaMemPoolSetAccess(pool, &access, 1));
  }
  done[index] = true;
}
#endif

// Owns one allocation; frees it and un-accounts it from the allocating rank's tracker. A device
// allocation is made on its own device (Device::index), on the rank's stream when the tensor is
// on the rank's device and on that device's legacy default stream otherwise; it is freed the
// same way.
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
      keep_pool_memory(device.index);
      const DeviceGuard guard(device.index);
      stream_ = current_context().device == device ? current_context().stream : nullptr;
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
      // Stream-ordered free on the allocating stream, on the allocation's device; errors here
      // cannot be thrown.
      int saved = 0;
      const bool switch_device = cudaGetDevice(&saved) == cudaSuccess && saved != device_.index &&
                                 cudaSetDevice(device_.index) == cudaSuccess;
      cudaFreeAsync(ptr_, static_cast<cudaStream_t>(stream_));
      if (switch_device) cudaSetDevice(saved);
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
  [[maybe_unused]] void* stream_ = nullptr;  // the allocation's stream (CUDA builds only)
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
  t.shape_ = shape_.with_dim(0, end - begin);
  t.byte_offset_ += storage_bytes(dtype_, Elements(begin * row_elems)).value;
  return t;
}

namespace detail {
void count_copy(Device dst_device, Device src_device, Bytes n) {
  if (n.value == 0 || dst_device.is_cpu() == src_device.is_cpu()) return;
  const bool to_device = src_device.is_cpu();
  global_copy_counter().add(to_device, n);
  if (CopyCounter* c = current_context().copies) c->add(to_device, n);
}
}  // namespace detail

void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, Bytes n) {
  if (n.value == 0) return;
  detail::count_copy(dst_device, src_device, n);
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

void copy_bytes_2d(void* dst, Device dst_device, int64_t dst_pitch, const void* src,
                   Device src_device, int64_t src_pitch, int64_t width, int64_t height) {
  MP_CHECK(width >= 0 && height >= 0 && dst_pitch >= width && src_pitch >= width,
           "copy_bytes_2d: {} rows of {} bytes with pitches {} (dst) and {} (src)", height, width,
           dst_pitch, src_pitch);
  if (width == 0 || height == 0) return;
  auto* d = static_cast<char*>(dst);
  const auto* s = static_cast<const char*>(src);
  // cudaMemcpy2DAsync takes pitches up to cudaDevAttrMaxPitch (2^31 - 1 on every current GPU):
  // larger pitches (and host-to-host copies) go row by row.
  constexpr int64_t kMaxPitch = (int64_t{1} << 31) - 1;
  if ((dst_device.is_cpu() && src_device.is_cpu()) || dst_pitch > kMaxPitch ||
      src_pitch > kMaxPitch) {
    for (int64_t r = 0; r < height; ++r)
      copy_bytes(d + r * dst_pitch, dst_device, s + r * src_pitch, src_device, Bytes(width));
    return;
  }
#if MESHPROOF_HAVE_CUDA
  detail::count_copy(dst_device, src_device, Bytes(width * height));
  auto stream = static_cast<cudaStream_t>(current_context().stream);
  MP_CUDA_CHECK(cudaMemcpy2DAsync(d, static_cast<size_t>(dst_pitch), s,
                                  static_cast<size_t>(src_pitch), static_cast<size_t>(width),
                                  static_cast<size_t>(height), cudaMemcpyDefault, stream));
  if (dst_device.is_cpu() || src_device.is_cpu()) MP_CUDA_CHECK(cudaStreamSynchronize(stream));
#else
  MP_FAIL("2-D copy between {} and {} needs CUDA, which this build does not have", dst_device.str(),
          src_device.str());
#endif
}

PackPlan pack_plan(const std::vector<int64_t>& sizes) {
  PackPlan plan;
  for (const int64_t n : sizes) {
    MP_CHECK(n >= 0, "pack_plan: negative size {} at position {}", n, plan.offsets.size());
    plan.offsets.push_back(plan.total);
    plan.total += (n + kPackAlignment - 1) / kPackAlignment * kPackAlignment;
  }
  return plan;
}

namespace {

#if MESHPROOF_HAVE_CUDA
// A page-locked host buffer, freed with the guard.
class PinnedBuffer {
 public:
  explicit PinnedBuffer(int64_t bytes) {
    MP_CUDA_CHECK(cudaMallocHost(&ptr_, static_cast<size_t>(std::max<int64_t>(bytes, 1))));
  }
  ~PinnedBuffer() { cudaFreeHost(ptr_); }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  char* data() const { return static_cast<char*>(ptr_); }

 private:
  void* ptr_ = nullptr;
};
#endif

}  // namespace

std::vector<Tensor> to_host_batched(const std::vector<Tensor>& tensors) {
  std::vector<Tensor> out = tensors;
  std::vector<size_t> moved;  // indices of device tensors
  std::vector<int64_t> sizes;
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!tensors[i].defined() || tensors[i].device().is_cpu()) continue;
    MP_CHECK(tensors[i].device() == current_context().device,
             "to_host_batched: {} is not on this rank's device {}", tensors[i].describe(),
             current_context().device.str());
    moved.push_back(i);
    sizes.push_back(tensors[i].nbytes().value);
  }
  if (moved.empty()) return out;
#if MESHPROOF_HAVE_CUDA
  const PackPlan plan = pack_plan(sizes);
  const std::vector<int64_t>& offsets = plan.offsets;
  const int64_t total = plan.total;
  const Device dev = current_context().device;
  Tensor packed = Tensor::empty({total}, DType::kUInt8, dev);
  char* pk = static_cast<char*>(packed.raw_data());
  for (size_t k = 0; k < moved.size(); ++k)
    copy_bytes(pk + offsets[k], dev, tensors[moved[k]].raw_data(), dev, Bytes(sizes[k]));
  const PinnedBuffer pinned(total);
  auto stream = static_cast<cudaStream_t>(current_context().stream);
  detail::count_copy(Device::cpu(), dev, Bytes(total));
  MP_CUDA_CHECK(cudaMemcpyAsync(pinned.data(), pk, static_cast<size_t>(total),
                                cudaMemcpyDeviceToHost, stream));
  MP_CUDA_CHECK(cudaStreamSynchronize(stream));
  for (size_t k = 0; k < moved.size(); ++k) {
    const Tensor& t = tensors[moved[k]];
    Tensor h = Tensor::empty(t.shape(), t.dtype(), Device::cpu());
    if (sizes[k] > 0)
      std::memcpy(h.raw_data(), pinned.data() + offsets[k], static_cast<size_t>(sizes[k]));
    out[moved[k]] = std::move(h);
  }
  return out;
#else
  MP_FAIL("to_host_batched: device tensors in a build without CUDA");
#endif
}

void copy_batched(const std::vector<Tensor*>& dsts, const std::vector<Tensor>& srcs) {
  MP_CHECK(dsts.size() == srcs.size(), "copy_batched: {} destinations for {} sources", dsts.size(),
           srcs.size());
  std::vector<size_t> up;  // host source -> device destination
  std::vector<int64_t> sizes;
  for (size_t i = 0; i < dsts.size(); ++i) {
    Tensor& d = *dsts[i];
    const Tensor& src = srcs[i];
    MP_CHECK(src.dtype() == d.dtype() && src.numel() == d.numel(), "copy_batched: {} into {}",
             src.describe(), d.describe());
    if (src.device().is_cpu() && !d.device().is_cpu()) {
      MP_CHECK(d.device() == current_context().device,
               "copy_batched: {} is not on this rank's device {}", d.describe(),
               current_context().device.str());
      up.push_back(i);
      sizes.push_back(d.nbytes().value);
    } else {
      d.copy_from(src);
    }
  }
  if (up.empty()) return;
#if MESHPROOF_HAVE_CUDA
  const PackPlan plan = pack_plan(sizes);
  const std::vector<int64_t>& offsets = plan.offsets;
  const int64_t total = plan.total;
  const Device dev = current_context().device;
  const PinnedBuffer pinned(total);
  for (size_t k = 0; k < up.size(); ++k)
    if (sizes[k] > 0)
      std::memcpy(pinned.data() + offsets[k], srcs[up[k]].raw_data(),
                  static_cast<size_t>(sizes[k]));
  Tensor packed = Tensor::empty({total}, DType::kUInt8, dev);
  char* pk = static_cast<char*>(packed.raw_data());
  auto stream = static_cast<cudaStream_t>(current_context().stream);
  detail::count_copy(dev, Device::cpu(), Bytes(total));
  MP_CUDA_CHECK(cudaMemcpyAsync(pk, pinned.data(), static_cast<size_t>(total),
                                cudaMemcpyHostToDevice, stream));
  for (size_t k = 0; k < up.size(); ++k)
    copy_bytes(dsts[up[k]]->raw_data(), dev, pk + offsets[k], dev, Bytes(sizes[k]));
  // The pinned buffer is freed on return: the upload must be complete.
  MP_CUDA_CHECK(cudaStreamSynchronize(stream));
#else
  MP_FAIL("copy_batched: device tensors in a build without CUDA");
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
