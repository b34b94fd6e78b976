// Helpers of the quantizer GPU tests (quantize_gpu_test.cc, nvfp4_gpu_test.cc): the skip that
// names why no device is usable, and a tensor's bytes copied to the host for byte comparisons.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "kernels/core/device.h"
#include "kernels/core/tensor.h"
#include "tests/gpu_test.h"

namespace meshproof::kernels::testing {

// The bytes of `t` (any device), empty for an undefined tensor.
inline std::vector<uint8_t> bytes_of(const Tensor& t) {
  if (!t.defined()) return {};
  const Tensor h = t.device().is_cpu() ? t : t.to(Device::cpu());
  const auto* p = static_cast<const uint8_t*>(h.raw_data());
  return std::vector<uint8_t>(p, p + h.nbytes().value);
}

}  // namespace meshproof::kernels::testing
