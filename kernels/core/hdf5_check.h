// HDF5 status checks built on MP_CHECK. The HDF5 C++ API throws H5::Exception; MP_HDF5 turns that
// into kernels::Error with file:line, the call, HDF5's own detail and the caller's context (which
// file and dataset), so a user sees "reading /x from in.h5: ..." rather than an HDF5 stack dump.
#pragma once

#include <H5Cpp.h>

#include "kernels/core/error.h"

namespace meshproof::kernels {
// Turns off HDF5's automatic error-stack printing (errors reach the user through Error instead).
void silence_hdf5_errors();
}  // namespace meshproof::kernels

// MP_HDF5(kind, expr, "context {}", args...): evaluates expr; on H5::Exception throws with `kind`
// (kInput for a missing or malformed user file, kRuntime for write failures).
#define MP_HDF5(kind, expr, ...)                                                           \
  [&]() -> decltype(auto) {                                                                \
    try {                                                                                  \
      return (expr);                                                                       \
    } catch (const H5::Exception& mp_e_) {                                                 \
      ::meshproof::kernels::throw_error(                                                   \
          ::meshproof::kernels::ErrorKind::kind, __FILE__, __LINE__, #expr,                \
          ::fmt::format("{}: HDF5 {}", ::fmt::format(__VA_ARGS__), mp_e_.getDetailMsg())); \
    }                                                                                      \
  }()
