// Per-rank execution context. Virtual ranks are threads of one process; each thread installs its
// own RankContext (device, CUDA stream, memory tracker) so that kernels launched and memory
// allocated by that rank go to its stream and its accounting.
#pragma once

#include <atomic>
#include <string>

#include "kernels/units.h"

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

struct RankContext {
  int rank = 0;
  Device device = Device::cpu();
  void* stream = nullptr;  // cudaStream_t of this rank; nullptr = legacy default stream / CPU
  MemoryTracker* memory = nullptr;
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
