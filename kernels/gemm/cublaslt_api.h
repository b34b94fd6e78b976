// cuBLASLt, opened on first use (docs/design.md section 31, "Loaded on first use").
//
// meshproof does not link libcublasLt: the library's own start-up (it is over 500 MB and its
// static initialisers touch tens of MB) cost every process about 0.15 s before main, CPU runs and
// the CPU test binaries included. `api()` opens it with dlopen the first time a GEMM, a handle or
// the version is needed and resolves the entry points meshproof calls; every call site goes
// through the table.
#pragma once

#if MESHPROOF_HAVE_CUDA
#include <cublasLt.h>

#include <string>

#include "kernels/core/error.h"

namespace meshproof::kernels::lt {

// The cuBLASLt entry points meshproof uses, with the library's own signatures.
struct Api {
  decltype(&::cublasLtCreate) create = nullptr;
  decltype(&::cublasLtDestroy) destroy = nullptr;
  decltype(&::cublasLtGetVersion) get_version = nullptr;
  decltype(&::cublasLtGetStatusName) get_status_name = nullptr;
  decltype(&::cublasLtGetStatusString) get_status_string = nullptr;
  decltype(&::cublasLtMatmulDescCreate) matmul_desc_create = nullptr;
  decltype(&::cublasLtMatmulDescDestroy) matmul_desc_destroy = nullptr;
  decltype(&::cublasLtMatmulDescSetAttribute) matmul_desc_set_attribute = nullptr;
  decltype(&::cublasLtMatrixLayoutCreate) matrix_layout_create = nullptr;
  decltype(&::cublasLtMatrixLayoutDestroy) matrix_layout_destroy = nullptr;
  decltype(&::cublasLtMatmulPreferenceCreate) matmul_preference_create = nullptr;
  decltype(&::cublasLtMatmulPreferenceDestroy) matmul_preference_destroy = nullptr;
  decltype(&::cublasLtMatmulPreferenceSetAttribute) matmul_preference_set_attribute = nullptr;
  decltype(&::cublasLtMatmulAlgoGetHeuristic) matmul_algo_get_heuristic = nullptr;
  decltype(&::cublasLtMatmul) matmul = nullptr;
};

// The library's soname for the headers this build compiled against ("libcublasLt.so.13").
std::string soname();

// Opens the library on the first call (thread-safe) and returns its entry points. The search:
// the soname through the dynamic loader (LD_LIBRARY_PATH, this binary's RUNPATH, the loader
// cache), then the CUDA toolkit's library folder of the build. Throws a kRuntime error naming
// the library and dlerror()'s reason when it cannot be opened, or the first missing entry point;
// the next call tries again.
const Api& api();

// Whether this process has opened it (for tests and the environment record).
bool api_loaded();

}  // namespace meshproof::kernels::lt

// A cuBLAS status check built on kernels::throw_error: file:line, the call, the status's name and
// description (through the table: the library is not linked).
#define MP_CUBLAS_CHECK(expr)                                                            \
  do {                                                                                   \
    const cublasStatus_t mp_status_ = (expr);                                            \
    if (mp_status_ != CUBLAS_STATUS_SUCCESS) [[unlikely]] {                              \
      ::meshproof::kernels::throw_error(                                                 \
          ::meshproof::kernels::ErrorKind::kRuntime, __FILE__, __LINE__, #expr,          \
          ::fmt::format("cuBLAS error {}: {}",                                           \
                        ::meshproof::kernels::lt::api().get_status_name(mp_status_),     \
                        ::meshproof::kernels::lt::api().get_status_string(mp_status_))); \
    }                                                                                    \
  } while (0)
#endif
