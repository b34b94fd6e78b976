#include "kernels/core/runtime.h"

#include <fmt/format.h>

#include <algorithm>

#include "kernels/core/cuda_check.h"

namespace meshproof::kernels {

std::string Device::str() const {
  return is_cpu() ? std::string("cpu") : fmt::format("cuda:{}", index);
}

void MemoryTracker::on_alloc(Device d, Bytes n) {
  const int i = d.is_cpu() ? 0 : 1;
  const int64_t now = current_[i].fetch_add(n.value) + n.value;
  int64_t prev = peak_[i].load();
  while (now > prev && !peak_[i].compare_exchange_weak(prev, now)) {
  }
}

void MemoryTracker::on_free(Device d, Bytes n) { current_[d.is_cpu() ? 0 : 1].fetch_sub(n.value); }

Bytes MemoryTracker::current(DeviceType t) const {
  return Bytes(current_[t == DeviceType::kCpu ? 0 : 1].load());
}

Bytes MemoryTracker::peak(DeviceType t) const {
  return Bytes(peak_[t == DeviceType::kCpu ? 0 : 1].load());
}

void MemoryTracker::reset_peak() {
  for (int i = 0; i < 2; ++i) peak_[i].store(current_[i].load());
}

void CopyCounter::add(bool to_device, Bytes n) {
  (to_device ? h2d_ : d2h_).fetch_add(n.value, std::memory_order_relaxed);
  if (n.value > kScalarCopyBytes) {
    (to_device ? bulk_h2d_ : bulk_d2h_).fetch_add(n.value, std::memory_order_relaxed);
    bulk_copies_.fetch_add(1, std::memory_order_relaxed);
  }
  copies_.fetch_add(1, std::memory_order_relaxed);
}

CopyCounts CopyCounter::counts() const {
  constexpr auto r = std::memory_order_relaxed;
  return {h2d_.load(r),      d2h_.load(r),    bulk_h2d_.load(r),
          bulk_d2h_.load(r), copies_.load(r), bulk_copies_.load(r)};
}

void CopyCounter::reset() {
  for (std::atomic<int64_t>* a : {&h2d_, &d2h_, &bulk_h2d_, &bulk_d2h_, &copies_, &bulk_copies_})
    a->store(0);
}

CopyCounter& global_copy_counter() {
  static CopyCounter c;
  return c;
}

namespace {
MemoryTracker g_default_tracker;
thread_local RankContext t_context{0, Device::cpu(), nullptr, &g_default_tracker, nullptr};
}  // namespace

RankContext& current_context() { return t_context; }

ScopedRankContext::ScopedRankContext(const RankContext& ctx) : saved_(t_context) {
  t_context = ctx;
  if (t_context.memory == nullptr) t_context.memory = &g_default_tracker;
#if MESHPROOF_HAVE_CUDA
  if (t_context.device.is_cuda()) MP_CUDA_CHECK(cudaSetDevice(t_context.device.index));
#endif
}

ScopedRankContext::~ScopedRankContext() { t_context = saved_; }

void synchronize_current() {
#if MESHPROOF_HAVE_CUDA
  if (t_context.device.is_cuda()) {
    MP_CUDA_CHECK(cudaStreamSynchronize(static_cast<cudaStream_t>(t_context.stream)));
  }
#endif
}

}  // namespace meshproof::kernels
