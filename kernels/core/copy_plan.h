// Where the batched host<->device transfers (kernels/core/tensor.h to_host_batched, copy_batched)
// put each tensor in their one packed buffer: a pure function of the byte sizes, so that a build
// without a GPU can prove that every tensor gets its own aligned, non-overlapping span.
#pragma once

#include <cstdint>
#include <vector>

namespace meshproof::kernels {

// Every span starts on this boundary (cudaMalloc's alignment, a multiple of every dtype's).
inline constexpr int64_t kPackAlignment = 256;

struct PackPlan {
  std::vector<int64_t> offsets;  // byte offset of tensor i in the packed buffer, list order
  int64_t total = 0;             // bytes of the packed buffer
};

// Tensors of `sizes` bytes (each >= 0) packed back to back in list order, each start rounded up
// to kPackAlignment.
PackPlan pack_plan(const std::vector<int64_t>& sizes);

}  // namespace meshproof::kernels
