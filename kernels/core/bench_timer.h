// Timing of device work for benchmarks: CUDA events recorded on the current rank's stream (the
// elapsed device time between them), or std::chrono::steady_clock on the CPU backend. Also the
// size of the cache a benchmark must rotate its inputs beyond so that every timed iteration reads
// from memory, not from a warm cache.
#pragma once

#include <string>

#include "kernels/core/runtime.h"
#include "kernels/core/units.h"

namespace meshproof::kernels {

class DeviceTimer {
 public:
  explicit DeviceTimer(Device device);
  ~DeviceTimer();
  DeviceTimer(const DeviceTimer&) = delete;
  DeviceTimer& operator=(const DeviceTimer&) = delete;

  // Marks the start: records the start event on the current stream (CUDA) or reads the clock.
  void start();
  // Seconds since start(). CUDA: records the stop event, waits for it and returns the event
  // interval (the device time of the work queued in between); CPU: wall clock.
  double stop();

 private:
  Device device_;
  void* start_event_ = nullptr;  // cudaEvent_t
  void* stop_event_ = nullptr;   // cudaEvent_t
  int64_t start_ns_ = 0;
};

// Bytes of the last-level cache in front of `device`'s memory: the GPU's L2
// (cudaDevAttrL2CacheSize) or the host's L3 (else L2) from sysconf; 32 MiB when unknown.
Bytes last_level_cache_bytes(Device device);

// "NVIDIA H100 80GB HBM3" for a CUDA device, "cpu" for the host.
std::string device_name(Device device);

}  // namespace meshproof::kernels
