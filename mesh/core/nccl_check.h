// NCCL and MPI status checks built on MP_CHECK (mesh owns the communication libraries).
#pragma once

#include "kernels/core/error.h"

#if MESHPROOF_HAVE_CUDA
#include <nccl.h>

#define MP_NCCL_CHECK(expr)                                                     \
  do {                                                                          \
    const ncclResult_t mp_status_ = (expr);                                     \
    if (mp_status_ != ncclSuccess) [[unlikely]] {                               \
      ::meshproof::kernels::throw_error(                                        \
          ::meshproof::kernels::ErrorKind::kRuntime, __FILE__, __LINE__, #expr, \
          ::fmt::format("NCCL error {}: {}", static_cast<int>(mp_status_),      \
                        ncclGetErrorString(mp_status_)));                       \
    }                                                                           \
  } while (0)
#endif

#if MESHPROOF_HAVE_MPI
#include <mpi.h>

#define MP_MPI_CHECK(expr)                                                               \
  do {                                                                                   \
    const int mp_status_ = (expr);                                                       \
    if (mp_status_ != MPI_SUCCESS) [[unlikely]] {                                        \
      char mp_msg_[MPI_MAX_ERROR_STRING];                                                \
      int mp_len_ = 0;                                                                   \
      MPI_Error_string(mp_status_, mp_msg_, &mp_len_);                                   \
      ::meshproof::kernels::throw_error(                                                 \
          ::meshproof::kernels::ErrorKind::kRuntime, __FILE__, __LINE__, #expr,          \
          ::fmt::format("MPI error {}: {}", mp_status_, std::string(mp_msg_, mp_len_))); \
    }                                                                                    \
  } while (0)
#endif
