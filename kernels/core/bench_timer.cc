#include "kernels/core/bench_timer.h"

#include <unistd.h>

#include <chrono>

#include "kernels/core/cuda_check.h"
#include "kernels/core/device.h"
#include "kernels/core/error.h"

namespace meshproof::kernels {
namespace {

int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

}  // namespace

DeviceTimer::DeviceTimer(Device device) : device_(device) {
  if (device_.is_cpu()) return;
#if MESHPROOF_HAVE_CUDA
  cudaEvent_t a = nullptr, b = nullptr;
  MP_CUDA_CHECK(cudaEventCreate(&a));
  MP_CUDA_CHECK(cudaEventCreate(&b));
  start_event_ = a;
  stop_event_ = b;
#else
  MP_FAIL("DeviceTimer on {} needs CUDA, which this build does not have", device_.str());
#endif
}

DeviceTimer::~DeviceTimer() {
#if MESHPROOF_HAVE_CUDA
  // Destructors cannot throw: a failed destroy leaks an event, nothing worse.
  if (start_event_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(start_event_));
  if (stop_event_ != nullptr) cudaEventDestroy(static_cast<cudaEvent_t>(stop_event_));
#endif
}

void DeviceTimer::start() {
  if (device_.is_cpu()) {
    start_ns_ = now_ns();
    return;
  }
#if MESHPROOF_HAVE_CUDA
  MP_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(start_event_),
                                static_cast<cudaStream_t>(current_context().stream)));
#endif
}

double DeviceTimer::stop() {
  if (device_.is_cpu()) return static_cast<double>(now_ns() - start_ns_) * 1e-9;
#if MESHPROOF_HAVE_CUDA
  auto stop = static_cast<cudaEvent_t>(stop_event_);
  MP_CUDA_CHECK(cudaEventRecord(stop, static_cast<cudaStream_t>(current_context().stream)));
  MP_CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  MP_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start_event_), stop));
  return static_cast<double>(ms) * 1e-3;
#else
  return 0;
#endif
}

Bytes last_level_cache_bytes(Device device) {
  constexpr int64_t kUnknown = int64_t{32} << 20;
  if (device.is_cuda()) {
#if MESHPROOF_HAVE_CUDA
    int bytes = 0;
    MP_CUDA_CHECK(cudaDeviceGetAttribute(&bytes, cudaDevAttrL2CacheSize, device.index));
    return Bytes{bytes > 0 ? bytes : kUnknown};
#else
    return Bytes{kUnknown};
#endif
  }
  long l3 = -1, l2 = -1;
#ifdef _SC_LEVEL3_CACHE_SIZE
  l3 = sysconf(_SC_LEVEL3_CACHE_SIZE);
#endif
#ifdef _SC_LEVEL2_CACHE_SIZE
  l2 = sysconf(_SC_LEVEL2_CACHE_SIZE);
#endif
  if (l3 > 0) return Bytes{l3};
  if (l2 > 0) return Bytes{l2};
  return Bytes{kUnknown};
}

std::string device_name(Device device) {
  if (device.is_cpu()) return "cpu";
  const CudaStatus& s = cuda_status();
  for (const GpuInfo& g : s.gpus) {
    if (g.index == device.index) return g.name;
  }
  return device.str();
}

}  // namespace meshproof::kernels
