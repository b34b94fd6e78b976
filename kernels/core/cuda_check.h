// Status checks for the CUDA runtime, built on MP_CHECK (cuBLASLt's: MP_CUBLAS_CHECK in
// kernels/gemm/cublaslt_api.h; NCCL's and MPI's: mesh/core/nccl_check.h): a failure throws
// kernels::Error with file:line, the call, the library's error name and its description.
#pragma once

#include "kernels/core/error.h"

#if MESHPROOF_HAVE_CUDA
#include <cuda_runtime.h>

#define MP_CUDA_CHECK(expr)                                                     \
  do {                                                                          \
    const cudaError_t mp_status_ = (expr);                                      \
    if (mp_status_ != cudaSuccess) [[unlikely]] {                               \
      ::meshproof::kernels::throw_error(                                        \
          ::meshproof::kernels::ErrorKind::kRuntime, __FILE__, __LINE__, #expr, \
          ::fmt::format("CUDA error {}: {}", cudaGetErrorName(mp_status_),      \
                        cudaGetErrorString(mp_status_)));                       \
    }                                                                           \
  } while (0)

// Checks the last kernel launch (configuration errors surface here, execution errors later).
#define MP_CUDA_CHECK_LAUNCH() MP_CUDA_CHECK(cudaGetLastError())

// Checks a launcher's status handed back as an int (launchers declared in headers that host code
// includes, so without CUDA types), reporting the caller's file:line.
#define MP_CUDA_CHECK_STATUS(status) MP_CUDA_CHECK(static_cast<cudaError_t>(status))

#endif
