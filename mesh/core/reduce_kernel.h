// Launcher of the device rank-order reduction (mesh/core/reduce.cu). Plain C++17 on purpose: nvcc
// compiles reduce.cu without fmt (whose consteval format strings nvcc rejects); the checked
// wrapper is reduce_rank_order_device in mesh/core/communicator.h.
#pragma once

#include <cstdint>

namespace meshproof::mesh::detail {

inline constexpr int kMaxReduceInputs = 64;
enum class ReduceKernelOp : int { kSum = 0, kAvg = 1, kMax = 2 };

// Returns the launch status as an int (cudaError_t); the caller checks it.
int launch_reduce_rank_order(float* out, const float* const* inputs, int n, int64_t count,
                             ReduceKernelOp op, void* stream);

}  // namespace meshproof::mesh::detail
