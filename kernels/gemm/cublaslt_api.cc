#include "kernels/gemm/cublaslt_api.h"

#if MESHPROOF_HAVE_CUDA
#include <dlfcn.h>
#include <fmt/format.h>

#include <atomic>
#include <mutex>

#include "kernels/core/error.h"

namespace meshproof::kernels::lt {
namespace {

std::mutex& open_mu() {
  static std::mutex mu;
  return mu;
}
Api& table() {
  static Api a;
  return a;
}
std::atomic<bool>& opened() {
  static std::atomic<bool> o{false};
  return o;
}

template <typename F>
void resolve(void* lib, const char* name, F& slot) {
  dlerror();  // clear
  void* sym = dlsym(lib, name);
  const char* err = dlerror();
  MP_CHECK(sym != nullptr && err == nullptr, "cuBLASLt: {} has no entry point {} ({})", soname(),
           name, err != nullptr ? err : "a null symbol");
  slot = reinterpret_cast<F>(sym);
}

}  // namespace

std::string soname() { return fmt::format("libcublasLt.so.{}", CUBLAS_VER_MAJOR); }

const Api& api() {
  if (opened().load(std::memory_order_acquire)) return table();
  std::lock_guard<std::mutex> lock(open_mu());
  if (opened().load(std::memory_order_relaxed)) return table();
  const std::string name = soname();
  // RTLD_LOCAL: nothing else in the process resolves symbols against it; never closed (its
  // handles and algorithm state live as long as the process).
  void* lib = dlopen(name.c_str(), RTLD_NOW | RTLD_LOCAL);
  std::string why = lib == nullptr ? std::string(dlerror()) : std::string();
#ifdef MESHPROOF_CUDA_LIBRARY_DIR
  if (lib == nullptr) {
    const std::string full = std::string(MESHPROOF_CUDA_LIBRARY_DIR) + "/" + name;
    lib = dlopen(full.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (lib == nullptr) why += fmt::format("; {}", dlerror());
  }
#endif
  MP_CHECK(lib != nullptr,
           "cuBLASLt: cannot open {} ({}); the CUDA backend's GEMMs need it (install the CUDA "
           "toolkit's cuBLAS, or put its folder on LD_LIBRARY_PATH)",
           name, why);
  Api a;
  resolve(lib, "cublasLtCreate", a.create);
  resolve(lib, "cublasLtDestroy", a.destroy);
  resolve(lib, "cublasLtGetVersion", a.get_version);
  resolve(lib, "cublasLtGetStatusName", a.get_status_name);
  resolve(lib, "cublasLtGetStatusString", a.get_status_string);
  resolve(lib, "cublasLtMatmulDescCreate", a.matmul_desc_create);
  resolve(lib, "cublasLtMatmulDescDestroy", a.matmul_desc_destroy);
  resolve(lib, "cublasLtMatmulDescSetAttribute", a.matmul_desc_set_attribute);
  resolve(lib, "cublasLtMatrixLayoutCreate", a.matrix_layout_create);
  resolve(lib, "cublasLtMatrixLayoutDestroy", a.matrix_layout_destroy);
  resolve(lib, "cublasLtMatmulPreferenceCreate", a.matmul_preference_create);
  resolve(lib, "cublasLtMatmulPreferenceDestroy", a.matmul_preference_destroy);
  resolve(lib, "cublasLtMatmulPreferenceSetAttribute", a.matmul_preference_set_attribute);
  resolve(lib, "cublasLtMatmulAlgoGetHeuristic", a.matmul_algo_get_heuristic);
  resolve(lib, "cublasLtMatmul", a.matmul);
  table() = a;
  opened().store(true, std::memory_order_release);
  return table();
}

bool api_loaded() { return opened().load(std::memory_order_acquire); }

}  // namespace meshproof::kernels::lt
#endif
