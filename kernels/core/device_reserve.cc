#include "kernels/core/device_reserve.h"

#include <algorithm>
#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>
#include <utility>

#include "kernels/core/device.h"
#include "kernels/core/error.h"
#include "kernels/gemm/cublaslt_resources.h"
#if MESHPROOF_HAVE_CUDA
#include <cuda_runtime_api.h>

#include "kernels/core/cuda_check.h"
#endif

namespace meshproof::kernels {
namespace {

constexpr std::string_view kPoolName = "cuda_pool";
constexpr std::string_view kCublasLtName = "cublaslt";

struct Registry {
  std::mutex mu;
  // (device type, index, name) -> bytes
  std::map<std::tuple<int, int, std::string>, Bytes> fixed;
  std::map<std::string, ReserveProvider, std::less<>> providers;
};

Registry& registry() {
  static Registry r;
  return r;
}

std::tuple<int, int, std::string> key(Device d, std::string_view name) {
  return {static_cast<int>(d.type), d.index, std::string(name)};
}

bool fixed_name_used(const Registry& r, std::string_view name) {
  for (const auto& [k, v] : r.fixed)
    if (std::get<2>(k) == name) return true;
  return false;
}

}  // namespace

void set_device_reserve(Device device, std::string_view name, Bytes bytes) {
  MP_CHECK(!name.empty() && name != kPoolName && name != kCublasLtName,
           "device reserve: the name '{}' is reserved", name);
  MP_CHECK(bytes.value >= 0, "device reserve '{}' on {}: {} bytes is negative", name, device.str(),
           bytes.value);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  MP_CHECK(!r.providers.contains(name), "device reserve '{}' is already a provider", name);
  r.fixed[key(device, name)] = bytes;
}

void clear_device_reserve(Device device, std::string_view name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  r.fixed.erase(key(device, name));
}

void register_reserve_provider(std::string_view name, ReserveProvider provider) {
  MP_CHECK(!name.empty() && name != kPoolName && name != kCublasLtName,
           "reserve provider: the name '{}' is reserved", name);
  MP_CHECK(static_cast<bool>(provider), "reserve provider '{}' is empty", name);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  MP_CHECK(!fixed_name_used(r, name), "reserve provider '{}' is already a fixed reserve", name);
  r.providers.insert_or_assign(std::string(name), std::move(provider));
}

void unregister_reserve_provider(std::string_view name) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.mu);
  if (auto it = r.providers.find(name); it != r.providers.end()) r.providers.erase(it);
}

std::vector<NamedReserve> device_reserves(Device device) {
  std::vector<NamedReserve> out;
  std::vector<std::pair<std::string, ReserveProvider>> providers;
  {
    Registry& r = registry();
    std::lock_guard<std::mutex> lock(r.mu);
    for (const auto& [k, bytes] : r.fixed)
      if (std::get<0>(k) == static_cast<int>(device.type) && std::get<1>(k) == device.index &&
          bytes.value > 0)
        out.push_back({std::get<2>(k), bytes});
    providers.assign(r.providers.begin(), r.providers.end());
  }
  // Providers run outside the lock: they may query the device.
  for (const auto& [name, provider] : providers) {
    const Bytes b = provider(device);
    MP_CHECK(b.value >= 0, "reserve provider '{}' gave {} bytes on {}", name, b.value,
             device.str());
    if (b.value > 0) out.push_back({name, b});
  }
  if (const Bytes pool = cuda_pool_reserve(device); pool.value > 0)
    out.push_back({std::string(kPoolName), pool});
  // The cuBLASLt workspaces held for this device's streams (kernels/gemm/cublaslt_resources.h).
  if (const int64_t lt = cublaslt_reserved_bytes(device); lt > 0)
    out.push_back({std::string(kCublasLtName), Bytes(lt)});
  std::sort(out.begin(), out.end(),
            [](const NamedReserve& a, const NamedReserve& b) { return a.name < b.name; });
  return out;
}

Bytes total_of(const std::vector<NamedReserve>& reserves) {
  Bytes t;
  for (const NamedReserve& r : reserves) t += r.bytes;
  return t;
}

Bytes cuda_pool_reserve(Device device) {
#if MESHPROOF_HAVE_CUDA
  const CudaStatus& cuda = cuda_status();
  if (!device.is_cuda() || !cuda.usable || device.index < 0 ||
      device.index >= static_cast<int>(cuda.gpus.size()))
    return Bytes(0);
  cudaMemPool_t pool = nullptr;
  MP_CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool, device.index));
  uint64_t reserved = 0, used = 0;  // cuuint64_t (cuda.h), a 64-bit unsigned
  MP_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrReservedMemHigh, &reserved));
  MP_CUDA_CHECK(cudaMemPoolGetAttribute(pool, cudaMemPoolAttrUsedMemHigh, &used));
  return Bytes(reserved > used ? static_cast<int64_t>(reserved - used) : 0);
#else
  (void)device;
  return Bytes(0);
#endif
}

}  // namespace meshproof::kernels
