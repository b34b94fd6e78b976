// Which backend an op's dispatch takes: a kernel family's host entry point runs on the CUDA
// device when its operands live there, and a CUDA tensor in a build without the CUDA backend is an
// error naming the op, never a silent host fallback.
#pragma once

#include "kernels/core/error.h"
#include "kernels/core/runtime.h"

namespace meshproof::kernels {

// Whether `op` runs on a CUDA device (its operands on `dev`); throws when `dev` is a CUDA device
// and meshproof was built without CUDA.
inline bool device_op(const char* op, Device dev) {
  if (!dev.is_cuda()) return false;
  MP_CHECK(MESHPROOF_HAVE_CUDA, "{}: {} is a CUDA device but meshproof was built without CUDA", op,
           dev.str());
  return true;
}

}  // namespace meshproof::kernels
