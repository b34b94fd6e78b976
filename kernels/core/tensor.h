// A dense tensor: shape, dtype and device are runtime data; storage is reference-counted and
// accounted to the allocating rank's MemoryTracker. Views share storage.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "kernels/core/dtype.h"
#include "kernels/core/error.h"
#include "kernels/core/runtime.h"
#include "kernels/core/units.h"

namespace meshproof::kernels {

// Row-major shape, outermost dimension first.
class Shape {
 public:
  // The most dimensions a shape has (held inline: copying a shape never allocates).
  static constexpr int kMaxRank = 8;

  Shape() = default;
  Shape(std::initializer_list<int64_t> dims) { assign(dims.begin(), dims.size()); }
  explicit Shape(const std::vector<int64_t>& dims) { assign(dims.data(), dims.size()); }
  explicit Shape(std::span<const int64_t> dims) { assign(dims.data(), dims.size()); }
  // From per-dimension element counts (a mesh box's extent), without an intermediate vector:
  // collectives ask for boxes' shapes at every call.
  explicit Shape(std::span<const Elements> extents) {
    set_rank(extents.size());
    std::transform(extents.begin(), extents.end(), dims_.begin(),
                   [](Elements e) { return e.value; });
  }

  int rank() const { return rank_; }
  int64_t operator[](int i) const {
    const int at = i < 0 ? i + rank() : i;
    MP_CHECK(0 <= at && at < rank(), "dimension {} of a rank-{} shape", i, rank());
    return dims_[static_cast<size_t>(at)];
  }
  std::span<const int64_t> dims() const { return {dims_.data(), static_cast<size_t>(rank_)}; }
  // This shape with dimension `d` set to `extent`.
  Shape with_dim(int d, int64_t extent) const;
  Elements numel() const;
  // Product of all but the last dimension ("M" of a 2-D view), and the last dimension ("K").
  int64_t leading() const;
  int64_t last() const { return rank_ == 0 ? 1 : dims_[static_cast<size_t>(rank_ - 1)]; }
  bool operator==(const Shape& o) const {
    return rank_ == o.rank_ && std::equal(dims().begin(), dims().end(), o.dims().begin());
  }
  std::string str() const;  // "[4, 128]"

 private:
  void set_rank(size_t n) {
    MP_CHECK_INPUT(n <= static_cast<size_t>(kMaxRank),
                   "a tensor shape has at most {} dimensions, got {}", kMaxRank, n);
    rank_ = static_cast<int8_t>(n);
  }
  void assign(const int64_t* d, size_t n) {
    set_rank(n);
    std::copy(d, d + n, dims_.begin());
  }
  std::array<int64_t, kMaxRank> dims_{};
  int8_t rank_ = 0;
};

class Storage;

class Tensor {
 public:
  Tensor() = default;  // an undefined tensor (defined() == false)

  // Uninitialised memory on `device` (the current rank's device when omitted).
  static Tensor empty(const Shape& shape, DType dtype, Device device);
  static Tensor empty(const Shape& shape, DType dtype) {
    return empty(shape, dtype, current_context().device);
  }
  static Tensor zeros(const Shape& shape, DType dtype, Device device);
  static Tensor zeros(const Shape& shape, DType dtype) {
    return zeros(shape, dtype, current_context().device);
  }
  // A host float32/int32/... tensor holding a copy of `values`.
  template <typename T>
  static Tensor from_vector(const Shape& shape, const std::vector<T>& values);

  bool defined() const { return storage_ != nullptr; }
  DType dtype() const { return dtype_; }
  const Shape& shape() const { return shape_; }
  Device device() const;
  Elements numel() const { return shape_.numel(); }
  Bytes nbytes() const { return storage_bytes(dtype_, numel()); }

  void* raw_data();
  const void* raw_data() const;
  // Typed pointer; checks that T matches the dtype. Use raw_data() for bf16/fp8 bit patterns.
  template <typename T>
  T* data() {
    check_dtype(DTypeOf<T>::value);
    return static_cast<T*>(raw_data());
  }
  template <typename T>
  const T* data() const {
    check_dtype(DTypeOf<T>::value);
    return static_cast<const T*>(raw_data());
  }

