#include "kernels/core/device.h"

#include <fmt/format.h>

#include "kernels/core/cuda_check.h"
#include "kernels/core/error.h"
#include "kernels/gemm/cublaslt_api.h"

namespace meshproof::kernels {
namespace {

CudaStatus probe() {
  CudaStatus s;
#if MESHPROOF_HAVE_CUDA
  s.compiled = true;
  cudaRuntimeGetVersion(&s.runtime_version);
  // cudaDriverGetVersion reports 0 when no driver library is installed; it never fails hard.
  if (cudaDriverGetVersion(&s.driver_version) != cudaSuccess) s.driver_version = 0;
  int count = 0;
  const cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later probes start clean
    s.reason = fmt::format("cudaGetDeviceCount failed: {} ({})", cudaGetErrorName(err),
                           cudaGetErrorString(err));
    if (s.driver_version == 0) s.reason += "; no CUDA driver is installed";
    return s;
  }
  if (count == 0) {
    s.reason = "the CUDA driver reports no devices";
    return s;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp p{};
    if (cudaGetDeviceProperties(&p, i) != cudaSuccess) continue;
    s.gpus.push_back(GpuInfo{i, p.name, p.major, p.minor,
                             Bytes(static_cast<int64_t>(p.totalGlobalMem)), p.multiProcessorCount});
  }
  s.usable = !s.gpus.empty();
  if (!s.usable) s.reason = "no device properties could be read";
#else
  s.reason = "meshproof was built without CUDA (MESHPROOF_CUDA=OFF or no nvcc at configure time)";
#endif
  return s;
}

}  // namespace

const CudaStatus& cuda_status() {
  static const CudaStatus s = probe();
  return s;
}

std::string format_cuda_version(int v) {
  if (v <= 0) return "none";
  return fmt::format("{}.{}", v / 1000, (v % 1000) / 10);
}

std::string cublaslt_version_text(bool open) {
#if MESHPROOF_HAVE_CUDA
  if (!open && !lt::api_loaded()) return "not loaded";
  try {
    return format_cublaslt_version(lt::api().get_version());
  } catch (const Error& e) {
    return fmt::format("none ({})", e.what());
  }
#else
  (void)open;
  return "none";
#endif
}

std::string format_cublaslt_version(size_t v) {
  if (v == 0) return "none";
  // cuBLAS encodes major*10000 + minor*100 + patch.
  return fmt::format("{}.{}.{}", v / 10000, (v / 100) % 100, v % 100);
}

Device resolve_backend(std::string_view choice) {
  const CudaStatus& s = cuda_status();
  if (choice == "cpu") return Device::cpu();
  if (choice == "cuda") {
    MP_CHECK_INPUT(s.usable, "backend 'cuda' requested but CUDA is not usable: {}", s.reason);
    return Device::cuda(0);
  }
  if (choice == "auto") return s.usable ? Device::cuda(0) : Device::cpu();
  MP_FAIL_INPUT("unknown backend '{}' (expected cpu, cuda or auto)", choice);
}

}  // namespace meshproof::kernels
