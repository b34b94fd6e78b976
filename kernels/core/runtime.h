// Per-rank execution context. Virtual ranks are threads of one process; each thread installs its
// own RankContext (device, CUDA stream, memory tracker) so that kernels launched and memory
// allocated by that rank go to its stream and its accounting.
#pragma once

#include <atomic>
#include <string>

#include "kernels/core/units.h"

namespace meshproof::kernels {

enum class DeviceType : uint8_t { kCpu, kCuda };

struct Device {
  DeviceType type = DeviceType::kCpu;
  int index = 0;  // CUDA ordinal; 0 for the CPU

  static constexpr Device cpu() { return Device{DeviceType::kCpu, 0}; }
  static constexpr Device cuda(int i = 0) { return Device{DeviceType::kCuda, i}; }
  bool is_cpu() const { return type == DeviceType::kCpu; }
  bool is_cuda() const { return type == DeviceType::kCuda; }
  bool operator==(const Device&) const = default;
  std::string str() const;  // "cpu" or "cuda:0"
};

// Live and peak bytes allocated by one rank (host and device counted separately).
class MemoryTracker {
 public:
  void on_alloc(Device d, Bytes n);
  void on_free(Device d, Bytes n);
  Bytes current(DeviceType t) const;
  Bytes peak(DeviceType t) const;
  void reset_peak();

 private:
  std::atomic<int64_t> current_[2] = {0, 0};
  std::atomic<int64_t> peak_[2] = {0, 0};
};

// Bytes copied between the host and a device (kernels::copy_bytes, so Tensor::to and
// Tensor::copy_from too), by direction. Device-to-device and host-to-host copies are not counted:
// the counter measures what crosses PCIe (docs/design.md, "Device-resident training state").
// Copies of at most kScalarCopyBytes (a double: a loss, a norm) are "scalars"; the bulk_ fields
// count the bytes of the larger ones only.
inline constexpr int64_t kScalarCopyBytes = 8;

struct CopyCounts {
  int64_t host_to_device = 0;
  int64_t device_to_host = 0;
  int64_t bulk_host_to_device = 0;  // bytes of copies larger than kScalarCopyBytes
  int64_t bulk_device_to_host = 0;
  int64_t copies = 0;       // number of counted copies (either direction)
  int64_t bulk_copies = 0;  // of which larger than kScalarCopyBytes
  int64_t total() const { return host_to_device + device_to_host; }
  CopyCounts operator-(const CopyCounts& o) const {
    return {host_to_device - o.host_to_device,
            device_to_host - o.device_to_host,
            bulk_host_to_device - o.bulk_host_to_device,
            bulk_device_to_host - o.bulk_device_to_host,
            copies - o.copies,
            bulk_copies - o.bulk_copies};
  }
};

class CopyCounter {
 public:
  void add(bool to_device, Bytes n);
  CopyCounts counts() const;
  void reset();

 private:
  std::atomic<int64_t> h2d_{0}, d2h_{0}, bulk_h2d_{0}, bulk_d2h_{0}, copies_{0}, bulk_copies_{0};
};

// Every host<->device copy of the process, all ranks together.
CopyCounter& global_copy_counter();

struct RankContext {
  int rank = 0;
  Device device = Device::cpu();
  void* stream = nullptr;  // cudaStream_t of this rank; nullptr = legacy default stream / CPU
  MemoryTracker* memory = nullptr;
  // This rank's host<->device copies (nullptr: counted only in global_copy_counter()).
  CopyCounter* copies = nullptr;
};

// The calling thread's context (a process-wide default CPU context until one is installed).
RankContext& current_context();

// Installs `ctx` for the calling thread for the lifetime of the guard.
class ScopedRankContext {
 public:
  explicit ScopedRankContext(const RankContext& ctx);
  ~ScopedRankContext();
  ScopedRankContext(const ScopedRankContext&) = delete;
  ScopedRankContext& operator=(const ScopedRankContext&) = delete;

 private:
  RankContext saved_;
};

// Blocks until all work queued on the current rank's stream is done (no-op on CPU).
void synchronize_current();

}  // namespace meshproof::kernels
