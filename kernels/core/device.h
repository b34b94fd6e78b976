// What CUDA can do in this process: compiled in or not, a usable driver and device or not (and
// why not), library versions and each GPU's properties. Never throws: with no driver or no device
// the answer is "not usable" with a reason, and the program runs on the CPU backend.
#pragma once

#include <string>
#include <string_view>
#include <vector>

#include "kernels/core/runtime.h"
#include "kernels/core/units.h"

namespace meshproof::kernels {

struct GpuInfo {
  int index = 0;
  std::string name;
  int cc_major = 0;
  int cc_minor = 0;
  Bytes total_memory;
  int sm_count = 0;
};

struct CudaStatus {
  bool compiled = false;    // built with the CUDA backend
  bool usable = false;      // a driver and at least one device are present
  std::string reason;       // why not usable (empty when usable)
  int runtime_version = 0;  // cudart, e.g. 13000
  int driver_version = 0;   // highest CUDA version the driver supports, 0 if no driver
  std::vector<GpuInfo> gpus;
};

// Probes once per process and caches the answer.
const CudaStatus& cuda_status();

// Formats CUDA's integer versions (13000 -> "13.0"; cuBLASLt 130100 -> "13.1.0").
std::string format_cuda_version(int v);
std::string format_cublaslt_version(size_t v);

// cuBLASLt for the environment record. The library is opened on first use
// (kernels/gemm/cublaslt_api.h): with `open` this opens it and gives its version, or "none (why)";
// without, "not loaded" unless this process has already opened it. "none" in a build without CUDA.
std::string cublaslt_version_text(bool open);

// Resolves a backend choice "cpu", "cuda" or "auto" to a device. "cuda" without a usable device
// is an input error naming the reason; "auto" picks CUDA when usable, else the CPU.
Device resolve_backend(std::string_view choice);

}  // namespace meshproof::kernels