  // Same storage, new shape with the same element count.
  Tensor view(const Shape& shape) const;
  // Rows [begin, end) of the outermost dimension, sharing storage.
  Tensor slice_rows(int64_t begin, int64_t end) const;
  // Deep copy onto `device` (synchronous for device->host so the result is readable).
  Tensor to(Device device) const;
  Tensor clone() const { return to(device()); }
  // This tensor (shared storage) when it is on `device` already, else a copy there.
  Tensor on(Device device) const { return this->device() == device ? *this : to(device); }
  // Copies `src` (same dtype and element count) into this tensor's memory.
  void copy_from(const Tensor& src);
  // Sets every byte to zero.
  void zero_();
  // Host-side copy of the elements as float32/int32/...; copies from the device when needed.
  template <typename T>
  std::vector<T> to_vector() const;

  std::string describe() const;  // "float32[4, 128] on cpu"

 private:
  void check_dtype(DType expected) const;

  std::shared_ptr<Storage> storage_;
  int64_t byte_offset_ = 0;
  DType dtype_ = DType::kFloat32;
  Shape shape_;
};

// Copies `n` bytes between any two devices on the current rank's stream; host destinations are
// synchronised before return. Host<->device copies are counted (kernels/core/runtime.h CopyCounter:
// the process's counter and the current rank context's).
void copy_bytes(void* dst, Device dst_device, const void* src, Device src_device, Bytes n);

// `height` rows of `width` bytes, row r from src + r * src_pitch to dst + r * dst_pitch (pitches
// in bytes, >= width), between any two devices: one cudaMemcpy2DAsync on the current rank's
// stream when a device is involved (so a strided region of a device tensor is one copy, not one
// per row), row by row on the host. Synchronised like copy_bytes; counted like copy_bytes.
void copy_bytes_2d(void* dst, Device dst_device, int64_t dst_pitch, const void* src,
                   Device src_device, int64_t src_pitch, int64_t width, int64_t height);

// Host copies of `tensors` (host tensors are returned as they are, sharing storage). The device
// tensors of one device are packed on the device (device-to-device copies) and cross to the host
// in ONE asynchronous copy into pinned memory (one synchronisation), then are unpacked into
// ordinary host tensors: a checkpoint save's download, one transfer whatever the number of
// tensors. All device tensors must be on the current rank's device.
std::vector<Tensor> to_host_batched(const std::vector<Tensor>& tensors);

// dsts[i]->copy_from(srcs[i]) for every i (same dtype and element count each). Host sources for
// device destinations are packed into pinned memory and cross in ONE asynchronous copy (a
// checkpoint load's upload), then are scattered on the device; every other pair is copied as
// copy_from does. Returns after the copies are complete.
void copy_batched(const std::vector<Tensor*>& dsts, const std::vector<Tensor>& srcs);

namespace detail {
// The copy counting of copy_bytes: adds `n` to the global and the current context's counters
// when exactly one of the two devices is the host (exposed for the counter's unit test).
void count_copy(Device dst_device, Device src_device, Bytes n);

// The calling thread's cache of freed host blocks (tensor.cc, docs/design.md section 21), for the
// tests: whether it is compiled in (not under AddressSanitizer), the bytes it holds, how many
// allocations it served, and its limits.
struct HostBlockCacheStats {
  bool enabled = false;
  int64_t cached_bytes = 0;
  int64_t hits = 0;
  int64_t max_block = 0;
  int64_t max_cached = 0;
};
HostBlockCacheStats host_block_cache_stats();
}  // namespace detail

template <typename T>
Tensor Tensor::from_vector(const Shape& shape, const std::vector<T>& values) {
  MP_CHECK(static_cast<int64_t>(values.size()) == shape.numel().value,
           "from_vector: {} values for shape {}", values.size(), shape.str());
  Tensor t = empty(shape, DTypeOf<T>::value, Device::cpu());
  std::copy(values.begin(), values.end(), t.data<T>());
  return t;
}

template <typename T>
std::vector<T> Tensor::to_vector() const {
  Tensor host = device().is_cpu() ? *this : to(Device::cpu());
  const T* p = host.data<T>();
  return std::vector<T>(p, p + numel().value);
}

}  // namespace meshproof::kernels
